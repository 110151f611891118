"""The worker's command line is built in one place, from the plan and the attempt's typed overrides."""

from __future__ import annotations

from pathlib import Path

from diagnosis.recovery import AttemptOverrides
from scheduler.cluster import detect_local_cluster
from scheduler.placement import place_plans
from scheduler.planner import plan_job, worker_planner_config
from scheduler.worker_command import plan_overrides, worker_args
from training.config import load_job_spec


REPO = Path(__file__).resolve().parents[3]


def _placement():
    spec = load_job_spec(REPO / "configs" / "tiny-cpu.yaml")
    cluster = detect_local_cluster()
    return place_plans(plan_job(spec, cluster, worker_planner_config(cluster)), cluster, job=spec.name)


def _sets(args: list[str]) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args) if a == "--set"]


def test_first_attempt_runs_the_plan_from_the_newest_checkpoint():
    placement = _placement()
    args = worker_args("job.yaml", placement)
    assert args[:3] == ["-m", "training.train", "job.yaml"]
    assert _sets(args) == plan_overrides(placement)
    assert "--resume-from-step" not in args


def test_rollback_attempt_resumes_from_its_step_and_skips_batches():
    placement = _placement()
    args = worker_args("job.yaml", placement, resume_from_step=20, overrides=AttemptOverrides(skip_batches=7))
    assert _sets(args) == plan_overrides(placement) + ["spike.skip_batches=7"]
    assert args[-2:] == ["--resume-from-step", "20"]


def test_the_plans_tensor_and_pipeline_degrees_reach_the_worker():
    placement = _placement()
    sets = _sets(worker_args("job.yaml", placement))
    assert f"training.tensor_parallel={placement.tp}" in sets
    assert f"training.pipeline_parallel={placement.pp}" in sets


def test_the_ranks_read_the_flows_validated_spec_and_refuse_one_that_changed(tmp_path, capsys):
    """The worker reads the spec the flow wrote into the run directory (not the user's YAML
    file, with its `base:` chain, which another node may not have) and checks its hash."""
    from scheduler.worker_command import write_attempt_spec
    from training.train import main as worker_main

    spec = load_job_spec(REPO / "configs" / "tiny-cpu.yaml", {"run_dir": str(tmp_path / "run")})
    path = write_attempt_spec(spec, attempt=3)
    assert path == tmp_path / "run" / "spec" / "attempt-3.json"
    assert load_job_spec(path) == spec  # the same spec, validated again from the JSON alone

    args = worker_args(path, _placement(), config_hash=spec.config_hash())
    assert args[:5] == ["-m", "training.train", str(path), "--config-hash", spec.config_hash()]

    # Someone edits the file after launch (a larger model): the rank refuses before training.
    changed = spec.model_dump(mode="json")
    changed["model"]["num_layers"] += 1
    path.write_text(__import__("json").dumps(changed))
    assert worker_main([str(path), "--config-hash", spec.config_hash()]) == 2
    err = capsys.readouterr().err
    assert f"not {spec.config_hash()}" in err and "launch again from the flow" in err
