"""The elastic policy: golden decisions on hand-built cases, and the simulator running it.

Jobs here are pure data parallel (unit 1) on one GPU type, so the counts say everything:
`Option.run_s` is the whole job on that layout, `ElasticRunning.remaining` the fraction left.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from scheduler.cluster import load_cluster, parse_cluster
from scheduler.elastic import (
    MEASURED_RESTART_S,
    ElasticConfig,
    ElasticRunning,
    elastic_pass,
    resizable_layouts,
)
from scheduler.fair_share import TeamRules
from scheduler.placement import first_fit_select
from scheduler.policy import FreeGpus, Option, QueuedJob
from scheduler.simulate import SIM_POLICIES, Simulator, SimulationError, simulate
from scheduler.traces import TraceJob, generate_frenzy_queue

REPO = Path(__file__).resolve().parents[3]
GPU = "A100-80G"
NOW = 10_000.0


def _cluster(nodes: int = 2, per_node: int = 8):
    return parse_cluster({"name": "t", "nodes": [{"name": f"n{i}", "gpu_type": GPU, "gpu_count": per_node}
                                                 for i in range(nodes)]})


def _opt(n: int, run_s: float) -> Option:
    return Option(gpu_type=GPU, num_gpus=n, unit=1, min_memory_bytes=0, run_s=run_s, dp=n)


def _running(free: FreeGpus, job_id: str, layouts: dict[int, float], now_at: int, *, remaining: float = 1.0,
             requested: int | None = None, last_resize_s: float = 0.0) -> ElasticRunning:
    """A running job holding `now_at` GPUs (allocated on `free`), resizable to `layouts` {count: run_s}."""
    options = tuple(_opt(n, s) for n, s in sorted(layouts.items()))
    current = next(o for o in options if o.num_gpus == now_at)
    placement = free.try_place(job_id, current, first_fit_select)
    assert placement is not None
    return ElasticRunning(job_id, current, placement, NOW + remaining * current.run_s, remaining, last_resize_s,
                          requested or now_at, options)


def _waiting(job_id: str, n: int, run_s: float) -> QueuedJob:
    return QueuedJob(job_id, NOW - 60.0, [_opt(n, run_s)])


def _held(decision, running) -> dict[str, set]:
    """GPUs per job after the decision: resized jobs' new placements, started jobs', the others' old."""
    moved = {rz.job_id: rz.placement for rz in decision.resizes}
    held = {r.job_id: moved.get(r.job_id, r.placement) for r in running}
    held.update({q.job_id: p for q, _, p in decision.started})
    return {j: {(a.node, g) for a in p.assignments for g in a.gpus} for j, p in held.items()}


def test_a_queued_job_starts_by_shrinking_a_running_one_when_that_saves_more_than_it_costs():
    free = FreeGpus(_cluster())
    # A scales poorly from 8 to 16 GPUs: halving it costs 100 s (+ a restart); B would wait 1,000 s
    a = _running(free, "A", {8: 1100.0, 16: 1000.0}, 16)
    decision = elastic_pass(NOW, [_waiting("B", 8, 100.0)], [a], free)
    assert [(q.job_id, o.num_gpus) for q, o, _ in decision.started] == [("B", 8)]
    [rz] = decision.resizes
    assert (rz.job_id, rz.kind, rz.old.num_gpus, rz.new.num_gpus, rz.for_job) == ("A", "shrink", 16, 8, "B")
    assert rz.gain_s == pytest.approx(1000.0) and rz.cost_s == pytest.approx(100.0 + MEASURED_RESTART_S)
    held = _held(decision, [a])
    assert len(held["A"]) == 8 and len(held["B"]) == 8 and not held["A"] & held["B"]
    assert free.by_type[GPU] == 0 == free.cluster.free_gpus_by_type()[GPU]


def test_no_shrink_when_the_victim_loses_more_than_the_queued_job_gains():
    free = FreeGpus(_cluster())
    # A scales linearly: halving it costs 500 s + a restart; B gains 500 s by starting now
    a = _running(free, "A", {8: 2000.0, 16: 1000.0}, 16, remaining=0.5)
    decision = elastic_pass(NOW, [_waiting("B", 8, 100.0)], [a], free)
    assert decision.started == [] and decision.resizes == []
    assert free.by_type[GPU] == 0 and a.placement.world_size == 16


def test_a_running_job_grows_into_idle_gpus():
    free = FreeGpus(_cluster())
    a = _running(free, "A", {4: 4000.0, 8: 2000.0, 16: 1000.0}, 8)
    decision = elastic_pass(NOW, [], [a], free)
    [rz] = decision.resizes
    assert (rz.kind, rz.old.num_gpus, rz.new.num_gpus) == ("grow", 8, 16)
    assert rz.gain_s == pytest.approx(1000.0)
    assert len(_held(decision, [a])["A"]) == 16 and free.by_type[GPU] == 0


def test_no_growth_when_the_time_saved_is_less_than_a_restart():
    free = FreeGpus(_cluster())
    # 1 % left: 16 GPUs would save 0.01 x 1000 = 10 s < 11.97 s of restart
    a = _running(free, "A", {8: 2000.0, 16: 1000.0}, 8, remaining=0.01)
    assert elastic_pass(NOW, [], [a], free).resizes == []
    # a dearer restart stops a bigger saving too
    b_free = FreeGpus(_cluster())
    b = _running(b_free, "B", {8: 2000.0, 16: 1000.0}, 8, remaining=0.5)
    assert elastic_pass(NOW, [], [b], b_free, ElasticConfig(resize_cost_s=600.0)).resizes == []
    assert elastic_pass(NOW, [], [b], b_free, ElasticConfig(resize_cost_s=400.0)).resizes != []


def test_a_grown_job_shrinks_back_first_when_a_queued_job_needs_the_gpus():
    free = FreeGpus(_cluster(nodes=3))
    # A asked for 8 and was grown to 16; C runs at its request of 8 and could halve more cheaply
    # per GPU freed (15.5 s against A's 26.5 s), but growth is given back first
    a = _running(free, "A", {4: 3000.0, 8: 1500.0, 16: 1100.0}, 16, remaining=0.5, requested=8)
    c = _running(free, "C", {4: 1000.0, 8: 900.0}, 8, remaining=0.5)
    decision = elastic_pass(NOW, [_waiting("B", 4, 100.0)], [a, c], free)
    assert [q.job_id for q, _, _ in decision.started] == ["B"]
    [rz] = decision.resizes
    assert (rz.job_id, rz.kind, rz.new.num_gpus) == ("A", "shrink", 8)  # back to its request, not below
    held = _held(decision, [a, c])
    assert sum(map(len, held.values())) == 8 + 8 + 4
    assert free.by_type[GPU] == 4  # A gave back 8, B took 4: the other 4 stay idle this pass


def test_min_resize_interval_is_respected_in_both_directions():
    config = ElasticConfig(min_resize_interval_s=300.0)
    free = FreeGpus(_cluster())
    recent = _running(free, "A", {8: 2000.0, 16: 1000.0}, 8, last_resize_s=NOW - 299.0)
    assert elastic_pass(NOW, [], [recent], free, config).resizes == []  # no growth yet
    free = FreeGpus(_cluster())
    due = _running(free, "A", {8: 2000.0, 16: 1000.0}, 8, last_resize_s=NOW - 300.0)
    assert [rz.kind for rz in elastic_pass(NOW, [], [due], free, config).resizes] == ["grow"]
    free = FreeGpus(_cluster())
    busy = _running(free, "A", {8: 1100.0, 16: 1000.0}, 16, last_resize_s=NOW - 10.0)
    decision = elastic_pass(NOW, [_waiting("B", 8, 100.0)], [busy], free, config)
    assert decision.resizes == [] and decision.started == []  # would shrink, but resized 10 s ago


def test_never_hands_out_more_gpus_than_are_free_and_no_gpu_to_two_jobs():
    rng = random.Random(7)
    for case in range(150):
        cluster = _cluster(nodes=rng.choice((2, 3, 4)), per_node=rng.choice((2, 4, 8)))
        total = cluster.total_gpus
        free = FreeGpus(cluster)
        running = []
        for i in range(rng.randint(0, 4)):
            n = rng.choice((1, 2, 4, 8))
            if free.by_type[GPU] < n:
                break
            run = rng.uniform(500, 5000)
            layouts = {c: run * n / c * rng.uniform(1.0, 1.3) for c in (1, 2, 4, 8, 16) if c <= total}
            layouts[n] = run
            running.append(_running(free, f"r{i}", layouts, n, remaining=rng.uniform(0.05, 1.0),
                                    requested=rng.choice((n, max(1, n // 2))),
                                    last_resize_s=NOW - rng.choice((0.0, 1000.0))))
        queue = [_waiting(f"q{i}", rng.choice((1, 2, 4, 8)), rng.uniform(50, 3000)) for i in range(rng.randint(0, 5))]
        idle_before = free.by_type[GPU]
        decision = elastic_pass(NOW, queue, running, free, ElasticConfig(min_resize_interval_s=300.0))
        held = _held(decision, running)
        gpus = [g for s in held.values() for g in s]
        assert len(gpus) == len(set(gpus)), f"case {case}: a GPU held by two jobs"
        assert len(gpus) <= total
        assert free.by_type[GPU] == total - len(gpus) == cluster.free_gpus_by_type()[GPU], case
        handed = sum(o.num_gpus for _, o, _ in decision.started) + sum(
            rz.new.num_gpus - rz.old.num_gpus for rz in decision.resizes)
        assert handed <= idle_before, case  # net GPUs handed out: at most the idle ones
        for rz in decision.resizes:  # each job resizes at most once, only if past its interval
            assert sum(1 for x in decision.resizes if x.job_id == rz.job_id) == 1
            assert next(r for r in running if r.job_id == rz.job_id).last_resize_s <= NOW - 300.0


def test_resizable_layouts_keep_the_model_parallel_degrees_and_the_bounds():
    def o(n, tp, pp, run):
        return Option(gpu_type=GPU, num_gpus=n, unit=tp, min_memory_bytes=0, run_s=run, dp=n // (tp * pp), tp=tp, pp=pp)

    current = o(16, 2, 2, 100.0)
    options = [o(4, 2, 2, 400.0), o(8, 2, 2, 200.0), o(8, 4, 2, 150.0), o(32, 2, 2, 50.0), o(64, 2, 2, 25.0),
               o(128, 2, 2, 12.0)]
    layouts = resizable_layouts(options, current, 16, ElasticConfig(min_shrink_factor=0.25, max_grow_factor=4.0))
    assert [(x.num_gpus, x.tp, x.pp) for x in layouts] == [(4, 2, 2), (8, 2, 2), (16, 2, 2), (32, 2, 2), (64, 2, 2)]
    assert resizable_layouts([o(8, 4, 2, 150.0)], current, 16, ElasticConfig()) == ()  # only other tp: fixed


def test_config_refuses_nonsense():
    for bad in ({"resize_cost_s": -1.0}, {"min_resize_interval_s": -5.0}, {"max_grow_factor": 0.5},
                {"min_shrink_factor": 0.0}, {"shrink_depth": -1}, {"admission": "elastic"}):
        with pytest.raises(ValueError):
            ElasticConfig(**bad)


# --- the simulator running it ---------------------------------------------------------------


@pytest.fixture(scope="module")
def elastic_run():
    cluster = load_cluster(REPO / "configs/clusters/frenzy-testbed.yaml")
    jobs = generate_frenzy_queue(24, seed=3, span_s=1200)
    jobs += [TraceJob(job_id=f"eval-{i}", arrival_s=60.0 * i, num_gpus=1 + (i % 3), category="evaluation",
                      duration_s=300.0 + 40 * i) for i in range(12)]
    return cluster, jobs, simulate(cluster, jobs, ["fcfs", "elastic"])


def test_elastic_in_the_simulator_conserves_work_and_resizes(elastic_run):
    _, jobs, results = elastic_run
    result = results["elastic"]
    assert "elastic" in SIM_POLICIES and result.summary()["finished"] == len(jobs)
    for r in result.records:
        assert r.work_done == pytest.approx(1.0, abs=1e-9), r.job_id  # each job did exactly its work
        assert len(r.spans) == r.resizes + 1
        assert r.spans[0][0] == r.start_s and r.spans[-1][1] == r.end_s
        assert all(a[1] == b[0] for a, b in zip(r.spans, r.spans[1:]))  # no gap: held GPUs all along
    resized = [r for r in result.records if r.resizes]
    assert resized and result.summary()["resizes"] == sum(r.resizes for r in resized)
    sizes = [[len(s[2]) for s in r.spans] for r in resized]
    assert any(b > a for s in sizes for a, b in zip(s, s[1:])), "no job grew"
    assert any(b < a for s in sizes for a, b in zip(s, s[1:])), "no job shrank"
    assert all(r.resizes == 0 for r in results["fcfs"].records)


def test_elastic_in_the_simulator_never_gives_a_gpu_to_two_jobs(elastic_run):
    cluster, _, results = elastic_run
    held: dict[tuple[str, int], list[tuple[float, float, str]]] = {}
    for r in results["elastic"].records:
        for t0, t1, gpus in r.spans:
            for g in gpus:
                held.setdefault(g, []).append((t0, t1, r.job_id))
    for g, spans in held.items():
        spans.sort()
        for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
            assert start >= end, f"GPU {g}: {a} and {b} overlap"
    # and at no event more GPUs are busy than the cluster has
    assert max(busy for _, busy in results["elastic"].timeline) <= cluster.total_gpus


def test_a_restart_costs_time_and_unknown_settings_are_refused(elastic_run):
    cluster, jobs, results = elastic_run
    slow = Simulator(cluster, jobs, "elastic", elastic=ElasticConfig(resize_cost_s=120.0)).run()
    assert all(r.work_done == pytest.approx(1.0, abs=1e-9) for r in slow.records)
    with pytest.raises(SimulationError, match="elastic"):
        Simulator(cluster, jobs, "elastik")
    with pytest.raises(SimulationError, match="teams"):
        Simulator(cluster, jobs, "elastic", teams=TeamRules())
