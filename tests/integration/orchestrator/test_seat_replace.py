"""`Seat.replace` (tasks/cluster_tasks.py) after a node check cordons a node of a running job.

When the nodes left in service can hold one of the job's plans, the job is placed again there.
When they cannot (even with no other job running), it fails at once with an error that says why,
instead of waiting in the queue forever; the job is never left queued, and the flow's HeldJob
releases its GPUs as failed. The Prefect tasks it calls run as plain functions (`.fn`).
"""

from __future__ import annotations

import pytest

import tasks.cluster_tasks as cluster_tasks
from scheduler.cluster import parse_cluster
from scheduler.orchestrator import OrchestratorError
from scheduler.orchestrator.lease import HeldJob
from scheduler.orchestrator.options import options_from_plans
from scheduler.planner import plan_job, worker_planner_config
from tasks.cluster_tasks import Seat, cluster_orchestrator
from training.config import load_job_spec

TWO_SMALL = {"name": "two-small", "nodes": [
    {"name": "node-a", "gpu_type": "A10", "gpu_count": 1, "address": "127.0.0.1"},
    {"name": "node-b", "gpu_type": "A10", "gpu_count": 1, "address": "127.0.0.1"},
]}


@pytest.fixture
def without_prefect(monkeypatch):
    """Seat's Prefect tasks as plain functions, and no artifacts (no Prefect API in a unit run)."""
    monkeypatch.setattr(cluster_tasks, "cordon_faulty", cluster_tasks.cordon_faulty.fn)
    monkeypatch.setattr(cluster_tasks, "publish_cluster_table", lambda orch, cluster: None)

    def wait_for_gpus(orch, job_id, plans, job, poll_s=0.05):
        return orch.wait_admitted(job_id, poll_s=poll_s, timeout_s=10).placement

    monkeypatch.setattr(cluster_tasks, "wait_for_gpus", wait_for_gpus)


def _running_job(url: str, gpus: set[int]):
    """The tiny job on two 1-GPU nodes, with only its plans of `gpus` GPUs, admitted."""
    inventory = parse_cluster(TWO_SMALL)
    spec = load_job_spec("configs/tiny-cpu.yaml")
    plans = [p for p in plan_job(spec, inventory, worker_planner_config(inventory)) if p.num_gpus in gpus]
    assert plans
    orch = cluster_orchestrator(url)
    orch.register(inventory)
    job_id = orch.submit(spec.name, options_from_plans(plans, spec.training.steps, inventory.gpu_types()),
                         cluster=inventory.name)
    assert orch.job(job_id)["state"] == "running"
    return orch, inventory, spec, plans, job_id


def test_replace_fails_at_once_when_no_plan_fits_the_nodes_left(tmp_path, without_prefect):
    orch, inventory, spec, plans, job_id = _running_job(f"sqlite:///{tmp_path / 'state.db'}", {2})
    assert sorted(orch.admission(job_id).placement.nodes) == ["node-a", "node-b"]

    with pytest.raises(OrchestratorError) as refused:
        with HeldJob(orch, job_id) as held:
            seat = Seat(orch, job_id, held, inventory.name, plans, spec.name)
            try:
                seat.replace(["node-b"], inventory, "failed the node check after attempt 0")
            finally:  # what the flow sees while the error propagates: the job still holds its GPUs
                assert orch.job(job_id)["state"] == "running"

    message = str(refused.value)
    assert f"job {spec.name!r} cannot be placed on cluster 'two-small'" in message
    assert "2x A10" in message and "1x A10 on 1 node(s) (node-a;" in message
    assert "node-b (cordoned: failed the node check after attempt 0" in message and "uncordon" in message
    job = orch.job(job_id)
    assert job["state"] == "failed" and "cannot be placed" in job["reason"]  # released by HeldJob, not queued
    assert orch.queue_position(job_id) == (0, 0)
    assert {n.name: n.cordoned for n in orch.cluster("two-small").nodes} == {"node-a": False, "node-b": True}


def test_replace_places_the_job_again_when_a_plan_fits(tmp_path, without_prefect):
    orch, inventory, spec, plans, job_id = _running_job(f"sqlite:///{tmp_path / 'state.db'}", {1, 2})
    [faulty] = orch.admission(job_id).placement.nodes  # the one-GPU plan is the fastest of the tiny job
    [healthy] = {"node-a", "node-b"} - {faulty}

    with HeldJob(orch, job_id) as held:
        seat = Seat(orch, job_id, held, inventory.name, plans, spec.name)
        placement = seat.replace([faulty], inventory, "failed the node check after attempt 0")
        assert placement.nodes == [healthy]
        assert orch.job(job_id)["state"] == "running"
    assert orch.job(job_id)["state"] == "finished"
