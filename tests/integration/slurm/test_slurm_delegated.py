"""Delegated mode on the session's real Slurm: Slurm chooses the node (no --nodelist), the
placement is read back from the job, and a job Slurm keeps PENDING behind another job shows
Slurm's reason in the flow's log and `forgeflow jobs`, spends no restart, and trains once it starts.
The orchestrator keeps a mirror of the delegated job (issue 32): Slurm's job id, state and reason,
and no allocation or lease of the orchestrator's GPUs."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import threading
import time

import pytest

from flows.pretrain import pretrain

# The watcher's start-up timeout here (the test waits it out while the job is PENDING): long enough
# for tiny-cpu to start on a busy machine (Slurm's start to rank 0's `started`: 4 s on an idle 2-core box,
# over 30 s on a slow one running three workers' tests)
STARTUP_S = 45.0


def _slurm(slurm, *args: str) -> str:
    return subprocess.run(list(args), env={**os.environ, **slurm.env()}, capture_output=True, text=True,
                          check=True).stdout.strip()


def _until(what: str, check, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def sleeper(slurm):
    """Another job that takes every CPU of the one node until scancelled."""
    job_id = _slurm(slurm, "sbatch", "--parsable", "--exclusive", "--job-name=someone-else",
                    "--output=/dev/null", "--wrap", "sleep 900").split(";")[0]
    _until("the sleeper to run", lambda: _slurm(slurm, "squeue", "-h", "-j", job_id, "-o", "%T") == "RUNNING")
    yield job_id
    subprocess.run(["scancel", job_id], env={**os.environ, **slurm.env()}, check=False)


def test_a_job_pending_behind_another_waits_with_slurms_reason_and_trains_when_it_starts(
        prefect_api, slurm, slurm_job, slurm_cluster, sleeper, caplog, monkeypatch):
    import sqlalchemy as sa

    from infra.statedb import read_transaction
    from infra.statedb.schema import allocations
    from infra.watch import watch
    from scheduler.orchestrator import OrchestratorError
    from scheduler.orchestrator.seat import cluster_orchestrator
    from scheduler.orchestrator.views import job_list

    # A start-up timeout (600 s by default) shorter than the time the job waits in the queue
    monkeypatch.setattr("tasks.pretrain_tasks.watch", functools.partial(watch, startup_timeout_s=STARTUP_S))
    job = slurm_job("slurm-pending")
    results: list = []
    flow = threading.Thread(target=lambda: results.append(pretrain(
        str(job), cluster=str(slurm_cluster), launcher="slurm", max_restarts=0)), daemon=True)
    flow.start()
    run_dir = job.parent / "slurm-pending" / "run"
    job_id_file = run_dir / "launch" / "attempt-0" / "slurm-job-id"
    ours = _until("the flow's batch job", lambda: job_id_file.exists() and job_id_file.read_text().strip())
    state, reason = _until("Slurm to hold it PENDING with a reason", lambda: (
        lambda out: out.split("|") if out.startswith("PENDING|") and not out.endswith("|None") else None)(
        _slurm(slurm, "squeue", "-h", "-j", ours, "-o", "%T|%r")))
    assert reason in ("Resources", "Priority")
    sbatch = (run_dir / "launch" / "attempt-0" / "job.sbatch").read_text()
    assert "--delegated" in sbatch

    def listed():
        mine = [j for j in job_list(cluster_orchestrator().engine)["jobs"] if j["name"] == "slurm-pending"]
        return mine[0] if mine and mine[0]["state"] == "waiting" else None

    entry = _until("forgeflow jobs to show it waiting in Slurm", listed)
    assert entry["waiting"] == f"waiting in Slurm: {reason} (job {ours})"
    # The orchestrator's mirror of the delegated job: what Slurm says, and nothing held here
    orch = cluster_orchestrator()
    mirrored = _until("the mirror to show Slurm's PENDING and its reason", lambda: (
        lambda e: e if e.get("batch") == f"slurm {ours}: PENDING ({reason})" else None)(listed() or {}))
    row = orch.job(mirrored["job_id"])
    assert row["state"] == "delegated" and row["placement"] is None and row["attempts"] == 0
    assert (row["batch"]["system"], row["batch"]["id"], row["batch"]["state"], row["batch"]["reason"]) == (
        "slurm", ours, "PENDING", reason)
    with read_transaction(orch.engine) as conn:  # no allocation (so no lease), live or ended
        assert conn.execute(sa.select(sa.func.count()).select_from(allocations).where(
            allocations.c.job_id == row["id"])).scalar() == 0
    with pytest.raises(OrchestratorError, match="delegated"):
        orch.admission(row["id"])  # not admitted anywhere: nothing to hold
    time.sleep(STARTUP_S + 10)  # longer than the start-up timeout: a queued job is no hang
    assert flow.is_alive() and not (run_dir / "launch" / "attempt-1").exists()

    subprocess.run(["scancel", sleeper], env={**os.environ, **slurm.env()}, check=True)
    flow.join(timeout=300)
    assert not flow.is_alive()
    result = results[0]
    assert result.finished and result.final_step == 12 and result.attempts == 1 and not result.failures, result
    row = orch.job(result.job_id)  # ended as any job; the mirror keeps where Slurm ran it and how it ended
    assert row["state"] == "finished" and row["batch"]["state"] == "COMPLETED" and row["batch"]["nodes"] == [slurm.node]
    assert f"waiting in Slurm: {reason}" in caplog.text
    # Slurm was asked when each option would start; the one it would finish first was submitted
    assert "Slurm's predicted starts (sbatch --test-only)" in caplog.text and "✓ 2x cpu on 1 node(s) x 2" in caplog.text
    # The placement the job really had, built inside it from Slurm's environment.
    placement = json.loads((run_dir / "launch" / "attempt-0" / "placement.json").read_text())
    assert placement["slurm_job_id"] == ours and placement["master_addr"] == slurm.node
    assert [(n["node"], n["node_rank"], n["nproc_per_node"]) for n in placement["nodes"]] == [(slurm.node, 0, 2)]


def test_forgeflow_cancel_while_pending_takes_the_job_out_of_slurms_queue(
        prefect_api, slurm, slurm_job, slurm_cluster, sleeper):
    from scheduler.orchestrator.seat import cluster_orchestrator
    from scheduler.orchestrator.views import job_list

    job = slurm_job("slurm-pending-cancel")
    results: list = []
    flow = threading.Thread(target=lambda: results.append(pretrain(
        str(job), cluster=str(slurm_cluster), launcher="slurm")), daemon=True)
    flow.start()
    orch = cluster_orchestrator()
    entry = _until("forgeflow jobs to show it waiting in Slurm", lambda: next(
        (j for j in job_list(orch.engine)["jobs"] if j["name"] == "slurm-pending-cancel" and j["state"] == "waiting"),
        None))
    ours = (job.parent / "slurm-pending-cancel" / "run" / "launch" / "attempt-0" / "slurm-job-id").read_text().strip()
    orch.request_stop(entry["job_id"], "not needed after all", by="test")
    flow.join(timeout=180)
    assert not flow.is_alive()
    result = results[0]
    assert result.cancelled and not result.finished and result.attempts == 1 and not result.failures, result
    assert "not needed after all" in result.stopped_because
    assert _slurm(slurm, "squeue", "-h", "-j", ours, "-o", "%T") in ("", "CANCELLED")  # out of Slurm's queue
    assert _slurm(slurm, "squeue", "-h", "-j", sleeper, "-o", "%T") == "RUNNING"  # the other job untouched


def test_slurm_is_asked_when_each_option_would_start_and_the_one_done_first_is_submitted(slurm, tmp_path, monkeypatch):
    """`sbatch --test-only` for each option with the options it would be submitted with; the one
    Slurm would finish first (not the one it would start first) is submitted, never with --nodelist."""
    from datetime import datetime, timedelta, timezone

    from infra import slurm as slurm_module
    from infra import slurm_start
    from infra.launch import CHOOSE_ON_NODE_0, LaunchRequest, NodeLaunch
    from infra.slurm import SlurmLauncher, SlurmSettings
    from infra.slurm_start import StartCandidate, choose_start

    sbatch_calls: list[list[str]] = []
    real = slurm_module.slurm_command

    def spy(args, settings, check=True, **kwargs):
        if args[0] == "sbatch":
            sbatch_calls.append(list(args))
        return real(args, settings, check, **kwargs)

    monkeypatch.setattr(slurm_module, "slurm_command", spy)
    monkeypatch.setattr(slurm_start, "slurm_command", spy)

    def request(nodes: int, nproc: int) -> LaunchRequest:
        return LaunchRequest("start-choice", [
            NodeLaunch(node=f"any-{i}", address=f"any-{i}", node_rank=i, nnodes=nodes, nproc_per_node=nproc,
                       cuda_visible_devices="", master_addr="any-0", master_port=CHOOSE_ON_NODE_0,
                       first_global_rank=i * nproc) for i in range(nodes)], [], tmp_path / "run")

    # Someone else's job holds one of the node's two CPUs for up to 10 minutes.
    other = _slurm(slurm, "sbatch", "--parsable", "--cpus-per-task=1", "--time=10", "--job-name=someone-else",
                   "--output=/dev/null", "--wrap", "sleep 900").split(";")[0]
    try:
        _until("the other job to run", lambda: _slurm(slurm, "squeue", "-h", "-j", other, "-o", "%T") == "RUNNING")
        launcher = SlurmLauncher(SlurmSettings(partition="debug", slurm_conf=str(slurm.conf), poll_s=0.5))
        candidates = [StartCandidate("1 CPU for 20 min", request(1, 1), "cpu", 1200.0),
                      StartCandidate("2 CPUs for 1 min", request(1, 2), "cpu", 60.0),
                      StartCandidate("2 nodes", request(2, 1), "cpu", 30.0)]
        now = datetime.now(timezone.utc)
        choice = choose_start(launcher, candidates)
        assert [call[:2] for call in sbatch_calls] == [["sbatch", "--test-only"]] * 3
        for call, candidate in zip(sbatch_calls, candidates):
            assert call[2:] == launcher.submit_args(candidate.request, candidate.gpu_type)
        one_cpu, two_cpus, two_nodes = choice.options
        assert two_nodes.refused and two_nodes.said == "Requested node configuration is not available"
        assert abs(one_cpu.start - now) < timedelta(minutes=2)  # the free CPU, now (read in UTC)
        assert two_cpus.start >= one_cpu.start + timedelta(minutes=8)  # both CPUs once the other job ends
        assert choice.chosen is two_cpus  # it starts later and finishes first

        job = launcher.start(candidates[choice.chosen_index].request)
        try:
            submitted = sbatch_calls[-1]
            assert submitted[:2] == ["sbatch", "--parsable"] and submitted[2:-1] == list(two_cpus.args)
            assert not any(a.startswith(("--nodelist", "-w")) for call in sbatch_calls for a in call)
            assert "--signal=B:TERM@120" in submitted and "--partition=debug" in submitted
            assert job.waiting() is not None  # queued behind the other job, as Slurm predicted
        finally:
            job.terminate(grace_s=1.0)
    finally:
        subprocess.run(["scancel", other], env={**os.environ, **slurm.env()}, check=False)


def test_forgeflow_submit_to_delegated_slurm_records_a_mirror_that_holds_no_gpu(slurm, slurm_job, slurm_cluster):
    """`forgeflow submit --launcher slurm` on a delegate-mode cluster: the job is recorded as
    delegated from the start, never queued for (or admitted onto) the orchestrator's GPUs, even
    before its runner takes it up; with `--launcher local` the same job is admitted."""
    import sqlalchemy as sa

    from infra.statedb import read_transaction
    from infra.statedb.schema import allocations
    from scheduler.orchestrator.seat import cluster_orchestrator, queue_spec
    from training.config import load_job_spec

    orch = cluster_orchestrator()
    delegated = queue_spec(load_job_spec(slurm_job("submitted-delegated")), str(slurm_cluster),
                           launcher="slurm").job_id
    pinned_here = queue_spec(load_job_spec(slurm_job("submitted-here")), str(slurm_cluster), launcher="local").job_id
    try:
        assert orch.job(delegated)["state"] == "delegated"
        assert orch.job(pinned_here)["state"] in ("queued", "running")
        with read_transaction(orch.engine) as conn:
            assert conn.execute(sa.select(sa.func.count()).select_from(allocations).where(
                allocations.c.job_id == delegated)).scalar() == 0
    finally:
        for job_id in (delegated, pinned_here):
            orch.cancel(job_id, reason="test over")
