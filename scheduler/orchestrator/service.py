"""The orchestrator: submit, admit, renew, release, expire, cordon — each one transaction.

Every change runs `_locked`: a write transaction that first takes the scheduler
lock (BEGIN IMMEDIATE on SQLite; the cluster's row `SELECT ... FOR UPDATE` on
PostgreSQL), reclaims expired leases, applies the change, and — whenever
resources may have changed — makes one policy pass (`scheduler.policy.schedule_pass`,
the simulator's code) that turns queued jobs into allocations. The partial unique
index on live allocations is the database's own refusal of a double booking, so
even a bug here could not hand one GPU to two jobs.

Between its own decisions a process keeps its view of the cluster (free GPUs, the
queue, running jobs) in memory: each scheduling transaction bumps the cluster's
`state_version` under the lock and records what it changed in `cluster_changes`
(submitted, admitted where, ended freeing what). A process whose view is a few
versions old replays those rows — read in the same round trip as the lock — instead
of reading the whole cluster and queue back (every flow is its own process, so
consecutive decisions usually come from different processes); `refresh()` does the
same outside the lock, from a flow's lease loop and a waiting job's poll. A change
the log does not describe (health, lease expiry, re-queue, a new inventory) or a
pruned log makes the view read everything back.

Cost of a decision (what bounds admissions/s): a release is two round trips on
PostgreSQL (`infra.statedb.StatementBatch`: the lock, the job's state, freeing and
ending it in one; every admission's writes with the COMMIT in the other), the
allocation history is written by the database's triggers, the lease-expiry UPDATE
runs only once the view's earliest lease may have run out, and the policy pass
skips queued jobs whose (shared) options already found no room.
"""

from __future__ import annotations

import bisect
import contextlib
import getpass
import json
import logging
import math
import os
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from infra.statedb import (
    StateDbError,
    StatementBatch,
    batched_write_transaction,
    is_postgres,
    open_state_db,
    read_transaction,
    write_transaction,
)
from infra.statedb.batch import Pending
from infra.statedb.clock import db_now
from infra.statedb.schema import (allocations, cluster_changes, clusters, control_plane, job_launches, jobs, nodes,
                                  preemptions)
from infra.stop_signal import Stop
from scheduler.cluster import Cluster, ClusterError
from scheduler.elastic import ElasticConfig, ElasticRunning, elastic_pass, resizable_layouts
from scheduler.placement import Placement
from scheduler.fair_share import NO_TEAM, Snapshot
from scheduler.policy import Busy, FreeGpus, Option, QueuedJob, admission_policy, schedule_pass
import scheduler.orchestrator.epoch as epoch
import scheduler.orchestrator.identity as identity
import scheduler.orchestrator.inventory as inventory
import scheduler.orchestrator.quotas as quotas
import scheduler.preemption as preemption
from scheduler.orchestrator.config import LeaseLostError, OrchestratorConfig, OrchestratorError
from scheduler.orchestrator.options import ELASTIC_LAYOUTS, REQUESTED_AS, options_to_json, placement_from_dict
from scheduler.orchestrator.start_estimates import WaitingJob, queue_order

log = logging.getLogger(__name__)

# A delegated job (issue 32) is in a site's batch system (Slurm's delegate mode), which decides
# where and when it runs: the orchestrator keeps a mirror of it (`jobs.batch`: what the batch system
# says, written by its flow) so `forgeflow jobs` and `cluster queue` list it, but never admits it,
# gives it no lease and no allocation, and no policy pass, quota or preemption counts it: every
# admission path reads only queued and running jobs. It is active (cancel, shared paths, its flow)
# and ends finished / failed / cancelled as every job does.
DELEGATED = "delegated"
ACTIVE = ("queued", "running", DELEGATED)
# A delegated job's liveness (no lease: it holds nothing here): its flow (`lease.DelegatedJob`)
# renews a deadline in `jobs.batch` every lease_s / 3, lease_s from now on the database's clock
# (`renew_delegated`), and the pass that reclaims expired leases ends the job once the deadline is
# grace_s past, after the same outage epoch (`_expire`). A job whose flow never took it up has no
# deadline yet (as a queued job waits for its flow, it waits for its flow to start).
DELEGATED_UNTIL = "delegated_until"  # jobs.batch: the deadline (database clock, s since the epoch)
DELEGATED_RENEWED = "renewed_at"  # jobs.batch: the flow's last renewal (database clock)
_DELEGATED_DEADLINE = jobs.c.batch[DELEGATED_UNTIL].as_float()
_DELEGATED_SILENT = sa.select(jobs.c.id, jobs.c.batch, jobs.c.stop_requested, jobs.c.lost_count).where(
    jobs.c.cluster == sa.bindparam("cname"), jobs.c.state == DELEGATED,
    _DELEGATED_DEADLINE < sa.bindparam("cutoff"))
_DELEGATED_FLOOR = sa.select(sa.func.min(_DELEGATED_DEADLINE)).where(
    jobs.c.cluster == sa.bindparam("cname"), jobs.c.state == DELEGATED)
# A waiting job's position (queue_position) orders by the teams' usage read at most this long ago:
# it changes slowly, and reading the allocation history at every poll of every waiter would not.
TEAM_USAGE_STALE_S = 30.0
DONE = ("finished", "failed", "cancelled")

# The statements of a decision, built once (a decision runs a handful of them; building and
# compiling-cache-keying a fresh Core statement each time cost more CPU than the database did).
_BUMP_VERSION = (sa.update(clusters).where(clusters.c.name == sa.bindparam("cname"))
                 # a change waits for a policy pass (only tracked while a decider has beaten)
                 .values(state_version=clusters.c.state_version + 1, pass_pending=clusters.c.decider_seen_at.isnot(None))
                 # and the database's clock: every time this decision writes or compares is on it
                 .returning(clusters.c.state_version, clusters.c.generation, clusters.c.decider_seen_at, db_now()))
# a policy pass ran in this transaction (the lock statement marked the change as waiting for one)
_PASS_DONE = sa.update(clusters).where(clusters.c.name == sa.bindparam("cname")).values(pass_pending=False)
_DECIDER_STATE = sa.select(clusters.c.pass_pending, clusters.c.decider_seen_at).where(
    clusters.c.name == sa.bindparam("cname"))
_INSERT_JOB = sa.insert(jobs).values(
    {**{c: sa.bindparam(c) for c in ("cluster", "name", "spec", "options", "priority", "submitted_by", "team")},
     "submitted_at": db_now(), "queued_at": db_now(), "state": "queued", "attempts": 0, "lost_count": 0}
).returning(jobs.c.id, jobs.c.queued_at)
_INSERT_DELEGATED = sa.insert(jobs).values(
    {**{c: sa.bindparam(c) for c in ("cluster", "name", "spec", "options", "priority", "submitted_by", "team",
                                     "batch")},
     "submitted_at": db_now(), "queued_at": db_now(), "state": DELEGATED, "attempts": 0, "lost_count": 0}
).returning(jobs.c.id)
_JOB_STATE = sa.select(jobs.c.state, jobs.c.attempts).where(jobs.c.id == sa.bindparam("jid"))
# (no IN list here: StatementBatch sends statements pre-compiled, without expanding parameters)
_JOB_ENDED = (sa.update(jobs).where(jobs.c.id == sa.bindparam("jid"),
                                    sa.or_(*(jobs.c.state == s for s in ACTIVE)))
              .values(state=sa.bindparam("outcome"), finished_at=db_now(), reason=sa.bindparam("why")))
_RELEASE_JOB = (sa.update(allocations).where(allocations.c.job_id == sa.bindparam("jid"),
                                             allocations.c.released_at.is_(None))
                .values(released_at=db_now(), release_event="release")
                .returning(allocations.c.job_id, allocations.c.node, allocations.c.gpu_index))
# A holder's renewal and release are fenced by the admission it was given (`jobs.attempts`
# counts admissions): once its lease was reclaimed and the job admitted again, the old holder
# touches neither the new admission's lease nor its end.
_SAME_ADMISSION = sa.exists().where(jobs.c.id == sa.bindparam("jid"), jobs.c.attempts == sa.bindparam("attempt"))
_RELEASE_ADMISSION = _RELEASE_JOB.where(_SAME_ADMISSION)
_ADMISSION_ENDED = _JOB_ENDED.where(jobs.c.attempts == sa.bindparam("attempt"))
_JOB_ADMITTED = (sa.update(jobs).where(jobs.c.id == sa.bindparam("jid"))
                 .values(state="running", admitted_at=sa.bindparam("now"), attempts=jobs.c.attempts + 1,
                         reason=None, placement=sa.bindparam("placement"),
                         predicted_run_s=sa.bindparam("predicted_run_s")))
_ALLOCATE = sa.insert(allocations).values(
    {c: sa.bindparam(c) for c in ("job_id", "cluster", "node", "gpu_index", "allocated_at", "lease_expires_at")})
# The change log (see `_View.replay`): what this transaction changed, the changes since a version,
# and pruning (every CHANGE_PRUNE_EVERY versions, rows older than CHANGES_KEPT versions go).
_RECORD_CHANGE = sa.insert(cluster_changes).values(
    cluster=sa.bindparam("cname"), version=sa.bindparam("version"), change=sa.bindparam("change"))
_CHANGES_SINCE = (sa.select(cluster_changes.c.version, cluster_changes.c.change)
                  .where(cluster_changes.c.cluster == sa.bindparam("cname"),
                         cluster_changes.c.version > sa.bindparam("since"))
                  .order_by(cluster_changes.c.version))
_PRUNE_CHANGES = sa.delete(cluster_changes).where(cluster_changes.c.cluster == sa.bindparam("cname"),
                                                  cluster_changes.c.version < sa.bindparam("below"))
CHANGES_KEPT = 4096
# A decider (`serve`) beats every DECIDER_BEAT_S; others trust it for DECIDER_TTL_S after its last beat.
DECIDER_BEAT_S = 1.0
DECIDER_TTL_S = 5.0
REFRESH_EVERY_S = 15.0  # how often a waiting job's process brings its view up to date (`refresh`)
WAIT_RETRY_MAX_S = 30.0  # a waiting job retries an unreachable database at most this far apart
CHANGE_PRUNE_EVERY = 256
_GENERATION = sa.select(clusters.c.generation).where(clusters.c.name == sa.bindparam("cname"))
# A renewal: the lease runs `lease_s` from now on the database's clock (never shortened: one given
# with a longer lease_s stays), fenced by the admission when the holder names it.
_RENEWED_UNTIL = db_now() + sa.bindparam("lease_s")
_RENEW = (sa.update(allocations).where(allocations.c.job_id == sa.bindparam("jid"), allocations.c.released_at.is_(None))
          .values(lease_expires_at=sa.case((allocations.c.lease_expires_at < _RENEWED_UNTIL, _RENEWED_UNTIL),
                                           else_=allocations.c.lease_expires_at))
          .returning(allocations.c.lease_expires_at))
_RENEW_ADMISSION = _RENEW.where(_SAME_ADMISSION)
_LIVE_LEASE_FLOOR = sa.select(sa.func.min(allocations.c.lease_expires_at)).where(
    allocations.c.cluster == sa.bindparam("cname"), allocations.c.released_at.is_(None))
# what a waiting job's poll reads (`pass_due`): the earliest lease and delegated deadline, one round trip
_LIVENESS_FLOORS = sa.select(_LIVE_LEASE_FLOOR.scalar_subquery(), _DELEGATED_FLOOR.scalar_subquery())

# Elastic resizes' promised admissions (`jobs.promised`, `Orchestrator.resize`): the live ones of a
# cluster, and dropping one (admitted, expired, or on a node out of service).
_PROMISES = sa.select(jobs.c.id, jobs.c.state, jobs.c.promised).where(
    jobs.c.cluster == sa.bindparam("cname"), jobs.c.promised.is_not(None), jobs.c.state.in_(ACTIVE))
_DROP_PROMISE = sa.update(jobs).where(jobs.c.id == sa.bindparam("jid")).values(promised=sa.null())


@dataclass(frozen=True)
class _Promised:
    """A job admitted on what a resize promised it (a pass's started entry, like a QueuedJob)."""

    job_id: str
    options: tuple
    run_s: float  # what is left of its run on the promised layout, predicted


def _promise_gpus(promise: dict[str, Any]) -> list[tuple[str, int]]:
    return [(n["node"], g) for n in promise["placement"]["nodes"] for g in n["gpus"]]


def _hold(cluster: Cluster, free: FreeGpus, gpus: list[tuple[str, int]]) -> None:
    """Take `gpus` (idle, on schedulable nodes) on `cluster` and out of `free`'s counts."""
    by_node: dict[str, list[int]] = {}
    for node, gpu in gpus:
        by_node.setdefault(node, []).append(gpu)
    for node, taken in by_node.items():
        cluster.allocate(node, taken)
        gpu_type = cluster.node(node).gpu_type
        free.by_type[gpu_type] = free.by_type.get(gpu_type, 0) - len(taken)


def _unhold(view: "_View", gpus: list[tuple[str, int]]) -> None:
    """Give back what `_hold` kept from a pass."""
    by_node: dict[str, list[int]] = {}
    for node, gpu in gpus:
        by_node.setdefault(node, []).append(gpu)
    for node, taken in by_node.items():
        view.cluster.release(node, taken)
        view.free.give_back(view.cluster.node(node).gpu_type, len(taken))


PRIORITY_RANGE = (-1000, 1000)


def _utc(at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(at))


def check_priority(priority: int | str) -> None:
    """OrchestratorError for a priority outside PRIORITY_RANGE (higher goes first). A class name
    is checked when the job is submitted (`quotas.resolve_priority`)."""
    if isinstance(priority, str):
        if not priority.lstrip("-").isdigit():
            return
        priority = int(priority)
    low, high = PRIORITY_RANGE
    if not low <= priority <= high:
        raise OrchestratorError(f"priority {priority} is out of range; give a whole number from {low} to {high} "
                                "(higher runs first; default 0)")


def default_actor() -> str:
    try:
        user = getpass.getuser()
    except Exception:  # no passwd entry in some containers
        user = str(os.getuid())
    return f"{user}@{socket.gethostname()}"


@dataclass(frozen=True)
class Admission:
    """A job that holds GPUs: where, and until when its lease runs."""

    job_id: int
    name: str
    placement: Placement
    lease_expires_at: float
    attempt: int = 0  # which admission of the job this is (`jobs.attempts`): fences renew/release


@dataclass
class PassResult:
    admitted: list[int]
    expired_jobs: list[int]
    considered: int
    seconds: float = 0.0  # the whole transaction, when the decider (`serve`) made it
    # (job id, GPU type, shadow time) the pass reserved GPUs for (EASY's head), while teams exist
    reservation: tuple | None = None


@dataclass
class _View:
    """One process's picture of a cluster as of `version` (valid while nobody else writes)."""

    version: int
    generation: int
    cluster: Cluster  # private copy: free lists and cordons as of `version`
    free: FreeGpus  # idle GPUs per type of `cluster`, kept in step with it
    queue: list[QueuedJob]  # queue order
    keys: list[tuple]  # (-priority, queued_at, id) of each queued job: the queue order, sorted
    running: dict[int, Busy]  # every running job of the cluster (ECT's profile; a release's prior state)
    # No live lease on the cluster expires before this (leases are only made by a decision, which
    # lowers it, or renewed, which never shortens one): a pass skips the expiry UPDATE until then.
    lease_floor: float = float("inf")
    teams: quotas.TeamState | None = None  # while teams are defined: quotas, fair share (`quotas`)

    key_of: dict[int, tuple] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.key_of = {k[2]: k for k in self.keys}

    def enqueue(self, key: tuple, job: QueuedJob) -> None:
        at = bisect.bisect(self.keys, key)
        self.keys.insert(at, key)
        self.queue.insert(at, job)
        self.key_of[key[2]] = key

    def unqueue(self, job_id: int) -> None:
        key = self.key_of.pop(job_id, None)
        if key is not None:
            at = bisect.bisect_left(self.keys, key)
            del self.keys[at], self.queue[at]

    # Changes as the log records them (`Orchestrator._record`), applied in order by `replay`.
    def end(self, job_id: int, gpus: list, at: float | None = None) -> None:
        """The job ended (released or cancelled) at `at`: its GPUs [[node, index], ...] are idle again."""
        self.running.pop(job_id, None)
        if self.teams is not None:
            self.teams.ended(job_id, time.time() if at is None else at)
        self.unqueue(job_id)
        by_node: dict[str, list[int]] = {}
        for node, gpu in gpus:
            by_node.setdefault(node, []).append(gpu)
        for node, freed in by_node.items():
            self.cluster.release(node, freed)
            if not self.cluster.node(node).cordoned:  # FreeGpus counts schedulable GPUs only
                self.free.give_back(self.cluster.node(node).gpu_type, len(freed))

    def admit(self, job_id: int, gpu_type: str, world_size: int, end_s: float, lease: float,
              assignments: list, at: float | None = None) -> None:
        """A pass admitted the job onto `assignments` [[node, [indices]], ...] at `at`."""
        if self.teams is not None:
            self.teams.admitted(job_id, gpu_type, world_size, time.time() if at is None else at)
        for node, gpus in assignments:
            self.cluster.allocate(node, gpus)
            self.free.by_type[gpu_type] = self.free.by_type.get(gpu_type, 0) - len(gpus)
        self.running[job_id] = Busy(gpu_type, world_size, end_s)
        self.unqueue(job_id)
        self.lease_floor = min(self.lease_floor, lease)


class Orchestrator:
    """Cluster state, queue and leases in the state database at `url` (default: FORGEFLOW_DB_URL or SQLite)."""

    def __init__(self, url: str | None = None, config: OrchestratorConfig | None = None, *,
                 engine: Engine | None = None, actor: str | None = None, elastic: ElasticConfig | None = None):
        self.engine = engine or open_state_db(url)
        self.elastic = elastic or ElasticConfig()  # how the decider resizes jobs under policy elastic (`resize`)
        self.url = str(self.engine.url)
        self.config = config or OrchestratorConfig()
        self.policy: str | None = self.config.policy  # else the cluster file's (`_resolve_policy`)
        # who this process is: the database role on PostgreSQL (`identity`), user@host on SQLite
        self.identity = identity.engine_identity(self.engine)
        self.actor = self.identity.role if self.identity is not None else actor or default_actor()
        # whether its policy passes see the whole queue; a role that sees only its teams' jobs
        # leaves every pass to the decider (`forgeflow cluster serve`, run as an operator)
        self._decides = self.identity is None or self.identity.sees_everything
        self._options: dict[int, tuple[Option, ...]] = {}  # per job, immutable after submit, interned
        self._interned: dict[tuple, tuple[Option, ...]] = {}
        self._by_text: dict[str | None, tuple[Option, ...]] = {}  # stored JSON text -> the interned tuple
        self._names: dict[int, str] = {}
        self._job_cluster: dict[int, str] = {}  # a job's cluster never changes
        self._views: dict[str, _View] = {}
        self._order_teams: dict[str, tuple[float, quotas.TeamState | None]] = {}  # queue_position's
        self._pending: _View | None = None  # the view being changed by the open transaction
        self.last_pass: PassResult | None = None
        self._mutex = threading.RLock()  # one transaction of this object at a time (lease threads)
        # the open transaction (inside _locked): its statement batch, the lock's pending row, and
        # (connection, cluster, cached view until settled, state version once settled)
        self._batch: StatementBatch | None = None
        self._lock_row: Pending | None = None
        self._tx: tuple | None = None
        self._since: Pending | None = None  # the change log since the cached view's version
        # jobs submitted since the newest this process knows (their options, for the replay of
        # their 'queue' changes), read in the lock's round trip too
        self._new_jobs: Pending | None = None
        self._newest_job = 0
        self._jobs_since: sa.Select | None = None
        self._serving = False  # this object is the cluster's decider (`serve`)
        self._delegate = False  # the open transaction leaves its policy pass to a live decider
        self._decider_known = False  # a decider has beaten (the open transaction must clear pass_pending)
        # whether this process's view was stale at its last decision: then the change log and new
        # jobs are read in the lock's round trip; a process deciding on its own skips both reads
        self._expect_stale = True
        self._now = 0.0  # the open transaction's time on the database's clock (read with its lock)
        # what the open transaction changed, in order, for the change log; None: not described
        self._ops: list | None = []

    # ---------------------------------------------------------------- transactions
    @contextmanager
    def _locked(self, cluster: str | None, *, deferred: bool = False) -> Iterator[tuple[Connection, str]]:
        """A write transaction holding the scheduler lock of the cluster, with this process's view of it.

        The scheduler lock is the first statement: an UPDATE of the cluster's row (a row lock on
        PostgreSQL; SQLite's BEGIN IMMEDIATE already holds the database lock) that bumps its
        `state_version`; one decision at a time. It goes out in the transaction's
        `StatementBatch`: with `deferred`, the caller may queue more statements behind it and
        must call `_settle()` before it runs anything else (they then travel in one round
        trip on PostgreSQL); otherwise it is sent at once. Statements queued at the end (the
        decision's writes) are sent with the COMMIT.
        """
        with self._mutex, self._in_transaction():
            committed_view = None
            with batched_write_transaction(self.engine) as (conn, batch):
                name = cluster if cluster is not None else inventory.resolve_cluster(conn, None)
                self._batch = batch
                self._ops = []
                self._lock_row = batch.add(_BUMP_VERSION, {"cname": name})
                cached = self._views.pop(name, None)
                # the changes other processes made since this process's view, behind the lock
                self._since = self._new_jobs = None
                if cached is not None and self._expect_stale:
                    self._queue_catch_up(conn, name, cached)
                self._tx = (conn, name, cached, 0)
                if not deferred:
                    self._settle()
                yield conn, name
                self._settle()
                version = self._tx[3]
                # sent with the COMMIT: what this decision changed, for the other processes' views
                batch.add(_RECORD_CHANGE, {"cname": name, "version": version,
                                           "change": {"reload": True} if self._ops is None else {"ops": self._ops}})
                if version % CHANGE_PRUNE_EVERY == 0:
                    batch.add(_PRUNE_CHANGES, {"cname": name, "below": version - CHANGES_KEPT})
                if self._pending is not None:
                    self._pending.version = self._tx[3]
                    committed_view = self._pending
            # Kept only once the COMMIT went through: a COMMIT that fails (the server restarted,
            # the disk is full, PostgreSQL's refusal of a double booking arrives with it) rolls the
            # decision back, and a view that still held it would pass the next version check.
            if committed_view is not None:
                self._views[name] = committed_view

    def _settle(self) -> None:
        """Send the lock (and whatever was queued behind it) and decide whether the cached view is current."""
        if self._lock_row is None:
            return
        self._batch.flush()
        conn, name, cached, _ = self._tx
        rows, self._lock_row = self._lock_row.all(), None
        if not rows:
            inventory.resolve_cluster(conn, name)  # raises: says which clusters exist
        version, generation, decider_seen_at, self._now = rows[0]
        # a live decider keeps a current view: a process whose view is stale leaves the pass to it
        self._decider_known = decider_seen_at is not None
        self._delegate = not self._decides or (not self._serving and decider_seen_at is not None
                                               and decider_seen_at > self._now - DECIDER_TTL_S)
        if cached is not None:
            self._expect_stale = cached.version != version - 1
            if self._expect_stale and self._since is None:  # skipped on a guess that was wrong:
                self._queue_catch_up(conn, name, cached)      # one more round trip
                self._batch.flush()
        since, self._since = self._since, None
        new_jobs, self._new_jobs = self._new_jobs, None
        if new_jobs is not None:
            self._know_jobs(new_jobs.all())
        if cached is not None and (cached.generation != generation
                                   or (cached.version != version - 1 and not self._replay(conn, cached, since, version))):
            cached = None  # changed in a way the log does not describe: read the state back
        self._pending = cached
        self._tx = (conn, name, None, version)

    def refresh(self, cluster: str | None = None) -> bool:
        """Bring this process's cached view of the cluster up to date from the change log, outside the
        scheduler lock (what a flow's lease loop and a waiting job's poll call now and then), so that
        its next decision replays a few changes instead of reading the whole state back. Returns
        whether a view is kept; one that cannot be brought up to date is dropped."""
        with self._mutex:
            names = [cluster] if cluster is not None else list(self._views)
            kept = False
            for name in names:
                view = self._views.pop(name, None)
                if view is None:
                    continue
                with read_transaction(self.engine) as conn:
                    # the generation before and after the changes: a register in between (which the
                    # log does not describe) shows as a change of generation
                    before = conn.execute(_GENERATION, {"cname": name}).scalar()
                    changes = conn.execute(_CHANGES_SINCE, {"cname": name, "since": view.version}).all()
                    after = conn.execute(_GENERATION, {"cname": name}).scalar()
                if before != view.generation or after != before:
                    continue
                version = changes[-1][0] + 1 if changes else view.version + 1
                if self._replay(conn, view, changes, version, connect=True):
                    view.version = version - 1
                    self._views[name] = view
                    kept = True
            return kept

    def _queue_catch_up(self, conn: Connection, name: str, cached: _View) -> None:
        """Queue the reads that bring `cached` up to date: the change log since it, and new jobs."""
        self._since = self._batch.add(_CHANGES_SINCE, {"cname": name, "since": cached.version})
        self._new_jobs = self._batch.add(self._jobs_since_statement(conn),
                                         {"cname": name, "newest": self._newest_job})

    def _jobs_since_statement(self, conn: Connection) -> sa.Select:
        """Name and options text of the cluster's jobs with an id above `newest` (built once: the
        batch compiles each statement object once)."""
        if self._jobs_since is None:
            self._jobs_since = sa.select(jobs.c.id, jobs.c.name, self._policy_options_text(conn)).where(
                jobs.c.cluster == sa.bindparam("cname"), jobs.c.id > sa.bindparam("newest"))
        return self._jobs_since

    def _know_jobs(self, rows) -> None:  # noqa: ANN001 - (id, name, options text) rows
        for job_id, name, text in rows:
            if job_id not in self._options:
                self._options[job_id] = self._intern_text(text)
                self._names[job_id] = name
            self._newest_job = max(self._newest_job, job_id)

    def _replay(self, conn: Connection, view: _View, since: Pending | list | None, version: int,
                *, connect: bool = False) -> bool:
        """Bring `view` from its version to `version - 1` with the change log; False if it cannot.

        `since`: the log's rows after the view's version (a `Pending` inside the lock, rows
        read by `refresh`); `connect`: `conn` is closed, open a read for unknown jobs' options.
        """
        changes = since.all() if isinstance(since, Pending) else since or []
        if [v for v, _ in changes] != list(range(view.version + 1, version)):
            return False  # pruned, or a transaction before the log existed
        ops = []
        for _, change in changes:
            if "ops" not in change:
                return False  # a change the log does not describe (health, lease expiry, re-queue)
            ops.extend(change["ops"])
        unknown = [op[1] for op in ops if op[0] == "queue" and op[1] not in self._options]
        if unknown and connect:
            with read_transaction(self.engine) as reading:
                self._load_options(reading, unknown)
        elif unknown:
            self._load_options(conn, unknown)
        try:
            for op in ops:
                if op[0] == "free":
                    view.end(*op[1:])
                    self._options.pop(op[1], None)  # an ended job never comes back (a re-queue is
                    self._names.pop(op[1], None)    # not replayed): a long-lived decider forgets it
                elif op[0] == "admit":
                    view.admit(*op[1:])
                elif op[0] == "head":  # the job a pass reserved GPUs for stays first (`quotas`)
                    if view.teams is not None:
                        view.teams.head = op[1]
                elif op[0] == "queue":
                    _, job_id, name, priority, queued_at = op
                    self._names.setdefault(job_id, name)
                    if self._options.get(job_id):
                        view.enqueue((-priority, queued_at, job_id),
                                     QueuedJob(str(job_id), queued_at, self._options[job_id]))
                else:
                    return False
        except (ClusterError, KeyError, ValueError):
            return False  # the view disagrees with the log: trust the database, read it back
        return True

    def _record(self, op: list) -> None:
        """Note a change of this transaction for the change log (nothing once it is not described)."""
        if self._ops is not None:
            self._ops.append(op)

    @contextmanager
    def _in_transaction(self) -> Iterator[None]:
        try:
            yield
        finally:
            self._pending = None  # a rolled-back transaction leaves no view behind
            self._delegate = self._decider_known = False
            self._lock_row = None
            self._since = self._new_jobs = None
            self._batch = None
            self._tx = None
            self._now = 0.0

    def _view(self, conn: Connection, cname: str) -> _View:
        """The open transaction's view of the cluster, read from the database when not current."""
        self._settle()
        if self._pending is None:
            version, generation = conn.execute(sa.select(clusters.c.state_version, clusters.c.generation)
                                               .where(clusters.c.name == cname)).one()
            cluster = inventory.load_cluster(conn, cname, generation=generation, url=self.url).copy_state()
            self._resolve_policy(conn, cname, reread=True)
            queue, keys = self._load_queue(conn, cname)
            running = self._load_running(conn, cname)
            floor = conn.execute(_LIVE_LEASE_FLOOR, {"cname": cname}).scalar()
            self._pending = _View(version, generation, cluster, FreeGpus(cluster), queue, keys, running,
                                  float("inf") if floor is None else floor, quotas.TeamState.load(conn, cname))
        return self._pending

    def _forget_view(self) -> None:
        """After a change this process does not mirror in memory (health, expiry, register)."""
        self._settle()
        self._pending = None
        self._ops = None  # nor does the change log: other processes read the state back

    def _job_row(self, conn: Connection, job_id: int, *, lock: bool = False):
        query = sa.select(jobs).where(jobs.c.id == job_id)
        row = conn.execute(query.with_for_update() if lock and is_postgres(conn) else query).one_or_none()
        if row is None:
            raise identity.no_such_job(job_id, self.identity)
        return row

    def _cluster_of(self, job_id: int) -> str:
        if job_id in self._job_cluster:
            return self._job_cluster[job_id]
        with read_transaction(self.engine) as conn:
            name = conn.execute(sa.select(jobs.c.cluster).where(jobs.c.id == job_id)).scalar_one_or_none()
        if name is None:
            raise identity.no_such_job(job_id, self.identity)
        return name

    # ---------------------------------------------------------------- inventory and health
    def register(self, cluster: Cluster, *, source: str | None = None) -> dict[str, Any]:
        with write_transaction(self.engine) as conn:
            if is_postgres(conn):
                conn.execute(sa.select(clusters.c.name).where(clusters.c.name == cluster.name).with_for_update())
            summary = inventory.register(conn, cluster, source=source, by=self.actor)
        self._views.pop(cluster.name, None)
        self.reconcile(cluster.name)  # new GPUs: admit what now fits
        return summary

    def cluster(self, cluster: str | None = None) -> Cluster:
        """A private copy of the cluster as it is now (health and free GPUs)."""
        with read_transaction(self.engine) as conn:
            name = inventory.resolve_cluster(conn, cluster)
            return inventory.load_cluster(conn, name, url=self.url).copy_state()

    def set_health(self, node: str, state: str, *, reason: str = "", cluster: str | None = None,
                   by: str | None = None) -> dict[str, Any]:
        """cordon (faulty: place nothing there), drain (finish running work, admit nothing new) or ready."""
        if state not in inventory.HEALTH_STATES:
            raise OrchestratorError(f"unknown node state {state!r}; use one of {inventory.HEALTH_STATES}")
        with self._locked(cluster) as (conn, name):
            row = conn.execute(sa.select(nodes.c.state).where(nodes.c.cluster == name, nodes.c.name == node)
                               ).one_or_none()
            if row is None:
                known = [n for (n,) in conn.execute(sa.select(nodes.c.name).where(nodes.c.cluster == name)
                                                    .order_by(nodes.c.position))]
                shown = ", ".join(known[:12]) + (" ..." if len(known) > 12 else "")
                raise OrchestratorError(f"no node named {node!r} in cluster {name!r}; nodes: {shown}")
            conn.execute(sa.update(nodes).where(nodes.c.cluster == name, nodes.c.name == node).values(
                state=state, reason=reason or None, changed_by=identity.acting(self.actor, self.identity, by), changed_at=db_now()))
            running = inventory.live_jobs_on(conn, name, node)
            self._forget_view()
            result = self._pass(conn, name) if state == "ready" else None
        return {"cluster": name, "node": node, "state": state, "previous": row.state, "reason": reason or None,
                "running_jobs": running, "admitted": result.admitted if result else []}

    def cordon(self, node: str, reason: str = "", **kw: Any) -> dict[str, Any]:
        return self.set_health(node, "cordoned", reason=reason, **kw)

    def drain(self, node: str, reason: str = "", **kw: Any) -> dict[str, Any]:
        return self.set_health(node, "drained", reason=reason, **kw)

    def uncordon(self, node: str, reason: str = "", **kw: Any) -> dict[str, Any]:
        return self.set_health(node, "ready", reason=reason, **kw)

    def set_quota(self, team: str, gpu_type: str, nominal: int, borrowing_limit: int | None = 0, *,
                  cluster: str | None = None) -> dict[str, Any]:
        """Set a team's quota of a GPU type (`quotas.set_quota` checks it); every process's view
        is read back (the change log marks it), and a pass admits what the new quota allows."""
        with self._locked(cluster) as (conn, cname):
            result = quotas.set_quota(conn, cname, team, gpu_type, nominal, borrowing_limit)
            self._forget_view()
            self._pass(conn, cname)
        return result

    def rules_changed(self) -> None:
        """After a change of teams or weights (`teams.add_team`): every process's view of every
        cluster is read back (the change log marks it), so the next pass uses the new weights."""
        with read_transaction(self.engine) as conn:
            names = [n for (n,) in conn.execute(sa.select(clusters.c.name))]
        for name in names:
            with self._locked(name) as (conn, cname):
                self._forget_view()
                self._pass(conn, cname)

    # ---------------------------------------------------------------- the queue
    def submit(self, name: str, options: dict[str, list[Option]], *, cluster: str | None = None,
               spec: dict[str, Any] | None = None, priority: int | str = 0, team: str | None = None,
               delegated_to: str | None = None) -> int:
        """Queue a job with its options (see `options.job_options` / `demand_options`); returns its id.

        `priority`: a priority class's name, or (while no class is defined) a whole number; a
        class above the team's cap is refused. The same transaction makes a policy pass, so a
        job that fits starts at once.

        `delegated_to` (e.g. "slurm"): the job runs where and when that batch system decides
        (`DELEGATED`): recorded with the same checks, but never queued for this orchestrator's
        GPUs; its flow mirrors the batch system's state (`mirror`).
        """
        if not any(options.values()):
            raise OrchestratorError(f"job {name!r} has no way to run on this cluster (no options)")
        team = identity.team_for_submit(self.engine, self.identity, team)  # one line, exit 2, if none fits
        if priority != 0 or team is not None:  # (the default needs no read: 0 is always allowed)
            with read_transaction(self.engine) as conn:
                priority = quotas.resolve_priority(conn, priority, team)
        check_priority(priority)
        if delegated_to is not None:
            return self._submit_delegated(name, options, cluster, spec, priority, team, delegated_to)
        with self._locked(cluster, deferred=True) as (conn, cname):
            # The lock and the new row in one round trip on PostgreSQL.
            inserted = self._batch.add(_INSERT_JOB, dict(
                cluster=cname, name=name, spec=spec, options=options_to_json(options), priority=priority,
                submitted_by=self.actor, team=team))
            self._settle()
            job_id, now = inserted.all()[0]
            self._options[job_id] = self._intern(options.get(self._resolve_policy(conn, cname), []))
            self._names[job_id] = name
            self._job_cluster[job_id] = cname
            self._record(["queue", job_id, name, priority, now])
            self._newest_job = max(self._newest_job, job_id)
            current = self._pending is not None
            if self._delegate and not current:  # the decider admits it (within milliseconds)
                self._pass(conn, cname)
                return job_id
            view = self._view(conn, cname)  # when read back now, it holds this job already
            if view.teams is not None:
                view.teams.team_of[job_id] = team or ""
            if self._options.get(job_id) and current:
                view.enqueue((-priority, now, job_id), QueuedJob(str(job_id), now, self._options[job_id]))
            self._pass(conn, cname)
        return job_id

    def _submit_delegated(self, name: str, options: dict[str, list[Option]], cluster: str | None,
                          spec: dict[str, Any] | None, priority: int, team: str | None, system: str) -> int:
        """`submit` of a delegated job: a row, and nothing else (no scheduler lock, no change to any
        process's view of the cluster, no policy pass: no queue holds it)."""
        with write_transaction(self.engine) as conn:
            cname = inventory.resolve_cluster(conn, cluster)
            job_id = conn.execute(_INSERT_DELEGATED, dict(
                cluster=cname, name=name, spec=spec, options=options_to_json(options), priority=priority,
                submitted_by=self.actor, team=team, batch={"system": system, "at": time.time()})).scalar_one()
        self._job_cluster[job_id] = cname
        return job_id

    def delegate(self, job_id: int, system: str = "slurm") -> str:
        """Hand a queued job (one `forgeflow submit` queued) to the batch system `system`: it leaves
        the queue and becomes `DELEGATED` (an admission it got meanwhile is released, its GPUs go
        to the jobs waiting). Idempotent; returns the state it was in. OrchestratorError once it
        ended."""
        cluster = self._cluster_of(job_id)
        with self._locked(cluster) as (conn, cname):
            row = self._job_row(conn, job_id, lock=True)
            if row.state == DELEGATED:
                return row.state
            if row.state not in ACTIVE:
                raise OrchestratorError(f"job {job_id} ({row.name}) is {row.state}: nothing to hand to {system}")
            freed = self._free_allocations(conn, allocations.c.job_id == job_id, self._now, "release")
            conn.execute(sa.update(jobs).where(jobs.c.id == job_id).values(
                state=DELEGATED, placement=None, promised=sa.null(), reason=None,
                batch={"system": system, "at": time.time()}))
            self._forget_view()  # other processes read the queue back (the log does not describe this)
            if freed:
                self._pass(conn, cname)
        return row.state

    def mirror(self, job_id: int, **said: Any) -> bool:
        """Record what the batch system says of a delegated job (its flow, when that changes: "id",
        "state", "reason", "nodes", ...), merged into what was recorded and stamped with the time.
        False when the job is not delegated (any more): it ended, and nothing is written."""
        with write_transaction(self.engine) as conn:
            # (locked: a renewal of its deadline in between is never overwritten with what was read)
            row = conn.execute(sa.select(jobs.c.state, jobs.c.batch).where(jobs.c.id == job_id)
                               .with_for_update()).one_or_none()
            if row is None:
                raise identity.no_such_job(job_id, self.identity)
            if row.state != DELEGATED:
                return False
            conn.execute(sa.update(jobs).where(jobs.c.id == job_id, jobs.c.state == DELEGATED).values(
                batch={**(row.batch or {}), **said, "at": time.time()}))
        return True

    def renew_delegated(self, job_id: int) -> float:
        """A delegated job's flow says it is alive (`lease.DelegatedJob`, every lease_s / 3): its
        deadline (`jobs.batch`'s DELEGATED_UNTIL) runs `lease_s` from now on the database's clock,
        never shortened; the renewal also records that a writer reached the database (`epoch`),
        as a lease renewal does. Returns the deadline. LeaseLostError (naming how the job ended)
        once the job is not delegated any more: its flow must stop its work."""
        with write_transaction(self.engine) as conn:
            epoch.noted(conn.execute(epoch.TOUCH_UNLESS_BUSY, epoch.touch_params(self.config.lease_s)).all())
            row = conn.execute(sa.select(jobs.c.state, jobs.c.reason, jobs.c.batch, db_now()).where(
                jobs.c.id == job_id).with_for_update()).one_or_none()
            if row is None:
                raise identity.no_such_job(job_id, self.identity)
            state, reason, batch, now = row
            if state != DELEGATED:
                raise LeaseLostError(f"job {job_id} is {state}, not delegated to a batch system"
                                     + (f" ({reason})" if reason else ""))
            batch = dict(batch or {})
            until = max(now + self.config.lease_s, float(batch.get(DELEGATED_UNTIL) or 0.0))
            conn.execute(sa.update(jobs).where(jobs.c.id == job_id, jobs.c.state == DELEGATED).values(
                batch={**batch, DELEGATED_UNTIL: until, DELEGATED_RENEWED: now}))
        return until

    def cancel(self, job_id: int, reason: str = "cancelled") -> str:
        """Remove a queued job from the queue, or release a running one; returns its previous state."""
        return self.release(job_id, outcome="cancelled", reason=reason)

    def request_stop(self, job_id: int, reason: str, *, by: str | None = None) -> str:
        """`forgeflow cancel`: a queued job leaves the queue at once (cancelled); a running one is
        asked to stop. Its flow sees the request within seconds (lease.STOP_CHECK_S), stops the ranks
        gracefully (they commit the step they are on) and ends the job as cancelled; its GPUs
        stay held until then, so no other job is placed where its ranks still run (a flow that
        died ends it when its lease runs out). A delegated job is asked the same way: its flow reads
        the request (`lease.DelegatedJob`), cancels its batch job and ends it. Returns the state the job was in;
        OrchestratorError for an unknown job or one that already ended."""
        by = identity.acting(self.actor, self.identity, by)
        request = {"by": by, "reason": reason, "at": time.time()}
        with write_transaction(self.engine) as conn:
            row = self._job_row(conn, job_id)
            if row.state in DONE:
                raise OrchestratorError(f"job {job_id} ({row.name}) already {row.state}: nothing to cancel")
            conn.execute(sa.update(jobs).where(jobs.c.id == job_id, jobs.c.state.in_(ACTIVE))
                         .values(stop_requested=request))
        if row.state == "queued":
            self.release(job_id, outcome="cancelled", reason=f"cancelled by {by}: {reason}")
        return row.state

    def set_spec(self, job_id: int, spec: dict[str, Any]) -> None:
        """Record the job's spec as it runs (its paths filled in for this job id)."""
        with write_transaction(self.engine) as conn:
            conn.execute(sa.update(jobs).where(jobs.c.id == job_id).values(spec=spec))

    def active_specs(self) -> list[tuple[int, str, dict[str, Any] | None]]:
        """(id, name, spec) of every queued or running job, on every cluster."""
        with read_transaction(self.engine) as conn:
            return [tuple(r) for r in conn.execute(sa.select(jobs.c.id, jobs.c.name, jobs.c.spec).where(
                jobs.c.state.in_(ACTIVE)).order_by(jobs.c.id))]

    def record_launch(self, job_id: int, launch: str, request: dict[str, Any]) -> None:
        """Record what launch `launch` of the job runs on its nodes (its flow calls this before
        starting node-launch runs, which run only what is recorded: `launch_for`)."""
        with write_transaction(self.engine) as conn:
            self._job_row(conn, job_id)
            conn.execute(sa.delete(job_launches).where(job_launches.c.job_id == job_id,
                                                       job_launches.c.launch == launch))
            conn.execute(sa.insert(job_launches).values(job_id=job_id, launch=launch, request=request,
                                                        recorded_at=db_now()))

    def launch_for(self, job_id: int, launch: str, node: str) -> dict[str, Any]:
        """The launch request node `node` may run for the job: the one its flow recorded, and only
        while the job runs on that node. OrchestratorError otherwise (nothing is run)."""
        with read_transaction(self.engine) as conn:
            row = self._job_row(conn, job_id)
            request = conn.execute(sa.select(job_launches.c.request).where(
                job_launches.c.job_id == job_id, job_launches.c.launch == launch)).scalar()
        refused = f"refusing to run launch {launch!r} of job {job_id} ({row.name}) on node {node!r}"
        if row.state != "running":
            raise OrchestratorError(f"{refused}: the job is {row.state}, it holds no GPUs")
        if request is None:
            raise OrchestratorError(f"{refused}: its flow recorded no such launch")
        held = {n["node"] for n in (row.placement or {}).get("nodes", [])}
        if node not in held or node not in {n["node"] for n in request["nodes"]}:
            raise OrchestratorError(f"{refused}: the job holds {sorted(held)}, and the launch runs on "
                                    f"{sorted(n['node'] for n in request['nodes'])}")
        return request

    def stop_request(self, job_id: int) -> dict[str, Any] | None:
        """The job's stop request ({"by", "reason", "at"}), or None."""
        with read_transaction(self.engine) as conn:
            return conn.execute(sa.select(jobs.c.stop_requested).where(jobs.c.id == job_id)).scalar()

    def report_progress(self, job_id: int, **progress: Any) -> None:
        """Record how far the job got (its flow calls this: phase, step, steps, loss, step_s,
        diagnosis); merged into what was recorded, stamped with the time."""
        with write_transaction(self.engine) as conn:
            known = conn.execute(sa.select(jobs.c.progress).where(jobs.c.id == job_id)).scalar() or {}
            conn.execute(sa.update(jobs).where(jobs.c.id == job_id).values(
                progress={**known, **progress, "at": time.time()}))

    def job_run_by(self, flow_run_id: str) -> int | None:
        """The queued or running job whose runner is this Prefect flow run (`forgeflow submit`
        recorded it), or None."""
        with read_transaction(self.engine) as conn:
            return conn.execute(sa.select(jobs.c.id).where(
                jobs.c.runner["flow_run_id"].as_string() == flow_run_id, jobs.c.state.in_(ACTIVE))
                .order_by(jobs.c.id.desc()).limit(1)).scalar()

    def set_runner(self, job_id: int, runner: dict[str, Any]) -> None:
        """Record who runs the job (the detached runner's host, pid and log; the Prefect flow run)."""
        with write_transaction(self.engine) as conn:
            known = conn.execute(sa.select(jobs.c.runner).where(jobs.c.id == job_id)).scalar() or {}
            conn.execute(sa.update(jobs).where(jobs.c.id == job_id).values(runner={**known, **runner}))

    def release(self, job_id: int, *, outcome: str = "finished", reason: str | None = None,
                attempt: int | None = None) -> str:
        """Give the job's GPUs back and record how it ended (finished / failed / cancelled).

        Idempotent: releasing a job that already ended changes nothing. Returns the previous state.
        `attempt` (a holder's `Admission.attempt`): end the job only while it is still that
        admission (running, or queued again after its lease was reclaimed); a holder whose job
        was admitted again since changes nothing (the new admission's holder ends it).
        """
        if outcome == "preempted":
            return self._release_preempted(job_id, attempt)
        if outcome not in DONE:
            raise OrchestratorError(f"outcome must be one of {DONE} or 'preempted' (got {outcome!r})")
        cluster = self._cluster_of(job_id)
        with self._locked(cluster, deferred=True) as (conn, cname):
            # The lock, the job's state before this change, freeing its GPUs and ending it: one
            # round trip on PostgreSQL (they run in this order; ending touches only a live job).
            prior = self._batch.add(_JOB_STATE, {"jid": job_id})
            if attempt is None:
                released = self._batch.add(_RELEASE_JOB, {"jid": job_id})
                self._batch.add(_JOB_ENDED, {"jid": job_id, "outcome": outcome, "why": reason})
            else:
                released = self._batch.add(_RELEASE_ADMISSION, {"jid": job_id, "attempt": attempt})
                self._batch.add(_ADMISSION_ENDED, {"jid": job_id, "outcome": outcome, "why": reason,
                                                   "attempt": attempt})
            self._settle()
            rows, freed = prior.all(), released.all()
            if not rows:
                raise identity.no_such_job(job_id, self.identity)
            state, attempts = rows[0]
            if not freed and (state in DONE or (attempt is not None and attempts != attempt)):
                return state  # already ended, or admitted again since this holder's admission
            ended_at = self._now  # the database's clock, as the admission's time is
            self._record(["free", job_id, [[node, gpu] for _, node, gpu in freed], ended_at])
            self._options.pop(job_id, None)
            self._names.pop(job_id, None)
            if self._pending is None:
                if not self._delegate:  # read back now, after this change: nothing to apply to it
                    self._view(conn, cname)
            else:
                try:
                    self._pending.end(job_id, [(node, gpu) for _, node, gpu in freed], ended_at)
                except ClusterError:  # the view disagrees with the database: trust the database
                    self._settle()
                    self._pending = None
            if freed:
                self._pass(conn, cname)
            return state

    def requeue(self, job_id: int, reason: str) -> None:
        """Give a running job's GPUs back and put it in the queue again, at its old place
        (after a node check cordoned one of its nodes: it is placed anew on healthy ones)."""
        cluster = self._cluster_of(job_id)
        with self._locked(cluster) as (conn, cname):
            row = conn.execute(sa.select(jobs.c.state, jobs.c.submitted_at, jobs.c.priority).where(
                jobs.c.id == job_id)).one()
            if row.state != "running":
                raise OrchestratorError(f"job {job_id} is {row.state}, not running: nothing to re-queue")
            self._free_allocations(conn, allocations.c.job_id == job_id, self._now, "release")
            conn.execute(sa.update(jobs).where(jobs.c.id == job_id).values(
                state="queued", queued_at=row.submitted_at, placement=None, reason=reason))
            self._forget_view()
            self._pass(conn, cname)

    # ---------------------------------------------------------------- preemption (issue 31)
    def preempt(self, cluster: str | None = None, *, stop_s: float | None = None) -> dict[str, list]:
        """The decider's preemption pass (`serve` makes one every DECIDER_BEAT_S while
        `preempt_stop_s` is set): first every victim past its deadline is force-released
        (its allocations end, so its lease is gone: its holder's renewal fails and the nodes'
        lease check stops its ranks) and re-queued; then `scheduler.preemption.plan` picks new
        victims for the waiting jobs, and each is asked to stop (`stop_requested` with
        "preempted by job N", `preempted_by` and a `deadline` `stop_s` from now on the
        database's clock). Its flow stops the ranks gracefully (they commit the step they are
        on) and releases it with outcome "preempted": it is queued again at its submit time.
        Returns {"asked": [[victim, for job], ...], "forced": [victim, ...]}."""
        stop_s = self.config.preempt_stop_s if stop_s is None else stop_s
        if stop_s is None or stop_s <= 0:
            raise OrchestratorError("preemption needs a stop deadline: give stop_s (seconds) or set "
                                    "OrchestratorConfig.preempt_stop_s")
        out: dict[str, list] = {"asked": [], "forced": []}
        with self._locked(cluster) as (conn, cname):
            now = self._now
            rows = conn.execute(sa.select(
                jobs.c.id, jobs.c.team, jobs.c.priority, jobs.c.submitted_at, jobs.c.admitted_at,
                jobs.c.placement["gpu_type"].as_string().label("gpu_type"),
                jobs.c.placement["world_size"].as_integer().label("world_size"), jobs.c.progress,
                jobs.c.stop_requested).where(jobs.c.cluster == cname, jobs.c.state == "running")).all()
            for r in rows:
                request = r.stop_requested or {}
                if request.get("preempted_by") is not None and request.get("deadline", float("inf")) <= now:
                    self._requeue_preempted(conn, r.id, r.submitted_at,
                                            f"{request['reason']} (forced: not stopped by its deadline)", forced=True)
                    out["forced"].append(r.id)
            if out["forced"]:
                self._pass(conn, cname)  # the freed GPUs go to the jobs waiting for them
            view = self._view(conn, cname)
            if not view.queue:
                return out
            holders = [preemption.Holder(
                str(r.id), r.team or NO_TEAM, r.priority, r.gpu_type, r.world_size,
                # work since its last committed checkpoint, or since this admission if it committed none since
                max(float((r.progress or {}).get("committed_at") or 0.0), r.admitted_at),
                stopping=r.stop_requested is not None)
                for r in rows if r.id not in out["forced"] and r.id in view.running]
            admits = admission_policy(self.policy)
            if view.teams is not None:
                snap = view.teams.snapshot(conn, admits, now, view.queue, view.keys, list(view.running.values()),
                                           view.free, reservation_depth=self.config.reservation_depth)
            else:
                snap = Snapshot(admits, now, view.queue, list(view.running.values()), view.free,
                                priority_of={str(k[2]): -k[0] for k in view.keys})
            for p in preemption.plan(snap, holders):
                for victim in p.victims:
                    asked = conn.execute(sa.update(jobs).where(
                        jobs.c.id == int(victim), jobs.c.state == "running", jobs.c.stop_requested.is_(None)).values(
                        stop_requested={"by": "preemption", "reason": f"preempted by job {p.job_id}", "at": now,
                                        "deadline": now + stop_s, "preempted_by": int(p.job_id)}))
                    if asked.rowcount:
                        conn.execute(sa.insert(preemptions).values(
                            cluster=cname, job_id=int(victim), preempted_by=int(p.job_id), asked_at=now))
                    out["asked"].append([int(victim), int(p.job_id)])
                log.info("preempting %s for job %s (%.0f GPU-s since their checkpoints)",
                         ", ".join(p.victims), p.job_id, p.lost_gpu_s)
        return out

    def _preemption_due(self, cname: str) -> bool:
        """Whether a preemption pass has anything to look at: a queued job, or a running job asked
        to stop (a victim's deadline). One read, without the scheduler lock: an idle cluster's
        decider does not take the lock (and bump the cluster's version) every beat for nothing."""
        with read_transaction(self.engine) as conn:
            return conn.execute(sa.select(sa.literal(1)).where(
                jobs.c.cluster == cname,
                sa.or_(jobs.c.state == "queued",
                       sa.and_(jobs.c.state == "running", jobs.c.stop_requested.is_not(None)))).limit(1)).first() is not None

    def _release_preempted(self, job_id: int, attempt: int | None) -> str:
        """The flow of a job asked to stop for another released it (its ranks committed their
        step): queue it again at its submit time. Returns the state it was in (a job already
        force-released, or admitted again since `attempt`, is left as it is)."""
        cluster = self._cluster_of(job_id)
        with self._locked(cluster) as (conn, cname):
            row = self._job_row(conn, job_id, lock=True)
            if row.state != "running" or (attempt is not None and row.attempts != attempt):
                return row.state
            self._requeue_preempted(conn, job_id, row.submitted_at,
                                    (row.stop_requested or {}).get("reason") or "preempted")
            self._pass(conn, cname)
            return "running"

    def _requeue_preempted(self, conn: Connection, job_id: int, submitted_at: float, why: str, *,
                           forced: bool = False) -> None:
        """End the job's allocations (history event `preempt`), end its preemption record (what
        `cluster usage` counts) and queue it at its submit time."""
        self._free_allocations(conn, allocations.c.job_id == job_id, self._now, "preempt")
        values = {"ended_at": self._now, "forced": True} if forced else {"ended_at": self._now}
        conn.execute(sa.update(preemptions).where(preemptions.c.job_id == job_id, preemptions.c.ended_at.is_(None))
                     .values(**values))
        conn.execute(sa.update(jobs).where(jobs.c.id == job_id).values(
            state="queued", queued_at=submitted_at, placement=None, reason=why, stop_requested=sa.null()))
        self._forget_view()

    # ---------------------------------------------------------------- elastic resizes (issue 31)
    def resize(self, cluster: str | None = None, *, stop_s: float | None = None) -> dict[str, list]:
        """The decider's elastic pass on a cluster with policy elastic (`serve` makes one every
        DECIDER_BEAT_S there): `scheduler.elastic.elastic_pass` decides, this carries it out as
        preemptions. First every resized job past its deadline is force-released (as `preempt`
        does). Then each Resize asks its job to stop (`stop_requested`: "resized to N GPUs", its
        `preempted_by` the waiting job a shrink makes room for, or the job itself when it grows,
        a `deadline` `stop_s` from now; its flow stops the ranks gracefully and releases it as
        preempted, as for a preemption) and promises it its next admission (`jobs.promised`: the
        new layout on the GPUs the pass chose); the waiting job a shrink makes room for is
        promised the GPUs it freed. A pass admits a promised job there once all its GPUs are free
        and keeps them from every other job meanwhile (`_promised_admissions`); a promise lapses
        2 x `stop_s` after it was made. Each resize is recorded in `preemptions` (kind shrink or
        grow, GPUs before and after). While teams' quotas are defined nothing is resized (the
        elastic pass knows no quotas). Returns {"asked": [[job, from GPUs, to GPUs, for job or
        None], ...], "promised": [job, ...], "forced": [job, ...]}."""
        stop_s = self.config.resize_stop_s if stop_s is None else stop_s
        out: dict[str, list] = {"asked": [], "promised": [], "forced": []}
        with self._locked(cluster) as (conn, cname):
            now = self._now
            if self._resolve_policy(conn, cname) != "elastic":
                return out
            rows = conn.execute(sa.select(
                jobs.c.id, jobs.c.submitted_at, jobs.c.admitted_at, jobs.c.predicted_run_s, jobs.c.placement,
                jobs.c.options, jobs.c.progress, jobs.c.stop_requested).where(
                jobs.c.cluster == cname, jobs.c.state == "running")).all()
            for r in rows:
                request = r.stop_requested or {}
                if request.get("preempted_by") is not None and request.get("deadline", math.inf) <= now:
                    self._requeue_preempted(conn, r.id, r.submitted_at,
                                            f"{request['reason']} (forced: not stopped by its deadline)", forced=True)
                    out["forced"].append(r.id)
            if out["forced"]:
                self._pass(conn, cname)  # the freed GPUs go to the jobs promised them
            view = self._view(conn, cname)
            if view.teams is not None:  # elastic_pass knows no quotas (nor does the simulator's elastic policy)
                log.info("cluster %s: teams' quotas are defined; jobs are admitted FCFS, not resized", cname)
                return out
            # the pass decides on a copy: the view's cluster with every live promise's idle GPUs kept
            promises = {job_id: (state, p) for job_id, state, p in conn.execute(_PROMISES, {"cname": cname})
                        if p.get("until", math.inf) >= now}
            cluster_copy = view.cluster.copy_state()
            free = FreeGpus(cluster_copy)
            schedulable = {n.name for n in cluster_copy.schedulable_nodes()}
            for _, p in promises.values():
                _hold(cluster_copy, free, [(n, g) for n, g in _promise_gpus(p)
                                           if n in schedulable and g in cluster_copy.node(n).free_gpus])
            queue = [q for q in view.queue if int(q.job_id) not in promises]
            running = [self._elastic_running(r, now, resizable=r.stop_requested is None and r.id not in promises)
                       for r in rows if r.id not in out["forced"] and r.id in view.running]
            decision = elastic_pass(now, queue, running, free, self.elastic)
            until = now + 2 * stop_s
            remaining = {e.job_id: e.remaining for e in running}
            unasked: set[str] = set()  # waiting jobs some of whose victims could not be asked (a cancel came first)
            for rz in decision.resizes:
                job_id, to = int(rz.job_id), rz.placement.world_size
                reason = f"resized to {to} GPUs" + (f" for job {rz.for_job}" if rz.for_job is not None else "")
                by = int(rz.for_job) if rz.for_job is not None else job_id
                promise = {"option": rz.new.to_dict(), "placement": rz.placement.to_dict(), "reason": reason,
                           "until": until, "run_s": rz.new.run_s * remaining.get(rz.job_id, 1.0)}
                asked = conn.execute(sa.update(jobs).where(
                    jobs.c.id == job_id, jobs.c.state == "running", jobs.c.stop_requested.is_(None)).values(
                    stop_requested={"by": "elastic", "reason": reason, "at": now, "deadline": now + stop_s,
                                    "preempted_by": by,
                                    "resize": {"kind": rz.kind, "from_gpus": rz.old_placement.world_size, "to_gpus": to}},
                    promised=promise))
                if not asked.rowcount:
                    unasked.add(rz.for_job)
                    continue
                conn.execute(sa.insert(preemptions).values(
                    cluster=cname, job_id=job_id, preempted_by=by, asked_at=now, kind=rz.kind,
                    from_gpus=rz.old_placement.world_size, to_gpus=to))
                out["asked"].append([job_id, rz.old_placement.world_size, to,
                                     None if rz.for_job is None else int(rz.for_job)])
                log.info("job %s: %s (predicted gain %.0f s, cost %.0f s)", job_id, reason, rz.gain_s, rz.cost_s)
            made_room = {int(rz.for_job) for rz in decision.resizes if rz.for_job not in (None, *unasked)}
            for queued, opt, placement in decision.started:
                job_id = int(queued.job_id)
                if job_id not in made_room:
                    continue  # started by admission alone: the pass (`_pass`) admits it, not this copy
                placement.job = self._names.get(job_id) or str(job_id)
                conn.execute(sa.update(jobs).where(jobs.c.id == job_id, jobs.c.state == "queued").values(
                    promised={"option": opt.to_dict(), "placement": placement.to_dict(), "until": until,
                              "run_s": opt.run_s, "reason": "started on GPUs freed by resizing other jobs"}))
                out["promised"].append(job_id)
        return out

    def _elastic_running(self, row: Any, now: float, *, resizable: bool) -> ElasticRunning:
        """A running job as `elastic_pass` sees it: its layout now (the stored option of its GPU type,
        count, tp and pp; its stored layouts hold every plan's), the layouts it may resize to (none
        when `resizable` is False: asked to stop, or promised an admission), the fraction of its
        work left (its flow's progress, else its predicted end) and when it was last (re)admitted."""
        placement = placement_from_dict(row.placement)
        stored = row.options or {}
        sized = [Option.from_dict(o) for o in stored.get(ELASTIC_LAYOUTS) or stored.get("ect") or ()]
        key = (placement.gpu_type, placement.world_size, placement.tp, placement.pp)
        current = next((o for o in sized if (o.gpu_type, o.num_gpus, o.tp, o.pp) == key), None)
        run_s = row.predicted_run_s or 0.0
        end = row.admitted_at + run_s
        if current is None:  # a plain GPU demand (or a layout no plan names): not resizable
            current = Option(gpu_type=placement.gpu_type, num_gpus=placement.world_size, unit=placement.tp,
                             min_memory_bytes=0, run_s=max(run_s, 1e-9), dp=placement.dp, tp=placement.tp,
                             pp=placement.pp)
            resizable = False
        progress = row.progress or {}
        if progress.get("steps") and progress.get("step") is not None:
            remaining = 1.0 - float(progress["step"]) / float(progress["steps"])
        else:
            remaining = (end - now) / current.run_s
        remaining = min(1.0, max(0.01, remaining))
        asked = [Option.from_dict(x) for x in stored.get("elastic") or stored.get("fcfs") or ()]  # its request
        requested = next((o.num_gpus for o in asked if o.gpu_type == current.gpu_type), current.num_gpus)
        layouts = resizable_layouts(sized, current, requested, self.elastic) if resizable else ()
        return ElasticRunning(str(row.id), current, placement, end, remaining, row.admitted_at, requested, layouts)

    def _promised_admissions(self, conn: Connection, cname: str, view: _View,
                             now: float) -> tuple[list, list[tuple[str, int]], list[QueuedJob], list[tuple]]:
        """Under policy elastic, before the policy pass: admit every queued job whose resize promise
        (`resize`) has all its GPUs idle, on the promised layout and GPUs, and keep the idle GPUs of
        every other live promise from the pass. Returns (the admissions as the pass's started
        entries, the GPUs kept: `_unhold` gives them back, the queue and its keys without the jobs
        promised an admission). A promise past its `until`, or on a node out of service, lapses
        (the job waits in the queue as any other)."""
        started: list = []
        held: list[tuple[str, int]] = []
        promised: set[int] = set()
        dropped: list[dict[str, int]] = []
        schedulable = {n.name for n in view.cluster.schedulable_nodes()}
        for job_id, state, promise in conn.execute(_PROMISES, {"cname": cname}).all():
            gpus = _promise_gpus(promise)
            if promise.get("until", math.inf) < now or any(n not in schedulable for n, _ in gpus):
                dropped.append({"jid": job_id})
                continue
            idle = [(n, g) for n, g in gpus if g in view.cluster.node(n).free_gpus]
            if state == "queued":
                promised.add(job_id)
                if len(idle) == len(gpus):
                    _hold(view.cluster, view.free, gpus)  # taken for good: the admission's allocation
                    opt = Option.from_dict(promise["option"])
                    started.append((_Promised(str(job_id), (opt,), float(promise.get("run_s", opt.run_s))), opt,
                                    placement_from_dict(promise["placement"])))
                    dropped.append({"jid": job_id})
                    continue
            _hold(view.cluster, view.free, idle)
            held.extend(idle)
        if dropped:
            self._batch.add(_DROP_PROMISE, dropped)
        if not promised:
            return started, held, view.queue, view.keys
        kept = [i for i, k in enumerate(view.keys) if k[2] not in promised]
        return started, held, [view.queue[i] for i in kept], [view.keys[i] for i in kept]

    def _elastic_due(self, cname: str) -> bool:
        """Whether the decider's elastic pass has anything to look at on a cluster with policy
        elastic: a running job, and a queued job or an idle GPU (one read, without the lock)."""
        if (self.config.policy or self.policy) not in (None, "elastic"):
            return False  # (a re-registered file's policy is read back with the view: `_resolve_policy`)
        with read_transaction(self.engine) as conn:
            policy = self.config.policy or conn.execute(
                sa.select(clusters.c.policy).where(clusters.c.name == cname)).scalar()
            if policy != "elastic":
                return False
            counts = dict(conn.execute(sa.select(jobs.c.state, sa.func.count()).where(
                jobs.c.cluster == cname, jobs.c.state.in_(ACTIVE)).group_by(jobs.c.state)).all())
            if not counts.get("running"):
                return False
            if counts.get("queued"):
                return True
            ready = conn.execute(sa.select(sa.func.coalesce(sa.func.sum(nodes.c.gpu_count), 0)).where(
                nodes.c.cluster == cname, nodes.c.state == "ready")).scalar()
            held = conn.execute(sa.select(sa.func.count()).select_from(allocations).where(
                allocations.c.cluster == cname, allocations.c.released_at.is_(None))).scalar()
            return held < ready  # (a GPU of a ready node held by nobody; a job may grow into it)

    def renew(self, job_id: int, attempt: int | None = None) -> float:
        """Extend the job's lease by `lease_s`; LeaseLostError when its GPUs were reclaimed.

        `attempt` (the holder's `Admission.attempt`): renew only that admission. Without it, a
        holder whose lease was reclaimed while it stalled would renew the job's next admission
        (other GPUs, perhaps its own old ones given to another job) and never learn it lost them.

        The lease runs `lease_s` from now on the database's clock, whatever this host's clock says;
        the renewal also records that a writer reached the database (`epoch`: the first one
        after an outage records the epoch that gives every holder a full lease to renew). Both
        statements go in one round trip on PostgreSQL. Returns when the lease now runs out.
        """
        params = {"jid": job_id, "lease_s": self.config.lease_s}
        if attempt is not None:
            params["attempt"] = attempt
        with batched_write_transaction(self.engine) as (_conn, batch):
            touched = batch.add(epoch.TOUCH_UNLESS_BUSY, epoch.touch_params(self.config.lease_s))
            # Never shortens a lease (one given with a longer lease_s stays): a decision's view
            # skips the expiry check until the earliest lease it knows of (`_View.lease_floor`).
            renewed = batch.add(_RENEW if attempt is None else _RENEW_ADMISSION, params)
            batch.flush()
            epoch.noted(touched.all())
            until = [u for (u,) in renewed.all()]
        if not until:
            admission = "" if attempt is None else f" under admission {attempt}"
            raise LeaseLostError(
                f"job {job_id} holds no GPUs{admission} any more (its lease expired or it was released); "
                "stop its work: the GPUs may already run another job"
            )
        return min(until)

    def reconcile(self, cluster: str | None = None, *, check_leases: bool = True) -> PassResult:
        """Reclaim expired leases and admit what fits (what a waiting holder calls now and then)."""
        with self._locked(cluster) as (conn, cname):
            return self._pass(conn, cname, check_leases=check_leases)

    def serve(self, cluster: str | None = None, *, stop: Stop | None = None,
              busy_poll_s: float = 0.002, idle_poll_s: float = 0.05,
              on_pass: Callable[[PassResult], None] | None = None) -> None:
        """Be the cluster's decider until `stop` is set (`forgeflow cluster serve`); `on_pass` sees each pass.

        `stop` is a threading.Event set by another thread, or, to stop on a signal, the StopFlag of
        infra.stop_signal.stop_on_signals: a handler must never call Event.set() (it can deadlock
        on the lock of the Event.wait() it interrupted).

        Every flow is its own process and most find their view of the cluster stale when they
        release or submit; reading it back costs ~20 ms under the scheduler lock. While a
        decider's heartbeat is fresh (DECIDER_TTL_S) such a process only writes its change and
        leaves the policy pass to the decider, whose view stays current (it replays the change
        log): it passes whenever a change is waiting for one, and at least every DECIDER_BEAT_S
        (reclaiming expired leases). If it dies, its heartbeat goes stale and every process
        makes its own passes again; waiting jobs make the pass a dead decider left behind.
        """
        stop = stop or threading.Event()
        with read_transaction(self.engine) as conn:
            name = inventory.resolve_cluster(conn, cluster)
        self._serving = True
        beat = checked = 0.0
        try:
            while not stop.is_set():
                now = time.time()
                try:
                    if now - beat >= DECIDER_BEAT_S:
                        with write_transaction(self.engine) as conn:
                            conn.execute(sa.update(clusters).where(clusters.c.name == name).values(
                                decider=self.actor, decider_seen_at=db_now()))
                            epoch.touch(conn, self.config.lease_s, wait=False)  # a writer reached it
                        beat = now
                    with read_transaction(self.engine) as conn:
                        pending = conn.execute(_DECIDER_STATE, {"cname": name}).one()[0]
                    if pending or now - checked >= DECIDER_BEAT_S:
                        t0 = time.perf_counter()
                        result = self.reconcile(name, check_leases=now - checked >= DECIDER_BEAT_S)
                        result.seconds = time.perf_counter() - t0
                        if (self.config.preempt_stop_s is not None and now - checked >= DECIDER_BEAT_S
                                and self._preemption_due(name)):
                            self.preempt(name)
                        if now - checked >= DECIDER_BEAT_S and self._elastic_due(name):
                            self.resize(name)
                        if now - checked >= DECIDER_BEAT_S:
                            checked = now
                        if on_pass is not None:
                            on_pass(result)
                        stop.wait(busy_poll_s)
                    else:
                        stop.wait(idle_poll_s)
                except (StateDbError, sa.exc.OperationalError) as e:  # the database is down: keep trying; its
                    log.warning("decider: %s; retrying in 1 s", e)  # beat goes stale meanwhile
                    stop.wait(1.0)
        finally:
            self._serving = False
            with contextlib.suppress(StateDbError), write_transaction(self.engine) as conn:
                conn.execute(sa.update(clusters).where(clusters.c.name == name, clusters.c.decider == self.actor)
                             .values(decider=None, decider_seen_at=None))

    # ---------------------------------------------------------------- reading
    def job(self, job_id: int) -> dict[str, Any]:
        with read_transaction(self.engine) as conn:
            row = self._job_row(conn, job_id)
        return {k: v for k, v in row._mapping.items() if k != "options"}

    def admission(self, job_id: int) -> Admission | None:
        """Where the job runs, or None while it waits. Raises OrchestratorError if it ended."""
        with read_transaction(self.engine) as conn:
            row = self._job_row(conn, job_id)
            if row.state == "queued":
                return None
            if row.state != "running":
                raise OrchestratorError(f"job {job_id} ({row.name}) is {row.state}"
                                        + (f": {row.reason}" if row.reason else ""))
            lease = conn.execute(sa.select(sa.func.min(allocations.c.lease_expires_at)).where(
                allocations.c.job_id == job_id, allocations.c.released_at.is_(None))).scalar()
        return Admission(job_id, row.name, placement_from_dict(row.placement), lease or 0.0, row.attempts)

    def queue_position(self, job_id: int) -> tuple[int, int]:
        """(1-based position of the job among queued jobs of its cluster, queue length); (0, n) if
        not queued. The position is in the order the next pass takes the queue
        (`start_estimates.queue_order`): priority, then arrival; with teams, fair-share order by
        the teams' usage, read at most TEAM_USAGE_STALE_S ago (a waiting job asks every poll)."""
        with read_transaction(self.engine) as conn:
            row = self._job_row(conn, job_id)
            queued = conn.execute(sa.select(jobs.c.id, jobs.c.name, jobs.c.priority, jobs.c.queued_at).where(
                jobs.c.cluster == row.cluster, jobs.c.state == "queued").order_by(
                jobs.c.priority.desc(), jobs.c.queued_at, jobs.c.id)).all()
            read_at, teams = self._order_teams.get(row.cluster, (-math.inf, None))
            if time.monotonic() - read_at > TEAM_USAGE_STALE_S:
                teams = quotas.TeamState.load(conn, row.cluster)  # None while no team is defined
                self._order_teams[row.cluster] = (time.monotonic(), teams)
            if teams is not None:
                teams.learn_teams(conn, [r.id for r in queued])
        order = queue_order([WaitingJob(r.id, r.name, r.priority, r.queued_at, ()) for r in queued], teams, time.time())
        ids = [w.job_id for w in order]
        return (ids.index(job_id) + 1 if job_id in ids else 0), len(ids)

    def pass_due(self, cluster: str | None = None) -> bool:
        """Whether a waiting job should make a policy pass itself (one read): a live allocation is
        past its lease and grace (the pass reclaims it), or a delegated job's deadline is (its flow
        stopped renewing: the pass ends it), or a change waits for a pass that no live
        decider will make (it stopped beating). Times on the database's clock; a lease is overdue
        only once its holders had a full lease after the last outage (`epoch`). When nobody else
        wrote lately, the poll records that a writer reached the database (`epoch.touch`)."""
        lease_s = self.config.lease_s
        with read_transaction(self.engine) as conn:
            name = inventory.resolve_cluster(conn, cluster)
            # the earliest lease, or delegated job's deadline (its flow's liveness), of the cluster
            floors = [f for f in conn.execute(_LIVENESS_FLOORS, {"cname": name}).one() if f is not None]
            oldest = min(floors, default=None)
            pending, seen = conn.execute(_DECIDER_STATE, {"cname": name}).one()
            now, seen_at, epoch_at, _ = conn.execute(epoch.STATE).one()
        if seen_at is None or now - seen_at > epoch.keepalive_after_s(lease_s):
            with write_transaction(self.engine) as conn:
                epoch_at = epoch.touch(conn, lease_s, wait=False) or epoch_at
        if not self._decides:
            return False  # the decider (an operator) makes every pass for this role
        if oldest is not None and epoch.reclaim_at(oldest, epoch_at, lease_s, self.config.grace_s) < now:
            return True
        return bool(pending) and (seen is None or seen < now - DECIDER_TTL_S)

    def wait_admitted(self, job_id: int, *, poll_s: float = 1.0, timeout_s: float | None = None,
                      on_wait: Callable[[int, int], None] | None = None,
                      on_unreachable: Callable[[str], None] | None = None) -> Admission:
        """Block until the job holds GPUs. `on_wait(position, queue_length)` is called each poll.

        While waiting it reclaims overdue leases (a crashed holder frees GPUs even when
        nothing else touches the orchestrator). While the state database cannot be reached
        it keeps waiting, retrying with backoff (1 s doubling to WAIT_RETRY_MAX_S), and says
        so through `on_unreachable(message)` (default: this module's log) at each retry.
        Raises OrchestratorError if the job ends without running (cancelled, failed) and
        TimeoutError after `timeout_s`.
        """
        say = on_unreachable or log.warning
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        refreshed = time.monotonic()
        cluster: str | None = None
        backoff = 0.0
        while True:
            try:
                cluster = cluster or self._cluster_of(job_id)
                admission = self.admission(job_id)
                if admission is not None:
                    return admission
                if time.monotonic() - refreshed >= REFRESH_EVERY_S:  # keep this process's view near current
                    self.refresh(cluster)
                    refreshed = time.monotonic()
                if self.pass_due(cluster):
                    self.reconcile(cluster)
                    continue
                if on_wait is not None:
                    on_wait(*self.queue_position(job_id))
                if backoff:
                    say(f"job {job_id}: the state database answers again; still waiting for GPUs")
                backoff = 0.0
            except (StateDbError, sa.exc.OperationalError, sa.exc.InterfaceError) as e:
                backoff = min(WAIT_RETRY_MAX_S, backoff * 2 or 1.0)
                reason = str(getattr(e, "orig", None) or e).strip().splitlines()[0][:300]
                say(f"job {job_id}: the state database cannot be reached ({reason}); still waiting for GPUs, "
                    f"retrying in {backoff:.0f} s")
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still queued after {timeout_s:.0f} s")
            time.sleep(backoff or poll_s)

    # ---------------------------------------------------------------- inside the lock
    def _free_allocations(self, conn: Connection, which, now: float, event: str) -> list[tuple]:
        """End the live allocations `which` selects: (job, node, GPU) of each.

        The database's trigger appends each one's `event` (release | expire) to the history.
        """
        return conn.execute(sa.update(allocations).where(which, allocations.c.released_at.is_(None)).values(
            released_at=now, release_event=event).returning(
            allocations.c.job_id, allocations.c.node, allocations.c.gpu_index)).all()

    def _expire(self, conn: Connection, cname: str, now: float, *, check: bool = False) -> list[int]:
        """Reclaim leases past their grace; without `check`, only when the view's lease floor says one may be.

        `now` is the database's clock. Before reclaiming anything the pass records that a writer
        reached the database, and nothing is reclaimed until every holder has had a full lease
        since the last outage (`epoch`): a pass that is the first writer after one records it
        and reclaims nothing."""
        cutoff = now - self.config.grace_s
        view = self._pending
        if not check and view is not None and view.lease_floor >= cutoff:
            return []  # no live lease of the cluster runs out before the floor
        epoch_at = epoch.touch(conn, self.config.lease_s)
        if epoch.reclaim_at(float("-inf"), epoch_at, self.config.lease_s, self.config.grace_s) >= now:
            return []  # holders are still renewing after an outage
        freed = self._free_allocations(conn, sa.and_(allocations.c.cluster == cname,
                                                     allocations.c.lease_expires_at < cutoff), now, "expire")
        lost = sorted({j for j, *_ in freed})
        if lost:
            self._forget_view()  # GPUs freed and jobs re-queued behind this process's back
        elif view is not None:  # renewals moved the earliest lease on: skip the check until then
            floor = conn.execute(_LIVE_LEASE_FLOOR, {"cname": cname}).scalar()
            view.lease_floor = float("inf") if floor is None else floor
        for job_id in lost:
            row = self._job_row(conn, job_id)
            if row.state != "running":
                continue
            # a job asked to stop ends cancelled: its holder died before it could end it
            preempted = bool((row.stop_requested or {}).get("preempted_by"))
            requeue = (self.config.on_lost == "requeue" and row.lost_count < self.config.max_requeues
                       and (not row.stop_requested or preempted))
            why = f"lost: lease expired at {time.strftime('%H:%M:%S', time.gmtime(now))} UTC (holder stopped renewing)"
            conn.execute(sa.update(jobs).where(jobs.c.id == job_id).values(
                state="queued" if requeue else "cancelled" if row.stop_requested and not preempted else "failed",
                lost_count=row.lost_count + 1,
                queued_at=now, placement=None if requeue else row.placement,
                finished_at=None if requeue else now, reason=why + ("; re-queued" if requeue else ""),
                # a preempted (or resized) job queued again: its stop request is done with, as when its
                # flow releases it (`_requeue_preempted`); else its next admission would be stopped too
                **({"stop_requested": sa.null()} if requeue and preempted else {})))
            if requeue and preempted:
                conn.execute(sa.update(preemptions).where(preemptions.c.job_id == job_id,
                                                          preemptions.c.ended_at.is_(None)).values(ended_at=now))
        return lost + self._end_silent_delegated(conn, cname, now, cutoff)

    def _end_silent_delegated(self, conn: Connection, cname: str, now: float, cutoff: float) -> list[int]:
        """End the delegated jobs whose flow stopped renewing (deadline before `cutoff`, database
        clock; `_expire` checked the outage epoch): failed, or cancelled when a stop was asked
        (its flow died before it could end it), never queued again: nothing but its flow puts a
        delegated job in the batch system, and that flow is gone. Its batch job stops on its own:
        the nodes stop the ranks once the flow's lease file goes stale (`infra.lease_guard`)."""
        ended = []
        for row in conn.execute(_DELEGATED_SILENT, {"cname": cname, "cutoff": cutoff}).all():
            batch = row.batch or {}
            renewed, until = batch.get(DELEGATED_RENEWED), float(batch[DELEGATED_UNTIL])
            why = (f"lost: its flow stopped renewing (last renewal {_utc(renewed) if renewed else 'unknown'} UTC, "
                   f"deadline {_utc(until)} UTC passed at {_utc(now)} UTC)")
            done = conn.execute(sa.update(jobs).where(jobs.c.id == row.id, jobs.c.state == DELEGATED).values(
                state="cancelled" if row.stop_requested else "failed", lost_count=row.lost_count + 1,
                finished_at=now, reason=why))
            if done.rowcount:
                ended.append(row.id)
                log.warning("job %s (delegated): %s", row.id, why)
        return ended

    def _load_queue(self, conn: Connection, cname: str) -> tuple[list[QueuedJob], list[tuple]]:
        # The queue with each job's name and options (as text: a process that knows a job skips it,
        # one that does not parses each distinct list once): one query, not one per 500 unknown jobs.
        rows = conn.execute(sa.select(jobs.c.id, jobs.c.queued_at, jobs.c.priority, jobs.c.name,
                                      self._policy_options_text(conn)).where(
            jobs.c.cluster == cname, jobs.c.state == "queued").order_by(
            jobs.c.priority.desc(), jobs.c.queued_at, jobs.c.id)).all()
        self._know_jobs((job_id, name, text) for job_id, _, _, name, text in rows)
        kept = [r for r in rows if self._options[r.id]]
        return ([QueuedJob(str(r.id), r.queued_at, self._options[r.id]) for r in kept],
                [(-r.priority, r.queued_at, r.id) for r in kept])

    def _load_options(self, conn: Connection, job_ids: list[int]) -> None:
        """Read the options (for this process's policy) and names of jobs it has not seen yet."""
        for start in range(0, len(job_ids), 500):
            chunk = job_ids[start:start + 500]
            # Only this policy's list (the column holds one per policy), as JSON text: a process
            # reading the queue back parses each distinct list once (`_intern_text`).
            for job_id, name, text in conn.execute(
                    sa.select(jobs.c.id, jobs.c.name, self._policy_options_text(conn)).where(jobs.c.id.in_(chunk))):
                self._options[job_id] = self._intern_text(text)
                self._names[job_id] = name

    def _policy_options_text(self, conn: Connection) -> sa.ColumnElement:
        """The job's options for this process's policy as JSON text (not decoded by the driver).
        Jobs queued before the EASY/SJF lists were stored have empty ones: those run what FCFS
        runs (the requested count, as `options._by_policy` now stores for them)."""
        fallback = REQUESTED_AS.get(self.policy)
        if is_postgres(conn):
            mine = sa.cast(jobs.c.options.op("->")(sa.literal(self.policy)), sa.Text)
            if fallback is None:
                return mine
            return sa.func.coalesce(sa.func.nullif(mine, "[]"),
                                    sa.cast(jobs.c.options.op("->")(sa.literal(fallback)), sa.Text))
        mine = sa.func.json_extract(sa.cast(jobs.c.options, sa.Text), f"$.{self.policy}")
        if fallback is None:
            return mine
        return sa.func.coalesce(sa.func.nullif(mine, "[]"),
                                sa.func.json_extract(sa.cast(jobs.c.options, sa.Text), f"$.{fallback}"))

    def _resolve_policy(self, conn: Connection, cname: str, *, reread: bool = False) -> str:
        """The policy this process decides with: the config's, else the cluster file's (read once,
        and again whenever the view is read back: a re-registered file may name another one, and
        then the jobs' options are read again for it)."""
        if self.config.policy is not None:
            self.policy = self.config.policy
        elif self.policy is None or reread:
            policy = conn.execute(sa.select(clusters.c.policy).where(clusters.c.name == cname)).scalar() or "has"
            if self.policy is not None and policy != self.policy:
                self._options.clear()
                self._by_text.clear()
                self._jobs_since = None
            self.policy = policy
        return self.policy

    def _intern_text(self, text: str | None) -> tuple[Option, ...]:
        """A stored option list (JSON text) as the shared tuple `_intern` gives; parsed once per distinct text."""
        options = self._by_text.get(text)
        if options is None:
            listed = json.loads(text) if text else []
            options = self._intern([Option.from_dict(o) for o in listed])
            if len(self._by_text) > 100_000:  # a long-lived process: keep the memo bounded
                self._by_text.clear()
            self._by_text[text] = options
        return options

    def _intern(self, options: list[Option]) -> tuple[Option, ...]:
        """One shared tuple per distinct option list: a policy pass skips every job whose options
        it already found no room for (`schedule_pass`), instead of trying each GPU type again."""
        if any(o.plan is not None for o in options):
            return tuple(options)  # a planner's plan object rides along: keep the job's own
        return self._interned.setdefault(tuple(tuple(o.to_dict().values()) for o in options), tuple(options))

    def _load_running(self, conn: Connection, cname: str) -> dict[int, Busy]:
        out = {}
        # the two fields a pass needs, not each running job's whole placement
        for job_id, admitted, run_s, gpu_type, world_size in conn.execute(sa.select(
                jobs.c.id, jobs.c.admitted_at, jobs.c.predicted_run_s, jobs.c.placement["gpu_type"].as_string(),
                jobs.c.placement["world_size"].as_integer()).where(
                jobs.c.cluster == cname, jobs.c.state == "running")):
            out[job_id] = Busy(gpu_type, world_size, admitted + (run_s or 0.0))
        return out

    def _pass(self, conn: Connection, cname: str, *, check_leases: bool = False) -> PassResult:
        self._settle()
        if self._delegate and self._pending is None:
            # A decider with a current view makes this pass (the change stays marked as waiting
            # for one); reading the whole cluster back here would cost ~20 ms of the lock.
            self.last_pass = PassResult([], [], 0)
            return self.last_pass
        if self._decider_known:
            self._batch.add(_PASS_DONE, {"cname": cname})
        now = self._now
        expired = self._expire(conn, cname, now, check=check_leases)
        view = self._view(conn, cname)
        result = PassResult([], expired, 0)
        self.last_pass = result
        if not view.queue:
            return result
        free = view.free
        if not free.any():
            return result
        queue, keys, promised, held = view.queue, view.keys, [], []
        if self.policy == "elastic":  # resizes' promised admissions first; their GPUs kept from the pass
            promised, held, queue, keys = self._promised_admissions(conn, cname, view, now)
        try:
            if view.teams is not None:  # fair-share order and the teams' quotas
                started, result.considered = view.teams.decide(
                    conn, admission_policy(self.policy), now, queue, keys, list(view.running.values()), free,
                    reservation_depth=self.config.reservation_depth)
                if free.reservation is not None and int(free.reservation[0]) != view.teams.head:
                    view.teams.head = int(free.reservation[0])
                    self._record(["head", view.teams.head])
                result.reservation = free.reservation
            else:
                started, result.considered = schedule_pass(
                    admission_policy(self.policy), now, queue, list(view.running.values()), free,
                    reservation_depth=self.config.reservation_depth)
        finally:
            _unhold(view, held)
        started = promised + started
        if not started:
            return result
        lease = now + self.config.lease_s
        rows, updates = [], []
        for queued, opt, placement in started:
            job_id = int(queued.job_id)
            placement.job = self._names.get(job_id) or conn.execute(
                sa.select(jobs.c.name).where(jobs.c.id == job_id)).scalar_one()
            rows.extend(dict(job_id=job_id, cluster=cname, node=a.node, gpu_index=g, allocated_at=now,
                             lease_expires_at=lease) for a in placement.assignments for g in a.gpus)
            run_s = getattr(queued, "run_s", opt.run_s)  # a resized job's promise: what is left of its run
            updates.append(dict(jid=job_id, now=now, placement=placement.to_dict(), predicted_run_s=run_s))
            view.running[job_id] = Busy(opt.gpu_type, placement.world_size, now + run_s)
            if view.teams is not None:
                view.teams.admitted(job_id, opt.gpu_type, placement.world_size, now)
            result.admitted.append(job_id)
            self._record(["admit", job_id, opt.gpu_type, placement.world_size, now + run_s, lease,
                          [[a.node, list(a.gpus)] for a in placement.assignments], now])
        # Every job this pass admits, in one multi-row statement each (the history rows come from
        # the database's trigger on allocations).
        # These writes are the decision's last statements: queued, they go out with the COMMIT.
        self._batch.add(_JOB_ADMITTED, updates)
        for job_id in result.admitted:
            view.unqueue(job_id)
        view.lease_floor = min(view.lease_floor, lease)
        # The database refuses a GPU that another live allocation holds (uq_allocations_live_gpu):
        # an IntegrityError here (or from the COMMIT that sends it) rolls the whole decision back,
        # and this process's view with it (its version no longer matches the database's).
        self._batch.add(_ALLOCATE, rows)
        return result
