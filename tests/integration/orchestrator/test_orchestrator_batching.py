"""The batched decision path on a real PostgreSQL (psycopg pipeline mode) and on SQLite.

One release that lets many queued jobs start admits them all in one transaction (its
writes sent with the COMMIT); the history the database's triggers write must still
replay without a double booking, and the unique index must still refuse a second
live allocation of a GPU when it comes through that same batched path.
"""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from infra.statedb import batched_write_transaction, read_transaction
from infra.statedb.schema import allocation_events, allocations
from scheduler.cluster import parse_cluster
from scheduler.orchestrator import Orchestrator, OrchestratorConfig, demand_options, double_booked

ONE_TYPE = {"name": "pool", "nodes": [{"name": "n", "replicas": 4, "gpu_type": "A100-80G", "gpu_count": 8}]}


def _history(engine) -> list[tuple]:
    with read_transaction(engine) as conn:
        return conn.execute(sa.select(allocation_events.c.allocation_id, allocation_events.c.job_id,
                                      allocation_events.c.node, allocation_events.c.gpu_index,
                                      allocation_events.c.event).order_by(allocation_events.c.id)).all()


def test_one_release_admits_many_jobs_in_one_transaction(state_db_url):
    orch = Orchestrator(state_db_url, OrchestratorConfig(policy="has", lease_s=600))
    cluster = parse_cluster(ONE_TYPE)
    orch.register(cluster)
    blocker = orch.submit("everything", demand_options(cluster, 32))
    small = [orch.submit(f"one-{i}", demand_options(cluster, 1)) for i in range(40)]
    assert orch.job(blocker)["state"] == "running"
    assert {orch.job(j)["state"] for j in small} == {"queued"}

    orch.release(blocker)
    admitted = orch.last_pass.admitted
    assert sorted(admitted) == small[:32]  # queue order; the other 8 wait
    assert [orch.job(j)["state"] for j in small] == ["running"] * 32 + ["queued"] * 8
    gpus = [(a.node, g) for j in small[:32] for a in orch.admission(j).placement.assignments for g in a.gpus]
    assert len(set(gpus)) == 32

    history = _history(orch.engine)
    events = [e for *_, e in history]
    assert events == ["allocate"] * 32 + ["release"] * 32 + ["allocate"] * 32
    with read_transaction(orch.engine) as conn:
        live = conn.execute(sa.select(allocations.c.id, allocations.c.job_id, allocations.c.node,
                                      allocations.c.gpu_index).where(allocations.c.released_at.is_(None))).all()
    # every live allocation has its 'allocate' event, written by the trigger with the row's own id
    assert sorted(tuple(r) for r in live) == sorted((a, j, n, g) for a, j, n, g, e in history[64:])
    assert double_booked(orch.engine) == 0

    # a second process (its own view) releases one of them: the next queued job takes that GPU
    other = Orchestrator(state_db_url, OrchestratorConfig(policy="has", lease_s=600))
    other.release(small[0])
    assert orch.job(small[32])["state"] == "running"
    orch.release(small[1])  # this process's view is stale now: it reads the state back
    assert orch.job(small[33])["state"] == "running"
    assert double_booked(orch.engine) == 0


def test_the_database_refuses_a_forced_double_allocation_sent_in_a_batch(state_db_url):
    orch = Orchestrator(state_db_url)
    cluster = parse_cluster(ONE_TYPE)
    orch.register(cluster)
    job = orch.submit("holder", demand_options(cluster, 8))
    node = orch.admission(job).placement.assignments[0]
    before = _history(orch.engine)

    row = dict(job_id=job, cluster="pool", node=node.node, gpu_index=node.gpus[0], allocated_at=0.0,
               lease_expires_at=1e12)
    with pytest.raises(sa.exc.IntegrityError):
        with batched_write_transaction(orch.engine) as (conn, batch):
            batch.add(sa.insert(allocations), [row])  # queued: sent with the COMMIT on PostgreSQL
    assert _history(orch.engine) == before  # nothing of it committed, not even its trigger's event
    with read_transaction(orch.engine) as conn:
        live = conn.execute(sa.select(sa.func.count()).select_from(allocations)
                            .where(allocations.c.released_at.is_(None))).scalar()
    assert live == 8
    assert double_booked(orch.engine) == 0


def test_a_renewal_never_shortens_a_lease(state_db_url):
    long = Orchestrator(state_db_url, OrchestratorConfig(lease_s=3600))
    cluster = parse_cluster(ONE_TYPE)
    long.register(cluster)
    job = long.submit("long-lease", demand_options(cluster, 1))
    granted = long.admission(job).lease_expires_at
    short = Orchestrator(state_db_url, OrchestratorConfig(lease_s=1))
    short.renew(job)  # would end the lease in 1 s: the longer one stays
    assert long.admission(job).lease_expires_at == granted
