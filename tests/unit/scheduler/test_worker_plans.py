"""Plans are limited to what the training worker runs (training/capabilities.py), in the
planner CLI, the pretrain flow's planner and the job-spec check alike."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flows.cli import main as forgeflow
from scheduler.cluster import detect_local_cluster, load_cluster
from scheduler.planner import plan_job, worker_planner_config
from training.capabilities import WORKER
from training.config import ConfigError, load_job_spec

REPO = Path(__file__).resolve().parents[3]
FRENZY = REPO / "configs" / "clusters" / "frenzy-testbed.yaml"
# A 7B-class model: on the testbed's GPUs the planner would like pipeline stages.
BIG_JOB = (
    "name: big\nmodel: {num_layers: 32, hidden_size: 4096, num_attention_heads: 32, num_query_groups: 8,\n"
    "  ffn_hidden_size: 11008, vocab_size: 32000, seq_length: 2048}\n"
    "training: {global_batch_size: 64, steps: 10, precision: bf16}\n"
)


@pytest.fixture
def big_job(tmp_path) -> Path:
    path = tmp_path / "big.yaml"
    path.write_text(BIG_JOB)
    return path


def _plan_json(capsys, *argv) -> dict:
    assert forgeflow(["plan", *map(str, argv), "--json", "--top", "100"]) == 0
    return json.loads(capsys.readouterr().out)


def test_forgeflow_plan_proposes_only_what_the_worker_runs(big_job, capsys):
    out = _plan_json(capsys, big_job, "--cluster", FRENZY)
    assert out["plans"] and all(p["pp"] <= WORKER.max_pipeline_stages for p in out["plans"])
    assert out["chosen"]["pp"] <= WORKER.max_pipeline_stages


def test_more_pipeline_stages_are_an_explicit_what_if(big_job, capsys, monkeypatch):
    # The worker runs pipeline stages now; a worker limited to one stage shows the what-if.
    import scheduler.planner
    import training.capabilities
    import training.config

    one_stage = training.capabilities.WorkerCapabilities(max_pipeline_stages=1)
    for module in (training.capabilities, scheduler.planner, training.config):
        monkeypatch.setattr(module, "WORKER", one_stage)
    assert forgeflow(["plan", str(big_job), "--cluster", str(FRENZY), "--json", "--top", "100", "--max-pp", "8"]) == 0
    captured = capsys.readouterr()
    assert any(p["pp"] > one_stage.max_pipeline_stages for p in json.loads(captured.out)["plans"])
    assert "what-if" in captured.err and "cannot run them yet" in captured.err


def test_flow_planner_uses_the_worker_capabilities(big_job):
    gpus = load_cluster(FRENZY)
    config = worker_planner_config(gpus)
    assert config.max_pipeline_stages == WORKER.max_pipeline_stages
    assert (config.recompute, config.distributed_optimizer) == (WORKER.recompute, WORKER.distributed_optimizer)
    assert all(p.pp <= WORKER.max_pipeline_stages for p in plan_job(load_job_spec(big_job), gpus, config))
    # On CPU the planner leaves out what only trades step time for memory it does not need.
    cpus = detect_local_cluster()
    cpu_config = worker_planner_config(cpus, memory_margin=0.2)
    assert (cpu_config.distributed_optimizer, cpu_config.recompute, cpu_config.memory_margin) == (
        False, ("none", "selective"), 0.2)


def test_job_spec_refuses_more_pipeline_stages_than_the_worker_runs(tmp_path):
    path = tmp_path / "pp.yaml"
    path.write_text(BIG_JOB.replace("precision: bf16}", f"precision: bf16, "
                                    f"pipeline_parallel: {WORKER.max_pipeline_stages * 2}}}"))
    with pytest.raises(ConfigError, match="pipeline_parallel"):
        load_job_spec(path)


def test_every_plan_of_a_job_uses_the_same_optimizer_so_a_replacement_can_resume(big_job):
    """A job placed again after losing a node may change dp across 1 (dp 2 -> dp 1); the
    optimizer state it saved loads only into the same kind of optimizer, so the planner never
    picks the distributed optimizer for some dp and the plain one for others."""
    gpus = load_cluster(FRENZY)
    plans = plan_job(load_job_spec(big_job), gpus, worker_planner_config(gpus))
    assert {p.dp for p in plans} >= {1, 2}
    assert {p.distributed_optimizer for p in plans} == {WORKER.distributed_optimizer}
