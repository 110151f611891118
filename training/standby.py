"""A standby rank: imports the trainer and megatron, waits for its gate, then trains.

    python -m training.standby GATE   (what infra.standby starts on every rank, under torchrun)

The gate (infra.standby.gate_path) is a JSON file the flow writes when it launches the attempt
this world was started for: `argv`, the worker's arguments (`python -m training.train` ARGS) and
`env`, the attempt's environment (a drill, the flow run that scopes it), set before training. From
then on the rank is `training.train`'s: same output, run files and exit codes. Until then it
writes nothing anywhere: the run directory is the running attempt's. A SIGTERM while waiting (the
standby is stopped) ends it at once.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

# What a rank imports before its first step, imported while nothing waits for it (the trainer's
# own modules import the rest of megatron lazily, at set-up).
import training.train as worker
import checkpoint.engine  # noqa: F401
import training.attention  # noqa: F401
import training.checkpointing  # noqa: F401
import training.data  # noqa: F401
import training.metrics  # noqa: F401
import training.model  # noqa: F401
import megatron.core.distributed  # noqa: F401
import megatron.core.optimizer  # noqa: F401
import megatron.core.pipeline_parallel  # noqa: F401
import torch._dynamo  # noqa: F401  (torch.optim's constructor imports it at its first call: 1.4 s)

POLL_S = 0.02  # a stat every 20 ms: the gate is seen within that of being written


def wait_for_gate(path: Path, poll_s: float = POLL_S) -> dict:
    while True:
        try:
            gate = json.loads(path.read_text())  # written whole (atomic rename) or not at all
            return {"argv": [str(a) for a in gate["argv"]], "env": {str(k): str(v) for k, v in gate["env"].items()}}
        except FileNotFoundError:
            time.sleep(poll_s)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -m training.standby GATE_FILE", file=sys.stderr)
        sys.exit(2)
    gate = wait_for_gate(Path(sys.argv[1]))
    os.environ.update(gate["env"])
    sys.argv = ["training.train", *gate["argv"]]
    worker.run_worker(gate["argv"], warm=True)
