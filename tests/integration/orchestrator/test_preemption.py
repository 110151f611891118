"""Preemption that ends in a checkpoint (issue 31 item 1), orchestrator side, on a real PostgreSQL
and on SQLite: the decider asks the victim to stop, the victim's holder releases it as preempted
(queued again at its submit time), the waiting job is admitted; a victim that never releases is
force-released at its deadline; no GPU is ever held twice (the allocation history's replay)."""

from __future__ import annotations

import time

import pytest
import sqlalchemy as sa

from infra.statedb import read_transaction
from infra.statedb.schema import allocation_events, preemptions

from scheduler.cluster import parse_cluster
from scheduler.orchestrator import LeaseLostError, Orchestrator, OrchestratorConfig, OrchestratorError, demand_options
from scheduler.orchestrator import double_booked
from scheduler.orchestrator.node_lease import NodeLease
from scheduler.orchestrator.usage import usage
from scheduler.orchestrator.views import job_list

ONE_CPU = {"name": "one", "policy": "has",
           "nodes": [{"name": "n1", "gpu_type": "cpu", "gpu_count": 1, "gpu_memory_gib": 16, "peak_tflops": 1}]}


def _orchestrator(url: str) -> Orchestrator:
    orch = Orchestrator(url, OrchestratorConfig(lease_s=600, preempt_stop_s=300))
    orch.register(parse_cluster(ONE_CPU))
    return orch


def _entry(orch: Orchestrator, job_id: int) -> dict:
    return next(j for j in job_list(orch.engine)["jobs"] if j["job_id"] == job_id)


def test_a_low_priority_job_stops_for_a_high_one_and_comes_back_first_of_its_class(state_db_url):
    orch = _orchestrator(state_db_url)
    holder = Orchestrator(state_db_url, OrchestratorConfig(lease_s=600))  # the victim's flow: its own process
    one = demand_options(orch.cluster(), 1, duration_s=10)
    a = orch.submit("a", one, priority=0)
    a_admission = orch.admission(a)
    assert orch.preempt() == {"asked": [], "forced": []}  # nothing waits: nobody is asked
    later = orch.submit("later", one, priority=0)  # same class as A, after it
    b = orch.submit("b", one, priority=10)
    assert [orch.job(j)["state"] for j in (a, later, b)] == ["running", "queued", "queued"]

    assert orch.preempt() == {"asked": [[a, b]], "forced": []}
    request = holder.stop_request(a)
    assert request["reason"] == f"preempted by job {b}" and request["preempted_by"] == b
    assert request["deadline"] > request["at"]
    assert orch.preempt() == {"asked": [], "forced": []}  # asked once: its GPU is already coming free
    assert orch.job(b)["state"] == "queued"  # A keeps its GPU until its ranks committed and stopped
    assert _entry(orch, a)["stop_requested"]["reason"] == f"preempted by job {b}"

    # A's flow stopped the ranks (they committed their step) and releases it as preempted
    assert holder.release(a, outcome="preempted", attempt=a_admission.attempt) == "running"
    assert orch.job(b)["state"] == "running"
    a_row = orch.job(a)
    assert a_row["state"] == "queued" and a_row["reason"] == f"preempted by job {b}"
    assert a_row["stop_requested"] is None and a_row["queued_at"] == a_row["submitted_at"]
    entry = _entry(orch, a)
    assert entry["state"] == "preempted" and entry["reason"] == f"preempted by job {b}"
    assert orch.queue_position(a) == (1, 2) and orch.queue_position(later) == (2, 2)
    # a late second release by the same holder changes nothing
    assert holder.release(a, outcome="preempted", attempt=a_admission.attempt) == "queued"
    assert orch.job(b)["state"] == "running"

    with read_transaction(orch.engine) as conn:  # one record, ended by A's own release
        records = conn.execute(sa.select(preemptions.c.job_id, preemptions.c.preempted_by, preemptions.c.forced,
                                         preemptions.c.ended_at.is_not(None))).all()
    assert [tuple(r) for r in records] == [(a, b, False, True)]
    orch.release(b)  # B ends: A (not the later job of its class) gets the GPU back
    assert orch.job(a)["state"] == "running" and orch.job(later)["state"] == "queued"
    assert orch.admission(a).attempt == a_admission.attempt + 1
    with pytest.raises(LeaseLostError):  # the old admission's holder is fenced off
        holder.renew(a, attempt=a_admission.attempt)
    assert orch.preempt() == {"asked": [], "forced": []}  # same class: no preemption among equals
    orch.release(a)
    assert orch.job(later)["state"] == "running"
    assert double_booked(orch.engine) == 0


def test_a_victim_that_never_stops_is_force_released_at_its_deadline(state_db_url):
    orch = _orchestrator(state_db_url)
    holder = Orchestrator(state_db_url, OrchestratorConfig(lease_s=600))
    one = demand_options(orch.cluster(), 1, duration_s=10)
    a = orch.submit("a", one, priority=0)
    a_admission = orch.admission(a)
    b = orch.submit("b", one, priority=10)
    assert orch.preempt(stop_s=0.5) == {"asked": [[a, b]], "forced": []}
    assert orch.preempt() == {"asked": [], "forced": []}  # before its deadline nothing is forced
    assert orch.job(a)["state"] == "running" and orch.job(b)["state"] == "queued"
    holder.renew(a, attempt=a_admission.attempt)  # A's holder keeps renewing, and never stops
    deadline = holder.stop_request(a)["deadline"]
    time.sleep(0.6)  # past the deadline (on the database's clock: the next decision reads it)

    result = orch.preempt()
    assert result["forced"] == [a]
    assert orch.job(b)["state"] == "running"
    a_row = orch.job(a)
    assert a_row["state"] == "queued" and a_row["reason"].startswith(f"preempted by job {b} (forced")
    with read_transaction(orch.engine) as conn:  # the history says how A's allocation ended
        ends = conn.execute(sa.select(allocation_events.c.event, allocation_events.c.at).where(
            allocation_events.c.job_id == a, allocation_events.c.event != "allocate")).all()
    assert [e for e, _ in ends] == ["preempt"] and ends[0][1] >= deadline
    with read_transaction(orch.engine) as conn:  # the record `cluster usage` counts: ended, forced
        records = conn.execute(sa.select(preemptions.c.job_id, preemptions.c.preempted_by, preemptions.c.ended_at,
                                         preemptions.c.forced)).all()
    assert [(j, by, forced) for j, by, _, forced in records] == [(a, b, True)] and records[0][2] >= deadline
    (me,) = usage(orch.engine, since_s=3600, by="user")["rows"]  # one submitter: it suffered and caused it
    assert (me["preemptions_suffered"], me["preemptions_caused"]) == (1, 1)
    # its lease is revoked: the holder's renewal fails and the node's own check says gone
    with pytest.raises(LeaseLostError):
        holder.renew(a, attempt=a_admission.attempt)
    look = NodeLease(orch.engine, 600, a, "n1", a_admission.attempt).look()
    assert look.held is False
    # its holder's late release touches nothing of B's
    holder.release(a, outcome="preempted", attempt=a_admission.attempt)
    assert orch.job(b)["state"] == "running" and orch.job(a)["state"] == "queued"
    orch.release(b)
    assert orch.job(a)["state"] == "running"
    assert double_booked(orch.engine) == 0


def test_a_cancel_while_preempted_ends_the_job_and_bad_outcomes_are_refused(state_db_url):
    orch = _orchestrator(state_db_url)
    one = demand_options(orch.cluster(), 1, duration_s=10)
    a = orch.submit("a", one, priority=0)
    b = orch.submit("b", one, priority=10)
    orch.preempt()
    orch.request_stop(a, "not needed")  # a person's cancel replaces the preemption request
    orch.release(a, outcome="cancelled")
    assert orch.job(a)["state"] == "cancelled" and orch.job(b)["state"] == "running"
    with pytest.raises(OrchestratorError, match="outcome must be one of"):
        orch.release(b, outcome="paused")
    with pytest.raises(OrchestratorError, match="stop deadline"):
        Orchestrator(state_db_url, OrchestratorConfig()).preempt()


def test_forgeflow_jobs_says_preempted_by_job_n(state_db_url, capsys):
    from flows.cli import main

    orch = _orchestrator(state_db_url)
    one = demand_options(orch.cluster(), 1, duration_s=10)
    a = orch.submit("victim", one, priority=0)
    attempt = orch.admission(a).attempt
    b = orch.submit("urgent", one, priority=10)
    orch.preempt()
    assert main(["jobs", "--db", state_db_url]) == 0
    line = next(row for row in capsys.readouterr().out.splitlines() if "victim" in row)
    assert f"preempted by job {b}: stopping" in line and "running" in line
    orch.release(a, outcome="preempted", attempt=attempt)
    assert main(["jobs", "--db", state_db_url]) == 0
    line = next(row for row in capsys.readouterr().out.splitlines() if "victim" in row)
    assert "preempted" in line.split(f"preempted by job {b}")[0] and f"preempted by job {b}" in line


def _until(check, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_the_decider_preempts_and_the_victims_seat_yields_then_holds_its_next_admission(state_db_url):
    import threading

    from scheduler.orchestrator.lease import HeldJob
    from scheduler.orchestrator.seat import Seat

    orch = _orchestrator(state_db_url)  # preempt_stop_s set: its serve() preempts
    flow = Orchestrator(state_db_url, OrchestratorConfig(lease_s=600))  # the victim's flow
    one = demand_options(orch.cluster(), 1, duration_s=10)
    a = flow.submit("a", one, priority=0)
    stop = threading.Event()
    decider = threading.Thread(target=orch.serve, kwargs={"stop": stop}, daemon=True)
    decider.start()
    try:
        with HeldJob(flow, a) as held:
            seat = Seat(flow, a, held, "one", [], "a", poll_s=0.05)
            b = flow.submit("b", one, priority=10)
            _until(lambda: flow.stop_request(a) is not None, "the decider to ask A to stop")
            held.stop_requested = flow.stop_request(a)  # what the holder's next renewal reads
            assert seat.preempted_by() == b and seat.stop_requested() == f"preempted by job {b}"
            placed = []
            yielding = threading.Thread(target=lambda: placed.append(seat.yield_to_preemption()), daemon=True)
            yielding.start()
            _until(lambda: flow.job(b)["state"] == "running", "B to be admitted")
            assert flow.job(a)["state"] == "queued" and not placed
            flow.release(b)
            yielding.join(timeout=60)
            assert placed and placed[0].world_size == 1
            assert held.attempt == 2 and seat.preempted_by() is None and flow.job(a)["state"] == "running"
        assert flow.job(a)["state"] == "finished"
    finally:
        stop.set()
        decider.join(timeout=30)
    assert double_booked(orch.engine) == 0


def test_forgeflow_cluster_serve_preempts_with_preempt_stop_s(state_db_url, capsys):
    from flows.cli import main

    orch = _orchestrator(state_db_url)
    one = demand_options(orch.cluster(), 1, duration_s=10)
    a = orch.submit("a", one, priority=0)
    b = orch.submit("b", one, priority=10)
    assert main(["cluster", "serve", "--seconds", "1", "--db", state_db_url]) == 0
    assert orch.stop_request(a) is None  # without the option the decider preempts nothing
    assert main(["cluster", "serve", "--seconds", "1.5", "--preempt-stop-s", "30", "--db", state_db_url]) == 0
    request = orch.stop_request(a)
    assert request["reason"] == f"preempted by job {b}" and request["deadline"] - request["at"] == pytest.approx(30)
    capsys.readouterr()
    assert main(["cluster", "serve", "--seconds", "1", "--preempt-stop-s", "0", "--db", state_db_url]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--preempt-stop-s" in err[0] and "above 0" in err[0]
