"""A submitted job whose pretrain flow run is cancelled in Prefect before it starts leaves the queue.

Two halves, each on a real Prefect API:
- the `release-cancelled-job` flow (called here as the trigger's run would be): the job run by
  the cancelled flow run leaves the queue, recorded as cancelled; a run that is not cancelled,
  or not tagged with the job, releases nothing (the parameter is a flow run's id, which anyone
  who may create a run can give);
- the wiring (prefect.yaml, deployed by `forgeflow deploy`): cancelling a scheduled run of the
  `pretrain` deployment makes the server create one `release-cancelled` run for it. No worker
  serves the run: the test reads what the server created, then deletes it.
"""

from __future__ import annotations

import pytest

from scheduler.cluster import parse_cluster
from scheduler.orchestrator import Orchestrator, demand_options
from tests.integration.flows.test_prefect_deployments import deployed_once, triggered_runs  # noqa: F401 (fixture)

ONE_CPU = {"name": "release-one", "nodes": [{"name": "n1", "gpu_type": "cpu", "gpu_count": 1,
                                              "gpu_memory_gib": 8, "peak_tflops": 1}]}


@pytest.fixture
def state_db(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'state.db'}"
    monkeypatch.setenv("FORGEFLOW_DB_URL", url)
    orch = Orchestrator(url)
    orch.register(parse_cluster(ONE_CPU))
    return orch


def _flow_run(client, job_id: int, name: str):
    from prefect import flow

    @flow(name="pretrain-stand-in")
    def stand_in() -> None:  # never runs: only its flow runs are created
        pass

    return client.create_flow_run(stand_in, name=name, tags=[f"job-{job_id}"])


def test_the_job_of_a_cancelled_run_leaves_the_queue_and_nothing_else_does(prefect_api, state_db):
    from prefect import get_client
    from prefect.states import Cancelled

    from flows.cancelled_run import release_cancelled_job

    one = demand_options(state_db.cluster(), 1, duration_s=10)
    holder = state_db.submit("holder", one)  # holds the CPU: the others stay queued
    waiting, other = state_db.submit("waiting", one), state_db.submit("other", one)
    with get_client(sync_client=True) as client:
        run = _flow_run(client, waiting, "waiting-run")
        live = _flow_run(client, other, "other-run")
        state_db.set_runner(waiting, {"kind": "prefect", "flow_run_id": str(run.id)})
        state_db.set_runner(other, {"kind": "prefect", "flow_run_id": str(live.id)})
        # not cancelled: nothing happens, whoever asks
        assert release_cancelled_job(f"prefect.flow-run.{run.id}") is None
        assert state_db.job(waiting)["state"] == "queued"
        client.set_flow_run_state(run.id, Cancelled(), force=True)
        assert release_cancelled_job(f"prefect.flow-run.{run.id}") == waiting
        assert release_cancelled_job(str(live.id)) is None  # another job's live run
    job = state_db.job(waiting)
    assert job["state"] == "cancelled" and "was cancelled in Prefect" in job["reason"], job
    assert [state_db.job(j)["state"] for j in (holder, other)] == ["running", "queued"]
    with pytest.raises(ValueError, match="not a flow run id"):
        release_cancelled_job("../../etc/passwd")


def test_cancelling_a_scheduled_pretrain_run_triggers_its_release(deployed_once):  # noqa: F811
    from prefect import get_client
    from prefect.states import Cancelled

    with get_client(sync_client=True) as client:
        pretrain = client.read_deployment_by_name("pretrain/pretrain")
        release = client.read_deployment_by_name("release-cancelled-job/release-cancelled")
        run = client.create_flow_run_from_deployment(pretrain.id, parameters={"job_spec": "unused.yaml"},
                                                     tags=["job-0"])
        client.set_flow_run_state(run.id, Cancelled(), force=True)
        runs: list = []
        try:
            resource = f"prefect.flow-run.{run.id}"
            runs = triggered_runs(client, release.id, lambda r: r.parameters.get("flow_run") == resource)
            assert len(runs) == 1, "cancelling the pretrain run did not trigger its release"
        finally:
            for r in [*runs, run]:
                client.delete_flow_run(r.id)
