"""When MARP finds no GPU-resident plan, the planner offers a Mobius offload plan with a predicted step time."""

from __future__ import annotations

import pytest

from scheduler.cluster import parse_cluster
from scheduler.planner import InfeasibleJobError, PlannerConfig, PlanRequest, plan_job
from training.config import ModelConfig


def _server(host_ram_gib: float):
    return parse_cluster({"name": "commodity", "nodes": [{
        "name": "box", "gpu_type": "RTX3090Ti", "gpu_count": 8, "gpu_memory_gib": 24, "peak_tflops": 80,
        "intra_link": "PCIe", "intra_bandwidth_gbps": 52, "pcie_root_complex": [0, 0, 0, 0, 1, 1, 1, 1],
        "host_ram_gib": host_ram_gib}]})


MODEL = ModelConfig(num_layers=40, hidden_size=5120, num_attention_heads=40, vocab_size=32000, seq_length=1024)


def test_a_13b_job_that_fits_no_gpu_gets_an_offload_plan():
    request = PlanRequest(model=MODEL, global_batch=8, name="ft13b")
    with pytest.raises(InfeasibleJobError) as err:
        plan_job(request, _server(1536), PlannerConfig(recompute=("full",)))
    plan = err.value.offload_plan
    assert plan is not None and plan.num_gpus == 8 and plan.partition.num_stages >= 8
    assert plan.predicted_step_time_s > 0
    assert "Mobius offload" in str(err.value) and any("Mobius offload" in a for a in err.value.alternatives)
    # cross mapping: neighbouring positions under different root complexes
    rc = [0, 0, 0, 0, 1, 1, 1, 1]
    assert all(rc[a] != rc[b] for a, b in zip(plan.gpu_of_position, plan.gpu_of_position[1:]))


def test_no_offload_plan_when_host_memory_cannot_hold_the_state():
    with pytest.raises(InfeasibleJobError) as err:
        plan_job(PlanRequest(model=MODEL, global_batch=8), _server(64))
    assert err.value.offload_plan is None
