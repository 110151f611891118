"""Preemption that ends in a checkpoint: which running jobs to stop so a waiting one can start — pure functions.

`plan(snap, holders)` reads the same `scheduler.fair_share.Snapshot` an admission pass reads
(the queue, idle GPUs, teams' rules, holdings, priorities) plus the running jobs as possible
victims (`Holder`), and returns one `Preemption` per waiting job that should get GPUs by
stopping others. The live orchestrator (`Orchestrator.preempt`) asks the victims to stop
gracefully (their ranks commit the step they are on), re-queues them at their original submit
time, and force-releases a victim that has not stopped by its deadline.

Who may be a victim of waiting job W (on the GPU type of one of W's options):
- a running job of a lower priority class than W; or
- a job of another team on borrowed quota (its team holds more than its nominal quota of the
  type) while W's team has work waiting within its own nominal quota (Kueue's reclaim).
With the teams' quotas enforced, W itself must be within its team's nominal quota of that type
after starting (otherwise freeing GPUs would not let it start: the quota gate refuses it).

Which victims: the set that loses the least work — GPU-seconds since each victim's last
committed checkpoint (`Holder.work_since_s`; its admission when it has committed none) — among
the sets that free enough GPUs of the type; ties go to fewer victims, then to the lowest
priority. Exact (a knapsack over GPU counts), so the set is minimal: no victim can be dropped
and still free enough. GPUs count per type; placement shape (a tensor-parallel unit that must
share a node) is left to the admission pass that follows, and a job the pass still cannot place
keeps the GPUs its victims freed for the next pass.

GPUs already coming free (idle now, or held by victims asked to stop earlier) count first: a
waiting job they cover gets no new victims, and each planned job takes its share of them so
the next waiting job does not count them again. Only the first `depth` waiting jobs in
admission order are considered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from scheduler.fair_share import NO_TEAM, Snapshot, pass_order


@dataclass(frozen=True)
class Holder:
    """A running job as preemption sees it."""

    job_id: str
    team: str
    priority: int
    gpu_type: str
    num_gpus: int
    work_since_s: float  # its last committed checkpoint (its admission before the first one)
    stopping: bool = False  # already asked to stop for another job: its GPUs are coming free

    def lost_gpu_s(self, now: float) -> float:
        """Work it would train again if stopped now without a new checkpoint (GPU-seconds)."""
        return self.num_gpus * max(0.0, now - self.work_since_s)


@dataclass(frozen=True)
class Preemption:
    job_id: str  # the waiting job the victims make room for
    gpu_type: str
    num_gpus: int  # what the waiting job's option needs
    victims: tuple[str, ...]
    lost_gpu_s: float  # of all victims, were they stopped without committing (the ranking)


def choose_victims(candidates: Sequence[Holder], need: int, now: float) -> tuple[Holder, ...] | None:
    """The set of candidates with at least `need` GPUs that loses the least work (then: fewest
    victims, then lowest priorities); None when all of them together hold fewer."""
    if need <= 0:
        return ()
    if sum(c.num_gpus for c in candidates) < need:
        return None
    # best[g]: (cost, victims) with min(need, GPUs) == g; cost = (lost, count, priorities)
    best: list[tuple | None] = [None] * (need + 1)
    best[0] = ((0.0, 0, 0), ())
    for c in sorted(candidates, key=lambda h: (h.lost_gpu_s(now), h.priority, h.job_id)):
        for g in range(need, -1, -1):  # each candidate once (0/1 knapsack)
            if best[g] is None:
                continue
            (lost, count, prio), chosen = best[g]
            to = min(need, g + c.num_gpus)
            cost = (lost + c.lost_gpu_s(now), count + 1, prio + c.priority)
            if best[to] is None or cost < best[to][0]:
                best[to] = (cost, chosen + (c,))
    return None if best[need] is None else best[need][1]


def _may_preempt(h: Holder, team: str, priority: int, snap: Snapshot) -> bool:
    if h.priority < priority:
        return True
    if not snap.rules.enforced or h.team == team:
        return False
    return snap.held.get((h.team, h.gpu_type), 0) > snap.rules.quota(h.team, h.gpu_type).nominal


def plan(snap: Snapshot, holders: Sequence[Holder], *, depth: int = 8) -> list[Preemption]:
    """The preemptions the waiting jobs of `snap` call for (see the module's docstring)."""
    queue = pass_order(snap.queue, snap.team_of, snap.priority_of, snap.usage, snap.rules, snap.head)
    coming: dict[str, int] = dict(snap.free.by_type)
    for h in holders:
        if h.stopping:
            coming[h.gpu_type] = coming.get(h.gpu_type, 0) + h.num_gpus
    taken: set[str] = set()
    out: list[Preemption] = []
    for job in queue[:depth]:
        team = snap.team_of.get(job.job_id, NO_TEAM)
        priority = snap.priority_of.get(job.job_id, 0)
        covered, best = None, None
        for opt in job.options:
            have = coming.get(opt.gpu_type, 0)
            if have >= opt.num_gpus:
                covered = opt
                break
            if snap.rules.enforced and (snap.held.get((team, opt.gpu_type), 0) + opt.num_gpus
                                        > snap.rules.quota(team, opt.gpu_type).nominal):
                continue  # the quota gate would refuse it even on freed GPUs
            candidates = [h for h in holders if not h.stopping and h.job_id not in taken
                          and h.gpu_type == opt.gpu_type and _may_preempt(h, team, priority, snap)]
            victims = choose_victims(candidates, opt.num_gpus - have, snap.now)
            if victims is None:
                continue
            lost = sum(v.lost_gpu_s(snap.now) for v in victims)
            if best is None or lost < best.lost_gpu_s:
                best = Preemption(job.job_id, opt.gpu_type, opt.num_gpus, tuple(v.job_id for v in victims), lost)
        if covered is not None:
            coming[covered.gpu_type] -= covered.num_gpus
            continue
        if best is None:
            continue
        freed = sum(h.num_gpus for h in holders if h.job_id in best.victims)
        coming[best.gpu_type] = coming.get(best.gpu_type, 0) + freed - best.num_gpus
        taken.update(best.victims)
        out.append(best)
    return out
