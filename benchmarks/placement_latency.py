"""Planner + placement latency on the 1,280-GPU Crius cluster, and simulator decisions/s.

1. One job at a time (llama-7b … mistral-large-123b at 2,048 tokens, cycled), `plan_job` +
   `place_plans` on configs/clusters/crius-sim.yaml, repeated. "cold" clears every cache before each
   run (a job shape never seen before); "warm" repeats a shape already planned (the
   memory estimates are cached per (model, layout)). Target: < 50 ms.
2. Simulator: 1,000 Acme-like jobs all queued at t=0 on the same cluster; scheduling
   decisions per second (one decision = one queued job considered in a scheduling
   pass), per policy. Plan enumeration happens once per job shape before the replay
   and is not counted.

The largest shape is mistral-large-123b at seq_length 2048, not its preset's 4096. Since
crius-sim.yaml has Crius Table 1's node shapes, no GPU type of it holds 123B at 4,096 tokens
(global batch 1,024, bf16, 10 % margin), and the planner is right about that (checked by
hand against MARP, scheduler.memory_model): 123B parameters over the largest model split the
A100-40G nodes of 4 allow (tp 4 inside a node, pp 8: the largest power of two dividing the 88
layers) is 3.83B parameters per GPU: weights 7.28 GiB (bf16) + gradients 14.56 GiB (fp32
main grads) = 21.8 GiB, plus the distributed optimizer's 12 bytes per parameter over dp.
256 of the 320 A100s give dp 8 (dp divides the batch of 1,024, so 320 cannot all be used):
optimizer 5.46 GiB; with full recompute and micro batch 1 the first stage still holds 8
micro batches in flight x (11 layer inputs + its own input) x 4,096 x 12,288 x 2 bytes
= 9 GiB of activations (no sequence parallelism in the worker, so not split by tp), 10.15 GiB
with the replayed layer; + 2.3 GiB runtime overhead + 0.26 GiB transient = 40.0 GiB against
36 GiB usable. It fits from dp 32 (1,024 A100s: 35.95 GiB); the A40s (48 GiB, nodes of 2,
tp <= 2) never hold it; the V100s (32 GiB, nodes of 16, tp 8) from 512. What would fit on
these 320 A100s is outside the worker's and the planner's search: sequence parallelism
(activations / 4: ~33 GiB), pp 22 or 44 (not a power of two; tp 4 pp 22 dp 2 on 176 GPUs:
30.8 GiB) or tp 8 across two nodes. At 2,048 tokens the activations halve and 123B is placed
on 256 A100-40G (tp 4, pp 8, dp 8, full recompute: 34.4 GiB): the same parameter count, the
largest job of the Acme mix, and the planner's own smallest suggested alternative.

Run:  .venv/bin/python benchmarks/placement_latency.py [--runs 60] [--sim-jobs 1000]
      .venv/bin/python benchmarks/placement_latency.py --smoke   # one run per shape, 50 jobs: seconds
The last line is a JSON object (HEADLINE_KEYS): plan_ms_p50, plan_ms_p99 (cold), warm figures
and sim_decisions_per_s (the slowest policy).
"""

from __future__ import annotations

import json
import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.headline import checked_headline  # noqa: E402
from scheduler import planner as planner_module  # noqa: E402
from scheduler.cluster import load_cluster  # noqa: E402
from scheduler.placement import place_plans  # noqa: E402
from scheduler.planner import PlanRequest, plan_job  # noqa: E402
from scheduler.simulate import POLICIES, JobCatalogue, Simulator  # noqa: E402
from scheduler.traces import MODEL_PRESETS, generate_acme_trace  # noqa: E402

CLUSTER = Path(__file__).resolve().parents[1] / "configs" / "clusters" / "crius-sim.yaml"
SHAPES = ["llama-7b", "llama-13b", "internlm-20b", "llama-70b", "mistral-large-123b"]
# The shapes' sequence lengths where not their preset's: 123B at 4,096 tokens fits no GPU type
# of crius-sim (see the docstring for the arithmetic).
SEQ_LENGTH = {"mistral-large-123b": 2048}
HEADLINE_KEYS = ("plan_ms_p50", "plan_ms_p99", "plan_cpu_ms_p50", "plan_cpu_ms_p99", "plan_ms_p50_warm",
                 "plan_ms_p99_warm", "sim_decisions_per_s", "sim_decisions_per_s_by_policy", "load_average")


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
    ap.add_argument("--smoke", action="store_true",
                    help="one timed run per shape and 50 simulated jobs: seconds, same code path and keys")
    args = ap.parse_args()
    if args.smoke:
        args.runs, args.sim_jobs = len(SHAPES), 50

    cluster = load_cluster(CLUSTER)
    print(f"cluster {cluster.name}: {cluster.total_gpus} GPUs on {len(cluster.nodes)} nodes, "
          f"types {cluster.gpu_types()}")
    models = {n: MODEL_PRESETS[n].model_copy(update={"seq_length": SEQ_LENGTH[n]}) if n in SEQ_LENGTH
              else MODEL_PRESETS[n] for n in SHAPES}
    requests = [PlanRequest(model=models[n], global_batch=1024, precision="bf16", name=n) for n in SHAPES]

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
        seq = models[name].seq_length
        print(f"  {name:20s} seq {seq:5d} cold median {statistics.median(values):7.2f} ms   {described[name]}")
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

    print(json.dumps(checked_headline({
        "plan_ms_p50": round(percentile(cold, 50), 3),
        "plan_ms_p99": round(percentile(cold, 99), 3),
        "plan_cpu_ms_p50": round(percentile(cold_cpu, 50), 3),
        "plan_cpu_ms_p99": round(percentile(cold_cpu, 99), 3),
        "plan_ms_p50_warm": round(percentile(warm, 50), 3),
        "plan_ms_p99_warm": round(percentile(warm, 99), 3),
        "sim_decisions_per_s": round(min(rates.values()), 1),
        "sim_decisions_per_s_by_policy": {k: round(v, 1) for k, v in rates.items()},
        "load_average": round(load_before, 2),
    }, HEADLINE_KEYS)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
