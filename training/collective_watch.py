"""Where a rank's main thread is, sampled by a thread of its own: in which collective, since when.

A hung collective looks the same in every rank's heartbeat (all of them stop beating), but not
from inside: the ranks that reached the collective wait in it, and the one that did not is
somewhere else (still computing, stuck in I/O or a driver call, or frozen altogether). Every
`interval_s` this thread looks at the main thread's Python stack and writes
`{run_dir}/heartbeat/where/rank{R}.json` (`infra.runfiles.read_wheres`): the collective the
main thread waits in, or None, and since when. The watcher compares the ranks
(`infra.watch.collective_stall`), so a hang is seen in seconds whatever the heartbeat timeout,
and its report names the rank(s) and node(s) that did not join and the collective the others
wait in, which NCCL and PyTorch users ask for (nccl#1260) and Mycroft builds its detection on.

A frame is in a collective when its code is torch.distributed's, or megatron-core's
communication code that waits on handles it started (`COLLECTIVE_CODE`); the collective's name is
the innermost such frame's function (`all_reduce`, `barrier`, `finish_grad_sync`, ...). A
process frozen as a whole (SIGSTOP, a kernel D-state) stops writing: the watcher counts a
sample that stops advancing as "not in the collective" too.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

from infra import runfiles
from infra.atomic_write import atomic_write_json

# Path fragments of the code a rank waits in while it is in a collective.
COLLECTIVE_CODE = (
    f"{os.sep}torch{os.sep}distributed{os.sep}",
    f"{os.sep}megatron{os.sep}core{os.sep}distributed{os.sep}",
    f"{os.sep}megatron{os.sep}core{os.sep}tensor_parallel{os.sep}mappings.py",
    f"{os.sep}megatron{os.sep}core{os.sep}pipeline_parallel{os.sep}p2p_communication.py",
)
# torch.distributed's launcher, under the rank's own code in a rank forked from its torchrun agent
# (infra.torchrun): the agent's frames (run.py, the launcher, the elastic agent and its process
# start) stay at the bottom of the fork's stack, and none of them is a collective the rank waits in.
LAUNCHER_CODE = (
    f"{os.sep}torch{os.sep}distributed{os.sep}elastic{os.sep}",
    f"{os.sep}torch{os.sep}distributed{os.sep}launcher{os.sep}",
    f"{os.sep}torch{os.sep}distributed{os.sep}run.py",
)
INTERVAL_S = 1.0


def collective_of(frame) -> str | None:  # noqa: ANN001 - a frame object
    """The collective a stack (its innermost frame) waits in, or None."""
    while frame is not None:
        name = frame.f_code.co_filename
        if any(part in name for part in COLLECTIVE_CODE) and not any(part in name for part in LAUNCHER_CODE):
            return frame.f_code.co_name
        frame = frame.f_back
    return None


class CollectiveWatch:
    """Samples the thread that created it (the training loop's) every `interval_s`; `step` is
    the last step the loop finished (set by the loop)."""

    def __init__(self, run_dir: str | Path, rank: int, interval_s: float = INTERVAL_S):
        self.path = runfiles.where_path(run_dir, rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.interval_s = interval_s
        self.step = 0
        self._watched = threading.get_ident()
        self._stop = threading.Event()
        self._state: tuple[str | None, int] | None = None
        self._since = time.time()
        self._thread = threading.Thread(target=self._run, name="collective-watch", daemon=True)

    def start(self) -> "CollectiveWatch":
        self._thread.start()
        return self

    def sample(self) -> dict:
        """One sample, written; what a test reads."""
        frame = sys._current_frames().get(self._watched)
        collective = collective_of(frame)
        del frame
        now = time.time()
        # a new step is a new state: a rank that samples inside all_reduce at every step is
        # not "in all_reduce" for longer than a step
        state = (collective, self.step)
        if state != self._state:
            self._state, self._since = state, now
        record = {"rank": self.rank, "time": now, "step": self.step, "collective": collective,
                  "since": self._since, "pid": os.getpid()}
        atomic_write_json(self.path, record, durable=False)  # the next sample replaces a lost one
        return record

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sample()
            except OSError:
                pass  # a full or vanished run directory: the heartbeat says so too

    def close(self) -> None:
        self._stop.set()
