"""The scheduling policies, one pass at a time: which waiting jobs start now, on which GPUs.

One function, `schedule_pass`, is what both the discrete-event simulator
(`scheduler.simulate`) and the live orchestrator (`scheduler.orchestrator`) run,
so a simulated result speaks for the live system. The caller owns the clock and
the cluster's free lists; the pass allocates on the `Cluster` object it is given
(all or nothing per job) and returns what started.

``fcfs``  FCFS-opportunistic (Frenzy's baseline): queue order, each job takes its
          first option whose GPUs are free, first-fit over nodes in inventory order;
          jobs behind a waiting one may start.
``has``   Frenzy's HAS: queue order, each job's MARP-sized options in preference
          order, best-fit over nodes (`scheduler.placement.has_select`).
``ect``   expected completion time with HRRN order and conservative backfilling
          (see `scheduler.simulate` for the rationale): each job takes the option
          that completes first given when each GPU type frees up; a job that must
          wait reserves its slot (the first `reservation_depth` do), so later jobs
          only backfill around it. With teams, the response ratio orders jobs within a
          rank of the fair-share order only (`rank`), and only a job within its team's
          nominal quota reserves.
``easy``  FCFS with EASY backfilling, what Slurm sites run (a baseline): queue order,
          each job its requested GPUs (first option that is free, first-fit); the
          first job that cannot start gets a reservation — the earliest time its
          GPUs free up, read off the running jobs' *predicted* ends — and a later
          job may start now only if it does not delay that reservation (it is
          predicted to end before it, or it uses GPUs the head job will not need,
          or another GPU type). With teams' quotas (`scheduler.fair_share`), only a job within its
          team's nominal quota reserves (a borrower takes idle GPUs only), and the job
          reserved for stays first of the queue in the next passes (`FreeGpus.reservation`).
``sjf``   shortest job first on estimates (a baseline): the queue ordered by each
          job's shortest predicted run time, opportunistic, requested GPUs, first-fit.

Every policy sees predicted run times only (`Option.run_s`, `Busy.end_s`); the
simulator draws actual run times around them (`scheduler.traces.apply_runtime_noise`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Literal, Mapping, Protocol, Sequence

from scheduler.cluster import Cluster, Node
from scheduler.placement import GpuRequest, Placement, allocate_placement, build_placement, first_fit_select, has_select

Policy = Literal["fcfs", "has", "ect", "easy", "sjf"]
POLICIES: tuple[str, ...] = ("fcfs", "has", "ect", "easy", "sjf")
POLICY_LABELS = {"fcfs": "FCFS-opportunistic", "has": "HAS + MARP", "ect": "ECT + HRRN + backfill (ours)",
                 "easy": "FCFS + EASY backfill", "sjf": "SJF (estimates)"}
# Policies whose pass reads the running jobs' predicted ends (the others ignore `running`).
USES_RUNNING: frozenset[str] = frozenset({"ect", "easy"})
# Policies that are more than an admission pass, and the pass that admits for them: ``elastic``
# (`scheduler.elastic`) admits FCFS-opportunistic (`ElasticConfig.admission`) and resizes running jobs.
ADMITS_AS: dict[str, str] = {"elastic": "fcfs"}


def admission_policy(policy: str) -> str:
    """The `schedule_pass` policy that admits queued jobs under `policy` (itself for all but ``elastic``)."""
    return ADMITS_AS.get(policy, policy)


@dataclass(frozen=True)
class Option:
    """One way a job can run: GPU type and count, the plan (training jobs) and its run time."""

    gpu_type: str
    num_gpus: int
    unit: int  # tensor-parallel group: GPUs that must share a node
    min_memory_bytes: int
    run_s: float  # predicted, when packed as densely as the planner assumed
    plan: Any = None  # scheduler.planner.Plan, when the option came from the planner
    dp: int = 1
    tp: int = 1
    pp: int = 1

    def request(self) -> GpuRequest:
        return GpuRequest(count=self.num_gpus, min_memory_bytes=self.min_memory_bytes,
                          gpu_type=self.gpu_type, unit=self.unit)

    @property
    def fit_key(self) -> tuple[str, int, int, int]:
        """What decides whether the option fits the free GPUs (its request); equal keys fit alike."""
        return (self.gpu_type, self.num_gpus, self.unit, self.min_memory_bytes)

    def to_dict(self) -> dict[str, Any]:
        """Everything but the plan object (what the orchestrator stores with a queued job)."""
        return {"gpu_type": self.gpu_type, "num_gpus": self.num_gpus, "unit": self.unit,
                "min_memory_bytes": self.min_memory_bytes, "run_s": self.run_s,
                "dp": self.dp, "tp": self.tp, "pp": self.pp}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Option":
        return cls(**{k: data[k] for k in ("gpu_type", "num_gpus", "unit", "min_memory_bytes", "run_s",
                                          "dp", "tp", "pp") if k in data})


class Waiting(Protocol):
    """A job in the queue, as a pass sees it."""

    job_id: str
    arrival_s: float  # when it (last) joined the queue
    options: Sequence[Option]  # the policy's options, in preference order
    shortest_run_s: float  # the fastest of its options (HRRN's run time)


@dataclass
class QueuedJob:
    job_id: str
    arrival_s: float
    options: Sequence[Option]
    shortest_run_s: float = math.inf

    def __post_init__(self) -> None:
        if self.shortest_run_s == math.inf and self.options:
            self.shortest_run_s = min(o.run_s for o in self.options)


@dataclass(frozen=True)
class Busy:
    """GPUs a running job holds and when it is predicted to give them back (ECT's profile)."""

    gpu_type: str
    num_gpus: int
    end_s: float


class FreeGpus:
    """The cluster's idle GPUs during one pass: per type counts and schedulable nodes per type."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self.by_type: dict[str, int] = cluster.free_gpus_by_type()
        self.nodes_by_type: dict[str, list[Node]] = {}
        for n in cluster.schedulable_nodes():
            self.nodes_by_type.setdefault(n.gpu_type, []).append(n)
        # Teams' quotas (`scheduler.fair_share.QuotaGate`), when the cluster has them: a placement
        # the gate refuses is not tried; `refused` counts refusals (a refusal is about the job's
        # team, not about room: passes must not conclude that equal options find no room).
        self.gate = None
        self.refused = 0
        # what the pass promised the job it could not start (EASY's head): (job id, GPU type, shadow
        # time); a caller keeps that job first in its order until it starts (`scheduler.fair_share`)
        self.reservation: tuple[str, str, float] | None = None

    def any(self) -> bool:
        return any(self.by_type.values())

    def try_place(self, job_id: str, opt: Option, select, misfits: set | None = None) -> Placement | None:
        """Allocate the option's GPUs on the cluster if they are free now (all or nothing).

        `misfits`: the `fit_key`s that did not fit earlier in this pass. A pass only takes
        GPUs, and a request fits exactly when its eligible nodes have enough usable idle GPUs
        (both selectors fail only then), so a key that did not fit cannot fit later in the
        same pass: it is refused without walking the nodes again.
        """
        if self.by_type.get(opt.gpu_type, 0) < opt.num_gpus:
            return None  # cheap rejection before walking the nodes
        if self.gate is not None and not self.gate.allows(job_id, opt):
            self.refused += 1
            return None
        if misfits is not None:
            key = opt.fit_key
            if key in misfits:
                return None
        chosen = select(self.cluster, opt.request(), self.nodes_by_type.get(opt.gpu_type, ()))
        if chosen is None:
            if misfits is not None:
                misfits.add(key)
            return None
        placement = build_placement(self.cluster, chosen, job=job_id, gpu_type=opt.gpu_type,
                                    dp=opt.dp, tp=opt.tp, pp=opt.pp)
        allocate_placement(self.cluster, placement)
        self.by_type[opt.gpu_type] -= opt.num_gpus
        if self.gate is not None:
            self.gate.took(job_id, opt)
        return placement

    def give_back(self, gpu_type: str, count: int) -> None:
        self.by_type[gpu_type] = self.by_type.get(gpu_type, 0) + count


def expected_end(predicted_end_s: float, now: float) -> float:
    """When a running job is expected to free its GPUs, from its predicted end.

    A job past its predicted end still holds its GPUs: expect it to overrun by as much
    again, rather than to free them now (which sends waiting jobs after GPUs that are
    not free, and lets a reservation be set at a time already gone).
    """
    return predicted_end_s if predicted_end_s > now else 2 * now - predicted_end_s


def schedule_pass(
    policy: str,
    now: float,
    queue: Sequence[Waiting],
    running: Iterable[Busy],
    free: FreeGpus,
    *,
    reservation_depth: int = 8,
    rank: Mapping[str, int] | None = None,
) -> tuple[list[tuple[Waiting, Option, Placement]], int]:
    """One scheduling pass: (started jobs with their option and placement, jobs considered).

    `queue` is in queue order (FCFS); `free` is allocated on as jobs start. `rank` (job id ->
    rank, lowest first; None: all equal): the policies that put the queue in an order of their
    own (ect's response ratio, sjf's shortest run) do so only among jobs of equal rank, so a
    caller's order between ranks holds (teams: priority class, then fair share; `fair_share`).
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
    started: list[tuple[Waiting, Option, Placement]] = []
    considered = 0
    misfits: set[tuple] = set()  # requests that did not fit in this pass (see FreeGpus.try_place)
    if policy in ("fcfs", "has"):
        select = first_fit_select if policy == "fcfs" else has_select
        # Jobs that share one options object (the orchestrator interns equal option lists) fit
        # alike: once one of them found no room, the others are skipped without trying a GPU
        # type (room only shrinks during a pass). Keeps a pass over 1,000 queued jobs cheap.
        no_room: set[int] = set()
        room = free.any()  # idle GPUs change only when a job starts: re-checked only then
        for job in queue:
            if not room:
                break
            considered += 1
            if id(job.options) in no_room:
                continue
            refused = free.refused
            for opt in job.options:
                placement = free.try_place(job.job_id, opt, select, misfits)
                if placement is not None:
                    started.append((job, opt, placement))
                    room = free.any()
                    break
            else:
                if free.refused == refused:  # no room (not a quota refusal of this job's team)
                    no_room.add(id(job.options))
        return started, considered
    if policy == "sjf":
        # Shortest predicted run first; anything that fits starts (no reservation).
        for job in sorted(queue, key=lambda j: (rank.get(j.job_id, 0) if rank else 0,
                                                min((o.run_s for o in j.options), default=math.inf))):
            if not free.any():
                break
            considered += 1
            for opt in job.options:
                placement = free.try_place(job.job_id, opt, first_fit_select)
                if placement is not None:
                    started.append((job, opt, placement))
                    break
        return started, considered
    if policy == "easy":
        return _easy_pass(now, queue, running, free)

    # ect: expected completion time over a free-GPU profile per type, where every job
    # that waits reserves its future slot (conservative backfilling).
    profiles: dict[str, FreeProfile] = {t: FreeProfile(now, n) for t, n in free.by_type.items()}
    for r in running:
        profiles.setdefault(r.gpu_type, FreeProfile(now, 0)).add(expected_end(r.end_s, now), math.inf, r.num_gpus)

    # Highest response ratio next: (wait + run) / run favours short jobs without starving
    # long ones, whose ratio grows while they wait.
    def response_ratio(job: Waiting) -> float:
        run = job.shortest_run_s
        return (now - job.arrival_s + run) / run

    order = sorted(queue, key=lambda job: (rank.get(job.job_id, 0) if rank else 0, -response_ratio(job)))
    reserved = 0
    for job in order:
        if reserved >= reservation_depth and not free.any():
            break
        considered += 1
        best: tuple[float, float, Option] | None = None
        for opt in job.options:
            profile = profiles.get(opt.gpu_type)
            if profile is None:
                continue
            start = profile.earliest(opt.num_gpus, opt.run_s)
            if best is None or start + opt.run_s < best[0]:
                best = (start + opt.run_s, start, opt)
        if best is None or best[1] == math.inf:
            continue
        _, start, opt = best
        if start == now:
            placement = free.try_place(job.job_id, opt, has_select, misfits)
            if placement is not None:
                started.append((job, opt, placement))
                profiles[opt.gpu_type].add(now, now + opt.run_s, -opt.num_gpus)
            # else: enough GPUs of the type, but not in whole tp groups per node: wait for
            # the next release rather than hold a reservation we cannot honour.
            continue
        # With teams' quotas, only a job within its team's nominal quota reserves (as under EASY):
        # a borrower's reservation would hold future GPUs beyond its quota, and an owner's job
        # could not backfill around it. A borrower takes idle GPUs only.
        if reserved < reservation_depth and (free.gate is None or free.gate.may_reserve(job.job_id, opt)):
            reserved += 1
            profiles[opt.gpu_type].add(start, start + opt.run_s, -opt.num_gpus)
    return started, considered


def _easy_pass(now: float, queue: Sequence[Waiting], running: Iterable[Busy],
               free: FreeGpus) -> tuple[list[tuple[Waiting, Option, Placement]], int]:
    """FCFS with EASY backfilling (Lifka 1995; Slurm's sched/backfill with one reservation).

    Jobs start in queue order until the first that cannot (the head). The head
    reserves the earliest (type, time) at which enough GPUs of one of its options
    are predicted free: the shadow time; `extra` is how many GPUs of that type are
    left over then. A later job backfills now only if it cannot delay the head:
    another type, or predicted to end by the shadow time, or within `extra` (which
    it then uses up). Reservations are per type and count, not per node.
    """
    started: list[tuple[Waiting, Option, Placement]] = []
    considered = 0
    ends: dict[str, list[tuple[float, int]]] = {}
    for r in running:
        ends.setdefault(r.gpu_type, []).append((expected_end(r.end_s, now), r.num_gpus))
    shadow: tuple[str, float, int] | None = None  # (gpu type, shadow time, extra GPUs)
    for job in queue:
        if not free.any():
            break
        considered += 1
        if shadow is None:
            refused = free.refused
            for opt in job.options:
                placement = free.try_place(job.job_id, opt, first_fit_select)
                if placement is not None:
                    started.append((job, opt, placement))
                    ends.setdefault(opt.gpu_type, []).append((now + opt.run_s, opt.num_gpus))
                    break
            else:
                if free.refused == refused:  # a job its team's quota holds back reserves nothing
                    shadow = _shadow(now, job, free, ends)
                    if shadow is not None:
                        free.reservation = (job.job_id, shadow[0], shadow[1])
            continue
        gpu_type, shadow_s, extra = shadow
        for opt in job.options:
            if free.by_type.get(opt.gpu_type, 0) < opt.num_gpus:
                continue
            same = opt.gpu_type == gpu_type
            ends_in_time = now + opt.run_s <= shadow_s
            if same and not ends_in_time and opt.num_gpus > extra:
                continue  # would still hold GPUs the head job is promised
            placement = free.try_place(job.job_id, opt, first_fit_select)
            if placement is None:
                continue
            started.append((job, opt, placement))
            if same and not ends_in_time:
                shadow = (gpu_type, shadow_s, extra - opt.num_gpus)
            break
    return started, considered


def _shadow(now: float, job: Waiting, free: FreeGpus,
            ends: dict[str, list[tuple[float, int]]]) -> tuple[str, float, int] | None:
    """The head job's reservation: its option whose GPUs are predicted free first. With teams'
    quotas, only an option within the team's nominal quota reserves (a borrower only takes idle
    GPUs, it holds no one back), and the gate keeps that quota for it (`QuotaGate.reserve`: the
    team's own later jobs cannot use up what the head will need)."""
    best: tuple[float, int, str, int, Option] | None = None  # (time, preference, type, extra, option)
    for rank, opt in enumerate(job.options):
        if free.gate is not None and not free.gate.may_reserve(job.job_id, opt):
            continue
        free_now = free.by_type.get(opt.gpu_type, 0)
        releases = sorted(ends.get(opt.gpu_type, ()))
        avail, t = free_now, now
        for end, n in releases:
            if avail >= opt.num_gpus:
                break
            avail += n
            t = end
        if avail < opt.num_gpus:
            continue  # never enough of this type (cordoned nodes): no reservation here
        # Free at the shadow time: everything released by then, not only what the head needs.
        avail = free_now + sum(n for end, n in releases if end <= t)
        if best is None or (t, rank) < best[:2]:
            best = (t, rank, opt.gpu_type, avail - opt.num_gpus, opt)
    if best is None:
        return None
    if free.gate is not None:
        free.gate.reserve(job.job_id, best[4])
    return (best[2], best[0], best[3])


class FreeProfile:
    """Free GPUs of one type over future time: a step function built from breakpoints.

    `add(t0, t1, delta)` changes the free count on [t0, t1); `earliest(n, d)` is the
    first time from now at which n GPUs stay free for d seconds.
    """

    def __init__(self, now: float, free_now: int):
        self.now = now
        self.base = free_now
        self.deltas: list[tuple[float, int]] = []  # (time, change), unsorted until needed
        self._sorted = True

    def add(self, t0: float, t1: float, delta: int) -> None:
        self.deltas.append((t0, delta))
        if t1 != math.inf:
            self.deltas.append((t1, -delta))
        self._sorted = False

    def earliest(self, need: int, duration: float) -> float:
        if not self._sorted:
            self.deltas.sort()
            self._sorted = True
        # Walk the breakpoints; a candidate start holds while the free count stays >= need.
        free = self.base
        events = self.deltas
        i = 0
        while i < len(events) and events[i][0] <= self.now:
            free += events[i][1]
            i += 1
        candidate = self.now if free >= need else None
        while i < len(events):
            t = events[i][0]
            if candidate is not None and t >= candidate + duration:
                return candidate
            while i < len(events) and events[i][0] == t:
                free += events[i][1]
                i += 1
            if free >= need:
                if candidate is None:
                    candidate = t
            else:
                candidate = None
        return candidate if candidate is not None else math.inf
