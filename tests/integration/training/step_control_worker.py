"""Run by test_step_control.py under torchrun (2 ranks, gloo): what StepControl decides.

Each rank gets its own clock and its own signals, so the ranks disagree on purpose;
every rank prints the decisions it got, one JSON line per step.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from types import SimpleNamespace


def main() -> None:
    from training.control import StepControl
    from training.model import init_distributed, shutdown_distributed

    env = init_distributed()
    now = [0.0]
    cfg = SimpleNamespace(interval_s=10.0, stop_deadline_s=60.0)
    control = StepControl(env, cfg, clock=lambda: now[0])
    # rank 0's clock runs 4 s per step, rank 1's 100 s: only rank 0's may decide
    tick = 4.0 if env.rank == 0 else 100.0
    for step in range(1, 8):
        now[0] += tick
        if env.rank == 1 and step == 5:
            os.kill(os.getpid(), signal.SIGTERM)  # only rank 1 is asked to stop
        decision = control.after_step()
        if decision.checkpoint_due:
            control.saved()
        # one write() per line: both ranks share torchrun's stdout pipe, and print() writes the
        # text and its newline separately, so two ranks' lines could interleave on one line
        line = json.dumps({"rank": env.rank, "step": step, "due": decision.checkpoint_due,
                           "stop": decision.stop})
        os.write(sys.stdout.fileno(), (line + "\n").encode())
    shutdown_distributed()


if __name__ == "__main__":
    sys.exit(main())
