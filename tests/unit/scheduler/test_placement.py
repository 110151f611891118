"""HAS placement (Frenzy's worked examples, cordons, tp groups), cross mapping, launch specs."""

from __future__ import annotations

from pathlib import Path

import pytest

from scheduler.cluster import GIB, load_cluster, parse_cluster
from scheduler.placement import (
    GpuRequest,
    PlacementError,
    allocate_placement,
    build_placement,
    first_fit_select,
    has_select,
    place_plans,
    release_placement,
)
from scheduler.planner import PlannerConfig, PlanRequest, plan_job
from scheduler.traces import MODEL_PRESETS

REPO = Path(__file__).resolve().parents[3]


def cluster_of(*nodes: dict, bandwidth: float = 100.0):
    return parse_cluster({"name": "t", "inter_node_bandwidth_gbps": bandwidth, "nodes": list(nodes)})


def node(name: str, gpus: int, gpu_type: str = "A100-40G", **extra) -> dict:
    return {"name": name, "gpu_type": gpu_type, "gpu_count": gpus, **extra}


def test_frenzy_example_job_2x32gb_goes_to_the_3_idle_40gb_node():
    cluster = cluster_of(node("big", 6, "A100-80G"), node("small", 3, "A100-40G"))
    chosen = has_select(cluster, GpuRequest(count=2, min_memory_bytes=32 * GIB))
    assert chosen == {"small": 2}


def test_frenzy_example_job_4x35gb_goes_to_one_4_gpu_node_not_four_1_gpu_nodes():
    cluster = cluster_of(*(node(f"one-{i}", 1) for i in range(4)), node("four", 4))
    chosen = has_select(cluster, GpuRequest(count=4, min_memory_bytes=35 * GIB))
    assert chosen == {"four": 4}
    # The baseline's first fit takes the four single-GPU nodes listed first.
    assert first_fit_select(cluster, GpuRequest(count=4, min_memory_bytes=35 * GIB)) == {
        f"one-{i}": 1 for i in range(4)
    }


def test_has_spreads_from_the_largest_node_then_best_fits_the_rest():
    cluster = cluster_of(node("n1", 1), node("n2", 2), node("n3", 3))
    assert has_select(cluster, GpuRequest(count=5)) == {"n3": 3, "n2": 2}
    assert has_select(cluster, GpuRequest(count=7)) is None


def test_has_respects_memory_type_and_tensor_parallel_groups():
    cluster = cluster_of(node("a", 3), node("b", 3), node("c", 8, "A10"))
    assert has_select(cluster, GpuRequest(count=2, min_memory_bytes=48 * GIB)) is None
    # tp=2 groups cannot straddle nodes: 3 idle GPUs per node give 2 usable each.
    assert has_select(cluster, GpuRequest(count=4, unit=2, gpu_type="A100-40G")) == {"b": 2, "a": 2}
    assert has_select(cluster, GpuRequest(count=6, unit=2, gpu_type="A100-40G")) is None
    with pytest.raises(PlacementError):
        GpuRequest(count=3, unit=2)


def test_cordoned_nodes_are_never_chosen_even_when_they_fit_best():
    cluster = cluster_of(node("best", 2), node("other", 8))
    cluster.cordon("best")
    assert has_select(cluster, GpuRequest(count=2)) == {"other": 2}
    cluster.cordon("other")
    assert has_select(cluster, GpuRequest(count=1)) is None
    assert first_fit_select(cluster, GpuRequest(count=1)) is None


def test_cross_mapping_puts_adjacent_stages_on_different_root_complexes():
    cluster = cluster_of(node("n", 4, pcie_root_complex=[0, 0, 1, 1]))
    crossed = build_placement(cluster, {"n": 4}, job="j", gpu_type="A100-40G", dp=1, tp=1, pp=4)
    naive = build_placement(cluster, {"n": 4}, job="j", gpu_type="A100-40G", dp=1, tp=1, pp=4, cross_map=False)
    rcs = crossed.assignments[0].root_complexes
    assert all(rcs[i] != rcs[i + 1] for i in range(3)), rcs
    assert crossed.stage_root_complex_conflicts() == 0 and crossed.cross_mapped
    assert naive.stage_root_complex_conflicts() > 0 and not naive.cross_mapped
    assert sorted(crossed.assignments[0].gpus) == [0, 1, 2, 3]


def test_cross_mapping_on_an_sxm_board_and_multi_gpu_stages():
    cluster = cluster_of(node("n", 8, pcie_root_complex=[0, 0, 1, 1, 2, 2, 3, 3]))
    eight = build_placement(cluster, {"n": 8}, job="j", gpu_type="A100-40G", dp=1, tp=1, pp=8)
    assert eight.stage_root_complex_conflicts() == 0
    # Stages of 2 GPUs (tp=2): each stage stays under one root complex, neighbours differ.
    pairs = build_placement(cluster, {"n": 8}, job="j", gpu_type="A100-40G", dp=1, tp=2, pp=4)
    a = pairs.assignments[0]
    stage_rcs = {s: {rc for st, rc in zip(a.stages, a.root_complexes) if st == s} for s in range(4)}
    assert all(len(v) == 1 for v in stage_rcs.values())
    assert all(stage_rcs[s].isdisjoint(stage_rcs[s + 1]) for s in range(3))


def test_gpus_are_spread_over_root_complexes_when_a_node_takes_part_of_a_pipeline():
    cluster = cluster_of(node("n", 8, pcie_root_complex=[0, 0, 0, 0, 1, 1, 1, 1]))
    two = build_placement(cluster, {"n": 2}, job="j", gpu_type="A100-40G", dp=1, tp=1, pp=2)
    assert set(two.assignments[0].root_complexes) == {0, 1}


def test_place_plans_allocates_ranks_and_renders_one_torchrun_per_node():
    cluster = load_cluster(REPO / "configs" / "clusters" / "crius-sim.yaml")
    request = PlanRequest(model=MODEL_PRESETS["llama-13b"], global_batch=512, precision="bf16", name="j13")
    plans = plan_job(request, cluster, PlannerConfig(gpu_counts=(32,), gpu_types=("A100-40G",)))
    before = cluster.free_gpus_by_type()["A100-40G"]
    placement = place_plans(plans, cluster, job="j13", allocate=True)
    assert placement is not None and placement.plan is plans[0]
    assert placement.world_size == 32 and len(placement.assignments) == 8  # 8 full 4-GPU nodes
    assert cluster.free_gpus_by_type()["A100-40G"] == before - 32
    ranks = [r for a in placement.assignments for r in a.ranks]
    assert ranks == list(range(32))
    specs = placement.launch_specs()
    assert [s.node_rank for s in specs] == list(range(8)) and all(s.nnodes == 8 for s in specs)
    assert sum(s.nproc_per_node for s in specs) == 32
    assert specs[0].master_addr == placement.master_addr == placement.assignments[0].address
    for spec, a in zip(specs, placement.assignments):
        assert spec.env()["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, a.gpus))
        assert f"--node-rank={spec.node_rank}" in spec.torchrun_args()
        assert spec.first_global_rank == a.ranks[0]
    # Busy GPUs cannot be handed out twice; releasing gives them back.
    with pytest.raises(PlacementError):
        allocate_placement(cluster, placement)
    release_placement(cluster, placement)
    assert cluster.free_gpus_by_type()["A100-40G"] == before


def test_place_plans_falls_back_to_the_next_plan_and_returns_none_when_nothing_is_free():
    cluster = load_cluster(REPO / "configs" / "clusters" / "frenzy-testbed.yaml")
    request = PlanRequest(model=MODEL_PRESETS["gpt2-350m"], global_batch=16, precision="bf16")
    plans = plan_job(request, cluster, PlannerConfig(gpu_counts=(2,)))
    first = place_plans(plans, cluster, allocate=True)
    taken = []
    while first is not None:
        taken.append(first)
        first = place_plans(plans, cluster, allocate=True)
    # Every 2-GPU hole of the testbed got used, never by two jobs at once.
    used = [(a.node, g) for p in taken for a in p.assignments for g in a.gpus]
    assert len(used) == len(set(used)) == 2 * len(taken)
    assert len(taken) >= 4 and len({p.plan.gpu_type for p in taken}) >= 2


def test_cpu_devices_get_no_cuda_visible_devices():
    cluster = cluster_of(node("box", 2, "cpu", gpu_memory_gib=4, peak_tflops=0.1))
    placement = build_placement(cluster, {"box": 2}, job="j", gpu_type="cpu", dp=2, tp=1, pp=1)
    spec = placement.launch_specs()[0]
    assert spec.cuda_visible_devices == "" and spec.env() == {} and spec.nproc_per_node == 2
