"""`forgeflow jobs`, `forgeflow cancel` and `forgeflow logs` against a SQLite state database.

Jobs are queued through the library (`Orchestrator.submit` with `demand_options`) on a one-node
cluster of 4 A100s; the commands run in process (`flows.cli.main`), and `logs --follow` as a
real subprocess that must end by itself when the job does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import sqlalchemy as sa

from flows.cli import main
from infra.statedb.schema import jobs as jobs_table
from scheduler.cluster import parse_cluster
from scheduler.orchestrator import Orchestrator, demand_options

REPO = Path(__file__).resolve().parents[3]
INVENTORY = "name: lab\nnodes:\n  - name: n1\n    gpu_type: A100-80G\n    gpu_count: 4\n"


@pytest.fixture
def lab(tmp_path):
    """(db argv, orchestrator, cluster) with the one-node cluster registered."""
    (tmp_path / "lab.yaml").write_text(INVENTORY)
    url = f"sqlite:///{tmp_path / 'jobs.db'}"
    assert main(["cluster", "register", str(tmp_path / "lab.yaml"), "--db", url]) == 0
    return ["--db", url], Orchestrator(url), parse_cluster({"name": "lab", "nodes": [
        {"name": "n1", "gpu_type": "A100-80G", "gpu_count": 4}]})


def _json(capsys, argv: list[str]) -> tuple[int, dict]:
    code = main(argv + ["--json"])
    return code, json.loads(capsys.readouterr().out)


def _by_id(listing: dict) -> dict[int, dict]:
    return {j["job_id"]: j for j in listing["jobs"]}


# --- forgeflow jobs ---------------------------------------------------------------------------


def test_jobs_shows_a_queued_job_with_its_position_reason_and_estimated_start(lab, capsys):
    db, orch, cluster = lab
    first = orch.submit("whole-node", demand_options(cluster, 4, duration_s=600))
    second = orch.submit("pair", demand_options(cluster, 2, duration_s=300))
    admitted = orch.job(first)["admitted_at"]
    code, listing = _json(capsys, ["jobs", *db])
    assert code == 0
    got = _by_id(listing)
    assert got[first]["state"] == "running" and got[first]["gpus"] == "4x A100-80G"
    queued = got[second]
    assert (queued["state"], queued["position"], queued["waiting_reason"]) == ("queued", 1, "no_room")
    assert queued["estimated_start"] == pytest.approx(admitted + 600.0)  # when the whole-node job ends
    assert 0 < queued["estimated_start_in_s"] <= 600.0
    assert queued["why"] == f"no GPU type has room now: wants 2x A100-80G (0 free); GPUs come free when job {first} ends"

    # its flow reports step 10 of 100 at 2 s a step: the first job ends 90 x 2 s after that report
    orch.report_progress(first, phase="training", step=10, steps=100, step_s=2.0, loss=3.25)
    reported = orch.job(first)["progress"]["at"]
    _, listing = _json(capsys, ["jobs", *db])
    got = _by_id(listing)
    assert got[second]["estimated_start"] == pytest.approx(reported + 180.0)
    assert (got[first]["step"], got[first]["steps"], got[first]["loss"]) == (10, 100, 3.25)

    assert main(["jobs", *db]) == 0  # the table
    table = capsys.readouterr().out
    assert "#1, " in table and "min)" in table and "no GPU type has room now" in table and "10/100" in table


def test_jobs_states_recovering_preempted_and_recently_ended(lab, capsys):
    db, orch, cluster = lab
    done = orch.submit("done", demand_options(cluster, 1, duration_s=60))
    old = orch.submit("old", demand_options(cluster, 1, duration_s=60))
    for job in (done, old):
        orch.release(job)
    recovering = orch.submit("recovering", demand_options(cluster, 2, duration_s=600))
    orch.report_progress(recovering, phase="recovering", step=40, diagnosis="cuda_error")
    preempted = orch.submit("preempted", demand_options(cluster, 2, duration_s=600))
    urgent = orch.submit("urgent", demand_options(cluster, 2, duration_s=600), priority=5)
    orch.requeue(preempted, "node check cordoned n1's GPU 3")  # ran once, queued again: urgent took its GPUs
    assert orch.job(urgent)["state"] == "running"
    with orch.engine.begin() as conn:  # `old` ended two hours ago
        conn.execute(sa.update(jobs_table).where(jobs_table.c.id == old).values(
            finished_at=jobs_table.c.finished_at - 7200))
    _, listing = _json(capsys, ["jobs", *db])
    got = _by_id(listing)
    assert got[recovering]["state"] == "recovering" and got[recovering]["diagnosis"] == "cuda_error"
    assert got[preempted]["state"] == "preempted"
    assert got[done]["state"] == "finished" and old not in got
    _, everything = _json(capsys, ["jobs", "--all", *db])
    assert _by_id(everything)[old]["state"] == "finished"


def test_jobs_mine_keeps_my_jobs_on_any_host(lab, capsys, tmp_path):
    db, orch, cluster = lab
    from scheduler.orchestrator.service import default_actor

    me = default_actor().split("@")[0]
    mine = Orchestrator(db[1], actor=f"{me}@another-host").submit("mine", demand_options(cluster, 1))
    theirs = Orchestrator(db[1], actor="someone-else@" + default_actor().split("@")[1]).submit(
        "theirs", demand_options(cluster, 1))
    _, listing = _json(capsys, ["jobs", "--mine", *db])
    assert set(_by_id(listing)) == {mine}
    _, listing = _json(capsys, ["jobs", *db])
    assert set(_by_id(listing)) == {mine, theirs}


# --- forgeflow cancel -------------------------------------------------------------------------


def test_cancel_a_queued_job_takes_it_out_of_the_queue(lab, capsys):
    db, orch, cluster = lab
    orch.submit("blocker", demand_options(cluster, 4))
    waiting = orch.submit("waiting", demand_options(cluster, 4))
    assert main(["cancel", str(waiting), "--reason", "wrong data", *db]) == 0
    assert capsys.readouterr().out.strip() == f"job {waiting} (waiting) was queued: cancelled, it left the queue"
    job = orch.job(waiting)
    assert job["state"] == "cancelled" and job["stop_requested"]["reason"] == "wrong data"
    assert job["stop_requested"]["by"] == orch.actor and "wrong data" in job["reason"]


def test_cancel_a_running_job_asks_its_flow_to_stop(lab, capsys):
    db, orch, cluster = lab
    running = orch.submit("running", demand_options(cluster, 4))
    orch.report_progress(running, phase="training", step=12, steps=100)
    code, out = _json(capsys, ["cancel", str(running), "--reason", "diverging", *db])
    assert code == 0 and out["previous_state"] == "running" and out["state"] == "running"
    assert out["stop_requested"]["reason"] == "diverging" and out["stop_requested"]["by"] == orch.actor
    assert "asked to stop" in out["message"] and "last reported: step 12" in out["message"]
    assert orch.stop_request(running)["reason"] == "diverging"  # what its flow reads (HeldJob)


def test_the_holder_sees_a_cancel_before_its_next_renewal(lab, capsys):
    """A renewal comes every lease_s / 3 (10 s for a flow); the stop request is read in between
    (STOP_CHECK_S), so a cancelled or preempted job stops seconds after it is asked."""
    import time

    from scheduler.orchestrator.lease import HeldJob

    db, orch, cluster = lab
    running = orch.submit("held", demand_options(cluster, 4))
    renewals = []
    renew = orch.renew
    orch.renew = lambda *a, **k: renewals.append(1) or renew(*a, **k)
    with HeldJob(orch, running, every_s=3600) as held:  # no renewal in this test but the first
        assert held.stop_requested is None and renewals == [1]
        assert main(["cancel", str(running), "--reason", "done", *db]) == 0
        deadline = time.monotonic() + 60
        while held.stop_requested is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert held.stop_requested is not None and held.stop_requested["reason"] == "done"
        assert renewals == [1]  # seen between renewals
    capsys.readouterr()


@pytest.mark.parametrize("case, message", [
    ("unknown", "no job with id 99"),
    ("ended", "already finished: nothing to cancel"),
])
def test_cancel_bad_input_is_one_line_exit_2_and_changes_nothing(lab, capsys, case, message):
    db, orch, cluster = lab
    ended = orch.submit("ended", demand_options(cluster, 1))
    orch.release(ended)
    other = orch.submit("other", demand_options(cluster, 1))
    before = [orch.job(j) for j in (ended, other)]
    assert main(["cancel", "99" if case == "unknown" else str(ended), *db]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and err.startswith("error: ")
    assert [orch.job(j) for j in (ended, other)] == before


# --- forgeflow logs ---------------------------------------------------------------------------


def _job_with_logs(orch, cluster, tmp_path) -> tuple[int, Path]:
    run_dir = tmp_path / "runs" / "tiny" / "1"
    job = orch.submit("tiny", demand_options(cluster, 4), spec={"name": "tiny", "run_dir": str(run_dir)})
    runner_log = tmp_path / "runner.log"
    runner_log.write_text("job 1 queued: waiting for GPUs\n")
    orch.set_runner(job, {"kind": "local", "host": "here", "pid": 1, "log": str(runner_log)})
    return job, run_dir


def test_logs_shows_the_runner_log_until_something_is_launched(lab, capsys, tmp_path):
    db, orch, cluster = lab
    job, _ = _job_with_logs(orch, cluster, tmp_path)
    assert main(["logs", str(job), *db]) == 0
    out = capsys.readouterr()
    assert out.out == "job 1 queued: waiting for GPUs\n" and "nothing launched yet" in out.err


def test_logs_shows_the_newest_attempts_node_consoles_a_chosen_attempt_and_a_rank(lab, capsys, tmp_path):
    db, orch, cluster = lab
    job, run_dir = _job_with_logs(orch, cluster, tmp_path)
    logs = run_dir / "logs"
    logs.mkdir(parents=True)
    (logs / "node-n1.attempt-0.out").write_text("[default0]:step 1\n[default0]:CUDA error\n")
    (logs / "node-n2.attempt-0.out").write_text("[default0]:step 1\n")
    (logs / "node-n1.attempt-1.out").write_text("[default0]:resumed at step 1\n")
    (logs / "rank0.log").write_text("rank=0 step=1 loss=3.2\n")
    assert main(["logs", str(job), *db]) == 0
    assert capsys.readouterr().out == "[n1] [default0]:resumed at step 1\n"
    assert main(["logs", str(job), "--attempt", "0", *db]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "[n1] [default0]:step 1", "[n1] [default0]:CUDA error", "[n2] [default0]:step 1"]
    assert main(["logs", str(job), "--rank", "0", *db]) == 0
    assert capsys.readouterr().out == "rank=0 step=1 loss=3.2\n"


@pytest.mark.parametrize("argv, message", [
    (["logs", "99"], "no job with id 99"),
    (["logs", "1", "--attempt", "5"], "has no node logs of attempt 5 (attempts with logs: none yet)"),
    (["logs", "1", "--rank", "0", "--attempt", "0"], "give --rank or --attempt, not both"),
    (["logs", "1", "--rank", "7"], "has no rank 7: it runs ranks 0-3"),
])
def test_logs_bad_input_is_one_line_and_exit_2(lab, capsys, tmp_path, argv, message):
    db, orch, cluster = lab
    _job_with_logs(orch, cluster, tmp_path)
    assert main(argv + db) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.err.count("\n") == 1 and captured.out == ""


def test_logs_follow_tails_the_runner_then_the_attempts_until_the_job_ends(lab, tmp_path):
    db, orch, cluster = lab
    job, run_dir = _job_with_logs(orch, cluster, tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "logs", str(job), "--follow", *db], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watchdog = threading.Timer(300, proc.kill)  # a follow that never ends fails the test, not the session
    watchdog.start()
    try:
        lines = []

        def until(text: str) -> None:
            while text not in lines:
                line = proc.stdout.readline()
                assert line, f"logs --follow ended before printing {text!r}: {lines}"
                lines.append(line.rstrip("\n"))

        until("job 1 queued: waiting for GPUs")
        logs = run_dir / "logs"
        logs.mkdir(parents=True)
        with open(logs / "node-n1.attempt-0.out", "a") as f:
            f.write("[default0]:step 1\n[default0]:step 2 (half a line")
        until("[n1] [default0]:step 1")
        with open(logs / "node-n1.attempt-0.out", "a") as f:
            f.write(")\n")
        until("[n1] [default0]:step 2 (half a line)")
        orch.release(job)  # the job ends: the follow prints what is left and exits by itself
        out, err = proc.communicate(timeout=120)
    finally:
        watchdog.cancel()
    assert proc.returncode == 0, err
    assert "==> job 1 (tiny), attempt 0: n1 <==" in err


def test_a_job_whose_runner_is_gone_says_so(tmp_path, monkeypatch, capsys):
    """A detached runner that died leaves its job to nobody: `forgeflow jobs` says so and what to do."""
    import socket
    import subprocess
    import sys

    from flows.cli import main
    from scheduler.orchestrator.seat import cluster_orchestrator, queue_spec
    from training.config import load_job_spec

    monkeypatch.setenv("FORGEFLOW_DB_URL", f"sqlite:///{tmp_path / 'state.db'}")
    spec = load_job_spec("configs/tiny-cpu.yaml", {"run_dir": str(tmp_path / "{name}/{job}")})
    job = queue_spec(spec, "configs/clusters/frenzy-testbed.yaml", gpu_type="A800-80G", gpus=4)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    orch = cluster_orchestrator()
    orch.set_runner(job.job_id, {"kind": "local", "host": socket.gethostname(), "pid": gone.pid})
    assert main(["jobs", "--json"]) == 0
    (entry,) = json.loads(capsys.readouterr().out)["jobs"]
    assert entry["runner_alive"] is False
    assert main(["jobs"]) == 0
    assert f"forgeflow cancel {job.job_id}" in capsys.readouterr().out.replace("\n", "")
    orch.set_runner(job.job_id, {"pid": os.getpid()})  # this test's own process: alive
    assert main(["jobs", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["jobs"][0]["runner_alive"] is True
