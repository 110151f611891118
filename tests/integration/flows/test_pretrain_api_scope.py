"""A pretrain run created through Prefect's API trains only a job `forgeflow submit` queued, with
the spec the orchestrator recorded (issue 29, item 1): its `job_spec` parameter (a path or content
of whoever could create a flow run) is never read, its `cluster` must be this machine or a
registered cluster's file, and a run without a job id is refused in one line before anything is
read. Runs are created from a real deployment on the (ephemeral) Prefect API and run by Prefect's
flow engine, as a worker runs them, against a real SQLite state database.
"""

from __future__ import annotations

from pathlib import Path

import pytest

CLUSTER = "configs/clusters/frenzy-testbed.yaml"


@pytest.fixture
def queued(tmp_path, monkeypatch):
    """A job queued with the orchestrator (as `forgeflow submit` queues it)."""
    from scheduler.orchestrator.seat import queue_spec
    from training.config import load_job_spec

    monkeypatch.setenv("FORGEFLOW_DB_URL", f"sqlite:///{tmp_path / 'state.db'}")
    monkeypatch.setenv("FORGEFLOW_STATE_DIR", str(tmp_path / "state"))
    spec = load_job_spec("configs/tiny-cpu.yaml", {"run_dir": str(tmp_path / "runs" / "{name}" / "{job}"),
                                                   "checkpoint": {"url": str(tmp_path / "ckpt" / "{job}")}})
    return queue_spec(spec, str(Path(CLUSTER).resolve()), gpu_type="A800-80G", gpus=4)


def _through_the_api(parameters: dict):
    from prefect import get_client
    from prefect.flow_engine import run_flow

    from flows.pretrain import pretrain

    with get_client(sync_client=True) as client:
        deployment = client.create_deployment(flow_id=client.create_flow(pretrain), name="scope-test")
        run = client.create_flow_run_from_deployment(deployment, parameters=parameters)
    assert run.deployment_id == deployment
    return run_flow(pretrain, flow_run=run, parameters=run.parameters)


def test_a_run_through_the_api_needs_a_queued_job_and_a_registered_cluster(prefect_api, queued, tmp_path):
    from training.config import ConfigError

    planted = tmp_path / "planted.yaml"  # a spec of the caller's choosing: never read
    planted.write_text(f"base: configs/tiny-cpu.yaml\nrun_dir: {tmp_path / 'elsewhere'}\n")
    with pytest.raises(ConfigError, match="give its job_id") as refused:
        _through_the_api({"job_spec": str(planted)})
    assert "\n" not in str(refused.value)

    inventory = tmp_path / "mine.yaml"
    inventory.write_text(Path(CLUSTER).read_text())
    with pytest.raises(ConfigError, match=f"cluster {inventory} is not the inventory of a cluster registered"):
        _through_the_api({"job_spec": str(planted), "job_id": queued.job_id, "cluster": str(inventory)})
    with pytest.raises(ConfigError, match="job_id 999: no job with id 999"):
        _through_the_api({"job_spec": str(planted), "job_id": 999, "cluster": "local"})
    assert not (tmp_path / "elsewhere").exists()


def test_the_recorded_spec_is_the_one_that_runs(queued, tmp_path):
    """The job's own record, paths filled in, whatever the run was given (here: the spec the
    orchestrator recorded at submit, with the job's run directory)."""
    from flows.pretrain import _recorded_spec
    from training.config import as_job_spec

    spec = as_job_spec(_recorded_spec(queued.job_id, str(Path(CLUSTER).resolve())))
    assert spec.resolved_run_dir == queued.spec.resolved_run_dir
    assert str(spec.resolved_run_dir).startswith(str(tmp_path / "runs"))
