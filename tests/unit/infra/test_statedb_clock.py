"""The database's clock on SQLite (infra.statedb.clock.db_now): one time per transaction, as
PostgreSQL's transaction_timestamp(), read once the write lock is held, so a release's end and the
admission its pass makes carry the same time, and a later transaction is never stamped earlier."""

from __future__ import annotations

import time

import sqlalchemy as sa

from infra.statedb import read_transaction, write_transaction
from infra.statedb.clock import db_now
from scheduler.cluster import parse_cluster
from scheduler.orchestrator import Orchestrator, demand_options

ONE_NODE = {"name": "one", "nodes": [{"name": "n0", "gpu_type": "A100-80G", "gpu_count": 8}]}


def test_one_time_per_transaction_and_later_transactions_are_later(tmp_path):
    o = Orchestrator(f"sqlite:///{tmp_path / 'state.db'}")
    with write_transaction(o.engine) as conn:
        first = conn.execute(sa.select(db_now())).scalar()
        time.sleep(0.02)  # SQLite's julianday('now') would have moved on by now
        assert conn.execute(sa.select(db_now())).scalar() == first
    assert abs(first - time.time()) < 5.0  # the local clock, in seconds since the epoch
    with read_transaction(o.engine) as conn:
        assert conn.execute(sa.select(db_now())).scalar() > first


def test_a_job_admitted_by_a_release_is_admitted_when_the_release_ended_the_holder(tmp_path):
    o = Orchestrator(f"sqlite:///{tmp_path / 'state.db'}")
    o.register(parse_cluster(ONE_NODE))
    holder = o.submit("holder", demand_options(o.cluster(), 8, gpu_type="A100-80G"))
    waiter = o.submit("waiter", demand_options(o.cluster(), 8, gpu_type="A100-80G"))
    assert o.job(waiter)["state"] == "queued"
    o.release(holder)
    ended, admitted = o.job(holder), o.job(waiter)
    assert admitted["state"] == "running"
    assert admitted["admitted_at"] == ended["finished_at"]  # one transaction, one time
