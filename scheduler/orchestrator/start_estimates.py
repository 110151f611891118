"""When each queued job of a cluster is expected to start, and why it still waits.

The estimate runs the cluster's own policy forward in time (`scheduler.policy.schedule_pass`,
the pass the orchestrator makes; no second policy here), starting from the cluster as it is:

- a running job gives its GPUs back at its expected end: from its measured progress when its
  flow reported one (`jobs.progress`: the remaining steps x rank 0's measured step seconds,
  counted from when it was written), else admitted_at + the predicted run time of the option it
  was admitted with (`jobs.predicted_run_s`, the cost model's); a job past that end is expected
  to overrun by as much again (`scheduler.policy.expected_end`);
- at each of those ends the policy makes a pass over the queue, in queue order, with each
  job's stored options; a job it admits holds its GPUs for its option's predicted run time;
- cordoned and drained nodes stay out of service (nothing brings them back by itself).

A job's estimated start is the time of the pass that admits it. Why it waits, one of
(`WAIT_REASONS`, checked in this order):

    infeasible        the cluster cannot hold it at all, even with every node in service
    out_of_service    it needs nodes that are cordoned or drained (named, with the reason)
    quota             GPUs fit it now, but its team holds its nominal quota of them and may not
                      borrow them now (another team waits for its own quota, or the borrowing
                      limit is reached)
    behind            GPUs it could use went (or are promised) to job N first: N is ahead of it
                      in the queue (priority, then submission order; with teams, fair-share
                      order within a priority) or the policy's order
    no_room           no GPU type it can run on has room now; the GPUs come free when job M ends
    next              it fits now: the next policy pass admits it

While teams are defined, each pass of the estimate is the live one, `scheduler.fair_share.decide`
(fair-share order, quotas), over the teams' holdings and usage as they are now.

`estimate_starts` is a pure function of the cluster, the queue and the running jobs (a test
builds them by hand); `read_queue_state` reads them from the state database and
`queue_estimates` puts the two together.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from infra.statedb import read_transaction
from infra.statedb.schema import clusters, jobs, nodes
from scheduler.cluster import Cluster, ClusterError
from scheduler.fair_share import NO_TEAM, RunningJob as FairRunning, Snapshot, decide, holdings, pass_order, team_usage
from scheduler.policy import (USES_RUNNING, Busy, FreeGpus, Option, QueuedJob, admission_policy, expected_end,
                              schedule_pass)
import scheduler.orchestrator.inventory as inventory
from scheduler.orchestrator.config import OrchestratorConfig
import scheduler.orchestrator.quotas as quotas
from scheduler.orchestrator.options import REQUESTED_AS, idle_fit

WAIT_REASONS = ("infeasible", "out_of_service", "quota", "behind", "no_room", "next")


@dataclass(frozen=True)
class WaitingJob:
    """A queued job: its place in the queue and its options under the cluster's policy."""

    job_id: int
    name: str
    priority: int
    queued_at: float
    options: tuple[Option, ...]


@dataclass(frozen=True)
class RunningJob:
    """A running job: the GPUs it holds and what says when it gives them back."""

    job_id: int
    gpu_type: str
    gpus: tuple[tuple[str, tuple[int, ...]], ...]  # (node, GPU indices)
    admitted_at: float
    predicted_run_s: float | None
    progress: dict[str, Any] | None = None  # jobs.progress: step, steps, step_s, at

    @property
    def num_gpus(self) -> int:
        return sum(len(g) for _, g in self.gpus)

    def expected_end_s(self, now: float) -> float:
        """When it is expected to give its GPUs back: remaining steps x measured step time when
        its flow reported them, else its admission + predicted run time; past either, it is
        expected to overrun by as much again (the policy's own rule)."""
        p = self.progress or {}
        step, steps, step_s = p.get("step"), p.get("steps"), p.get("step_s")
        if _number(step) and _number(steps) and _number(step_s) and step_s > 0:
            end = float(p.get("at") or now) + max(0.0, steps - step) * step_s
        else:
            end = self.admitted_at + (self.predicted_run_s or 0.0)
        return expected_end(end, now)


@dataclass
class QueueState:
    """A cluster as `estimate_starts` needs it: nodes with health and free GPUs, the queue in
    order, the running jobs; `health` is node -> (state, reason) for every node not ready."""

    cluster: Cluster
    waiting: list[WaitingJob]
    running: list[RunningJob]
    health: dict[str, tuple[str, str | None]] = field(default_factory=dict)
    policy: str = "has"
    teams: Any = None  # quotas.TeamState (rules, running jobs' teams, usage) while teams are defined


@dataclass(frozen=True)
class StartEstimate:
    job_id: int
    position: int  # 1-based, in queue order
    reason: str  # one of WAIT_REASONS
    why: str  # the reason in words, for a person
    start_s: float | None  # None: not while the nodes in service stay as they are
    option: str | None = None  # what it is expected to start on, "4x A100-80G"
    behind: int | None = None  # reason "behind": the job the GPUs go to first
    until_job: int | None = None  # the running (or earlier admitted) job whose end lets it start

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def in_words(seconds: float) -> str:
    """`in 12 min`: how far ahead an estimate is."""
    if seconds < 1:
        return "now"
    if seconds < 90:
        return f"in {seconds:.0f} s"
    return f"in {seconds / 60:.0f} min" if seconds < 5400 else f"in {seconds / 3600:.1f} h"


def start_text(start_s: float | None, now: float | None = None) -> str:
    """An estimated start for people: "expected to start 14:05 UTC (in 12 min)"."""
    if start_s is None:
        return "no start expected while the nodes in service stay as they are"
    now = time.time() if now is None else now
    return f"expected to start {time.strftime('%H:%M', time.gmtime(start_s))} UTC ({in_words(start_s - now)})"


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _fits_by_count(free: FreeGpus, options: Sequence[Option]) -> set[str]:
    """GPU types of which enough are idle for one of the options (a pass's cheap first test)."""
    return {o.gpu_type for o in options if free.by_type.get(o.gpu_type, 0) >= o.num_gpus}


def queue_order(waiting: Sequence[WaitingJob], teams: Any, now: float) -> list[WaitingJob]:
    """The queued jobs in the order the next admission pass takes them: priority, then arrival;
    while teams are defined, fair-share order over the teams' usage as of `now`
    (`scheduler.fair_share.pass_order`, what `decide` uses). A job position is its place here.
    `waiting`: by priority, then arrival; `teams`: a `quotas.TeamState`, None without teams."""
    if teams is None:
        return list(waiting)
    current = list(teams.running.values())
    order = pass_order([QueuedJob(str(w.job_id), w.queued_at, ()) for w in waiting],
                       {str(w.job_id): teams.team_of.get(w.job_id, NO_TEAM) for w in waiting},
                       {str(w.job_id): w.priority for w in waiting}, team_usage(teams.usage, current, now),
                       teams.rules, None if teams.head is None else str(teams.head))
    by_id = {str(w.job_id): w for w in waiting}
    return [by_id[q.job_id] for q in order]


def estimate_starts(state: QueueState, now: float, *, reservation_depth: int = 8) -> list[StartEstimate]:
    """Each queued job's estimated start and why it waits, in queue order (`queue_order`; see the
    module doc)."""
    sim = state.cluster.copy_state()
    waiting = {w.job_id: w for w in state.waiting}
    ordered = queue_order(state.waiting, state.teams, now)
    position = {w.job_id: i + 1 for i, w in enumerate(ordered)}
    queue = [QueuedJob(str(w.job_id), w.queued_at, w.options) for w in state.waiting if w.options]
    ends: list[tuple[float, int, int, str, tuple]] = []  # (end, seq, job, GPU type, ((node, gpus), ...))
    busy: dict[int, Busy] = {}
    for seq, r in enumerate(state.running):
        end = r.expected_end_s(now)
        heapq.heappush(ends, (end, seq, r.job_id, r.gpu_type, r.gpus))
        busy[r.job_id] = Busy(r.gpu_type, r.num_gpus, end)
    seq = len(state.running)
    started_at: dict[int, tuple[float, Option, int | None]] = {}
    behind: dict[int, int] = {}
    fits_now: set[int] = set()
    t, ended, first_pass = now, None, True
    teams = state.teams
    team_running = dict(teams.running) if teams is not None else {}
    head = None if teams is None or teams.head is None else str(teams.head)
    quota_blocked: dict[int, str] = {}
    while True:
        free = FreeGpus(sim)
        fits = {int(q.job_id): _fits_by_count(free, q.options) for q in queue}
        running_now = list(busy.values()) if state.policy in USES_RUNNING else ()
        if teams is None:
            started, _ = schedule_pass(state.policy, t, queue, running_now, free, reservation_depth=reservation_depth)
        else:
            held = holdings(team_running.values())
            snap = Snapshot(state.policy, t, queue, running_now, free, teams.rules,
                            {q.job_id: teams.team_of.get(int(q.job_id), NO_TEAM) for q in queue},
                            {str(w.job_id): w.priority for w in state.waiting}, held,
                            team_usage(teams.usage, team_running.values(), t), reservation_depth, head)
            started, _ = decide(snap)
            head = free.reservation[0] if free.reservation else head
        if first_pass:
            fits_now, first_pass = {j for j, types in fits.items() if types}, False
            if teams is not None and teams.rules.enforced:
                quota_blocked = _quota_blocked(teams, queue, fits, held, {int(q.job_id) for q, _, _ in started})
        taken: list[tuple[int, str]] = []  # (job, GPU type) admitted by this pass, in pass order
        for q, opt, placement in started:
            job_id = int(q.job_id)
            started_at[job_id] = (t, opt, ended)
            taken.append((job_id, opt.gpu_type))
            heapq.heappush(ends, (t + opt.run_s, seq, job_id, opt.gpu_type,
                                  tuple((a.node, tuple(a.gpus)) for a in placement.assignments)))
            busy[job_id] = Busy(opt.gpu_type, placement.world_size, t + opt.run_s)
            if teams is not None:
                team_running[job_id] = FairRunning(teams.team_of.get(job_id, NO_TEAM), opt.gpu_type,
                                                   placement.world_size, t)
                head = None if head == q.job_id else head
            seq += 1
        queue = [q for q in queue if int(q.job_id) not in started_at]
        for q in queue:  # GPUs it could have used went to another job first: it waits behind that one
            job_id = int(q.job_id)
            if job_id in behind or not fits[job_id]:
                continue
            first = next((j for j, gpu_type in taken if gpu_type in fits[job_id]), None)
            if first is None and state.policy in USES_RUNNING:  # a job ahead holds a reservation
                types = {o.gpu_type for o in q.options}
                first = next((int(o.job_id) for o in queue if o is not q and int(o.job_id) in waiting
                              and position[int(o.job_id)] < position[job_id]
                              and types & {x.gpu_type for x in o.options}), None)
            if first is not None:
                behind[job_id] = first
        if not queue or not ends:
            break
        t, ended = ends[0][0], ends[0][2]
        while ends and ends[0][0] <= t:
            _, _, job_id, _, held_gpus = heapq.heappop(ends)
            busy.pop(job_id, None)
            team_running.pop(job_id, None)
            for node, gpus in held_gpus:
                try:
                    sim.release(node, gpus)
                except ClusterError:  # a node that left the inventory, or GPUs already free: nothing to give
                    pass
    return [_quota_estimate(w, position[w.job_id], started_at.get(w.job_id), quota_blocked[w.job_id])
            if w.job_id in quota_blocked and w.job_id not in behind else
            _estimate(state, w, position[w.job_id], now, started_at.get(w.job_id), behind.get(w.job_id),
                      w.job_id in fits_now, waiting) for w in ordered]


def _quota_blocked(teams: Any, queue: list[QueuedJob], fits: dict[int, set[str]], held: dict[tuple[str, str], int],
                   started: set[int]) -> dict[int, str]:
    """Jobs GPUs fit now that the first pass left waiting although their team is at its nominal
    quota of each type that fits: why, in words."""
    out = {}
    for q in queue:
        job_id = int(q.job_id)
        if job_id in started or not fits[job_id]:
            continue
        team = teams.team_of.get(job_id, NO_TEAM)
        over = [(o, teams.rules.quota(team, o.gpu_type)) for o in q.options if o.gpu_type in fits[job_id]]
        if over and all(held.get((team, o.gpu_type), 0) + o.num_gpus > quota.nominal for o, quota in over):
            o, quota = over[0]
            limit = "any idle quota" if quota.borrowing_limit is None else f"up to {quota.borrowing_limit} more"
            out[job_id] = (f"team {team or '(none)'!r} holds {held.get((team, o.gpu_type), 0)} of its {quota.nominal} "
                           f"{o.gpu_type}; it may borrow {limit}, only from idle quota no other team waits for")
    return out


def _quota_estimate(job: WaitingJob, position: int, start: tuple[float, Option, int | None] | None,
                   why: str) -> StartEstimate:
    start_s, opt, until_job = start if start is not None else (None, None, None)
    option = None if opt is None else f"{opt.num_gpus}x {opt.gpu_type}"
    return StartEstimate(job.job_id, position, "quota", why, start_s, option, None, until_job)


def _estimate(state: QueueState, job: WaitingJob, position: int, now: float,
              start: tuple[float, Option, int | None] | None, blocker: int | None, fits_now: bool,
              waiting: dict[int, WaitingJob]) -> StartEstimate:
    if start is None:
        return _never(state, job, position)
    start_s, opt, until_job = start
    option = f"{opt.num_gpus}x {opt.gpu_type}"
    if blocker is not None:
        other = waiting.get(blocker)
        if other is not None and other.priority > job.priority:
            order = f"priority {other.priority} > {job.priority}"
        elif other is not None and (other.queued_at, other.job_id) < (job.queued_at, job.job_id):
            order = "ahead in the queue"
        elif other is not None and state.teams is not None and other.priority == job.priority:
            order = "first in fair-share order: its team used less of its share"
        else:
            order = f"first in the {state.policy} policy's order"
        return StartEstimate(job.job_id, position, "behind",
                             f"waiting behind job {blocker} ({order}): the GPUs it could use go to that job first",
                             start_s, option, blocker, until_job)
    if fits_now and start_s <= now:
        return StartEstimate(job.job_id, position, "next", "fits now: the next policy pass admits it",
                             start_s, option, None, None)
    free = state.cluster.free_gpus_by_type()
    wants = _wants(job.options, free)
    then = f"; GPUs come free when job {until_job} ends" if until_job is not None else ""
    return StartEstimate(job.job_id, position, "no_room", f"no GPU type has room now: wants {wants}{then}",
                         start_s, option, None, until_job)


def _wants(options: Sequence[Option], free: dict[str, int], most: int = 3) -> str:
    """The smallest option per GPU type, with how many of that type are free: `4x A40 (1 free)`."""
    smallest: dict[str, Option] = {}
    for o in sorted(options, key=lambda o: o.num_gpus):
        smallest.setdefault(o.gpu_type, o)
    parts = [f"{o.num_gpus}x {o.gpu_type} ({free.get(o.gpu_type, 0)} free)" for o in list(smallest.values())[:most]]
    more = len(smallest) - most
    return " or ".join(parts) + (f" or {more} other type(s)" if more > 0 else "")


def _never(state: QueueState, job: WaitingJob, position: int) -> StartEstimate:
    """A job the simulation never started: nodes it needs are out of service, or none can hold it."""
    whole = state.cluster.copy_state()
    for node in whole.nodes:
        node.cordoned = False
    if not job.options or idle_fit(job.options, whole) is None:
        wants = _wants(job.options, whole.total_gpus_by_type()).replace(" free)", " in the cluster)")
        return StartEstimate(job.job_id, position, "infeasible",
                             f"the cluster cannot hold it even with every node in service: wants {wants or 'nothing'}"
                             "; add nodes (`forgeflow cluster register`) or cancel it", None)
    types = {o.gpu_type for o in job.options}
    down = [n for n in state.cluster.nodes if n.cordoned and n.gpu_type in types] or \
           [n for n in state.cluster.nodes if n.cordoned]
    named = ", ".join(f"{n.name} ({_health_text(state.health.get(n.name))})" for n in down[:6])
    more = f" and {len(down) - 6} more" if len(down) > 6 else ""
    return StartEstimate(job.job_id, position, "out_of_service",
                         f"needs nodes that are out of service: {named}{more}; "
                         "`forgeflow cluster uncordon NODE` returns one", None)


def _health_text(health: tuple[str, str | None] | None) -> str:
    if health is None:
        return "cordoned"
    state, reason = health
    return f"{state}: {reason}" if reason else state


# --- reading the state database --------------------------------------------------------------


def read_queue_state(engine: Engine, cluster: str | None = None, *, policy: str | None = None) -> QueueState:
    """The cluster, its queue (in queue order, with each job's options under `policy`, default
    the cluster file's) and its running jobs, read in one transaction."""
    policy = policy or OrchestratorConfig().policy
    with read_transaction(engine) as conn:
        name = inventory.resolve_cluster(conn, cluster)
        policy = policy or conn.execute(sa.select(clusters.c.policy).where(clusters.c.name == name)).scalar() or "has"
        current = inventory.load_cluster(conn, name, url=str(engine.url)).copy_state()
        health = {n: (s, r) for n, s, r in conn.execute(sa.select(nodes.c.name, nodes.c.state, nodes.c.reason).where(
            nodes.c.cluster == name, nodes.c.state != "ready"))}
        queued = conn.execute(sa.select(jobs.c.id, jobs.c.name, jobs.c.priority, jobs.c.queued_at, jobs.c.options).where(
            jobs.c.cluster == name, jobs.c.state == "queued").order_by(
            jobs.c.priority.desc(), jobs.c.queued_at, jobs.c.id)).all()
        running = conn.execute(sa.select(jobs.c.id, jobs.c.admitted_at, jobs.c.predicted_run_s, jobs.c.placement,
                                         jobs.c.progress).where(
            jobs.c.cluster == name, jobs.c.state == "running")).all()
        teams = quotas.TeamState.load(conn, name)  # None while no team is defined
        if teams is not None:
            teams.learn_teams(conn, [r.id for r in queued])
    waiting = [WaitingJob(r.id, r.name, r.priority, r.queued_at,
                          tuple(Option.from_dict(o) for o in (r.options or {}).get(policy)
                                or (r.options or {}).get(REQUESTED_AS.get(policy, policy)) or ())) for r in queued]
    held = [RunningJob(r.id, r.placement["gpu_type"],
                       tuple((n["node"], tuple(n["gpus"])) for n in r.placement["nodes"]),
                       r.admitted_at or 0.0, r.predicted_run_s, r.progress)
            for r in running if r.placement]
    return QueueState(current, waiting, held, health, admission_policy(policy), teams)


def queue_estimates(engine: Engine, cluster: str | None = None, *, now: float | None = None,
                    policy: str | None = None) -> dict[int, StartEstimate]:
    """{job id: its estimate} for every queued job of the cluster, as of `now` (default: the clock)."""
    state = read_queue_state(engine, cluster, policy=policy)
    return {e.job_id: e for e in estimate_starts(state, time.time() if now is None else now)}
