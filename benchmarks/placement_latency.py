"""Planner + placement latency on the 1,280-GPU Crius cluster, and simulator decisions/s.

1. One job at a time (llama-7b … mistral-large-123b, cycled), `plan_job` + `place_plans`
   on configs/clusters/crius-sim.yaml, repeated. "cold" clears every cache before each
   run (a job shape never seen before); "warm" repeats a shape already planned (the
   memory estimates are cached per (model, layout)). Target: < 50 ms.
2. Simulator: 1,000 Acme-like jobs all queued at t=0 on the same cluster; scheduling
   decisions per second (one decision = one queued job considered in a scheduling
   pass), per policy. Plan enumeration happens once per job shape before the replay
   and is not counted.

Run:  .venv/bin/python benchmarks/placement_latency.py [--runs 60] [--sim-jobs 1000]
The last line is a JSON object: plan_ms_p50, plan_ms_p99 (cold), warm figures and
sim_decisions_per_s (the slowest policy).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scheduler import planner as planner_module  # noqa: E402
from scheduler.cluster import load_cluster  # noqa: E402
from scheduler.placement import place_plans  # noqa: E402
from scheduler.planner import PlanRequest, plan_job  # noqa: E402
from scheduler.simulate import POLICIES, JobCatalogue, Simulator  # noqa: E402
from scheduler.traces import MODEL_PRESETS, generate_acme_trace  # noqa: E402

CLUSTER = Path(__file__).resolve().parents[1] / "configs" / "clusters" / "crius-sim.yaml"
SHAPES = ["llama-7b", "llama-13b", "internlm-20b", "llama-70b", "mistral-large-123b"]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def clear_caches() -> None:
    planner_module._cached_estimate.cache_clear()
    planner_module._model_from_key.cache_clear()


def time_one(cluster, request: PlanRequest) -> tuple[float, float, int, str]:
    """(wall ms, CPU ms of this process, feasible plans, where it was placed)."""
    c0, t0 = time.process_time(), time.perf_counter()
    plans = plan_job(request, cluster)
    placement = place_plans(plans, cluster, job=request.name)
    elapsed = (time.perf_counter() - t0) * 1e3
    cpu = (time.process_time() - c0) * 1e3
    where = f"{placement.world_size}x{placement.gpu_type} on {len(placement.assignments)} node(s)"
    return elapsed, cpu, len(plans), where


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=60, help="timed runs per mode (default 60)")
    ap.add_argument("--sim-jobs", type=int, default=1000)
    args = ap.parse_args()

    cluster = load_cluster(CLUSTER)
    print(f"cluster {cluster.name}: {cluster.total_gpus} GPUs on {len(cluster.nodes)} nodes, "
          f"types {cluster.gpu_types()}")
    requests = [PlanRequest(model=MODEL_PRESETS[n], global_batch=1024, precision="bf16", name=n) for n in SHAPES]

    load_before = os.getloadavg()[0]
    cold: list[float] = []
    cold_cpu: list[float] = []
    per_shape: dict[str, list[float]] = {n: [] for n in SHAPES}
    described: dict[str, str] = {}
    for i in range(args.runs):
        request = requests[i % len(requests)]
        clear_caches()
        ms, cpu, count, where = time_one(cluster, request)
        cold.append(ms)
        cold_cpu.append(cpu)
        per_shape[request.name].append(ms)
        described[request.name] = f"{count} feasible plans, placed {where}"
    warm: list[float] = []
    for i in range(args.runs):
        ms, _, _, _ = time_one(cluster, requests[i % len(requests)])
        warm.append(ms)

    print("\nplanner + placement, one job (cold = caches cleared before each run)")
    for name in SHAPES:
        values = per_shape[name]
        print(f"  {name:20s} cold median {statistics.median(values):7.2f} ms   {described[name]}")
    print(f"  all shapes: cold p50 {percentile(cold, 50):.2f} ms, p99 {percentile(cold, 99):.2f} ms; "
          f"warm p50 {percentile(warm, 50):.2f} ms, p99 {percentile(warm, 99):.2f} ms  (target < 50 ms)")
    print(f"  CPU time of this process, cold: p50 {percentile(cold_cpu, 50):.2f} ms, p99 {percentile(cold_cpu, 99):.2f} ms "
          f"(wall-clock includes waiting for a core: load average was {load_before:.1f} on {os.cpu_count()} CPUs)")

    jobs = generate_acme_trace(args.sim_jobs, cluster_gpus=cluster.total_gpus, seed=7)
    for j in jobs:
        j.arrival_s = 0.0  # everything queued at once
    t0 = time.perf_counter()
    catalogue = JobCatalogue(cluster)
    options = {j.job_id: catalogue.options(j) for j in jobs}
    prep_s = time.perf_counter() - t0
    print(f"\nsimulator: {len(jobs)} jobs queued at t=0 (plan enumeration for all: {prep_s:.2f} s, not counted)")
    rates: dict[str, float] = {}
    for policy in POLICIES:
        t0 = time.perf_counter()
        result = Simulator(cluster, jobs, policy, catalogue, options).run()
        wall = time.perf_counter() - t0
        rates[policy] = result.decisions / result.decision_seconds
        print(f"  {policy:5s} {result.decisions:9d} decisions in {result.passes} passes, "
              f"{rates[policy]:12,.0f} decisions/s, {1e6 / rates[policy]:7.1f} µs/decision (replay {wall:.1f} s)")

    print(json.dumps({
        "plan_ms_p50": round(percentile(cold, 50), 3),
        "plan_ms_p99": round(percentile(cold, 99), 3),
        "plan_cpu_ms_p50": round(percentile(cold_cpu, 50), 3),
        "plan_cpu_ms_p99": round(percentile(cold_cpu, 99), 3),
        "plan_ms_p50_warm": round(percentile(warm, 50), 3),
        "plan_ms_p99_warm": round(percentile(warm, 99), 3),
        "sim_decisions_per_s": round(min(rates.values()), 1),
        "sim_decisions_per_s_by_policy": {k: round(v, 1) for k, v in rates.items()},
        "load_average": round(load_before, 2),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
