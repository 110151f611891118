"""The outage epoch (scheduler.orchestrator.epoch) on the embedded SQLite database: after a gap
in which no writer reached the database, the first writer records an epoch and no lease is
reclaimed until every holder has had a full lease period since it to renew.

A gap is made by moving `control_plane.seen_at` back, and an outage's effect on a lease by
moving its `lease_expires_at` back: the database's clock itself is not faked."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from infra.statedb import read_transaction, write_transaction
from infra.statedb.clock import db_now
from infra.statedb.schema import allocations, control_plane
from scheduler.cluster import parse_cluster
from scheduler.orchestrator import Orchestrator, OrchestratorConfig, demand_options
from scheduler.orchestrator import epoch

LEASE_S, GRACE_S = 30.0, 10.0
NODE = {"name": "one", "nodes": [{"name": "n0", "gpu_type": "A100-80G", "gpu_count": 8}]}


def test_expiry_counts_from_the_later_of_the_last_renewal_and_the_epoch():
    assert epoch.reclaim_at(100.0, None, LEASE_S, GRACE_S) == 110.0
    assert epoch.reclaim_at(100.0, 50.0, LEASE_S, GRACE_S) == 110.0  # an old epoch changes nothing
    assert epoch.reclaim_at(100.0, 200.0, LEASE_S, GRACE_S) == 240.0  # a full lease after the epoch


@pytest.mark.parametrize("lease_s", [1.0, 4.0, 60.0, 600.0])
def test_an_outage_that_could_cost_a_renewal_is_a_gap_and_a_quiet_healthy_cluster_makes_none(lease_s):
    renew_every = lease_s / 3  # HeldJob's period
    # a holder that renewed just before an outage of gap_s still has a third of its lease left
    assert epoch.gap_s(lease_s) < lease_s - renew_every
    # holders renewing (or waiting jobs keeping the row alive) never leave a gap behind
    assert renew_every + epoch.touch_every_s(lease_s) < epoch.gap_s(lease_s)
    assert epoch.keepalive_after_s(lease_s) + epoch.touch_every_s(lease_s) < epoch.gap_s(lease_s)


@pytest.fixture
def orch(tmp_path) -> Orchestrator:
    o = Orchestrator(f"sqlite:///{tmp_path / 'state.db'}", OrchestratorConfig(lease_s=LEASE_S, grace_s=GRACE_S))
    o.register(parse_cluster(NODE))
    return o


def _holder_and_waiter(o: Orchestrator) -> tuple[int, int]:
    holder = o.submit("holder", demand_options(o.cluster(), 8, gpu_type="A100-80G"))
    waiter = o.submit("waiter", demand_options(o.cluster(), 8, gpu_type="A100-80G"))
    assert o.job(holder)["state"] == "running" and o.job(waiter)["state"] == "queued"
    return holder, waiter


def _set(o: Orchestrator, table, where, **seconds_ago: float) -> None:
    with write_transaction(o.engine) as conn:
        conn.execute(sa.update(table).where(where).values({k: db_now() - v for k, v in seconds_ago.items()}))


def _control_plane(o: Orchestrator) -> dict:
    with read_transaction(o.engine) as conn:
        row = conn.execute(sa.select(db_now().label("now"), control_plane)).one()
    return row._asdict()


def _outage(o: Orchestrator, job_id: int, seconds: float) -> None:
    """As if the database had been out of reach for `seconds`: nobody wrote, nobody renewed."""
    _set(o, control_plane, control_plane.c.id == 1, seen_at=seconds)
    _set(o, allocations, allocations.c.job_id == job_id, lease_expires_at=seconds - LEASE_S)


def test_the_first_pass_after_an_outage_records_the_epoch_and_reclaims_nothing(orch):
    holder, waiter = _holder_and_waiter(orch)
    orch.renew(holder)
    _outage(orch, holder, 120)  # two lease periods: the lease looks 90 s expired, 80 s past grace
    assert not orch.pass_due()  # a waiting job does not spin on a lease it may not reclaim
    result = orch.reconcile()
    assert result.expired_jobs == [] and orch.job(holder)["state"] == "running"
    state = _control_plane(orch)
    assert state["epoch_at"] == pytest.approx(state["now"], abs=5) and state["gap_s"] == pytest.approx(120, abs=5)
    orch.renew(holder)  # the holder's first renewal after the outage keeps its GPUs
    assert orch.job(holder)["state"] == "running" and orch.job(waiter)["state"] == "queued"


def test_a_holder_that_did_not_renew_within_a_lease_of_the_epoch_is_reclaimed(orch):
    holder, waiter = _holder_and_waiter(orch)
    _outage(orch, holder, 120)
    orch.reconcile()
    assert orch.job(holder)["state"] == "running"
    # a full lease and grace after the epoch, still no renewal: that holder is gone
    _set(orch, control_plane, control_plane.c.id == 1, epoch_at=LEASE_S + GRACE_S + 1)
    assert orch.pass_due()
    assert orch.reconcile().expired_jobs == [holder]
    assert orch.job(waiter)["state"] == "running" and orch.job(holder)["state"] == "queued"


def test_without_a_gap_an_overdue_lease_is_reclaimed_at_once(orch):
    holder, waiter = _holder_and_waiter(orch)
    orch.renew(holder)  # a writer reached the database just now
    _set(orch, allocations, allocations.c.job_id == holder, lease_expires_at=GRACE_S + 5)
    assert orch.pass_due()
    assert orch.reconcile().expired_jobs == [holder]
    assert _control_plane(orch)["epoch_at"] is None  # a fresh database's first writer makes no epoch


def test_a_renewal_after_a_gap_records_the_epoch_too(orch):
    holder, _ = _holder_and_waiter(orch)
    orch.renew(holder)
    _set(orch, control_plane, control_plane.c.id == 1, seen_at=100)
    orch.renew(holder)
    state = _control_plane(orch)
    assert state["epoch_at"] == pytest.approx(state["now"], abs=5) and state["gap_s"] == pytest.approx(100, abs=5)


def test_a_gap_is_a_warning_where_a_job_held_gpus_and_info_in_a_quiet_cluster(orch, caplog):
    caplog.set_level("INFO", logger=epoch.__name__)
    orch.reconcile()  # a writer reached the fresh database: no gap yet
    _set(orch, control_plane, control_plane.c.id == 1, seen_at=100)
    orch.reconcile()  # nothing submitted, nothing held: the first writer after a quiet spell
    assert [(r.levelname, "quiet cluster" in r.getMessage()) for r in caplog.records] == [("INFO", True)]
    caplog.clear()
    holder, _ = _holder_and_waiter(orch)
    _outage(orch, holder, 120)
    orch.reconcile()  # the holder could not renew: its users must hear of it
    assert [(r.levelname, "out of reach for 120 s" in r.getMessage()) for r in caplog.records] == [("WARNING", True)]
