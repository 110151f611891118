"""Evaluation trials as Slurm batch jobs (evalsuite.slurm_trials) through the session's real Slurm.

The same tiny model and suite evaluated by the local executor and through Slurm give the
same scores; every trial ran as its own Slurm job; a failed trial is reported with its job's
output; an interrupted evaluation leaves no job queued or running.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from evalsuite.coordinator import Policy
from tests.tiny_suite import write_tiny_suite


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from testing.tiny_checkpoint import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("slurm-eval-model") / "hf")


def _suite(tiny_model: Path, tmp_path: Path):
    from evalsuite.suite import load_suite

    return load_suite(str(write_tiny_suite(tmp_path / "suite.yaml", tiny_model, "slurm-eval")))


def _history(path: Path):
    # A fresh runtime history: the plan does not depend on what earlier runs on this machine measured.
    from evalsuite.history import RuntimeHistory

    return RuntimeHistory(path)


def _job(job_id: str, slurm) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=dict(os.environ, **slurm.env()),
                         capture_output=True, text=True, check=True).stdout
    return dict(item.split("=", 1) for item in out.split() if "=" in item)


def test_trials_run_as_slurm_jobs_and_score_like_the_local_executor(slurm, slurm_cluster, tiny_model, tmp_path):
    from evalsuite.runner import evaluate
    from scheduler.cluster import load_cluster

    suite = _suite(tiny_model, tmp_path)
    # No preload: each trial loads from storage, so the jobs read nothing this process holds;
    # no batching of small datasets: one trial per dataset, two jobs.
    local = evaluate(str(tiny_model), suite, tmp_path / "local", policy=Policy(preload=False, batch_small=False), echo=lambda _: None,
                     history=_history(tmp_path / "local-history.json"))
    settings = load_cluster(str(slurm_cluster)).slurm   # the cluster file's slurm: section (partition debug)
    through = evaluate(str(tiny_model), suite, tmp_path / "slurm", policy=Policy(preload=False, batch_small=False),
                       history=_history(tmp_path / "slurm-history.json"), echo=lambda _: None,
                       submitter="slurm", slurm=settings)

    assert local.failed_datasets == {} and through.failed_datasets == {}
    assert set(through.results) == {"capitals-mc", "perplexity"}
    for name, metrics in local.results.items():
        assert through.results[name] == pytest.approx(metrics, rel=1e-6), name
    assert len(through.outcomes) == 2
    for outcome in through.outcomes:
        job_id = outcome.result.worker["slurm_job_id"]   # written from inside the job
        assert job_id == (tmp_path / "slurm" / "slurm" / f"{outcome.trial_id}.job-id").read_text()
        job = _job(job_id, slurm)   # no slurmdbd here (sacct needs one): slurmctld's record
        assert job["JobState"] == "COMPLETED" and job["JobName"] == f"forgeflow-eval-{outcome.trial_id}"
        assert job["Partition"] == "debug"


def test_a_failed_trial_is_reported_with_its_slurm_output(slurm, tmp_path):
    from evalsuite.errors import TrialError
    from evalsuite.sandbox import Sandbox, SandboxLimits
    from evalsuite.slurm_trials import SlurmSubmitter
    from evalsuite.trials import Trial
    from infra.slurm import SlurmSettings

    submitter = SlurmSubmitter(tmp_path / "jobs", SlurmSettings(slurm_conf=str(slurm.conf), poll_s=0.5), 1,
                               Sandbox(SandboxLimits()))
    missing = tmp_path / "no-such-model"
    from evalsuite.datasets import DatasetRef
    from evalsuite.trials import ShardSpec

    trial = Trial(trial_id="broken", backend="transformers", model_source=str(missing), output_dir=str(tmp_path / "out"),
                  devices=["cpu"], shards=[ShardSpec(dataset=DatasetRef(name="capitals-mc", options={"limit": 2}),
                                                     shard=0, start=0, stop=2)])
    try:
        handle = submitter.submit_trial(trial, None)
        assert submitter.wait_first([handle]) is handle
        with pytest.raises(TrialError) as failed:
            handle.result()
    finally:
        submitter.close()
    message = str(failed.value)
    assert f"Slurm job {handle.job_id} ended FAILED" in message
    assert "no-such-model" in message and "Traceback" in message   # the job's own output, for diagnosis


def test_an_interrupted_evaluation_scancels_its_running_trial_jobs(slurm, slurm_cluster, tiny_model, tmp_path):
    from evalsuite.runner import evaluate
    from scheduler.cluster import load_cluster

    jobs = tmp_path / "out" / "slurm"
    started: list[str] = []
    seen: list[str] = []   # the first job's state when the evaluation was interrupted

    def interrupt_once_a_job_runs(kind: str, info: dict) -> None:
        if kind != "trial_started":
            return
        started.append(info["trial"])
        if len(started) < 2:
            return   # the first trial is being submitted right after this event
        first = (jobs / f"{started[0]}.job-id").read_text()
        deadline = time.monotonic() + 60
        while (state := _job(first, slurm)["JobState"]) != "RUNNING" and time.monotonic() < deadline:
            time.sleep(0.2)
        seen.append(state)
        raise KeyboardInterrupt   # e.g. Ctrl-C while the plan runs

    with pytest.raises(KeyboardInterrupt):
        evaluate(str(tiny_model), _suite(tiny_model, tmp_path), tmp_path / "out", policy=Policy(preload=False, batch_small=False),
                 history=_history(tmp_path / "history.json"), echo=lambda _: None,
                 on_event=interrupt_once_a_job_runs, submitter="slurm",
                 slurm=load_cluster(str(slurm_cluster)).slurm)
    first = (jobs / f"{started[0]}.job-id").read_text()
    assert seen == ["RUNNING"] and _job(first, slurm)["JobState"] == "CANCELLED"
    assert not (jobs / f"{started[0]}.result.json").exists()
    trial_file = str(jobs / f"{started[0]}.trial.json")
    left = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _cmdline_has(p, trial_file)]
    assert left == [], "a cancelled trial's process is still running"


def _cmdline_has(proc: Path, text: str) -> bool:
    try:
        return text in (proc / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False


def test_the_evaluate_flow_submits_its_trials_to_slurm(slurm, slurm_cluster, prefect_api, tiny_model, tmp_path):
    """evaluate-checkpoint with submitter='slurm': trials are Slurm jobs, metric jobs the flow's task runs."""
    from flows.evaluate import evaluate_checkpoint

    suite = tmp_path / "suite.yaml"
    _suite(tiny_model, tmp_path)   # writes suite.yaml
    result = evaluate_checkpoint(str(tiny_model), suite=str(suite), output_dir=str(tmp_path / "out"),
                                 history_path=str(tmp_path / "history.json"), submitter="slurm",
                                 slurm_cluster_file=str(slurm_cluster))
    assert result["failed"] == {} and set(result["results"]) == {"capitals-mc", "perplexity"}
    job_ids = sorted((tmp_path / "out" / "slurm").glob("*.job-id"))
    assert job_ids and all(_job(p.read_text(), slurm)["JobState"] == "COMPLETED" for p in job_ids)
    with pytest.raises(ValueError, match="drop nodes/node_count"):
        evaluate_checkpoint(str(tiny_model), suite=str(suite), submitter="slurm", nodes=["n1"])
