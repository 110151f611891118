"""Which running jobs preemption stops for a waiting one (scheduler.preemption): least work lost,
a minimal set, the right GPU type, lower classes or borrowed quota only."""

from __future__ import annotations

from scheduler.cluster import parse_cluster
from scheduler.fair_share import Quota, Snapshot, TeamRules
from scheduler.policy import FreeGpus, Option, QueuedJob
from scheduler.preemption import Holder, choose_victims, plan

NOW = 10_000.0


def _free(idle: dict[str, int]) -> FreeGpus:
    """Idle GPUs per type (a cluster whose nodes hold exactly these idle)."""
    nodes = [{"name": f"n-{t}", "gpu_type": t, "gpu_count": max(n, 1), "gpu_memory_gib": 80, "peak_tflops": 100}
             for t, n in idle.items()]
    free = FreeGpus(parse_cluster({"name": "c", "nodes": nodes}))
    free.by_type = dict(idle)
    return free


def _job(job_id: str, gpus: int, gpu_type: str = "h100") -> QueuedJob:
    return QueuedJob(job_id, 0.0, (Option(gpu_type, gpus, 1, 0, 3600.0),))


def _holder(job_id: str, gpus: int, since: float, priority: int = 0, gpu_type: str = "h100", team: str = "",
            stopping: bool = False) -> Holder:
    return Holder(job_id, team, priority, gpu_type, gpus, since, stopping)


def test_victims_are_the_set_that_loses_the_least_work():
    # 4 GPUs needed: the 4-GPU job that checkpointed a minute ago loses 240 GPU-s; the two 2-GPU
    # jobs together 2*500 + 2*100 = 1200; the 8-GPU one 8*50 = 400
    candidates = [_holder("fresh4", 4, NOW - 60), _holder("old2", 2, NOW - 500), _holder("mid2", 2, NOW - 100),
                  _holder("big8", 8, NOW - 50)]
    assert [v.job_id for v in choose_victims(candidates, 4, NOW)] == ["fresh4"]
    # without it, the 8-GPU one (400) beats the two 2-GPU ones (1200): least work, not fewest GPUs
    assert [v.job_id for v in choose_victims(candidates[1:], 4, NOW)] == ["big8"]
    # and a checkpoint just now makes any job the cheapest victim
    assert [v.job_id for v in choose_victims(candidates[1:3], 2, NOW)] == ["mid2"]


def test_the_set_is_minimal_and_none_when_not_enough():
    candidates = [_holder("a", 1, NOW - 10), _holder("b", 1, NOW - 20), _holder("c", 1, NOW - 30)]
    assert sorted(v.job_id for v in choose_victims(candidates, 2, NOW)) == ["a", "b"]
    assert choose_victims(candidates, 4, NOW) is None
    assert choose_victims(candidates, 0, NOW) == ()


def test_only_lower_classes_of_the_right_type_and_idle_gpus_count_first():
    queue = [_job("hi", 2)]
    snap = Snapshot("has", NOW, queue, [], _free({"h100": 1, "a100": 4}), priority_of={"hi": 10})
    holders = [_holder("same-class", 1, NOW - 1, priority=10),  # equal class: never a victim
               _holder("other-type", 4, NOW - 1, gpu_type="a100"),  # wrong type
               _holder("low-old", 1, NOW - 900), _holder("low-new", 1, NOW - 30)]
    [p] = plan(snap, holders)
    assert (p.job_id, p.victims, p.gpu_type) == ("hi", ("low-new",), "h100")  # 1 idle + 1 freed
    # a victim already asked to stop covers the need: no new victim
    stopping = holders[:2] + [_holder("low-old", 1, NOW - 900, stopping=True), holders[3]]
    assert plan(snap, stopping) == []


def test_a_second_waiting_job_does_not_count_the_same_gpus_again():
    queue = [_job("hi1", 1), _job("hi2", 1)]
    snap = Snapshot("has", NOW, queue, [], _free({"h100": 0}), priority_of={"hi1": 5, "hi2": 5})
    holders = [_holder("low1", 1, NOW - 10, stopping=True), _holder("low2", 1, NOW - 20)]
    [p] = plan(snap, holders)  # hi1 takes low1's GPU (already stopping), hi2 needs low2's
    assert (p.job_id, p.victims) == ("hi2", ("low2",))


def test_borrowed_quota_is_reclaimed_for_its_owner_only():
    rules = TeamRules({("A", "h100"): Quota(2, None), ("B", "h100"): Quota(2, None)})
    holders = [_holder("a1", 2, NOW - 10, team="A"), _holder("a2", 2, NOW - 5, team="A")]  # A borrows B's 2
    held = {("A", "h100"): 4}
    b = Snapshot("has", NOW, [_job("b", 2)], [], _free({"h100": 0}), rules, {"b": "B"}, {"b": 0}, held)
    [p] = plan(b, holders)
    assert p.victims == ("a2",)  # same class: only because A is over its quota; a2 loses less
    # A's own waiting job may not take its team's GPUs, nor may B's beyond B's quota
    a = Snapshot("has", NOW, [_job("a3", 2)], [], _free({"h100": 0}), rules, {"a3": "A"}, {"a3": 0}, held)
    assert plan(a, holders) == []
    big = Snapshot("has", NOW, [_job("b", 4)], [], _free({"h100": 0}), rules, {"b": "B"}, {"b": 0}, held)
    assert plan(big, holders) == []
    # within quota (A holds only its own 2): nothing is borrowed, nothing to reclaim
    within = Snapshot("has", NOW, [_job("b", 2)], [], _free({"h100": 0}), rules, {"b": "B"}, {"b": 0},
                      {("A", "h100"): 2})
    assert plan(within, holders[:1]) == []
