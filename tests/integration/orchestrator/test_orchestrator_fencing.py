"""Fencing by admission, on SQLite and PostgreSQL: a holder renews and ends only the admission it
was given (`Admission.attempt`). A holder that stalled past its lease (a GC pause, a network
partition) must learn it lost its GPUs even where its job was admitted again meanwhile, and its
release must leave that newer admission alone."""

from __future__ import annotations

import time

import pytest
import sqlalchemy as sa

from infra.statedb import write_transaction
from infra.statedb.schema import allocations
from scheduler.cluster import parse_cluster
from scheduler.orchestrator import LeaseLostError, Orchestrator, OrchestratorConfig, demand_options, double_booked
from scheduler.orchestrator.lease import HeldJob


def _stall(o: Orchestrator, job_id: int) -> None:
    """The job's holder stopped renewing long ago: its lease ran out past any grace (set in
    the database, so no test waits on the clock of a loaded machine)."""
    with write_transaction(o.engine) as conn:
        conn.execute(sa.update(allocations).where(allocations.c.job_id == job_id, allocations.c.released_at.is_(None))
                     .values(lease_expires_at=time.time() - 3600))


def test_a_holder_whose_lease_was_reclaimed_neither_renews_nor_ends_the_next_admission(state_db_url):
    """Fencing by admission: the stalled holder of admission 1 wakes after its job was re-queued
    and admitted again elsewhere; it must learn it lost its GPUs and leave admission 2 alone."""
    o = Orchestrator(state_db_url, OrchestratorConfig(lease_s=600, grace_s=30))
    o.register(parse_cluster({"name": "c", "nodes": [{"name": "n", "gpu_type": "A100-80G", "gpu_count": 2}]}))
    one = demand_options(o.cluster(), 1)
    job, other = o.submit("a", one), o.submit("b", one)
    stale = o.admission(job)
    assert stale.attempt == 1
    waiter = o.submit("c", one)
    _stall(o, job)  # "b"'s holder keeps renewing; "a"'s stalled past lease + grace
    assert o.reconcile().expired_jobs == [job]
    assert o.job(waiter)["state"] == "running" and o.job(job)["state"] == "queued"
    o.release(other)  # frees a GPU: the re-queued job is admitted again
    fresh = o.admission(job)
    assert fresh.attempt == 2 and o.job(job)["state"] == "running"
    with pytest.raises(LeaseLostError, match="admission 1"):
        o.renew(job, stale.attempt)
    assert o.release(job, outcome="failed", attempt=stale.attempt) == "running"  # nothing ended
    assert o.job(job)["state"] == "running"
    o.renew(job, fresh.attempt)  # the new admission's holder is untouched
    # a HeldJob holds the admission it entered with, and its exit ends only that one
    with HeldJob(o, job, every_s=10) as held:
        assert held.attempt == 2
    assert o.job(job)["state"] == "finished"
    assert double_booked(o.engine) == 0


def test_a_lost_holder_that_exits_ends_its_requeued_job_so_nobody_is_admitted_for_it(state_db_url):
    o = Orchestrator(state_db_url, OrchestratorConfig(lease_s=600, grace_s=30))
    o.register(parse_cluster({"name": "c", "nodes": [{"name": "n", "gpu_type": "A100-80G", "gpu_count": 2}]}))
    job = o.submit("a", demand_options(o.cluster(), 2))
    blocker = o.submit("b", demand_options(o.cluster(), 2))
    attempt = o.admission(job).attempt
    _stall(o, job)
    o.reconcile()  # a's lease is reclaimed: "b" runs, "a" is queued again behind nobody
    assert o.job(job)["state"] == "queued" and o.job(blocker)["state"] == "running"
    assert o.release(job, outcome="failed", attempt=attempt) == "queued"
    assert o.job(job)["state"] == "failed"


def test_a_holder_that_handed_its_admission_back_ends_the_next_one_when_it_exits(state_db_url):
    """Placed again (re-queued after a node check, or after a lost lease): the flow dies after the
    job was admitted again but before it holds the new admission. Its exit must end that one,
    or the GPUs stay held by nobody until the lease runs out, again and again."""
    o = Orchestrator(state_db_url, OrchestratorConfig(lease_s=600, grace_s=30))
    o.register(parse_cluster({"name": "c", "nodes": [{"name": "n", "gpu_type": "A100-80G", "gpu_count": 2}]}))
    job = o.submit("a", demand_options(o.cluster(), 1))
    held = HeldJob(o, job, every_s=60).__enter__()
    held.hand_back()
    o.requeue(job, reason="placed again after a node check")
    assert o.wait_admitted(job, poll_s=0.05, timeout_s=10).attempt == 2
    held.__exit__(KeyboardInterrupt, KeyboardInterrupt(), None)  # cancelled before `resume`
    assert o.job(job)["state"] == "cancelled"
    assert o.cluster().free_gpus_by_type() == {"A100-80G": 2}
