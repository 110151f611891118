"""The Slurm launcher against a real slurmctld/slurmd on this machine: an attempt is one
batch job whose srun step starts torchrun on the node, exit codes come back per node,
failures are diagnosed from the Slurm output files, scancel leaves no rank behind, and a
node drained in Slurm is refused."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import psutil
import pytest

from infra.launch import CHOOSE_ON_NODE_0, LaunchRequest, NodeLaunch
from infra.slurm import SlurmLauncher, SlurmNodeUnavailable, drain_node, node_states, resume_node
from infra.watch import watch

RANK_WORKER = str(Path(__file__).resolve().parents[1] / "launch" / "rank_worker.py")


def _request(node: str, run_dir: Path, worker_args: list[str], env: dict | None = None, attempt: int = 0):
    spec = NodeLaunch(node=node, address=node, node_rank=0, nnodes=1, nproc_per_node=2, cuda_visible_devices="",
                      master_addr=node, master_port=CHOOSE_ON_NODE_0, first_global_rank=0)
    return LaunchRequest("slurm-test", [spec], worker_args, run_dir, env=env or {}, attempt=attempt)


def _squeue(slurm) -> str:
    return subprocess.run(["squeue", "-h", "-o", "%i %T"], env={**__import__("os").environ, **slurm.env()},
                          capture_output=True, text=True).stdout.strip()


def test_two_rank_training_attempt_finishes(slurm, slurm_job, tmp_path):
    job_file = slurm_job("slurm-train")
    request = _request(slurm.node, tmp_path / "slurm-train" / "run", ["-m", "training.train", str(job_file)])
    job = SlurmLauncher(grace_s=5).start(request)
    try:
        outcome = watch(job, request.run_dir, world_size=2, hang_timeout_s=120, startup_timeout_s=240)
    finally:
        job.terminate(grace_s=5)
    logs = "".join(p.read_text(errors="replace") for p in job.log_paths().values() if p.exists())
    assert outcome.status == "finished", (outcome, logs[-3000:])
    assert outcome.exit_codes == {slurm.node: 0} and outcome.last_step == 12
    assert job.state() == "COMPLETED"
    # The node's console is Slurm's step output; rank 0 chose the rendezvous port on the node.
    assert "[default1]" in job.log_paths()[slurm.node].read_text()
    assert f"job {job.job_id} on {slurm.node}" in job.log_paths()["slurm-batch"].read_text()
    assert "rendezvous" in logs and ":0" not in logs.split("rendezvous", 1)[1].split()[0]


def test_failing_attempt_is_diagnosed_from_its_slurm_output(slurm, slurm_job, tmp_path):
    from diagnosis.api import diagnose_log

    job_file = slurm_job("slurm-fail")
    request = _request(slurm.node, tmp_path / "slurm-fail" / "run", ["-m", "training.train", str(job_file)],
                       env={"FORGEFLOW_FAULT": "cuda_error@4:1"})
    job = SlurmLauncher(grace_s=5).start(request)
    try:
        outcome = watch(job, request.run_dir, world_size=2, hang_timeout_s=120, startup_timeout_s=240,
                        failure_grace_s=2)
    finally:
        job.terminate(grace_s=5)
    assert outcome.status == "failed" and outcome.failed_nodes == [slurm.node], outcome
    assert outcome.exit_codes[slurm.node] not in (None, 0)
    combined = tmp_path / "combined.log"
    combined.write_bytes(b"".join(Path(p).read_bytes() for p in outcome.log_paths.values() if Path(p).exists()))
    diagnosis = diagnose_log(combined, job_family="slurm-fail")
    assert diagnosis.root_cause == "CUDAError", diagnosis
    assert any("CUDA" in line for line in diagnosis.culprit_lines)


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


def test_a_node_drained_in_slurm_is_refused(slurm, tmp_path):
    drain_node(slurm.node, "failed the node check")
    try:
        state = node_states()[slurm.node]
        assert not state.schedulable and "node check" in state.reason
        with pytest.raises(SlurmNodeUnavailable, match=f"'{slurm.node}' is drain.*node check.*State=RESUME"):
            SlurmLauncher().start(_request(slurm.node, tmp_path / "run", [RANK_WORKER]))
        assert _squeue(slurm) == ""  # nothing was submitted
    finally:
        resume_node(slurm.node)
    assert node_states()[slurm.node].schedulable


def test_an_unknown_node_is_refused_before_submitting(slurm, tmp_path):
    with pytest.raises(SlurmNodeUnavailable, match="'no-such-node' is not a Slurm node"):
        SlurmLauncher().start(_request("no-such-node", tmp_path / "run", [RANK_WORKER]))
