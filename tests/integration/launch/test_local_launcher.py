"""LocalLauncher: real torchrun processes; no rank may survive termination or a crash of the launcher."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from infra.launch import LaunchRequest, LocalLauncher, local_node_launches, torchrun_command
from testing.torchrun_ranks import running

WORKER = str(Path(__file__).with_name("rank_worker.py"))


def _request(tmp_path: Path, port: int, env: dict[str, str] | None = None) -> LaunchRequest:
    return LaunchRequest(
        job_name="launch-test",
        nodes=local_node_launches(["node-a", "node-b"], 1, port),
        worker_args=[WORKER],
        run_dir=tmp_path / "run",
        env={"FORGEFLOW_TEST_PID_DIR": str(tmp_path / "pids"), **(env or {})},
    )


def _wait_for_pids(pid_dir: Path, count: int, timeout: float = 120) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = list(pid_dir.glob("rank*.pid")) if pid_dir.exists() else []
        if len(files) == count and all(f.read_text() for f in files):
            return [int(f.read_text()) for f in files]
        time.sleep(0.2)
    raise AssertionError(f"ranks did not start within {timeout}s")


def _all_gone(pids, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if not any(running(p) for p in pids):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)


def test_command_has_rendezvous_and_node_shape(tmp_path):
    request = _request(tmp_path, 29400)
    cmd = torchrun_command(request.nodes[1], request)
    assert "--nnodes=2" in cmd and "--nproc-per-node=1" in cmd
    assert "--node-rank=1" in cmd and "--master-addr=127.0.0.1" in cmd and "--master-port=29400" in cmd
    assert cmd[-1] == WORKER


def test_bad_node_ranks_are_refused(tmp_path):
    with pytest.raises(ValueError, match="node ranks"):
        bad = local_node_launches(["a", "b"], 1, 1)[1:]  # node rank 1 of 2, alone
        LaunchRequest("j", bad, [WORKER], tmp_path)


def test_terminate_kills_every_rank(tmp_path, free_port):
    job = LocalLauncher(grace_s=2).start(_request(tmp_path, free_port))
    try:
        ranks = _wait_for_pids(tmp_path / "pids", 2)
        everything = job.pids() | set(ranks)
        assert set(ranks) <= everything
        assert job.poll() == {"node-a": None, "node-b": None}
    finally:
        job.terminate(grace_s=2)
    assert _all_gone(everything)
    assert all(code is not None for code in job.poll().values())


def test_exit_code_of_a_failing_rank_is_reported(tmp_path, free_port):
    job = LocalLauncher(grace_s=2).start(_request(tmp_path, free_port, env={"FORGEFLOW_TEST_EXIT": "3"}))
    try:
        codes = job.wait(timeout=180, any_exit=True)
    finally:
        job.terminate(grace_s=2)
    assert any(code not in (0, None) for code in codes.values()), codes
    logs = "".join(p.read_text(errors="replace") for p in job.log_paths().values())
    assert "[default0]:rank" in logs  # torchrun's per-rank prefix reaches the node log


def test_ranks_die_with_a_crashed_launcher(tmp_path, free_port):
    """SIGKILL the process that launched the job: the reapers must take every rank down."""
    driver = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_local_launcher import _request
        from infra.launch import LocalLauncher
        from pathlib import Path
        job = LocalLauncher(grace_s=2).start(_request(Path({str(tmp_path)!r}), {free_port}))
        print("started", flush=True)
        time.sleep(600)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", driver], stdout=subprocess.PIPE, cwd=os.getcwd())
    try:
        ranks = _wait_for_pids(tmp_path / "pids", 2)
        everything = {p.pid for p in psutil.Process(parent.pid).children(recursive=True)} | set(ranks)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        assert _all_gone(everything, timeout=60), "ranks outlived their launcher"
    finally:
        if parent.poll() is None:
            parent.kill()


def _agent_and_ranks(reaper_pid: int) -> tuple[psutil.Process, list[psutil.Process]]:
    (agent,) = psutil.Process(reaper_pid).children()
    return agent, agent.children(recursive=True)


def test_a_sigkilled_reaper_takes_its_torchrun_and_ranks_along(tmp_path, free_port):
    """SIGKILL one node's reaper: its torchrun (parent-death SIGTERM, infra/reaper.py) stops its
    ranks and exits instead of training on as orphans; the launcher sees that node fail (-9), and
    terminate() still finds a tree whose reaper is gone (the reaper's process group)."""
    job = LocalLauncher(grace_s=2).start(_request(tmp_path, free_port))
    try:
        _wait_for_pids(tmp_path / "pids", 2)
        a, b = job.processes["node-a"].pid, job.processes["node-b"].pid
        agent_a, ranks_a = _agent_and_ranks(a)
        agent_b, ranks_b = _agent_and_ranks(b)
        assert ranks_a and ranks_b
        # node-b's torchrun is stopped first: node-a's agent hosts the world's store, and node-b's
        # must not act on node-a's end while node-a's tree is checked.
        agent_b.suspend()
        os.kill(a, signal.SIGKILL)
        assert _all_gone([agent_a.pid, *(r.pid for r in ranks_a)], timeout=60), "node-a's tree outlived its reaper"
        assert job.poll()["node-a"] == -signal.SIGKILL  # what the flow reads: a failure, not a finish
        os.kill(b, signal.SIGKILL)
        job.processes["node-b"].wait()
        # node-b's reaper is gone. Its torchrun is in the reaper's group, which that death leaves
        # orphaned with a stopped member, so the kernel sends the group SIGHUP and SIGCONT: the
        # torchrun wakes and may stop its rank at any moment from here (a run did so before this
        # check). Whatever of node-b is still alive after pids() looked, pids() found.
        found = job.pids()
        alive = {pid for pid in (agent_b.pid, *(r.pid for r in ranks_b)) if running(pid)}
        assert alive <= found, (alive, found)
    finally:
        job.terminate(grace_s=2)
    assert _all_gone([agent_b.pid, *(r.pid for r in ranks_b)], timeout=30), "terminate left node-b's tree"
    assert not job.pids()


def test_a_reaped_reapers_pid_led_by_another_program_is_left_alone(tmp_path):
    """Once a node's reaper is reaped, the kernel may give its pid to another program, which can
    lead a process group of its own with it (a database server did, next to a test's job): the
    job's terminate() and pids() must not take that group for the reaper's. The reuse is made
    here by pointing the reaped Popen at a group started after it was reaped, as the kernel would."""
    from infra.launch import LocalJob

    reaper = subprocess.Popen(["true"], start_new_session=True)
    job = LocalJob(_request(tmp_path, 0), {"node-a": reaper}, {})
    assert job.wait(timeout=30) == {"node-a": 0}
    time.sleep(0.1)  # start times are kept in 10 ms ticks
    other = subprocess.Popen(["sh", "-c", "sleep 600 & wait"], start_new_session=True)  # a leader and a member
    member = None
    try:
        deadline = time.monotonic() + 30
        while not psutil.Process(other.pid).children() and time.monotonic() < deadline:
            time.sleep(0.05)
        member = psutil.Process(other.pid).children()[0]
        assert os.getpgid(member.pid) == other.pid
        reaper.pid = other.pid  # the reaped reaper's number, now another program's group
        assert not job.pids()
        job.terminate(grace_s=1)
        assert other.poll() is None and member.is_running(), "terminate() signalled another program's group"
    finally:
        for proc in (member, psutil.Process(other.pid)):
            if proc is not None and proc.is_running():
                proc.kill()
        other.wait()


def test_wait_wakes_when_a_reaper_exits_not_at_a_poll_interval(tmp_path):
    """The watcher sees a node's exit when it happens (the reapers' pidfds), not at its next poll:
    a wait for the first exit polls once before and once after it, however long that takes."""
    from infra.launch import LocalJob

    lives, ends = (subprocess.Popen(cmd, start_new_session=True) for cmd in (["sleep", "600"], ["sleep", "1.5"]))
    job = LocalJob(_request(tmp_path, 0), {"node-a": lives, "node-b": ends}, {})
    polls = []
    poll = job.poll
    job.poll = lambda: polls.append(1) or poll()
    try:
        assert job.wait(timeout=60, any_exit=True) == {"node-a": None, "node-b": 0}
        assert len(polls) == 2  # polling every 0.2 s would have polled about 8 times
        assert job.wait(timeout=0.3, any_exit=False) == {"node-a": None, "node-b": 0}  # and times out
    finally:
        lives.kill()
        lives.wait()


def test_ranks_get_what_they_need_and_none_of_the_workers_secrets(tmp_path, free_port, monkeypatch):
    secrets = ("SLACK_WEBHOOK_URL", "PREFECT_API_AUTH_STRING", "PREFECT_API_KEY", "OPENAI_API_KEY",
               "FORGEFLOW_DB_URL", "FORGEFLOW_LLM_API_KEY", "PGPASSWORD", "GITHUB_TOKEN")
    needed = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "NCCL_DEBUG", "PYTORCH_CUDA_ALLOC_CONF", "OMP_NUM_THREADS",
              "HF_HOME", "FORGEFLOW_TRUST_LEGACY_CHECKPOINTS", "WANDB_API_KEY", "LC_ALL")
    for name in secrets + needed:
        monkeypatch.setenv(name, "x")
    job = LocalLauncher(grace_s=2).start(_request(tmp_path, free_port, env={"FORGEFLOW_TEST_EXIT": "0"}))
    try:
        _wait_for_pids(tmp_path / "pids", 2)
    finally:
        job.terminate(grace_s=2)
    for rank in (0, 1):
        seen = set(json.loads((tmp_path / "pids" / f"rank{rank}.env").read_text()))
        assert not seen & set(secrets)
        assert set(needed) | {"PATH", "FORGEFLOW_TEST_PID_DIR", "FORGEFLOW_NODE_NAME", "RANK", "MASTER_ADDR"} <= seen
