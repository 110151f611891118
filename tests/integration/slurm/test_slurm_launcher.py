"""The Slurm launcher against a real slurmctld/slurmd on this machine: scancel leaves no
rank behind, and (pinned) a node drained or unknown in Slurm is refused before submitting.
Training through Slurm (finish, crash diagnosed from the Slurm output, cancellation from
Prefect) is in test_slurm_pretrain_flow.py."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from infra.launch import CHOOSE_ON_NODE_0, LaunchRequest, NodeLaunch
from infra.slurm import SlurmLauncher, SlurmNodeUnavailable, SlurmSettings, drain_node, node_states, resume_node

RANK_WORKER = str(Path(__file__).resolve().parents[1] / "launch" / "rank_worker.py")


def _request(node: str, run_dir: Path, worker_args: list[str], env: dict | None = None, attempt: int = 0):
    spec = NodeLaunch(node=node, address=node, node_rank=0, nnodes=1, nproc_per_node=2, cuda_visible_devices="",
                      master_addr=node, master_port=CHOOSE_ON_NODE_0, first_global_rank=0)
    return LaunchRequest("slurm-test", [spec], worker_args, run_dir, env=env or {}, attempt=attempt)


def _squeue(slurm) -> str:
    return subprocess.run(["squeue", "-h", "-o", "%i %T"], env={**__import__("os").environ, **slurm.env()},
                          capture_output=True, text=True).stdout.strip()


def _rank_pids(pid_dir: Path, count: int, timeout: float = 120) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = list(pid_dir.glob("rank*.pid")) if pid_dir.exists() else []
        if len(files) == count and all(f.read_text() for f in files):
            return [int(f.read_text()) for f in files]
        time.sleep(0.2)
    raise AssertionError(f"ranks did not start within {timeout}s")


def test_scancel_leaves_no_rank_running(slurm, tmp_path):
    request = _request(slurm.node, tmp_path / "run", [RANK_WORKER], env={"FORGEFLOW_TEST_PID_DIR": str(tmp_path / "pids")})
    job = SlurmLauncher(grace_s=2).start(request)
    try:
        pids = _rank_pids(tmp_path / "pids", 2)
        assert job.poll() == {slurm.node: None} and job.state(fresh=True) == "RUNNING"
    finally:
        job.terminate(grace_s=2)
    assert job.state() == "CANCELLED"
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"ranks outlived scancel: {alive}"
    assert job.poll()[slurm.node] not in (None, 0)
    assert job.job_id not in _squeue(slurm)
    # The flow's own scancel (a start-up timeout, a hang, a cancellation) is not Slurm ending the
    # job: its batch script's trap saw a SIGTERM as it would a time limit's, but the attempt's
    # end must stay a failure to diagnose, not an eviction the flow restarts without counting.
    assert job.ended_by_batch_system() is None


def test_the_batch_job_and_its_ranks_get_none_of_the_workers_secrets(slurm, tmp_path, monkeypatch):
    """sbatch exports its environment to the job: the launcher gives it the ranks' allowlist
    (infra.launch.worker_environment), so the node task and the ranks never see the flow worker's secrets."""
    secrets = ("SLACK_WEBHOOK_URL", "PREFECT_API_AUTH_STRING", "OPENAI_API_KEY", "FORGEFLOW_DB_URL")
    for name in secrets + ("AWS_SECRET_ACCESS_KEY", "NCCL_DEBUG"):
        monkeypatch.setenv(name, "x")
    request = _request(slurm.node, tmp_path / "run", [RANK_WORKER], env={"FORGEFLOW_TEST_PID_DIR": str(tmp_path / "pids")})
    job = SlurmLauncher(grace_s=2).start(request)
    try:
        pids = _rank_pids(tmp_path / "pids", 2)
        node_task = next(p for p in psutil.Process(pids[0]).parents() if "infra.slurm" in " ".join(p.cmdline()))
        batch_env = node_task.environ()
    finally:
        job.terminate(grace_s=2)
    assert batch_env.get("SLURM_JOB_ID") == job.job_id and not set(batch_env) & set(secrets)
    assert {"AWS_SECRET_ACCESS_KEY", "NCCL_DEBUG", "SLURM_CONF", "PATH"} <= set(batch_env)
    for rank in (0, 1):
        seen = set(json.loads((tmp_path / "pids" / f"rank{rank}.env").read_text()))
        assert not seen & set(secrets) and {"AWS_SECRET_ACCESS_KEY", "NCCL_DEBUG"} <= seen


def test_a_node_drained_in_slurm_is_refused(slurm, tmp_path):
    drain_node(slurm.node, "failed the node check")
    try:
        state = node_states()[slurm.node]
        assert not state.schedulable and "node check" in state.reason
        with pytest.raises(SlurmNodeUnavailable, match=f"'{slurm.node}' is drain.*node check.*State=RESUME"):
            SlurmLauncher(SlurmSettings(mode="pin")).start(_request(slurm.node, tmp_path / "run", [RANK_WORKER]))
        assert _squeue(slurm) == ""  # nothing was submitted
    finally:
        resume_node(slurm.node)
    assert node_states()[slurm.node].schedulable


def test_an_unknown_node_is_refused_before_submitting(slurm, tmp_path):
    with pytest.raises(SlurmNodeUnavailable, match="'no-such-node' is not a Slurm node"):
        SlurmLauncher(SlurmSettings(mode="pin")).start(_request("no-such-node", tmp_path / "run", [RANK_WORKER]))
