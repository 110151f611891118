"""A node's own check of its job's lease: the ranks stop when the job's holder is gone.

The pretrain flow holds its job's GPUs by renewing a lease (scheduler.orchestrator.lease.HeldJob).
When the flow process dies (SIGKILL, the OOM killer, its host lost) nothing renews the lease, and
`grace_s` after it runs out the orchestrator gives the GPUs to another job. The flow's watcher is
gone with the flow, and on every launcher but the local one the ranks do not die with it. So each
node looks at the lease itself and stops its ranks once the lease is confirmed gone:

    guard = LeaseGuard(look, every_s, on_gone=stop_the_ranks)   # a thread: look() every every_s
    guard.start(); ...; guard.close()

`look()` answers held, gone (why) or unknown (why). Only a confirmed "gone" stops anything; a
look that cannot tell (the state database out of reach, the lease file unreadable) never does:
during an outage the holders cannot renew either, and the orchestrator counts expiry from the
outage's end (scheduler/orchestrator/epoch.py), so a job that kept training is not lost. The
stop is the ranks' graceful one (SIGTERM: they commit the step they are on and exit), then
SIGKILL after the launcher's grace: `on_gone` is the launcher's own stop.

Where the look comes from, per launcher:

- node-launch (Prefect, flows/node_launch.py): the state database, read by the node-launch flow
  run (`scheduler.orchestrator.node_lease.NodeLease`): a flow run holds the database's
  credentials anyway, and the database is the orchestrator's own word (released, reclaimed,
  admitted again, or the lease run out under its expiry rule).
- Slurm and Kubernetes: a lease file in the attempt's launch folder (`LeaseFile`), which the flow
  renews while it follows the attempt (`LeaseFileRenewer`, from the launcher's `poll`), read by
  the reaper on each node (`python -m infra.reaper --lease-file`). A batch job or a pod runs the
  job's code, and everything it runs inherits the node task's environment; the database's URL
  (with its password) must not be in it (infra.launch.WORKER_ENV_WITHHELD_PREFIXES). The run
  directory is already the channel every node shares with the flow (heartbeats, rendezvous,
  exit codes). The file is stale when its renewal count has not changed for `valid_s` on the
  node's own monotonic clock: no clock of another host is compared. A renewal written while the
  database is down still counts (the flow is alive; the orchestrator reclaims nothing then).
- local (infra.launch.LocalLauncher): every rank descends from the flow process, and the reaper
  stops them all when that process dies (PR_SET_PDEATHSIG, infra/reaper.py): nothing to look at.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from infra.atomic_write import atomic_write_json

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LeaseLook:
    """What one look at a job's lease found: held (True), gone (False) or unknown (None), and why."""

    held: bool | None
    why: str = ""
    runs_out_in_s: float | None = None  # held: when it runs out unless renewed (the next look is due then)


HELD = LeaseLook(True)


def look_every_s(valid_s: float) -> float:
    """How often a node looks: a tenth of the lease, between 1 and 5 s (the ranks stop within
    about lease + this + their graceful stop of the holder's death)."""
    return min(5.0, max(1.0, valid_s / 10))


class LeaseGuard:
    """Call `look()` every `every_s` in a thread; on the first look that confirms the lease gone,
    call `on_gone(why)` once and stop looking. A look that raises counts as unknown."""

    def __init__(self, look: Callable[[], LeaseLook], every_s: float, on_gone: Callable[[str], None],
                 *, name: str = "lease-guard"):
        self.look = look
        self.every_s = every_s
        self.on_gone = on_gone
        self.gone_because: str | None = None  # set once the lease was confirmed gone
        self.unknown_looks = 0  # looks that could not tell (each logged)
        self.looks = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def check_once(self) -> LeaseLook:
        """One look (what the thread does each period); acts on a confirmed "gone"."""
        try:
            seen = self.look()
        except Exception as e:  # whatever went wrong, it confirms nothing
            seen = LeaseLook(None, f"{type(e).__name__}: {e}")
        self.looks += 1
        if seen.held is None:
            self.unknown_looks += 1
            log.warning("lease check could not tell whether the job still holds its GPUs (%s); "
                        "the ranks keep running", seen.why)
        elif seen.held is False and self.gone_because is None:
            self.gone_because = seen.why
            log.error("the job's lease is gone (%s): stopping its ranks", seen.why)
            self.on_gone(seen.why)
        return seen

    def _run(self) -> None:
        wait_s = self.every_s
        while not self._done.wait(wait_s):
            seen = self.check_once()
            if seen.held is False:
                return
            # look again when the lease runs out if that comes first (a dead holder's ranks stop then)
            wait_s = self.every_s if seen.runs_out_in_s is None else min(self.every_s, max(0.2, seen.runs_out_in_s + 0.1))

    def start(self) -> "LeaseGuard":
        self._thread.start()
        return self

    def close(self) -> None:
        self._done.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.every_s + 5)


# ---------------------------------------------------------------- the lease file (Slurm, Kubernetes)

# How long a lease file holds without a renewal, unless a launcher is told otherwise: the flows'
# own database lease (scheduler.orchestrator.seat.FLOW_LEASE_S), so a dead flow's ranks stop
# about when its database lease runs out.
FILE_LEASE_S = 30.0


def lease_file_path(run_dir: str | Path, attempt: int) -> Path:
    """The lease file of attempt `attempt`, next to its other launch files (infra.launch)."""
    return Path(run_dir) / "launch" / f"attempt-{attempt}" / "lease.json"


class LeaseFileRenewer:
    """The flow's side: rewrite the lease file (renewal count + 1) at most every `every_s`.

    `renew()` is called from the launcher's `poll`, which the flow's watcher calls while it follows
    the attempt: the file is renewed exactly while the flow is alive and following its ranks.
    `release(why)` tells the nodes to stop at once (the flow ended the attempt)."""

    def __init__(self, path: Path, valid_s: float, every_s: float | None = None):
        self.path = Path(path)
        self.valid_s = valid_s
        self.every_s = every_s if every_s is not None else min(5.0, valid_s / 6)
        self.renewals = 0
        self._written_at = -1e18

    def _write(self, state: str, why: str = "") -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(self.path, {"state": state, "renewal": self.renewals, "valid_s": self.valid_s,
                                      "why": why, "holder": f"{socket.gethostname()}:{os.getpid()}"})
        self._written_at = time.monotonic()

    def renew(self) -> None:
        if time.monotonic() - self._written_at < self.every_s:
            return
        self.renewals += 1
        try:
            self._write("held")
        except OSError as e:  # shared storage hiccup: the next poll writes again (the file has slack)
            log.warning("renewing the lease file %s failed: %s", self.path, e)

    def release(self, why: str) -> None:
        try:
            self._write("released", why)
        except OSError as e:
            log.warning("releasing the lease file %s failed: %s", self.path, e)


def judge_lease_file(record: dict | None, unchanged_s: float) -> LeaseLook:
    """The decision on one reading of a lease file: `record` as read (None: unreadable or not
    written yet), `unchanged_s` how long (node's monotonic clock) its renewal count has not changed."""
    if record is None:
        return LeaseLook(None, "the lease file is not there or not readable")
    if record.get("state") == "released":
        return LeaseLook(False, f"the flow released the attempt ({record.get('why') or 'no reason given'})")
    valid_s = float(record.get("valid_s") or 0)
    if valid_s > 0 and unchanged_s >= valid_s:
        return LeaseLook(False, f"the flow ({record.get('holder', '?')}) stopped renewing the job's lease "
                                f"file {unchanged_s:.0f} s ago (valid for {valid_s:g} s): its holder is gone")
    return LeaseLook(True, runs_out_in_s=valid_s - unchanged_s if valid_s > 0 else None)


class LeaseFile:
    """The node's side: look at the lease file; staleness is timed on this node's monotonic clock
    from the first time this reader saw the current renewal count."""

    def __init__(self, path: Path, clock: Callable[[], float] = time.monotonic):
        self.path = Path(path)
        self.clock = clock
        self._renewal: object = None
        self._changed_at = clock()  # a new reader gives the holder a full period

    def read(self) -> dict | None:
        try:
            record = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) else None

    def look(self) -> LeaseLook:
        record = self.read()
        now = self.clock()
        if record is not None and record.get("renewal") != self._renewal:
            self._renewal, self._changed_at = record.get("renewal"), now
        return judge_lease_file(record, now - self._changed_at)
