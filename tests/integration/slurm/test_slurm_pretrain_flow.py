"""The pretrain flow with `launcher="slurm"`: attempts are Slurm batch jobs on the session's
real Slurm, a crash is diagnosed from the Slurm output files and recovered, and a
cancelled pretrain deployment run leaves no rank (and no Slurm job) behind."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time

import psutil
import pytest

from flows.pretrain import pretrain
from testing.torchrun_ranks import is_rank


def _squeue(slurm) -> str:
    return subprocess.run(["squeue", "-h", "-o", "%i %T"], env={**os.environ, **slurm.env()},
                          capture_output=True, text=True).stdout.strip()


def test_pretrain_through_slurm_recovers_from_a_crash(prefect_api, slurm, slurm_job, slurm_cluster):
    job = slurm_job("slurm-flow")
    result = pretrain(str(job), cluster=str(slurm_cluster), launcher="slurm", drill_faults=["cuda_error@5:1"],
                      backoff_s=0.5, hang_timeout_s=120)
    assert result.finished and result.final_step == 12, result
    assert [f.root_cause for f in result.failures] == ["CUDAError"]
    run_dir = job.parent / "slurm-flow" / "run"
    job_ids = sorted((run_dir / "launch").glob("attempt-*/slurm-job-id"))
    assert len(job_ids) == 2  # one batch job per attempt
    assert (run_dir / "logs" / "slurm-batch.attempt-0.out").read_text().count("forgeflow: srun exited") == 1
    # The diagnosis read Slurm's step output of the node: rank 1's CUDA error is there.
    failed_output = (run_dir / "logs" / f"node-{slurm.node}.attempt-0.out").read_text(errors="replace")
    assert "[default1]" in failed_output and "CUDA error" in failed_output
    assert (run_dir / "launch" / "attempt-0" / f"{slurm.node}.exit").read_text().strip() not in ("", "0")
    assert (run_dir / "launch" / "attempt-1" / f"{slurm.node}.exit").read_text().strip() == "0"
    # Node rank 0 chose the rendezvous port on the node and published it for the others.
    rendezvous = json.loads((run_dir / "launch" / "attempt-1" / "rendezvous.json").read_text())
    assert rendezvous["node"] == slurm.node and rendezvous["master_port"] > 0
    assert f"rendezvous {slurm.node}:{rendezvous['master_port']}" in (
        run_dir / "logs" / f"node-{slurm.node}.attempt-1.out").read_text()
    assert _squeue(slurm) == ""


def test_a_node_drained_in_slurm_is_not_placed(prefect_api, slurm, slurm_job, slurm_cluster):
    from infra.slurm import drain_node, resume_node
    from scheduler.cluster import load_inventory

    drain_node(slurm.node, "maintenance")
    try:
        inventory = load_inventory(str(slurm_cluster))
        assert inventory.node(slurm.node).cordoned
        with pytest.raises(Exception, match="no schedulable node"):
            pretrain(str(slurm_job("slurm-drained")), cluster=str(slurm_cluster), launcher="slurm")
    finally:
        resume_node(slurm.node)
    assert not load_inventory(str(slurm_cluster)).node(slurm.node).cordoned


@pytest.mark.slow
def test_cancelling_the_pretrain_run_scancels_its_slurm_job(slurm, slurm_job, slurm_cluster, tmp_path_factory,
                                                          repo_root, monkeypatch):
    """Prefect cancellation → the flow process gets SIGTERM → run_attempt's `finally` → scancel."""
    from prefect import get_client
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.states import Cancelling

    from flows.deploy import deploy_all
    from tests.integration.flows.conftest import PrefectServer, _drain_prefect_services

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = PrefectServer(tmp_path_factory.mktemp("prefect-slurm"), port, repo_root)
    monkeypatch.setenv("PREFECT_API_URL", server.url)
    monkeypatch.setenv("FORGEFLOW_ROOT", str(repo_root))
    try:
        with temporary_settings(updates={PREFECT_API_URL: server.url}):
            assert deploy_all(cluster=str(slurm_cluster), pool="forgeflow-slurm") == 0
            server.start_worker("forgeflow-slurm", "default")
            job = slurm_job("slurm-cancel", training={"steps": 100000})
            from infra.runfiles import attempt_spec_path
            from scheduler.orchestrator.seat import queue_spec
            from training.config import load_job_spec

            # a deployment's run trains a queued job, with the spec the orchestrator recorded
            queued = queue_spec(load_job_spec(job), str(slurm_cluster))
            run = run_deployment("pretrain/pretrain", timeout=0, as_subflow=False, parameters={
                "job_spec": str(job), "job_id": queued.job_id, "cluster": str(slurm_cluster), "launcher": "slurm"})

            # the ranks read the spec the flow wrote into the job's run directory
            spec_dir = str(attempt_spec_path(queued.spec.resolved_run_dir, 0).parent)

            def ranks() -> list[int]:
                return [p.pid for p in psutil.process_iter(["cmdline"])
                        if "training.train" in (p.info["cmdline"] or [])
                        and any(a.startswith(spec_dir) for a in p.info["cmdline"]) and is_rank(p)]

            deadline = time.monotonic() + 240
            while len(ranks()) < 2 and time.monotonic() < deadline:
                time.sleep(1)
            pids = ranks()
            assert len(pids) == 2, "the Slurm job's ranks never started"
            assert "RUNNING" in _squeue(slurm)
            with get_client(sync_client=True) as client:
                client.set_flow_run_state(run.id, Cancelling(), force=True)
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline and not client.read_flow_run(run.id).state.is_final():
                    time.sleep(1)
                assert client.read_flow_run(run.id).state.is_cancelled()
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and (_squeue(slurm) or any(psutil.pid_exists(p) for p in pids)):
                time.sleep(0.5)
            assert _squeue(slurm) == "", "the Slurm job outlived the cancelled flow run"
            alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
            assert not alive, f"ranks outlived the cancelled flow run: {alive}"
            _drain_prefect_services()
    finally:
        server.stop()
