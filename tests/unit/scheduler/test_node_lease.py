"""A node's look at its job's lease (scheduler.orchestrator.node_lease): the decision on one
reading, and the look itself on a real SQLite state database and on one that does not answer."""

from __future__ import annotations

import socket

import pytest
import sqlalchemy as sa

from infra.statedb import write_transaction
from infra.statedb.schema import allocations
from scheduler.cluster import parse_cluster
from scheduler.orchestrator import Orchestrator, OrchestratorConfig, demand_options
from scheduler.orchestrator.node_lease import LeaseReading, NodeLease, judge

LEASE_S = 30.0


def reading(**changes) -> LeaseReading:
    base = dict(state="running", attempts=2, live_gpus=1, lease_expires_at=1000.0, epoch_at=None, now=990.0)
    return LeaseReading(**{**base, **changes})


def test_a_running_admission_whose_lease_has_not_run_out_is_held():
    look = judge(reading(), attempt=2, node="n0", lease_s=LEASE_S)
    assert look.held is True and look.runs_out_in_s == 10.0  # the node looks again then


@pytest.mark.parametrize("changes, attempt, says", [
    ({"state": "queued"}, 2, "the job is queued"),  # reclaimed and queued again
    ({"state": "cancelled"}, 2, "the job is cancelled"),
    ({"state": None}, 2, "gone from the state database"),
    ({"attempts": 3}, 2, "admitted again (admission 3"),  # its GPUs here may run another job
    ({"live_gpus": 0, "lease_expires_at": None}, 2, "released or reclaimed"),
    ({"now": 1000.0}, 2, "lease ran out"),  # the holder stopped renewing: stop now, grace_s before the reclaim
])
def test_the_lease_is_gone_when_the_orchestrator_says_so(changes, attempt, says):
    look = judge(reading(**changes), attempt=attempt, node="n0", lease_s=LEASE_S)
    assert look.held is False and says in look.why, look


def test_after_an_outage_expiry_counts_from_the_epoch():
    """Back from an outage, every lease looks run out; the holder gets a full lease period from the epoch."""
    back = reading(lease_expires_at=1000.0, epoch_at=1100.0, now=1105.0)
    assert judge(back, attempt=2, node="n0", lease_s=LEASE_S).held is True
    later = reading(lease_expires_at=1000.0, epoch_at=1100.0, now=1100.0 + LEASE_S)
    assert judge(later, attempt=2, node="n0", lease_s=LEASE_S).held is False


@pytest.fixture
def admitted(tmp_path):
    """A one-node cluster and a job admitted onto it (admission 1), on a real SQLite database."""
    orch = Orchestrator(f"sqlite:///{tmp_path / 'state.db'}", OrchestratorConfig(lease_s=LEASE_S, grace_s=LEASE_S))
    cluster = parse_cluster({"name": "lease-look", "nodes": [{"name": "n0", "gpu_type": "A10", "gpu_count": 1}]})
    orch.register(cluster)
    job_id = orch.submit("job", demand_options(cluster, 1))
    admission = orch.admission(job_id)
    assert admission is not None and admission.attempt == 1
    return orch, job_id


def test_the_look_reads_the_orchestrators_record(admitted):
    orch, job_id = admitted
    assert NodeLease(orch.engine, LEASE_S, job_id, "n0", attempt=1).look().held is True
    other_node = NodeLease(orch.engine, LEASE_S, job_id, "n1", attempt=1).look()
    assert other_node.held is False and "released or reclaimed" in other_node.why
    # the holder stopped renewing: its lease runs out (moved into the past here, as time would)
    with write_transaction(orch.engine) as conn:
        conn.execute(sa.update(allocations).where(allocations.c.job_id == job_id).values(
            lease_expires_at=allocations.c.lease_expires_at - 2 * LEASE_S))
    ran_out = NodeLease(orch.engine, LEASE_S, job_id, "n0", attempt=1).look()
    assert ran_out.held is False and "lease ran out" in ran_out.why
    orch.renew(job_id, 1)  # renewed again: held
    assert NodeLease(orch.engine, LEASE_S, job_id, "n0", attempt=1).look().held is True
    orch.release(job_id, outcome="finished", attempt=1)
    released = NodeLease(orch.engine, LEASE_S, job_id, "n0", attempt=1).look()
    assert released.held is False and "the job is finished" in released.why


def test_a_look_that_does_not_reach_the_database_is_unknown(admitted):
    orch, job_id = admitted
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    down = sa.create_engine(f"postgresql+psycopg://postgres@127.0.0.1:{port}/state",
                            connect_args={"connect_timeout": 2})
    look = NodeLease(down, LEASE_S, job_id, "n0", attempt=1).look()
    assert look.held is None and "did not answer" in look.why, look
