"""Elastic scheduling: running data-parallel jobs shrink and grow with the free GPUs — one pass.

`elastic_pass` is the decision; the simulator (`scheduler.simulate`, policy ``elastic``) runs
it after every batch of events, and the live orchestrator's decider the same way
(`scheduler.orchestrator.service.Orchestrator.resize`, which carries each resize out as a
checkpoint-first preemption with a promised next admission on the new layout): it reads
the queue, every running job (`ElasticRunning`: its layout now, the layouts it may take, the
fraction of its work left, when it last resized) and the idle GPUs (`scheduler.policy.FreeGpus`,
allocated on as it decides), and returns the jobs to start and the jobs to resize, each with
its new placement. A pass, in order:

1. **Admit** (`ElasticConfig.admission`, FCFS-opportunistic by default): the queue's jobs that
   fit the idle GPUs start on their requested layout (`scheduler.policy.schedule_pass`).
2. **Shrink instead of wait**: for each of the first `shrink_depth` jobs still waiting, and
   each of its options, the cheapest set of running jobs to shrink that frees enough GPUs of
   that type. A victim steps down one data-parallel layout at a time (same GPU type, tensor-
   and pipeline-parallel degrees and global batch; the next smaller data-parallel degree),
   jobs grown above their request first (growth is given back first), then by the least
   predicted loss per GPU freed. It happens only when the waiting job's predicted completion
   improves by more than the victims lose: its gain is the completion it would get by waiting
   (the earliest its GPUs free up, from the running jobs' predicted ends, plus its run time)
   minus starting now; each victim loses its remaining work × (run time on the smaller layout −
   run time now) + one restart (`resize_cost_s`). Both are read off the cost model's
   predictions (`Option.run_s`: the whole job on that layout).
3. **Grow into idle GPUs**: each resizable job may take a larger layout of its type whose extra
   GPUs are idle, when the remaining time it saves exceeds one restart; the jobs that save
   the most seconds per extra GPU grow first, one resize per job per pass. (With
   `grow_while_waiting` off, not into a GPU type a still-waiting job could run on; growth
   leaves `grow_headroom_gpus` of each type idle.)

Defaults, chosen on the Acme-like trace of `benchmarks/simulate_policies.py` (load 0.8, noise
0.3) with seeds 100-104, not the benchmark's seeds 0-4 (mean elastic / FCFS-opportunistic
average JCT): growth up to 4x the request (2x: 0.853, 4x: 0.808, 8x: 0.795); growing while jobs
wait (off: 0.830); a waiting job starting below its request (`start_smaller`, off: on it was
0.833); the min interval barely matters (60 s: 0.806, 300 s: 0.808, 1800 s: 0.808), nor does
the restart (0 s and no interval, 8x growth: 0.806); idle headroom for small jobs trades their
wait against pretraining's speed (8 GPUs: 0.800, 32: 0.810). Growth is most of the gain:
shrink-to-admit alone (no growth) gives 0.973. Also tried and worse: moving a job to idle GPUs
of a faster type (0.858), growing the jobs with the fewest GPU-seconds per second saved first
(0.820).

A job resizes at most once per `min_resize_interval_s` (counted from its admission too), in
any direction. A resize is a checkpoint-and-restart: the job makes no progress for
`resize_cost_s` (default 11.97 s: `seconds_to_resume_p50` of `benchmarks/recovery.py`,
measured on the project's CPU box: from the last step before a stop to the first step after
the resume; the caller passes its own). The pass releases a victim's GPUs and allocates its
new placement on the `Cluster` behind `FreeGpus`, all or nothing per decision: if the waiting
job or any victim cannot be placed (tensor-parallel groups that must share a node), every
change of that decision is undone. No GPU is handed out that is not idle or released in the
same decision, so no GPU is ever held by two jobs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Literal, Mapping, Sequence

from scheduler.placement import Placement, allocate_placement, has_select, release_placement
from scheduler.policy import POLICIES, Busy, FreeGpus, Option, Waiting, expected_end, schedule_pass

# benchmarks/recovery.py, seconds_to_resume_p50 measured on the project's box: a stopped job's
# last step to its first step after the restart from its checkpoint.
MEASURED_RESTART_S = 11.97


@dataclass(frozen=True, kw_only=True)
class ElasticConfig:
    """How eagerly running jobs are resized."""

    resize_cost_s: float = MEASURED_RESTART_S  # no progress for this long after each resize
    min_resize_interval_s: float = 300.0  # per job, since its admission or last resize
    max_grow_factor: float = 4.0  # layouts up to this × the requested GPUs
    min_shrink_factor: float = 0.25  # layouts down to this × the requested GPUs
    shrink_depth: int = 8  # waiting jobs (queue order) that may shrink others per pass
    admission: str = "fcfs"  # the pass that starts jobs on idle GPUs (`scheduler.policy`)
    grow_while_waiting: bool = True  # grow into a GPU type that a waiting job could run on (it shrinks them back)
    start_smaller: bool = False  # a waiting job may also start below its request (then grow), weighed alike
    grow_headroom_gpus: int = 0  # growth leaves this many GPUs of each type idle (for small jobs arriving)

    def __post_init__(self) -> None:
        if not self.resize_cost_s >= 0:
            raise ValueError(f"resize_cost_s must be >= 0 seconds (got {self.resize_cost_s})")
        if not self.min_resize_interval_s >= 0:
            raise ValueError(f"min_resize_interval_s must be >= 0 seconds (got {self.min_resize_interval_s})")
        if not self.max_grow_factor >= 1:
            raise ValueError(f"max_grow_factor must be >= 1 (got {self.max_grow_factor}); 1 never grows a job")
        if not 0 < self.min_shrink_factor <= 1:
            raise ValueError(f"min_shrink_factor must be in (0, 1] (got {self.min_shrink_factor}); 1 never shrinks")
        if self.shrink_depth < 0:
            raise ValueError(f"shrink_depth must be >= 0 (got {self.shrink_depth})")
        if self.admission not in POLICIES:
            raise ValueError(f"admission {self.admission!r} is not a policy; choose from {', '.join(POLICIES)}")


@dataclass(frozen=True)
class ElasticRunning:
    """A running job as the elastic pass sees it."""

    job_id: str
    option: Option  # its layout now (`run_s`: the whole job on this layout, predicted)
    placement: Placement  # the GPUs it holds
    predicted_end_s: float  # when it is predicted to finish on what it holds now
    remaining: float = 1.0  # fraction of its work left (0..1]
    last_resize_s: float = -math.inf  # its admission or last resize
    requested_gpus: int = 0  # what it asked for (growth above it is given back first)
    # layouts it may resize to (same GPU type, tp, pp and global batch; its own among them);
    # empty: not resizable (a plain GPU demand, or a job whose layout has no data-parallel sibling)
    layouts: tuple[Option, ...] = ()

    def remaining_s(self, layout: Option) -> float:
        """Predicted seconds of work left on `layout`."""
        return self.remaining * layout.run_s

    def may_resize(self, now: float, config: ElasticConfig) -> bool:
        return bool(self.layouts) and now - self.last_resize_s >= config.min_resize_interval_s


@dataclass(frozen=True)
class Resize:
    """One running job moved to another layout (a checkpoint-and-restart)."""

    job_id: str
    old: Option
    new: Option
    old_placement: Placement
    placement: Placement  # the new one, allocated
    kind: Literal["shrink", "grow"]
    for_job: str | None = None  # the waiting job a shrink made room for
    gain_s: float = 0.0  # predicted: the waiting job's completion saved (shrink), remaining time saved (grow)
    cost_s: float = 0.0  # predicted: time the resized job(s) lose, restarts included


@dataclass
class ElasticDecision:
    started: list[tuple[Waiting, Option, Placement]] = field(default_factory=list)
    resizes: list[Resize] = field(default_factory=list)
    considered: int = 0


def elastic_pass(now: float, queue: Sequence[Waiting], running: Sequence[ElasticRunning], free: FreeGpus,
                 config: ElasticConfig = ElasticConfig(),
                 smaller: Mapping[str, Sequence[Option]] | None = None) -> ElasticDecision:
    """One elastic pass (see the module doc): admit, shrink instead of wait, grow into idle GPUs.

    `running`: every running job (not only resizable ones: all of them tell when GPUs free up).
    `smaller`: job id -> layouts below its request that a waiting job may start on (it grows
    later); weighed like its own options, by predicted completion.
    Allocates on `free`'s cluster; the caller applies the decision (starts, restarts) and
    keeps `running` in step with it for the next pass.
    """
    decision = ElasticDecision()
    busy = [Busy(r.option.gpu_type, r.placement.world_size, r.predicted_end_s) for r in running]
    started, decision.considered = schedule_pass(config.admission, now, queue, busy, free)
    decision.started.extend(started)
    state = {r.job_id: r for r in running}
    for q, opt, placement in started:  # they hold GPUs now: their ends count, they do not resize yet
        state[q.job_id] = ElasticRunning(q.job_id, opt, placement, now + opt.run_s, last_resize_s=now)
    resized: set[str] = set(state) - {r.job_id for r in running}
    begun = {q.job_id for q, _, _ in started}
    waiting = [q for q in queue if q.job_id not in begun][:config.shrink_depth]
    for job in waiting:
        shrink = _shrink_for(now, job, (smaller or {}).get(job.job_id, ()), state, resized, free, config)
        if shrink is None:
            continue
        opt, steps, gain, loss = shrink
        applied = _apply_shrink(job, opt, steps, state, free, gain, loss)
        if applied is None:
            continue
        placement, resizes = applied
        decision.started.append((job, opt, placement))
        decision.resizes.extend(resizes)
        for rz in resizes:
            resized.add(rz.job_id)
            state[rz.job_id] = _moved(state[rz.job_id], rz, now)
        state[job.job_id] = ElasticRunning(job.job_id, opt, placement, now + opt.run_s, last_resize_s=now)
        resized.add(job.job_id)
    still = [q for q in waiting if q.job_id not in resized]
    wanted = set() if config.grow_while_waiting else {o.gpu_type for q in still for o in q.options}
    decision.resizes.extend(_grow(now, state, resized, free, config, wanted))
    return decision


# --- shrink instead of wait -------------------------------------------------------------


def _smaller(job: ElasticRunning, than: Option) -> Option | None:
    """The job's next smaller layout below `than` (the largest one with fewer GPUs)."""
    below = [o for o in job.layouts if o.num_gpus < than.num_gpus]
    return max(below, key=lambda o: o.num_gpus) if below else None


def _expected_start(now: float, opt: Option, free: FreeGpus, state: dict[str, ElasticRunning]) -> float:
    """When `opt`'s GPU count is predicted free without resizing anyone (EASY's shadow time)."""
    have = free.by_type.get(opt.gpu_type, 0)
    if have >= opt.num_gpus:
        return now
    ends = sorted((expected_end(r.predicted_end_s, now), r.placement.world_size)
                  for r in state.values() if r.option.gpu_type == opt.gpu_type)
    for end, n in ends:
        have += n
        if have >= opt.num_gpus:
            return end
    return math.inf


def _shrink_for(now: float, job: Waiting, smaller: Sequence[Option], state: dict[str, ElasticRunning],
                resized: set[str], free: FreeGpus,
                config: ElasticConfig) -> tuple[Option, list[tuple[str, Option]], float, float] | None:
    """The best (option, victims' new layouts, gain, loss) that starts `job` now, or None."""
    waited = min((_expected_start(now, o, free, state) + o.run_s for o in job.options), default=math.inf)
    best = None
    for opt in (*job.options, *smaller):
        need = opt.num_gpus - free.by_type.get(opt.gpu_type, 0)
        if need <= 0 and opt in job.options:
            continue  # enough idle GPUs of the type, but not in whole groups per node: shrinking won't help
        gain = waited - (now + opt.run_s)
        if gain <= 0:
            continue
        steps = _victims(now, opt.gpu_type, need, state, resized, config) if need > 0 else ({}, 0.0)
        if steps is None:
            continue
        new_layout, loss = steps
        if gain > loss and (best is None or gain - loss > best[2] - best[3]):
            best = (opt, list(new_layout.items()), gain, loss)
    return best


def _victims(now: float, gpu_type: str, need: int, state: dict[str, ElasticRunning], resized: set[str],
             config: ElasticConfig) -> tuple[dict[str, Option], float] | None:
    """Step victims down one data-parallel layout at a time, grown jobs first, then the least
    predicted loss per GPU freed, until `need` GPUs are freed: ({job: new layout}, loss s)."""
    at: dict[str, Option] = {}
    loss = 0.0
    freed = 0
    candidates = [r for r in state.values() if r.option.gpu_type == gpu_type and r.job_id not in resized
                  and r.may_resize(now, config)]
    while freed < need:
        best = None
        for r in candidates:
            cur = at.get(r.job_id, r.option)
            nxt = _smaller(r, cur)
            if nxt is None:
                continue
            step_loss = r.remaining_s(nxt) - r.remaining_s(cur) + (0.0 if r.job_id in at else config.resize_cost_s)
            key = (cur.num_gpus <= r.requested_gpus, step_loss / (cur.num_gpus - nxt.num_gpus))
            if best is None or key < best[0]:
                best = (key, r, cur, nxt, step_loss)
        if best is None:
            return None
        _, r, cur, nxt, step_loss = best
        at[r.job_id] = nxt
        loss += step_loss
        freed += cur.num_gpus - nxt.num_gpus
    return at, loss


def _apply_shrink(job: Waiting, opt: Option, steps: list[tuple[str, Option]], state: dict[str, ElasticRunning],
                  free: FreeGpus, gain: float, loss: float) -> tuple[Placement, list[Resize]] | None:
    """Release the victims, place the waiting job, then the victims' smaller layouts; all or nothing."""
    victims = [(state[jid], new) for jid, new in steps]
    for r, _ in victims:
        _release(free, r.placement)
    placed: list[Placement] = []
    placement = free.try_place(job.job_id, opt, has_select)
    if placement is not None:
        placed.append(placement)
        for r, new in victims:
            p = free.try_place(r.job_id, new, has_select)
            if p is None:
                break
            placed.append(p)
    if placement is None or len(placed) != len(victims) + 1:
        for p in placed:
            _release(free, p)
        for r, _ in victims:
            _allocate(free, r.placement)
        return None
    resizes = [Resize(r.job_id, r.option, new, r.placement, p, "shrink", job.job_id, gain, loss)
               for (r, new), p in zip(victims, placed[1:])]
    return placement, resizes


# --- grow into idle GPUs --------------------------------------------------------------------


def _grow(now: float, state: dict[str, ElasticRunning], resized: set[str], free: FreeGpus,
          config: ElasticConfig, wanted: set[str]) -> list[Resize]:
    """Grow jobs into idle GPUs, most seconds saved per extra GPU first, one resize per job."""
    out: list[Resize] = []
    tried: set[str] = set()
    while True:
        best = None
        for r in state.values():
            if (r.job_id in resized or r.job_id in tried or r.option.gpu_type in wanted
                    or not r.may_resize(now, config)):
                continue
            idle = free.by_type.get(r.option.gpu_type, 0) - config.grow_headroom_gpus
            for big in r.layouts:
                extra = big.num_gpus - r.option.num_gpus
                if extra <= 0 or extra > idle:
                    continue
                saved = r.remaining_s(r.option) - r.remaining_s(big)
                if saved <= config.resize_cost_s:
                    continue
                key = saved / extra
                if best is None or key > best[0]:
                    best = (key, r, big, saved)
        if best is None:
            return out
        _, r, big, saved = best
        tried.add(r.job_id)
        _release(free, r.placement)
        placement = free.try_place(r.job_id, big, has_select)
        if placement is None:  # idle GPUs not in whole groups per node: keep what it has
            _allocate(free, r.placement)
            continue
        rz = Resize(r.job_id, r.option, big, r.placement, placement, "grow", None, saved, config.resize_cost_s)
        out.append(rz)
        resized.add(r.job_id)
        state[r.job_id] = _moved(r, rz, now)


# --- helpers --------------------------------------------------------------------------------


def _release(free: FreeGpus, placement: Placement) -> None:
    release_placement(free.cluster, placement)
    free.give_back(placement.gpu_type, placement.world_size)


def _allocate(free: FreeGpus, placement: Placement) -> None:
    allocate_placement(free.cluster, placement)
    free.by_type[placement.gpu_type] -= placement.world_size


def _moved(r: ElasticRunning, rz: Resize, now: float) -> ElasticRunning:
    end = now + rz.new.run_s * r.remaining  # the restart itself is small next to a run; ends are estimates
    return ElasticRunning(r.job_id, rz.new, rz.placement, end, r.remaining, now, r.requested_gpus, r.layouts)


def resizable_layouts(options: Iterable[Option], current: Option, requested_gpus: int,
                      config: ElasticConfig) -> tuple[Option, ...]:
    """The layouts `current` may resize to: same GPU type, tensor- and pipeline-parallel degrees
    (only the data-parallel degree changes; the global batch is the plans'), between
    `min_shrink_factor` and `max_grow_factor` × the request; one per GPU count (the fastest),
    `current` among them. Empty when only `current` remains (nothing to resize to)."""
    lo = requested_gpus * config.min_shrink_factor
    hi = requested_gpus * config.max_grow_factor
    by_count: dict[int, Option] = {current.num_gpus: current}
    for o in options:
        if (o.gpu_type, o.tp, o.pp) != (current.gpu_type, current.tp, current.pp) or not lo <= o.num_gpus <= hi:
            continue
        if o.num_gpus != current.num_gpus and (o.num_gpus not in by_count or o.run_s < by_count[o.num_gpus].run_s):
            by_count[o.num_gpus] = o
    if len(by_count) == 1:
        return ()
    return tuple(sorted(by_count.values(), key=lambda o: o.num_gpus))
