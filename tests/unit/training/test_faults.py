"""Fault-injection spec parsing and the fire-once rule (the faults themselves: integration)."""

from __future__ import annotations

import pytest

from training.config import FaultConfig
from training.faults import (
    CUDA_ILLEGAL_ACCESS_MESSAGE,
    LOSS_SPIKE_FACTOR,
    FaultInjector,
    FaultPlan,
    FaultSpecError,
    parse_fault,
    plan_from,
)


@pytest.mark.parametrize("text, plan", [
    ("cuda_error@12", FaultPlan("cuda_error", 12, 0)),
    ("hang@30:1", FaultPlan("hang", 30, 1)),
    (" oom_kill@0 ", FaultPlan("oom_kill", 0, 0)),
    ("exit_mid_checkpoint@20:3", FaultPlan("exit_mid_checkpoint", 20, 3)),
])
def test_parse_fault(text, plan):
    assert parse_fault(text) == plan


@pytest.mark.parametrize("text, hint", [
    ("cuda_error", "kind@step"),
    ("cuda_error@x", "kind@step"),
    ("cuda_error@3:", "kind@step"),
    ("segfault@3", "unknown fault kind 'segfault'"),
])
def test_bad_fault_specs_name_the_problem(text, hint):
    with pytest.raises(FaultSpecError, match=hint):
        parse_fault(text)


def test_env_var_wins_over_the_spec_and_nothing_means_no_fault():
    spec_fault = FaultConfig(kind="hang", at_step=5, rank=1)
    assert plan_from(spec_fault, {"FORGEFLOW_FAULT": "oom_kill@7"}) == FaultPlan("oom_kill", 7, 0)
    assert plan_from(spec_fault, {}) == FaultPlan("hang", 5, 1)
    assert plan_from(FaultConfig(), {}) is None
    assert plan_from(None, {"FORGEFLOW_FAULT": ""}) is None


def test_a_fault_fires_at_its_step_on_its_rank_only_and_only_once(tmp_path):
    plan = FaultPlan("script_error", 3, 1)
    other_rank = FaultInjector(plan, rank=0, run_dir=tmp_path)
    failing = FaultInjector(plan, rank=1, run_dir=tmp_path)
    for step in (1, 2, 3, 4):
        other_rank.after_step(step)
    failing.after_step(2)
    with pytest.raises(KeyError, match="attention_mask"):
        failing.after_step(3)
    # the restarted worker of the same run directory does not fire again
    restarted = FaultInjector(plan, rank=1, run_dir=tmp_path)
    restarted.after_step(3)
    assert restarted.plan is None


def test_cuda_error_raises_pytorchs_text():
    assert CUDA_ILLEGAL_ACCESS_MESSAGE.startswith("CUDA error: an illegal memory access was encountered\n")
    assert "CUDA kernel errors might be asynchronously reported" in CUDA_ILLEGAL_ACCESS_MESSAGE
    assert "CUDA_LAUNCH_BLOCKING=1" in CUDA_ILLEGAL_ACCESS_MESSAGE


def test_cuda_error_is_a_runtime_error(tmp_path):
    injector = FaultInjector(FaultPlan("cuda_error", 2), rank=0, run_dir=tmp_path)
    with pytest.raises(RuntimeError, match="an illegal memory access was encountered"):
        injector.after_step(2)


def test_loss_spike_scales_the_observed_loss_after_its_step_on_every_rank(tmp_path):
    injector = FaultInjector(FaultPlan("loss_spike", 2, 0), rank=1, run_dir=tmp_path)
    assert injector.observed_loss(3.0) == 3.0
    injector.after_step(2)
    assert injector.observed_loss(3.0) == 3.0 * LOSS_SPIKE_FACTOR


def test_exit_mid_checkpoint_ignores_checkpoints_before_its_step(tmp_path):
    injector = FaultInjector(FaultPlan("exit_mid_checkpoint", 10), rank=0, run_dir=tmp_path)
    injector.after_shards_written(5)  # returns: an earlier checkpoint is written normally
    assert not (tmp_path / "markers").exists()


def test_a_drill_fires_once_per_flow_run_scope(tmp_path, monkeypatch):
    """The fired record is the flow run's: a restart in the same flow run recovers, a new flow
    run of the same job (same run directory) drills again."""
    plan = FaultPlan("script_error", 3, 0)
    first_run = FaultInjector(plan, rank=0, run_dir=tmp_path, scope="run-a")
    with pytest.raises(KeyError):
        first_run.after_step(3)
    assert FaultInjector(plan, rank=0, run_dir=tmp_path, scope="run-a").plan is None  # restart: recovers
    monkeypatch.setenv("FORGEFLOW_FAULT_SCOPE", "run-b")  # how the pretrain flow passes it
    next_run = FaultInjector(plan, rank=0, run_dir=tmp_path)
    assert next_run.plan == plan
    with pytest.raises(KeyError):
        next_run.after_step(3)
    fired = sorted(p.name for p in (tmp_path / "markers").iterdir())
    assert fired == ["fault_fired.script_error@3.rank0.run-a", "fault_fired.script_error@3.rank0.run-b"]
    # a scope never escapes the markers folder
    assert FaultInjector(plan, rank=0, run_dir=tmp_path, scope="../x y")._marker().parent == tmp_path / "markers"
