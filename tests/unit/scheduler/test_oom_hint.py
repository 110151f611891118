"""After an out-of-memory stop the flow's alert names the most memory-frugal plan the worker runs."""

from __future__ import annotations

from pathlib import Path

from scheduler.cluster import parse_cluster
from scheduler.planner import next_plan_hint, plan_job, worker_planner_config
from training.config import load_job_spec

REPO = Path(__file__).resolve().parents[3]
CLUSTER = parse_cluster({"name": "two-a10", "nodes": [{"name": "n1", "gpu_type": "A10", "gpu_count": 2}]})


def test_the_hint_is_the_best_plan_with_recompute_and_a_sharded_optimizer():
    spec = load_job_spec(REPO / "configs" / "tiny-cpu.yaml")
    frugal = plan_job(spec, CLUSTER, worker_planner_config(CLUSTER, recompute=("full",), distributed_optimizer=True))
    best = frugal[0]
    assert best.recompute == "full" and best.distributed_optimizer
    assert next_plan_hint(spec, CLUSTER) == (f"next plan: {best.num_gpus}x A10 {best.layout} "
                                             f"(predicted peak {best.peak_memory_bytes / 2**30:.1f} GiB)")


def test_no_plan_is_a_hint_too_never_a_second_failure():
    spec = load_job_spec(REPO / "configs" / "tiny-cpu.yaml", {"model": {
        "num_layers": 96, "hidden_size": 16384, "num_attention_heads": 128, "ffn_hidden_size": 53248}})
    assert next_plan_hint(spec, CLUSTER) == "no alternative plan found (InfeasibleJobError)"
