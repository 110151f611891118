"""A trial's Slurm batch job gets what a worker needs, not the evaluating process's environment
(sbatch exports the environment it is given to the job)."""

from __future__ import annotations

import pytest

from tests import env_probe

SECRETS = ("SLACK_WEBHOOK_URL", "FORGEFLOW_DB_URL", "PREFECT_API_AUTH_STRING", "OPENAI_API_KEY")


def test_a_trial_job_gets_none_of_the_secrets(slurm, tmp_path, monkeypatch):
    from evalsuite.datasets import DatasetRef
    from evalsuite.errors import TrialError
    from evalsuite.sandbox import Sandbox, SandboxLimits
    from evalsuite.slurm_trials import SlurmSubmitter
    from evalsuite.trials import ShardSpec, Trial
    from infra.slurm import SlurmSettings

    for name in SECRETS:
        monkeypatch.setenv(name, "secret")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")   # a worker's setting: it reaches the job
    reports = env_probe.install(tmp_path / "probe", monkeypatch)
    submitter = SlurmSubmitter(tmp_path / "jobs", SlurmSettings(slurm_conf=str(slurm.conf), poll_s=0.5), 1,
                               Sandbox(SandboxLimits()))
    # The trial fails fast (no model there); the probe has recorded the job's environment by then.
    trial = Trial(trial_id="env", backend="transformers", model_source=str(tmp_path / "no-model"),
                  output_dir=str(tmp_path / "out"), devices=["cpu"],
                  shards=[ShardSpec(dataset=DatasetRef(name="capitals-mc", options={"limit": 2}), shard=0, start=0, stop=2)])
    try:
        handle = submitter.submit_trial(trial, None)
        assert submitter.wait_first([handle]) is handle
        with pytest.raises(TrialError):
            handle.result()
    finally:
        submitter.close()

    processes = env_probe.seen(reports)
    assert processes, "the trial job's Python never started (see its Slurm output under jobs/)"
    for names in processes:
        assert not names & set(SECRETS), names & set(SECRETS)
        assert {"PATH", "HF_HUB_OFFLINE", "SLURM_JOB_ID"} <= names
