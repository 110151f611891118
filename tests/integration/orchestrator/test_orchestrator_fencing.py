"""Fencing by admission, on SQLite and PostgreSQL: a holder renews and ends only the admission it
was given (`Admission.attempt`). A holder that stalled past its lease (a GC pause, a network
partition) must learn it lost its GPUs even where its job was admitted again meanwhile, and its
release must leave that newer admission alone."""

from __future__ import annotations

import time

import pytest

from scheduler.cluster import parse_cluster
from scheduler.orchestrator import LeaseLostError, Orchestrator, OrchestratorConfig, demand_options, double_booked
from scheduler.orchestrator.lease import HeldJob


def test_a_holder_whose_lease_was_reclaimed_neither_renews_nor_ends_the_next_admission(state_db_url):
    """Fencing by admission: the stalled holder of admission 1 wakes after its job was re-queued
    and admitted again elsewhere; it must learn it lost its GPUs and leave admission 2 alone."""
    o = Orchestrator(state_db_url, OrchestratorConfig(lease_s=1.0, grace_s=0.5))
    o.register(parse_cluster({"name": "c", "nodes": [{"name": "n", "gpu_type": "A100-80G", "gpu_count": 2}]}))
    one = demand_options(o.cluster(), 1)
    job, other = o.submit("a", one), o.submit("b", one)
    stale = o.admission(job)
    assert stale.attempt == 1
    waiter = o.submit("c", one)
    deadline = time.time() + 2.0
    while time.time() < deadline:  # "b" keeps renewing; "a"'s holder has stalled past lease + grace
        o.renew(other)
        time.sleep(0.2)
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
    o = Orchestrator(state_db_url, OrchestratorConfig(lease_s=0.2, grace_s=0.0))
    o.register(parse_cluster({"name": "c", "nodes": [{"name": "n", "gpu_type": "A100-80G", "gpu_count": 2}]}))
    job = o.submit("a", demand_options(o.cluster(), 2))
    blocker = o.submit("b", demand_options(o.cluster(), 2))
    attempt = o.admission(job).attempt
    time.sleep(0.3)
    o.reconcile()  # a's lease is reclaimed: "b" runs, "a" is queued again behind nobody
    assert o.job(job)["state"] == "queued" and o.job(blocker)["state"] == "running"
    assert o.release(job, outcome="failed", attempt=attempt) == "queued"
    assert o.job(job)["state"] == "failed"
