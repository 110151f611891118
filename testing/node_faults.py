"""Physical node faults for drills on a cluster whose nodes are this machine (tests, benchmarks).

A "node" of a local cluster is the set of processes started for it: the launcher gives each
one FORGEFLOW_NODE_NAME=<node> (infra.launch.node_env) and torchrun and its ranks inherit it.
`NodeLoss` makes such a node die the way a machine that lost power does: from its trigger on,
every process of the node — the reaper, torchrun, the training ranks, and later the ranks of a
node check placed there — is SIGKILLed as soon as it shows up, for as long as the drill lasts.
Nothing in forgeflow reads a flag to fail: the peers' connections really reset, the node's
torchrun really dies with -9, and a node-check world on it really fails.

Only processes that inherited this drill's scope token (an environment variable set in this
process while the drill is active) are touched, so a drill never kills another job's or another
user's "node-b" on a shared machine.

    with NodeLoss("node-b", trigger=after_step(run_dir, 6)) as lost:
        pretrain(...)              # the flow sees node-b die after step 6 and recovers
    lost.lost_at                   # when the node died (time.time())
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from pathlib import Path
from typing import Callable

import psutil

from infra import runfiles

SCOPE_VAR = "FORGEFLOW_NODE_DRILL_SCOPE"  # read by the drill only, never by forgeflow


def after_step(run_dir: str | Path, step: int) -> Callable[[], bool]:
    """A trigger: true once any rank's heartbeat reports `step` completed steps."""

    def reached() -> bool:
        beats = runfiles.read_heartbeats(run_dir)
        return any(b.step >= step for b in beats.values())

    return reached


class NodeLoss:
    """Kill node `node` once `trigger()` is true, and keep it dead until the drill ends."""

    def __init__(self, node: str, trigger: Callable[[], bool] = lambda: True, poll_s: float = 0.1):
        self.node = node
        self.trigger = trigger
        self.poll_s = poll_s
        self.lost_at: float | None = None
        self.killed: list[int] = []
        self._now = threading.Event()
        self._token = uuid.uuid4().hex
        self._previous: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "NodeLoss":
        self._previous = os.environ.get(SCOPE_VAR)
        os.environ[SCOPE_VAR] = self._token  # every process started from here on inherits it
        self._thread = threading.Thread(target=self._run, name=f"node-loss-{self.node}", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._previous is None:
            os.environ.pop(SCOPE_VAR, None)
        else:
            os.environ[SCOPE_VAR] = self._previous

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            if self.lost_at is None:
                try:
                    fired = self._now.is_set() or self.trigger()
                except Exception:  # a half-written heartbeat: look again next time
                    fired = False
                if not fired:
                    continue
                self.lost_at = time.time()
            self.kill_now()

    def lost_now(self) -> None:
        """Lose the node now, whatever the trigger says (kills before returning)."""
        self._now.set()
        if self.lost_at is None:
            self.lost_at = time.time()
        self.kill_now()

    def node_processes(self) -> list[psutil.Process]:
        mine = []
        for proc in psutil.process_iter():
            try:
                env = proc.environ()
            except (psutil.Error, OSError):  # gone, or not ours to read
                continue
            if env.get(SCOPE_VAR) == self._token and env.get("FORGEFLOW_NODE_NAME") == self.node:
                mine.append(proc)
        return mine

    def kill_now(self) -> int:
        """SIGKILL every live process of the node; returns how many were killed."""
        victims = self.node_processes()
        for proc in victims:  # stop them all first: a dying parent must not let a child slip away
            try:
                proc.suspend()
            except psutil.Error:
                pass
        for proc in victims:
            try:
                proc.kill()
                self.killed.append(proc.pid)
            except psutil.Error:
                pass
        return len(victims)
