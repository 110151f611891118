"""The elastic policy (`scheduler.elastic`) in the live orchestrator, on SQLite and a real PostgreSQL:
a cluster registered with `policy: elastic` admits queued jobs FCFS-opportunistic, and its decider
(`Orchestrator.resize`) carries out each resize as a preemption: the job is asked to stop, its
flow releases it as preempted, and it is admitted again on the layout and GPUs it was promised
(shrink: the freed GPUs go to the waiting job; grow: the idle GPUs are kept for it meanwhile)."""

from __future__ import annotations

import time

import pytest
import sqlalchemy as sa

from infra.statedb import read_transaction
from infra.statedb.schema import preemptions
from scheduler.cluster import parse_cluster
from scheduler.elastic import ElasticConfig
from scheduler.orchestrator import LeaseLostError, Orchestrator, OrchestratorConfig, demand_options
from scheduler.orchestrator import double_booked
from scheduler.orchestrator.usage import usage
from scheduler.policy import Option
from scheduler.orchestrator.start_estimates import queue_estimates

FOUR_CPUS = {"name": "four", "policy": "elastic",
             "nodes": [{"name": "n1", "gpu_type": "cpu", "gpu_count": 4, "gpu_memory_gib": 16, "peak_tflops": 1}]}


def test_an_elastic_cluster_admits_fcfs(state_db_url):
    orch = Orchestrator(state_db_url, OrchestratorConfig(lease_s=600))
    orch.register(parse_cluster(FOUR_CPUS))
    three = demand_options(orch.cluster(), 3, duration_s=10)
    assert three["elastic"] == three["fcfs"]
    a = orch.submit("a", three)
    b = orch.submit("b", three)
    one = orch.submit("one", demand_options(orch.cluster(), 1, duration_s=10))  # opportunistic: passes B
    assert [orch.job(j)["state"] for j in (a, b, one)] == ["running", "queued", "running"]
    assert queue_estimates(orch.engine)[b].start_s is not None  # A's predicted end (its FCFS pass)
    orch.release(a)
    assert orch.job(b)["state"] == "running"
    assert double_booked(orch.engine) == 0
    config = Orchestrator(state_db_url, OrchestratorConfig(policy="elastic", lease_s=600))  # the config's literal
    c = config.submit("c", three)
    assert config.job(c)["state"] == "queued"
    config.release(b)
    assert config.job(c)["state"] == "running"


# --- resizes (issue 31 items 3-4): the decider's elastic pass carried out as preemptions --------------

TWO_CPUS = {"name": "two", "policy": "elastic",
            "nodes": [{"name": "n1", "gpu_type": "cpu", "gpu_count": 2, "gpu_memory_gib": 16, "peak_tflops": 1}]}


def _data_parallel(run_s: dict[int, float]) -> dict[str, list[Option]]:
    """A training job's options as `options.options_from_plans` stores them: it asks for the
    largest count (FCFS's list), and its ECT list holds every data-parallel size (its layouts)."""
    sized = [Option(gpu_type="cpu", num_gpus=n, unit=1, min_memory_bytes=0, run_s=s, dp=n) for n, s in run_s.items()]
    asked = [max(sized, key=lambda o: o.num_gpus)]
    return {"fcfs": asked, "has": asked, "easy": asked, "sjf": asked, "elastic": asked, "ect": sized}


def _elastic(url: str, **config) -> tuple[Orchestrator, Orchestrator]:
    orch = Orchestrator(url, OrchestratorConfig(lease_s=600, **config), elastic=ElasticConfig(min_resize_interval_s=0))
    orch.register(parse_cluster(TWO_CPUS))
    holder = Orchestrator(url, OrchestratorConfig(lease_s=600))  # the resized job's flow: its own process
    return orch, holder


def _records(orch: Orchestrator) -> list[tuple]:
    with read_transaction(orch.engine) as conn:
        return [tuple(r) for r in conn.execute(sa.select(
            preemptions.c.job_id, preemptions.c.preempted_by, preemptions.c.kind, preemptions.c.from_gpus,
            preemptions.c.to_gpus, preemptions.c.ended_at.is_not(None), preemptions.c.forced).order_by(preemptions.c.id))]


def _gpus(orch: Orchestrator, job_id: int) -> set[tuple[str, int]]:
    placement = orch.admission(job_id).placement
    return {(a.node, g) for a in placement.assignments for g in a.gpus}


def test_a_running_job_shrinks_for_a_queued_one_and_grows_back_after_it(state_db_url, capsys):
    from flows.cli import main

    orch, holder = _elastic(state_db_url)
    a = orch.submit("a", _data_parallel({1: 1200.0, 2: 1000.0}))  # dp=2 is only a little faster
    first = orch.admission(a)
    assert first.placement.dp == 2
    assert orch.resize() == {"asked": [], "promised": [], "forced": []}  # nothing waits, nothing idle
    b = orch.submit("b", demand_options(orch.cluster(), 1, duration_s=100))
    assert orch.job(b)["state"] == "queued"

    # B would wait ~1000 s for A; A at dp=1 loses ~200 s and a restart: A is asked to stop
    assert orch.resize() == {"asked": [[a, 2, 1, b]], "promised": [b], "forced": []}
    request = holder.stop_request(a)
    assert request["reason"] == f"resized to 1 GPUs for job {b}" and request["preempted_by"] == b
    assert request["resize"] == {"kind": "shrink", "from_gpus": 2, "to_gpus": 1}
    assert request["deadline"] - request["at"] == pytest.approx(300)
    assert orch.resize()["asked"] == []  # asked once: A is stopping and B is promised its GPU
    assert orch.job(b)["state"] == "queued"  # A keeps both GPUs until its ranks committed and stopped
    assert main(["jobs", "--db", state_db_url]) == 0
    line = next(row for row in capsys.readouterr().out.splitlines() if " a " in row)
    assert f"resized to 1 GPUs for job {b}: stopping" in line

    # A's flow stopped the ranks and releases it as preempted: both are admitted, A on dp=1
    assert holder.release(a, outcome="preempted", attempt=first.attempt) == "running"
    shrunk = orch.admission(a)
    assert shrunk.attempt == first.attempt + 1 and shrunk.placement.dp == 1 and shrunk.placement.world_size == 1
    assert orch.job(b)["state"] == "running"
    assert _gpus(orch, a) | _gpus(orch, b) == {("n1", 0), ("n1", 1)}
    row = orch.job(a)
    assert row["promised"] is None and row["stop_requested"] is None and row["queued_at"] == row["submitted_at"]
    assert orch.job(b)["promised"] is None
    assert _records(orch) == [(a, b, "shrink", 2, 1, True, False)]
    assert usage(orch.engine, since_s=3600, by="user")["rows"][0]["preemptions_suffered"] == 0  # not a preemption

    # B ends: A grows back into the idle GPU, which nobody else gets meanwhile
    orch.release(b)
    assert orch.resize() == {"asked": [[a, 1, 2, None]], "promised": [], "forced": []}
    request = holder.stop_request(a)
    assert request["reason"] == "resized to 2 GPUs" and request["preempted_by"] == a
    c = orch.submit("c", demand_options(orch.cluster(), 1, duration_s=100))
    assert orch.job(c)["state"] == "queued"  # the idle GPU is A's promise
    assert holder.release(a, outcome="preempted", attempt=shrunk.attempt) == "running"
    grown = orch.admission(a)
    assert grown.placement.dp == 2 and grown.attempt == shrunk.attempt + 1
    assert orch.job(c)["state"] == "queued"
    assert _records(orch)[1:] == [(a, a, "grow", 1, 2, True, False)]
    orch.release(a)
    assert orch.job(c)["state"] == "running"
    assert double_booked(orch.engine) == 0


def test_a_resized_job_that_never_stops_is_force_released_and_its_promise_kept(state_db_url):
    orch, holder = _elastic(state_db_url)
    a = orch.submit("a", _data_parallel({1: 1200.0, 2: 1000.0}))
    first = orch.admission(a)
    b = orch.submit("b", demand_options(orch.cluster(), 1, duration_s=100))
    assert orch.resize(stop_s=0.5)["asked"] == [[a, 2, 1, b]]
    holder.renew(a, attempt=first.attempt)  # A's holder keeps renewing, and never stops
    time.sleep(0.6)  # past the deadline (on the database's clock: the next decision reads it)
    assert orch.resize()["forced"] == [a]
    assert orch.job(b)["state"] == "running" and orch.admission(a).placement.world_size == 1
    assert _records(orch) == [(a, b, "shrink", 2, 1, True, True)]
    with pytest.raises(LeaseLostError):  # the old admission's holder is fenced off
        holder.renew(a, attempt=first.attempt)
    assert double_booked(orch.engine) == 0


def test_a_promise_lapses_and_the_job_queues_as_any_other(state_db_url):
    orch, holder = _elastic(state_db_url)
    a = orch.submit("a", _data_parallel({1: 1200.0, 2: 1000.0}))
    first = orch.admission(a)
    b = orch.submit("b", demand_options(orch.cluster(), 1, duration_s=100))
    assert orch.resize(stop_s=0.2)["asked"] == [[a, 2, 1, b]]
    orch.request_stop(b, "not needed")  # B leaves the queue: its GPU was promised, A's still is
    time.sleep(0.5)  # both promises lapse (2 x stop_s)
    assert holder.release(a, outcome="preempted", attempt=first.attempt) == "running"
    assert orch.admission(a).placement.world_size == 2  # its own request again, not the lapsed shrink
    assert orch.job(a)["promised"] is None
    assert double_booked(orch.engine) == 0


def _until(check, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_the_decider_resizes_and_the_jobs_seat_yields_then_holds_each_new_layout(state_db_url):
    import threading

    from scheduler.orchestrator.lease import HeldJob
    from scheduler.orchestrator.seat import Seat

    orch, flow = _elastic(state_db_url)  # orch: the decider (`serve`); flow: the job's flow
    a = flow.submit("a", _data_parallel({1: 1200.0, 2: 1000.0}))
    stop = threading.Event()
    decider = threading.Thread(target=orch.serve, kwargs={"stop": stop}, daemon=True)
    decider.start()
    try:
        with HeldJob(flow, a) as held:
            seat = Seat(flow, a, held, "two", [], "a", poll_s=0.05)
            b = flow.submit("b", demand_options(orch.cluster(), 1, duration_s=100))
            _until(lambda: flow.stop_request(a) is not None, "the decider to ask A to shrink")
            held.stop_requested = flow.stop_request(a)  # what the holder's next renewal reads
            assert seat.preempted_by() == b and seat.stop_requested() == f"resized to 1 GPUs for job {b}"
            assert seat.resize() == {"kind": "shrink", "from_gpus": 2, "to_gpus": 1}
            placement = seat.yield_to_preemption()  # admitted again at once, on the GPU it was promised
            assert placement.world_size == 1 and placement.dp == 1 and held.attempt == 2
            assert flow.job(b)["state"] == "running"
            flow.release(b)
            _until(lambda: flow.stop_request(a) is not None, "the decider to ask A to grow")
            held.stop_requested = flow.stop_request(a)
            assert seat.preempted_by() == a and seat.stop_requested() == "resized to 2 GPUs"
            assert seat.resize() == {"kind": "grow", "from_gpus": 1, "to_gpus": 2}
            placement = seat.yield_to_preemption()
            assert placement.world_size == 2 and held.attempt == 3
        assert flow.job(a)["state"] == "finished"
    finally:
        stop.set()
        decider.join(timeout=30)
    assert double_booked(orch.engine) == 0


def test_a_resized_job_whose_flow_died_is_admitted_on_its_promise_once_its_lease_runs_out(state_db_url):
    orch = Orchestrator(state_db_url, OrchestratorConfig(lease_s=1.0, grace_s=0.5),
                        elastic=ElasticConfig(min_resize_interval_s=0))
    orch.register(parse_cluster(TWO_CPUS))
    a = orch.submit("a", _data_parallel({1: 1200.0, 2: 1000.0}))
    b = orch.submit("b", demand_options(orch.cluster(), 1, duration_s=100))
    assert orch.resize()["asked"] == [[a, 2, 1, b]]
    _until(lambda: orch.reconcile().expired_jobs == [a], "A's lease to run out (nobody renews it)", 30)
    assert orch.admission(a).placement.world_size == 1 and orch.job(b)["state"] == "running"
    row = orch.job(a)
    assert row["stop_requested"] is None and row["promised"] is None  # nothing left to stop it again
    assert _records(orch) == [(a, b, "shrink", 2, 1, True, False)]
    assert orch.resize(stop_s=0.1)["forced"] == []
    assert double_booked(orch.engine) == 0


def test_with_teams_quotas_defined_nothing_is_resized(state_db_url):
    from scheduler.orchestrator.teams import add_team

    orch, _ = _elastic(state_db_url)
    add_team(orch.engine, "A")
    orch.rules_changed()
    a = orch.submit("a", _data_parallel({1: 1200.0, 2: 1000.0}))
    b = orch.submit("b", demand_options(orch.cluster(), 1, duration_s=100))
    assert orch.resize() == {"asked": [], "promised": [], "forced": []}  # the elastic pass knows no quotas
    assert orch.stop_request(a) is None and orch.job(b)["state"] == "queued"
