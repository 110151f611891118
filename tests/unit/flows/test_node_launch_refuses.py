"""A node-launch run takes a job id, a launch name and a node, never a command: it runs only the
launch the job's flow recorded in the state database, and only while the job holds that node
(issue 29: reaching the Prefect API must not mean choosing what a GPU node runs)."""

from __future__ import annotations

import pytest

from flows.node_launch import node_launch
from infra.launch import LaunchRequest, NodeLaunch
from scheduler.orchestrator import OrchestratorError
from scheduler.orchestrator.seat import cluster_orchestrator, queue_spec
from training.config import load_job_spec

CLUSTER = "configs/clusters/frenzy-testbed.yaml"


def _request(node: str) -> dict:
    launch = NodeLaunch(node=node, address="127.0.0.1", node_rank=0, nnodes=1, nproc_per_node=1,
                        cuda_visible_devices="0", master_addr="127.0.0.1", master_port=29500, first_global_rank=0)
    return LaunchRequest("tiny-cpu", [launch], ["-m", "training.train", "spec.json"], "runs/x").to_dict()


@pytest.fixture
def orch(tmp_path, monkeypatch):
    monkeypatch.setenv("FORGEFLOW_DB_URL", f"sqlite:///{tmp_path / 'state.db'}")
    return cluster_orchestrator()


def test_only_the_recorded_launch_runs_and_only_on_a_node_the_job_holds(orch, tmp_path):
    spec = load_job_spec("configs/tiny-cpu.yaml", {"run_dir": str(tmp_path / "{name}/{job}")})
    running = queue_spec(spec, CLUSTER, gpu_type="A800-80G", gpus=4)
    node = orch.job(running.job_id)["placement"]["nodes"][0]["node"]
    waiting = queue_spec(spec, CLUSTER, gpu_type="A800-80G", gpus=4)  # the only A800 node is taken
    assert orch.job(waiting.job_id)["state"] == "queued"

    with pytest.raises(OrchestratorError, match="its flow recorded no such launch"):
        orch.launch_for(running.job_id, "tiny-cpu-a0", node)
    orch.record_launch(running.job_id, "tiny-cpu-a0", _request(node))
    assert orch.launch_for(running.job_id, "tiny-cpu-a0", node)["worker_args"][-1] == "spec.json"
    with pytest.raises(OrchestratorError, match=r"the job holds \['a800"):
        orch.launch_for(running.job_id, "tiny-cpu-a0", "some-other-node")

    orch.record_launch(waiting.job_id, "tiny-cpu-a0", _request(node))
    with pytest.raises(OrchestratorError, match="the job is queued, it holds no GPUs"):
        orch.launch_for(waiting.job_id, "tiny-cpu-a0", node)
    orch.release(running.job_id, outcome="finished")
    with pytest.raises(OrchestratorError, match="the job is finished"):
        orch.launch_for(running.job_id, "tiny-cpu-a0", node)


def test_the_flow_refuses_before_starting_anything(orch, tmp_path):
    """The flow's own body (no Prefect run needed): a job it may not run is one error, and no
    process is started (the refusal comes before start_node)."""
    spec = load_job_spec("configs/tiny-cpu.yaml", {"run_dir": str(tmp_path / "{name}/{job}")})
    job = queue_spec(spec, CLUSTER, gpu_type="A800-80G", gpus=4)
    with pytest.raises(OrchestratorError, match="refusing to run launch 'tiny-cpu-a0' of job"):
        node_launch.fn(job.job_id, "tiny-cpu-a0", "a800-80g-x4")
    with pytest.raises(OrchestratorError, match="no job with id 999"):
        node_launch.fn(999, "x-a0", "a800-80g-x4")
    assert not (tmp_path / "tiny-cpu").exists() or not any((tmp_path / "tiny-cpu").rglob("*.out"))
