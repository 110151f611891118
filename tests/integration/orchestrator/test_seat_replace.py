"""`Seat.replace` (scheduler.orchestrator.seat) after a node check cordons a node of a running job.

When the nodes left in service can hold one of the job's plans, the job is placed again there.
When they cannot (even with no other job running), it fails at once with an error that says why,
instead of waiting in the queue forever; the job is never left queued, and the flow's HeldJob
releases its GPUs as failed. No Prefect: the flow's seat (tasks.cluster_tasks.FlowSeat) only
shows the same steps in the UI.
"""

from __future__ import annotations

import pytest

from scheduler.cluster import parse_cluster
from scheduler.orchestrator import OrchestratorError
from scheduler.orchestrator.lease import HeldJob
from scheduler.orchestrator.options import options_from_plans
from scheduler.planner import plan_job, worker_planner_config
from scheduler.orchestrator.seat import INVENTORY_CORDON, Seat, cluster_orchestrator, sync_inventory
from scheduler.orchestrator.views import cluster_status
from training.config import load_job_spec

TWO_SMALL = {"name": "two-small", "nodes": [
    {"name": "node-a", "gpu_type": "A10", "gpu_count": 1, "address": "127.0.0.1"},
    {"name": "node-b", "gpu_type": "A10", "gpu_count": 1, "address": "127.0.0.1"},
]}


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


def test_replace_fails_at_once_when_no_plan_fits_the_nodes_left(tmp_path):
    orch, inventory, spec, plans, job_id = _running_job(f"sqlite:///{tmp_path / 'state.db'}", {2})
    assert sorted(orch.admission(job_id).placement.nodes) == ["node-a", "node-b"]

    with pytest.raises(OrchestratorError) as refused:
        with HeldJob(orch, job_id) as held:
            seat = Seat(orch, job_id, held, inventory.name, plans, spec.name, poll_s=0.05)
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


def test_replace_places_the_job_again_when_a_plan_fits(tmp_path):
    orch, inventory, spec, plans, job_id = _running_job(f"sqlite:///{tmp_path / 'state.db'}", {1, 2})
    [faulty] = orch.admission(job_id).placement.nodes  # the one-GPU plan is the fastest of the tiny job
    [healthy] = {"node-a", "node-b"} - {faulty}

    with HeldJob(orch, job_id) as held:
        seat = Seat(orch, job_id, held, inventory.name, plans, spec.name, poll_s=0.05)
        placement = seat.replace([faulty], inventory, "failed the node check after attempt 0")
        assert placement.nodes == [healthy]
        assert orch.job(job_id)["state"] == "running"
    assert orch.job(job_id)["state"] == "finished"


def test_joining_mirrors_the_inventorys_unschedulable_nodes_and_keeps_our_own_cordons(tmp_path):
    orch = cluster_orchestrator(f"sqlite:///{tmp_path / 'state.db'}")
    drained = parse_cluster({**TWO_SMALL, "nodes": [{**TWO_SMALL["nodes"][0], "cordoned": True},
                                                      TWO_SMALL["nodes"][1]]})
    assert sync_inventory(orch, drained) is True  # registered
    state = {n.name: n.cordoned for n in orch.cluster("two-small").nodes}
    assert state == {"node-a": True, "node-b": False}
    orch.cordon("node-b", reason="failed the node check", cluster="two-small", by="pretrain flow")

    # node-a schedulable again in the batch system; node-b's cordon is ours, not the inventory's
    assert sync_inventory(orch, parse_cluster(TWO_SMALL)) is False  # same nodes: not registered again
    nodes = {n["node"]: (n["state"], n["reason"]) for n in cluster_status(orch.engine, "two-small")["nodes"]}
    assert nodes["node-a"][0] == "ready"
    assert nodes["node-b"] == ("cordoned", "failed the node check")
    assert not nodes["node-b"][1].startswith(INVENTORY_CORDON)
