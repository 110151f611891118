"""A Slurm attempt whose flow died stops itself (issue 28 item 7): the flow renews the attempt's
lease file while it polls the job (`SlurmJob.poll`); once nobody does, the reaper on the node
(`--lease-file`) stops the ranks, the node task exits and the batch job ends, with no scancel.
Real slurmctld/slurmd on this machine."""

from __future__ import annotations

import time

import psutil

from infra.launch import exit_code_path
from infra.slurm import FINAL_STATES, SlurmLauncher
from tests.integration.slurm.test_slurm_launcher import RANK_WORKER, _request

LEASE_S = 3.0


def _alive(pids: list[int]) -> list[int]:
    return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def test_ranks_stop_once_the_flow_no_longer_renews_the_lease_file(slurm, tmp_path):
    request = _request(slurm.node, tmp_path / "run", [RANK_WORKER], env={"FORGEFLOW_TEST_PID_DIR": str(tmp_path / "pids")})
    job = SlurmLauncher(grace_s=2, lease_s=LEASE_S).start(request)
    try:
        pid_dir, deadline = tmp_path / "pids", time.monotonic() + 120
        while len(list(pid_dir.glob("rank*.pid")) if pid_dir.exists() else []) < 2 and time.monotonic() < deadline:
            job.poll()  # the flow's watcher polls from the start
            time.sleep(0.5)
        time.sleep(0.5)
        pids = [int(f.read_text()) for f in pid_dir.glob("rank*.pid")]
        assert len(pids) == 2, "the ranks did not start"
        polled_until = time.monotonic() + 3 * LEASE_S  # the flow follows the job: the ranks run on
        while time.monotonic() < polled_until:
            assert job.poll() == {slurm.node: None}
            time.sleep(0.5)
        assert len(_alive(pids)) == 2
        # the flow dies: no more polls, no scancel either
        deadline = time.monotonic() + 120
        while _alive(pids) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _alive(pids), "the ranks outlived their flow"
        while job.state(fresh=True) not in FINAL_STATES and time.monotonic() < deadline:
            time.sleep(0.5)
        assert job.state() in FINAL_STATES and job.state() != "CANCELLED", job.state()
        assert exit_code_path(request, slurm.node).read_text().strip() not in ("", "0")
    finally:
        job.terminate(grace_s=2)
