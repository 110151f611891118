"""A standby rank: imports the trainer and megatron, waits for its gate, then trains.

    python -m training.standby GATE   (what infra.standby starts on every rank, under torchrun)

The gate (infra.standby.gate_path) is a JSON file the flow writes when it launches the attempt
this world was started for: `argv`, the worker's arguments (`python -m training.train` ARGS) and
`env`, the attempt's environment (a drill, the flow run that scopes it), set before training. From
then on the rank is `training.train`'s: same output, run files and exit codes. Until then it
writes nothing anywhere but a node check's results: the run directory is the running attempt's.
A SIGTERM while waiting (the standby is stopped) ends it at once.

While it waits, the flow may ask it to run a round of the node check (infra.standby's
`StandbyNodeCheck` writes infra.standby.check_path: the round's worlds of nodes and where results
go): local rank 0 of each node in a world joins that world's process group in torchrun's store
under the round's own prefix, runs infra.nodecheck_worker.check_world, writes its result and
goes back to waiting. So a check after a failure costs a rendezvous and a few allgathers, not a
torchrun world of its own started from nothing.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from pathlib import Path

from infra.autogroup import SESSION_NICE_ENV, set_autogroup_nice  # (nothing heavy)


def _stay_behind_training() -> None:
    """Put this rank's session's autogroup at the niceness infra.reaper started the standby at
    (SESSION_NICE_ENV; infra.standby starts a standby's reaper at STANDBY_NICE): torchrun starts
    every rank in a session of its own, and where the kernel groups sessions
    (sched_autogroup_enabled), a niceness counts only within the group, so without this the
    imports below take a full share of the CPU from the training ranks. infra.standby's `open`
    gives both back (a cold launch's niceness, autogroup 0); once it has (this rank's niceness
    changed), this rank stops trying and leaves its group at 0."""
    nice = int(os.environ.get(SESSION_NICE_ENV) or 0)
    if nice <= 0:
        return

    def waiting() -> bool:
        return os.getpriority(os.PRIO_PROCESS, 0) == nice

    # (patience: the kernel's rate limit, shared by every rank starting on the machine)
    if set_autogroup_nice("self", nice, patience_s=30.0, still_wanted=waiting) and not waiting():
        set_autogroup_nice("self", 0, patience_s=30.0)  # opened meanwhile: undo what it undid


_stay_behind_training()  # before the imports below: they are what costs CPU

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
import torch.distributed as dist

from infra.atomic_write import atomic_write_json
from infra.nodecheck_worker import NodeCheckFailed, check_world

POLL_S = 0.02  # a stat every 20 ms: the gate is seen within that of being written
CHECK_FILE = "standby-nodecheck.json"  # next to the gate (infra.standby.check_path)


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())  # written whole (atomic rename) or not at all
    except FileNotFoundError:
        return None


def run_check(check: dict) -> None:
    """This rank's part of a node-check round (`check`: round, worlds, results, and the worker's
    settings): nothing unless it is local rank 0 of a node in one of the round's worlds."""
    node = os.environ.get("FORGEFLOW_NODE_NAME", "")
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return
    for index, world in enumerate(check["worlds"]):
        if node in world:
            break
    else:
        return
    rank, timeout_s = world.index(node), float(check["timeout_s"])
    result = Path(check["results"]) / f"world-{index}" / f"rank-{rank}.json"
    try:
        # torchrun's store (its agent on node 0 keeps it); the round's prefix keeps this world's
        # keys apart from every other round's and from training's own process groups
        store = dist.PrefixStore(f"forgeflow-nodecheck/{check['round']}/{index}", dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
            timeout=datetime.timedelta(seconds=timeout_s)))
        measured = {"ok": True, **check_world(store, rank, len(world), payload_mb=float(check["payload_mb"]),
                                              iterations=int(check["iterations"]), timeout_s=timeout_s)}
    except (NodeCheckFailed, RuntimeError, OSError, ValueError) as e:  # torch's collective errors included
        measured = {"ok": False, "detail": f"{type(e).__name__}: {e}"}
    atomic_write_json(result, measured, durable=False)  # read at once by the flow, never after a crash


def wait_for_gate(path: Path, poll_s: float = POLL_S) -> dict:
    """The gate's {argv, env}, once written; serving the node-check rounds asked meanwhile."""
    served = 0
    while True:
        gate = _read(path)
        if gate is not None:
            return {"argv": [str(a) for a in gate["argv"]], "env": {str(k): str(v) for k, v in gate["env"].items()}}
        check = _read(path.with_name(CHECK_FILE))
        if check is not None and int(check["round"]) > served:
            served = int(check["round"])
            run_check(check)
            continue
        time.sleep(poll_s)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -m training.standby GATE_FILE", file=sys.stderr)
        sys.exit(2)
    gate = wait_for_gate(Path(sys.argv[1]))
    os.environ.update(gate["env"])
    sys.argv = ["training.train", *gate["argv"]]
    worker.run_worker(gate["argv"], warm=True)
