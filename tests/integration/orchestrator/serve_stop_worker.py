"""Run by test_serve_stop.py: a decider stopped by SIGTERM over and over, in one process.

    python serve_stop_worker.py DB_URL TIMES

Each round installs the stop handler exactly as `forgeflow cluster serve` does
(infra.stop_signal.stop_on_signals), prints `serving N`, and serves the cluster with
tight polls until the parent's SIGTERM (sent at a random moment) stops it, then prints
`stopped N PASSES`. A handler that deadlocks leaves a round without its `stopped` line.
"""

from __future__ import annotations

import signal
import sys


def main(url: str, times: int) -> None:
    from infra.stop_signal import stop_on_signals
    from scheduler.orchestrator import Orchestrator, OrchestratorConfig

    orch = Orchestrator(url, OrchestratorConfig(policy="has", lease_s=600))
    for round_no in range(times):
        passes = [0]
        with stop_on_signals(signal.SIGTERM) as stop:
            print(f"serving {round_no}", flush=True)
            # tight polls: the loop is almost always in a database read or a stop.wait()
            orch.serve(stop=stop, busy_poll_s=0.0, idle_poll_s=0.001,
                       on_pass=lambda _result: passes.__setitem__(0, passes[0] + 1))
        print(f"stopped {round_no} {passes[0]}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
