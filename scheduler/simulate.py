"""Event-driven replay of a job trace on a cluster inventory under a scheduling policy.

Events are job arrivals and job completions; after each batch of events at one
instant the policy makes a scheduling pass over the queue.
Every started job holds its GPUs on the `Cluster` object (allocate/release),
so over-allocation is impossible by construction and checked again by the
accounting.

Policies
--------
``fcfs``  FCFS-opportunistic, the Frenzy baseline: each job gets exactly the
          GPUs it asked for, on the fastest GPU type that has that many free
          (and whose memory holds it), first-fit over nodes in inventory order.
          Jobs behind a waiting job may start (opportunistic).
``has``   Frenzy: MARP sizing + HAS placement. Per GPU type one plan: the
          requested count, or — where that does not fit the type's memory —
          the smallest count that does (MARP); ranked by predicted run time;
          the job takes the first plan the free GPUs satisfy, placed best-fit
          (`scheduler.placement.has_select`). (Letting HAS also shrink a job to
          whatever count is free was tried and is worse on the Acme-like
          trace: a long job shrunk at start stays slow for its whole run.)
``ect``   Ours: expected completion time, HRRN order, conservative backfilling.
          The queue is walked by highest response ratio ((wait + run) / run:
          short jobs first, long ones gain priority as they wait). Each job
          weighs every MARP-sized plan (every feasible count up to its request,
          on every type) by expected completion = expected start + predicted
          run time, with the expected start read off a per-type profile of
          free GPUs over time (running jobs' predicted ends, minus the slots
          reserved by the first `reservation_depth` = 8 waiting jobs). A plan
          that can start now is placed with HAS; otherwise the job waits and
          (within the depth) reserves its slot, so later jobs only backfill
          around it. Big jobs are neither starved by small ones nor rushed onto
          slow GPUs when fast ones free up shortly.
``easy``  FCFS with EASY backfilling (baseline; what Slurm sites run): the
          requested GPUs as in ``fcfs``; the first job that must wait reserves the
          earliest time its GPUs are predicted free, later jobs start only if they
          cannot delay it.
``sjf``   shortest job first on estimates (baseline): the requested GPUs as in
          ``fcfs``, the queue ordered by predicted run time.
``elastic`` `scheduler.elastic.elastic_pass` (`Simulator(..., elastic=ElasticConfig(...))`):
          admission as ``fcfs``, then running training jobs change their data-parallel
          degree with the free GPUs (shrink so a queued job starts, grow into idle GPUs,
          shrink back). A job's progress is tracked as a fraction of its work: it advances
          at 1 / (actual run time on its current placement), stops for `resize_cost_s`
          after each resize, and the job ends when the fraction reaches 1
          (`JobRecord.work_done`, `resizes`, `spans`: every placement it held, and when).

Predicted vs actual run time. Every policy sees predictions only: the options'
`run_s` and, for running jobs, start + the run time predicted for the placement
they got. The job's actual run time is that prediction × its
`TraceJob.runtime_factor` (1 unless the trace was given noise with
`scheduler.traces.apply_runtime_noise`, log-normal around the prediction), so
orderings and backfilling work from estimates, not from the truth.

Run time (the prediction): a training job runs steps × the plan's step time predicted for the
placement it got (`scheduler.cost_model`); its steps come from the trace or from
its duration on the reference GPU divided by the reference plan's step time.
A demand-only job runs its trace duration × reference TFLOP/s / GPU TFLOP/s.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from scheduler.cluster import Cluster
from scheduler.elastic import ElasticConfig, ElasticRunning, Resize, elastic_pass, resizable_layouts
from scheduler.fair_share import DecayedUsage, RunningJob, Snapshot, TeamRules, decide, holdings, team_usage
from scheduler.gpus import gpu_spec
from scheduler.placement import Placement, placed_step_time, release_placement
from scheduler.planner import (
    Plan,
    PlannerConfig,
    PlanRequest,
    catalogue_pool,
    gpu_pools,
    plan_on_pools,
)
from scheduler.policy import (
    POLICIES,
    POLICY_LABELS,
    USES_RUNNING,
    Busy,
    FreeGpus,
    Option,
    Policy,
    QueuedJob,
    schedule_pass,
)
from scheduler.traces import REFERENCE_GPU, TraceError, TraceJob

# The policies the simulator runs: the one-pass admission policies, and ``elastic``
# (`scheduler.elastic`: admission, then running jobs shrink and grow).
SIM_POLICIES: tuple[str, ...] = POLICIES + ("elastic",)
SIM_POLICY_LABELS = {**POLICY_LABELS, "elastic": "Elastic (shrink/grow)"}


class SimulationError(TraceError):
    """The simulation cannot run as asked (unknown policy, bad trace for this cluster)."""


@dataclass
class JobRecord:
    job_id: str
    category: str
    arrival_s: float
    requested_gpus: int
    start_s: float | None = None
    end_s: float | None = None
    gpu_type: str | None = None
    num_gpus: int = 0
    nodes: tuple[str, ...] = ()
    gpus: tuple[tuple[str, int], ...] = ()  # (node, GPU index) held while running
    rejected: str | None = None  # why the job can never run on this cluster
    resizes: int = 0  # times it moved to another layout while running (policy elastic)
    work_done: float = 0.0  # fraction of its work done when it ended (1.0: all of it)
    # every placement it held: (from, to, GPUs as (node, index)); one unless it was resized
    spans: list[tuple[float, float, tuple[tuple[str, int], ...]]] = field(default_factory=list)

    @property
    def jct_s(self) -> float:
        return self.end_s - self.arrival_s

    @property
    def queue_s(self) -> float:
        return self.start_s - self.arrival_s


@dataclass
class SimResult:
    policy: str
    records: list[JobRecord]
    total_gpus: int
    busy_gpu_seconds: float  # integral of busy GPUs over time
    timeline: list[tuple[float, int]]  # (time, busy GPUs) after each event batch
    decisions: int
    decision_seconds: float
    passes: int

    @property
    def finished(self) -> list[JobRecord]:
        return [r for r in self.records if r.end_s is not None]

    @property
    def makespan_s(self) -> float:
        done = self.finished
        return max(r.end_s for r in done) - min(r.arrival_s for r in done) if done else 0.0

    def summary(self) -> dict[str, Any]:
        done = self.finished
        n = len(done) or 1
        by_cat: dict[str, list[float]] = {}
        for r in done:
            by_cat.setdefault(r.category, []).append(r.jct_s)
        makespan = self.makespan_s
        return {
            "policy": self.policy,
            "jobs": len(self.records),
            "finished": len(done),
            "rejected": sum(1 for r in self.records if r.rejected),
            "avg_jct_s": sum(r.jct_s for r in done) / n,
            "avg_queue_s": sum(r.queue_s for r in done) / n,
            "p50_jct_s": _percentile([r.jct_s for r in done], 50),
            "p99_jct_s": _percentile([r.jct_s for r in done], 99),
            "makespan_s": makespan,
            "utilisation": self.busy_gpu_seconds / (self.total_gpus * makespan) if makespan else 0.0,
            "decisions": self.decisions,
            "resizes": sum(r.resizes for r in self.records),
            "us_per_decision": 1e6 * self.decision_seconds / max(1, self.decisions),
            "avg_jct_s_by_category": {c: sum(v) / len(v) for c, v in sorted(by_cat.items())},
        }


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[k]


# --- turning trace jobs into options ------------------------------------------------


class JobCatalogue:
    """Per-job options for each policy, computed once per (trace, cluster) and shared by policies.

    Plans are cached per (model, batch, counts) since traces repeat a few model shapes.
    """

    def __init__(self, cluster: Cluster, planner: PlannerConfig | None = None):
        self.cluster = cluster
        self.planner = planner or PlannerConfig()
        self.pools = gpu_pools(cluster)
        if not self.pools:
            raise SimulationError(f"cluster {cluster.name!r} has no schedulable GPUs")
        self._plans: dict[tuple, list[Plan]] = {}
        self.steps: dict[str, float] = {}
        self._layouts: dict[tuple, tuple[Option, ...]] = {}
        self.requested: dict[str, int] = {}  # training job -> the GPU count it asked for (raised to fit)

    def _plans_for(self, job: TraceJob, counts: tuple[int, ...], pools) -> list[Plan]:
        # The whole pool is the key, not its GPU type: the reference pool (catalogue nodes of 8)
        # and the cluster's pool of the same type may differ in node size, hence in layouts.
        key = (id(job.model), job.global_batch, job.precision, counts, tuple(pools))
        if key not in self._plans:
            request = PlanRequest(model=job.model, global_batch=job.global_batch, precision=job.precision,
                                  name=job.job_id)
            config = self.planner.model_copy(update={"gpu_counts": counts, "max_gpus": None})
            self._plans[key] = plan_on_pools(request, list(pools), config)
        return self._plans[key]

    def _reference(self, job: TraceJob) -> tuple[int, float]:
        """(GPU count, step time) of the job on its reference GPU; raises the count if too small."""
        try:
            pool = catalogue_pool(job.reference_gpu, inter_node_gbps=self.cluster.inter_node_bandwidth_gbps)
        except KeyError as e:
            raise SimulationError(f"job {job.job_id}: {e.args[0]}") from None
        n = job.num_gpus
        while n <= 1 << 14:
            plans = self._plans_for(job, (n,), (pool,))
            if plans:
                return n, plans[0].predicted_step_time_s
            n *= 2
        raise SimulationError(f"job {job.job_id}: its model fits on no count of {job.reference_gpu}")

    def _by_type_and_count(self, plans: list[Plan]) -> list[Plan]:
        seen, out = set(), []
        for p in plans:
            key = (p.gpu_type, p.num_gpus)
            if key not in seen:
                seen.add(key)
                out.append(p)
        return out

    def options(self, job: TraceJob) -> dict[str, list[Option]]:
        """{policy: options in the policy's preference order} (empty lists: never runnable)."""
        fastest_first = sorted(self.pools, key=lambda p: -p.peak_tflops)
        if not job.is_training:
            try:
                ref_tflops = gpu_spec(job.reference_gpu).peak_tflops
            except KeyError as e:
                raise SimulationError(f"job {job.job_id}: {e.args[0]}") from None
            need = int(job.min_gpu_memory_gib * 2**30)
            opts = [
                Option(gpu_type=p.gpu_type, num_gpus=job.num_gpus, unit=1, min_memory_bytes=need,
                       run_s=job.duration_s * ref_tflops / p.peak_tflops, dp=job.num_gpus)
                for p in fastest_first
                if p.memory_bytes >= need and p.total_gpus >= job.num_gpus
            ]
            return {"fcfs": opts, "has": opts, "ect": opts, "easy": opts, "sjf": opts, "elastic": opts}

        n_ref, ref_step = self._reference(job)
        steps = job.steps or max(1.0, job.duration_s / ref_step)
        self.steps[job.job_id] = steps
        self.requested[job.job_id] = n_ref

        def option(p: Plan) -> Option:
            return self._option(job, p)

        # Baseline: exactly the requested count, fastest type first.
        fcfs = []
        for pool in fastest_first:
            plans = self._plans_for(job, (n_ref,), (pool,))
            if plans:
                fcfs.append(option(plans[0]))
        # MARP sizing, per GPU type: every count (powers of two and the request) that holds
        # the job, up to the request; where the request has no fitting layout on a type, the
        # smallest count above it that does (up to 4x).
        counts = tuple(sorted({1 << k for k in range((4 * n_ref).bit_length())} | {n_ref}))
        counts = tuple(c for c in counts if c <= 4 * n_ref)
        by_type: dict[str, list[Option]] = {}
        for p in self._by_type_and_count(self._plans_for(job, counts, tuple(self.pools))):
            by_type.setdefault(p.gpu_type, []).append(option(p))
        sized: list[Option] = []
        for opts in by_type.values():
            opts.sort(key=lambda o: o.num_gpus)
            within = [o for o in opts if o.num_gpus <= n_ref]
            above = [o for o in opts if o.num_gpus > n_ref]
            sized.extend(within)
            if (not within or within[-1].num_gpus != n_ref) and above:
                sized.append(above[0])
        # HAS: one plan per type — the request, or MARP's raised count — fastest first.
        largest = {}
        for o in sized:
            if o.gpu_type not in largest or o.num_gpus > largest[o.gpu_type].num_gpus:
                largest[o.gpu_type] = o
        has = sorted(largest.values(), key=lambda o: (o.run_s, o.num_gpus))
        # ECT weighs every sized plan by expected completion time.
        ect = sorted(sized, key=lambda o: (o.run_s, o.num_gpus))
        # The Slurm-style baselines run what the user asked for, like FCFS; so does the elastic
        # policy at admission (it resizes running jobs afterwards: `layouts`).
        return {"fcfs": fcfs, "has": has, "ect": ect, "easy": fcfs, "sjf": fcfs, "elastic": fcfs}

    def _option(self, job: TraceJob, p: Plan) -> Option:
        return Option(gpu_type=p.gpu_type, num_gpus=p.num_gpus, unit=p.tp,
                      min_memory_bytes=p.required_memory_bytes, run_s=self.steps[job.job_id] * p.predicted_step_time_s,
                      plan=p, dp=p.dp, tp=p.tp, pp=p.pp)

    def layouts(self, job: TraceJob, current: Option, config: ElasticConfig) -> tuple[Option, ...]:
        """The layouts a job running on `current` may resize to (`scheduler.elastic.resizable_layouts`):
        its data-parallel degree halved or doubled, within the config's factors of its request.
        Empty for plain GPU demands."""
        if current.plan is None or job.job_id not in self.steps:
            return ()
        requested = self.requested[job.job_id]
        # keyed by what the layouts depend on, not the job id (traces reuse ids)
        key = (id(job.model), job.global_batch, job.precision, self.steps[job.job_id], requested, current.gpu_type,
               current.num_gpus, current.tp, current.pp, config.min_shrink_factor, config.max_grow_factor)
        if key not in self._layouts:
            pool = next(p for p in self.pools if p.gpu_type == current.gpu_type)
            group = current.tp * current.pp
            counts = {current.num_gpus}
            n = current.num_gpus
            while n % 2 == 0 and n // 2 >= max(group, requested * config.min_shrink_factor):
                n //= 2
                counts.add(n)
            n = current.num_gpus
            while 2 * n <= requested * config.max_grow_factor:
                n *= 2
                counts.add(n)
            plans = self._plans_for(job, tuple(sorted(counts)), (pool,))
            self._layouts[key] = resizable_layouts([self._option(job, p) for p in plans], current, requested, config)
        return self._layouts[key]

    def smaller_starts(self, job: TraceJob, options: list[Option], config: ElasticConfig) -> tuple[Option, ...]:
        """Layouts below its request a waiting job may start on (and grow later), on each type it may run on."""
        return tuple(o for opt in options for o in self.layouts(job, opt, config) if o.num_gpus < opt.num_gpus)


# --- the event loop ----------------------------------------------------------------------


@dataclass
class _Running:
    record: JobRecord
    placement: Placement
    end_s: float  # actual end (the event queue's)
    predicted_end_s: float  # what the policies are told
    option: Option | None = None
    event_seq: int = -1  # its finish event's; a resize pushes a new one and the old one is ignored
    # progress (fraction of the work) = done + rate × time since max(mark_s, resume_s)
    done: float = 0.0
    mark_s: float = 0.0
    resume_s: float = 0.0  # a resize's restart: no progress until then
    rate: float = 0.0  # actual fraction of the work per second on its placement
    predicted_run_s: float = 0.0  # the whole job on its placement, predicted
    last_resize_s: float = 0.0
    layouts: tuple[Option, ...] = ()

    def progress(self, now: float) -> float:
        return self.done + self.rate * max(0.0, now - max(self.mark_s, self.resume_s))


class Simulator:
    """Replays `jobs` on a private copy of `cluster` under `policy`."""

    def __init__(self, cluster: Cluster, jobs: Iterable[TraceJob], policy: str,
                 catalogue: JobCatalogue | None = None, options: dict[str, dict[str, list[Option]]] | None = None,
                 reservation_depth: int = 8, teams: TeamRules | None = None, team_of: dict[str, str] | None = None,
                 elastic: ElasticConfig | None = None):
        if policy not in SIM_POLICIES:
            raise SimulationError(f"unknown policy {policy!r}; choose from {', '.join(SIM_POLICIES)}")
        if policy == "elastic" and teams is not None:
            raise SimulationError("the elastic policy is simulated without teams' quotas; drop the teams or "
                                  "choose another policy")
        self.policy = policy
        self.elastic = elastic or ElasticConfig()
        self.cluster = cluster.copy_state()
        self.jobs = sorted(jobs, key=lambda j: j.arrival_s)
        if not self.jobs:
            raise SimulationError("the trace has no jobs")
        self.catalogue = catalogue or JobCatalogue(cluster)
        self.options = options if options is not None else {j.job_id: self.catalogue.options(j) for j in self.jobs}
        if policy == "elastic":  # options computed before the elastic policy existed
            for opts in self.options.values():
                opts.setdefault("elastic", opts["fcfs"])
        self.total_gpus = sum(n.gpu_count for n in self.cluster.schedulable_nodes())
        self.free = FreeGpus(self.cluster)
        self.reservation_depth = reservation_depth
        # teams (`scheduler.fair_share`): each pass is `decide` (fair-share order, quota gate), as live
        self.teams = teams
        self.team_of = team_of or {}
        self.promised: dict[str, float] = {}  # job -> the start its first reservation promised it
        self.shortest_run = {
            j: min((o.run_s for o in opts["ect"]), default=math.inf) for j, opts in self.options.items()
        }

    # -- helpers
    def _resize(self, run: _Running, job: TraceJob, rz: Resize, now: float, events: list, seq: int) -> int:
        """Move a running job to its new layout: it keeps the work done, makes no progress for the
        restart (`ElasticConfig.resize_cost_s`), then runs at the new layout's speed. Returns the next seq."""
        rec = run.record
        rec.spans.append((run.mark_s, now, rec.gpus))
        rec.resizes += 1
        rec.gpus = tuple((a.node, g) for a in rz.placement.assignments for g in a.gpus)
        rec.nodes = tuple(rz.placement.nodes)
        rec.num_gpus = rz.placement.world_size
        run.done = min(1.0, run.progress(now))
        run.mark_s, run.resume_s = now, now + self.elastic.resize_cost_s
        run.placement, run.option, run.last_resize_s = rz.placement, rz.new, now
        run.predicted_run_s = self._run_seconds(job, rz.new, rz.placement)
        run.rate = 1.0 / (run.predicted_run_s * job.runtime_factor)
        left = 1.0 - run.done
        run.predicted_end_s = run.resume_s + left * run.predicted_run_s
        run.end_s = run.resume_s + left / run.rate
        run.event_seq = seq
        heapq.heappush(events, (run.end_s, 0, seq, job.job_id))
        return seq + 1

    def _run_seconds(self, job: TraceJob, opt: Option, placement: Placement) -> float:
        """Predicted run time on the placement the job got (what a scheduler can know at start)."""
        if opt.plan is None:
            return opt.run_s
        return self.catalogue.steps[job.job_id] * placed_step_time(opt.plan, placement, self.cluster)

    # -- the loop
    def run(self) -> SimResult:
        records = {j.job_id: JobRecord(j.job_id, j.category, j.arrival_s, j.num_gpus) for j in self.jobs}
        events: list[tuple[float, int, int, str]] = []  # (time, kind 0=finish 1=arrival, seq, job id)
        by_id = {j.job_id: j for j in self.jobs}
        seq = 0
        for j in self.jobs:
            heapq.heappush(events, (j.arrival_s, 1, seq, j.job_id))
            seq += 1
        queue: list[QueuedJob] = []
        running: dict[str, _Running] = {}
        timeline: list[tuple[float, int]] = []
        busy = 0
        busy_integral = 0.0
        last_t = self.jobs[0].arrival_s
        decisions = passes = 0
        decision_seconds = 0.0
        held: dict[str, RunningJob] = {}  # running jobs' teams, while teams are simulated
        usage = DecayedUsage(self.teams.half_life_s if self.teams else 1.0)
        head = None

        while events:
            now = events[0][0]
            busy_integral += busy * (now - last_t)
            last_t = now
            while events and events[0][0] == now:
                _, kind, ev_seq, job_id = heapq.heappop(events)
                if kind == 0:
                    if job_id not in running or running[job_id].event_seq != ev_seq:
                        continue  # a resize moved its end: another event finishes it
                    done = running.pop(job_id)
                    release_placement(self.cluster, done.placement)
                    self.free.give_back(done.placement.gpu_type, done.placement.world_size)
                    busy -= done.placement.world_size
                    done.record.end_s = now
                    done.record.work_done = done.progress(now)
                    done.record.spans.append((done.mark_s, now, done.record.gpus))
                    if job_id in held:
                        gone = held.pop(job_id)
                        usage.add(gone.team, gone.num_gpus, gone.admitted_s, now)
                else:
                    job = by_id[job_id]
                    if not self.options[job_id][self.policy]:
                        records[job_id].rejected = "no GPU type of the cluster can hold it"
                    else:
                        queue.append(QueuedJob(job_id, job.arrival_s, self.options[job_id][self.policy],
                                               self.shortest_run[job_id]))
            t0 = time.perf_counter()
            busy_now = ([Busy(r.placement.gpu_type, r.placement.world_size, r.predicted_end_s) for r in running.values()]
                        if self.policy in USES_RUNNING else ())
            resizes: list[Resize] = []
            if self.policy == "elastic":
                views = [ElasticRunning(jid, r.option, r.placement, r.predicted_end_s, max(0.0, 1.0 - r.progress(now)),
                                        r.last_resize_s, self.catalogue.requested.get(jid, r.record.requested_gpus),
                                        r.layouts)
                         for jid, r in running.items()]
                smaller = {q.job_id: self.catalogue.smaller_starts(by_id[q.job_id], q.options, self.elastic)
                           for q in queue[:4 * self.elastic.shrink_depth]} if self.elastic.start_smaller else None
                decision = elastic_pass(now, queue, views, self.free, self.elastic, smaller)
                started, considered, resizes = decision.started, decision.considered, decision.resizes
            elif self.teams is None:
                started, considered = schedule_pass(self.policy, now, queue, busy_now, self.free,
                                                    reservation_depth=self.reservation_depth)
            else:
                snap = Snapshot(self.policy, now, queue, busy_now, self.free, self.teams,
                                {j.job_id: self.team_of.get(j.job_id, "") for j in queue}, {},
                                holdings(held.values()), team_usage(usage, held.values(), now),
                                self.reservation_depth, head)
                started, considered = decide(snap)
                head = self.free.reservation[0] if self.free.reservation else head
                if self.free.reservation:
                    self.promised.setdefault(head, self.free.reservation[2])
            decision_seconds += time.perf_counter() - t0
            decisions += considered
            passes += 1
            for rz in resizes:
                busy += rz.placement.world_size - rz.old_placement.world_size
                seq = self._resize(running[rz.job_id], by_id[rz.job_id], rz, now, events, seq)
            for queued, opt, placement in started:
                job = by_id[queued.job_id]
                rec = records[job.job_id]
                rec.start_s, rec.gpu_type, rec.num_gpus = now, opt.gpu_type, placement.world_size
                rec.nodes = tuple(placement.nodes)
                rec.gpus = tuple((a.node, g) for a in placement.assignments for g in a.gpus)
                predicted = self._run_seconds(job, opt, placement)
                end = now + predicted * job.runtime_factor
                running[job.job_id] = _Running(
                    rec, placement, end, now + predicted, opt, seq, mark_s=now, resume_s=now,
                    rate=1.0 / (predicted * job.runtime_factor), predicted_run_s=predicted, last_resize_s=now,
                    layouts=self.catalogue.layouts(job, opt, self.elastic) if self.policy == "elastic" else ())
                if self.teams is not None:
                    held[job.job_id] = RunningJob(self.team_of.get(job.job_id, ""), opt.gpu_type,
                                                  placement.world_size, now)
                    head = None if head == job.job_id else head
                busy += placement.world_size
                heapq.heappush(events, (end, 0, seq, job.job_id))
                seq += 1
            if started:
                started_ids = {q.job_id for q, _, _ in started}
                queue = [j for j in queue if j.job_id not in started_ids]
            if busy > self.total_gpus:
                raise AssertionError(f"over-allocation at t={now}: {busy} > {self.total_gpus}")
            timeline.append((now, busy))
        if queue:  # cannot happen: a job with options eventually fits an empty cluster
            raise SimulationError(f"{len(queue)} job(s) never started, e.g. {queue[0].job_id}")
        return SimResult(self.policy, list(records.values()), self.total_gpus, busy_integral, timeline,
                         decisions, decision_seconds, passes)


def simulate(cluster: Cluster, jobs: list[TraceJob], policies: Iterable[str] = POLICIES,
             planner: PlannerConfig | None = None, elastic: ElasticConfig | None = None) -> dict[str, SimResult]:
    """Run every policy on the same trace and cluster; options are computed once and shared."""
    policies = list(policies)
    for p in policies:
        if p not in SIM_POLICIES:
            raise SimulationError(f"unknown policy {p!r}; choose from {', '.join(SIM_POLICIES)}")
    catalogue = JobCatalogue(cluster, planner)
    options = {j.job_id: catalogue.options(j) for j in jobs}
    return {p: Simulator(cluster, jobs, p, catalogue, options, elastic=elastic).run() for p in policies}


def effective_capacity(cluster: Cluster, reference_gpu: str = REFERENCE_GPU) -> float:
    """The cluster's schedulable GPUs in reference-GPU equivalents (peak TFLOP/s ratio).

    Trace durations are on the reference GPU, so an offered load is work per second over
    this capacity, not over the raw GPU count: 1,280 mixed GPUs (A100/A40/A10/V100) are
    worth about 730 A100s. Peak TFLOP/s is the same speed ratio the simulator uses for
    demand-only jobs; training jobs' real speed ratios (the cost model) differ somewhat.
    """
    ref = gpu_spec(reference_gpu).peak_tflops
    return sum(n.gpu_count * n.peak_tflops / ref for n in cluster.schedulable_nodes())


def offered_load(jobs: list[TraceJob], capacity: float) -> float:
    """Work of a trace (reference GPU-seconds) per second of its arrival span, over `capacity`."""
    span = max(j.arrival_s for j in jobs) - min(j.arrival_s for j in jobs)
    work = sum(j.num_gpus * (j.duration_s or 0.0) for j in jobs)
    return work / (capacity * span) if span > 0 and capacity > 0 else math.inf


def plot_jct_cdf(results: dict[str, SimResult], path: str | Path, title: str = "JCT CDF") -> Path:
    """One JCT CDF line per policy, log-scaled time axis, saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy, result in results.items():
        jcts = sorted(r.jct_s / 3600 for r in result.finished)
        if not jcts:
            continue
        ys = [(i + 1) / len(jcts) for i in range(len(jcts))]
        avg = sum(jcts) / len(jcts)
        ax.step(jcts, ys, where="post", label=f"{SIM_POLICY_LABELS.get(policy, policy)} (avg {avg:.2f} h)")
    ax.set_xscale("log")
    ax.set_xlabel("job completion time (hours, log scale)")
    ax.set_ylabel("fraction of jobs")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper left", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
