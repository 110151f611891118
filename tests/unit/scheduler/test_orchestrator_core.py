"""The orchestrator on its embedded SQLite database: queue, policy passes, health, leases, refusals."""

from __future__ import annotations

import time

import pytest
import sqlalchemy as sa

from infra.statedb import StateDbError, forget_engines, open_state_db, read_transaction, write_transaction
from infra.statedb.schema import allocations
from scheduler.cluster import parse_cluster
from scheduler.orchestrator import (
    LeaseLostError,
    Orchestrator,
    OrchestratorConfig,
    OrchestratorError,
    demand_options,
    double_booked,
    job_options,
)
from scheduler.orchestrator.views import cluster_markdown, cluster_status, queue_snapshot
from scheduler.planner import InfeasibleJobError
from training.config import load_job_spec

INVENTORY = {
    "name": "mixed",
    "nodes": [
        {"name": "a100", "replicas": 2, "gpu_type": "A100-80G", "gpu_count": 4},
        {"name": "a10", "replicas": 2, "gpu_type": "A10", "gpu_count": 4},
    ],
}


@pytest.fixture
def url(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'state.db'}"


@pytest.fixture
def orch(url) -> Orchestrator:
    o = Orchestrator(url, OrchestratorConfig(lease_s=30, grace_s=0))
    o.register(parse_cluster(INVENTORY))
    return o


def _where(o: Orchestrator, job_id: int) -> set[str]:
    return set(o.admission(job_id).placement.nodes)


def test_jobs_queue_when_full_and_start_when_gpus_come_back(orch):
    cluster = orch.cluster()
    ids = [orch.submit(f"j{i}", demand_options(cluster, 4, min_memory_gib=40)) for i in range(3)]
    assert [orch.job(i)["state"] for i in ids] == ["running", "running", "queued"]
    assert orch.queue_position(ids[2]) == (1, 1)
    assert _where(orch, ids[0]) != _where(orch, ids[1])  # two jobs never share GPUs
    orch.release(ids[0])
    assert orch.job(ids[2])["state"] == "running"  # the release admitted the waiting job
    assert _where(orch, ids[2]) == {"a100-0", "a100-1"} - _where(orch, ids[1])
    assert orch.release(ids[0]) == "finished"  # releasing twice changes nothing
    assert double_booked(orch.engine) == 0


def test_database_refuses_a_second_live_allocation_of_a_gpu(orch):
    job = orch.submit("j", demand_options(orch.cluster(), 1, gpu_type="A10"))
    node = next(iter(_where(orch, job)))
    gpu = orch.admission(job).placement.assignments[0].gpus[0]
    with pytest.raises(sa.exc.IntegrityError):
        with write_transaction(orch.engine) as conn:
            conn.execute(sa.insert(allocations).values(job_id=job, cluster="mixed", node=node, gpu_index=gpu,
                                                       allocated_at=0.0, lease_expires_at=0.0))


def test_cordon_and_drain_persist_and_placement_avoids_them(url, orch):
    orch.cordon("a100-0", reason="ECC errors")
    orch.drain("a100-1", reason="maintenance")
    forget_engines()  # a restart of everything: a fresh engine and orchestrator
    again = Orchestrator(url)
    nodes = {n["node"]: n for n in cluster_status(again.engine)["nodes"]}
    assert nodes["a100-0"]["state"] == "cordoned" and nodes["a100-0"]["reason"] == "ECC errors"
    assert nodes["a100-1"]["state"] == "drained"
    job = again.submit("big", demand_options(again.cluster(), 4, min_memory_gib=40))
    assert again.job(job)["state"] == "queued"  # only A100s hold it, and none is schedulable
    small = again.submit("small", demand_options(again.cluster(), 2))
    assert _where(again, small) <= {"a10-0", "a10-1"}
    again.uncordon("a100-0")
    assert _where(again, job) == {"a100-0"}  # uncordon admits the waiting job
    assert "cordoned" not in cluster_markdown(cluster_status(again.engine))


def _age_lease(o: Orchestrator, job_id: int, seconds_ago: float) -> None:
    """Make the job's live lease run out `seconds_ago` (instead of sleeping past a short lease,
    which a loaded machine can stretch into a race with the test's own steps)."""
    with write_transaction(o.engine) as conn:
        aged = conn.execute(sa.update(allocations).where(
            allocations.c.job_id == job_id, allocations.c.released_at.is_(None)).values(
            lease_expires_at=time.time() - seconds_ago)).rowcount
    assert aged, f"job {job_id} holds no GPUs: no lease to age"


def _lease_expires_at(o: Orchestrator, job_id: int) -> float:
    with read_transaction(o.engine) as conn:
        return conn.execute(sa.select(sa.func.min(allocations.c.lease_expires_at)).where(
            allocations.c.job_id == job_id, allocations.c.released_at.is_(None))).scalar_one()


def test_an_expired_lease_frees_the_gpus_and_requeues_the_job(url):
    o = Orchestrator(url, OrchestratorConfig(lease_s=30, grace_s=30, max_requeues=1))
    o.register(parse_cluster(INVENTORY))
    holder = o.submit("holder", demand_options(o.cluster(), 8, gpu_type="A100-80G"))
    waiter = o.submit("waiter", demand_options(o.cluster(), 8, gpu_type="A100-80G"))
    assert o.job(waiter)["state"] == "queued"
    o.renew(holder)
    _age_lease(o, holder, seconds_ago=5)  # expired, but within its grace: still held
    o.reconcile()
    assert o.job(holder)["state"] == "running" and o.job(waiter)["state"] == "queued"
    _age_lease(o, holder, seconds_ago=120)  # the holder stopped renewing: past lease and grace
    admitted = o.wait_admitted(waiter, poll_s=0.05, timeout_s=10)
    assert admitted.placement.world_size == 8
    lost = o.job(holder)
    assert lost["state"] == "queued" and lost["lost_count"] == 1 and "lease expired" in lost["reason"]
    with pytest.raises(LeaseLostError):
        o.renew(holder)
    snapshot = queue_snapshot(o.engine)
    assert [q["name"] for q in snapshot["queued"]] == ["holder"] and snapshot["running"][0]["name"] == "waiter"
    assert double_booked(o.engine) == 0


def test_cancel_removes_a_queued_job(orch):
    cluster = orch.cluster()
    first = orch.submit("first", demand_options(cluster, 8, min_memory_gib=40))
    second = orch.submit("second", demand_options(cluster, 8, min_memory_gib=40))
    assert orch.cancel(second) == "queued"
    assert orch.queue_position(second) == (0, 0)
    with pytest.raises(OrchestratorError, match="cancelled"):
        orch.admission(second)
    orch.release(first)
    assert orch.job(second)["state"] == "cancelled"


def test_a_training_job_without_gpu_type_or_count_gets_marp_options(orch):
    spec = load_job_spec("configs/tiny-cpu.yaml")
    options = job_options(spec, orch.cluster())
    assert {o.gpu_type for o in options["has"]} == {"A100-80G", "A10"}
    job = orch.submit(spec.name, options, spec=spec.model_dump(mode="json"))
    placement = orch.admission(job).placement
    assert placement.gpu_type in {"A100-80G", "A10"} and placement.world_size >= 1


def test_bad_requests_get_one_clear_error(orch, url, tmp_path):
    with pytest.raises(OrchestratorError, match="no node named 'nope'.*nodes: a100-0"):
        orch.cordon("nope")
    with pytest.raises(OrchestratorError, match="can ever hold 64 GPU"):
        demand_options(orch.cluster(), 64)
    huge = load_job_spec("configs/tiny-cpu.yaml").model_copy(deep=True)
    huge.model.num_layers, huge.model.hidden_size, huge.model.ffn_hidden_size = 200, 16384, 53248
    with pytest.raises(InfeasibleJobError):
        job_options(huge, orch.cluster(), gpus=1)
    with pytest.raises(OrchestratorError, match="no cluster is registered"):
        Orchestrator(f"sqlite:///{tmp_path / 'empty.db'}").reconcile()
    with write_transaction(orch.engine) as conn:
        conn.execute(sa.text("UPDATE alembic_version SET version_num = '9999_from_the_future'"))
    forget_engines()
    with pytest.raises(StateDbError, match="newer forgeflow"):
        open_state_db(url)
    forget_engines()
    with pytest.raises(StateDbError, match="cannot reach the state database"):
        open_state_db("postgresql+psycopg://nobody@127.0.0.1:1/forgeflow")


def test_a_held_job_renews_its_lease_and_is_released_on_every_exit(url):
    from scheduler.orchestrator.lease import HeldJob

    o = Orchestrator(url, OrchestratorConfig(lease_s=30, grace_s=0.0))
    o.register(parse_cluster(INVENTORY))
    job = o.submit("held", demand_options(o.cluster(), 8, gpu_type="A10"))
    with HeldJob(o, job, every_s=0.05) as held:
        _age_lease(o, job, seconds_ago=1)  # run out: only a renewal can keep the job now
        deadline = time.monotonic() + 30
        while _lease_expires_at(o, job) < time.time():
            assert time.monotonic() < deadline, "HeldJob did not renew the lease within 30 s"
            time.sleep(0.02)
        o.reconcile()
        assert o.job(job)["state"] == "running" and held.lost is None
    assert o.job(job)["state"] == "finished"
    for exc, outcome in ((RuntimeError("boom"), "failed"), (KeyboardInterrupt(), "cancelled")):
        other = o.submit("held", demand_options(o.cluster(), 8, gpu_type="A10"))
        with pytest.raises(type(exc)):
            with HeldJob(o, other, every_s=0.05):
                raise exc
        assert o.job(other)["state"] == outcome
    assert o.cluster().free_gpus_by_type()["A10"] == 8


def test_requeue_after_a_cordon_places_the_job_on_healthy_nodes(orch):
    job = orch.submit("j", demand_options(orch.cluster(), 4, gpu_type="A10"))
    bad = next(iter(_where(orch, job)))
    orch.cordon(bad, reason="node check failed")
    orch.requeue(job, reason="re-placing after a node check")
    assert _where(orch, job) == {"a10-0", "a10-1"} - {bad}
    assert orch.job(job)["attempts"] == 2


@pytest.mark.parametrize("policy", ["fcfs", "has", "ect"])
def test_a_pass_decides_the_same_with_shared_or_separate_option_lists(policy):
    # schedule_pass skips a job whose (shared) option list already found no room in the pass,
    # and a request key that did not fit: that must never change what it decides.
    from scheduler.policy import FreeGpus, QueuedJob, schedule_pass

    def run(shared: bool):
        cluster = parse_cluster(INVENTORY)
        cluster.allocate("a100-0", [0, 1, 2])  # uneven room: some requests fit only after others
        shapes = {n: tuple(demand_options(cluster, n, min_memory_gib=m, duration_s=60 * n)["has"])
                  for n, m in ((1, 0), (2, 40), (4, 0), (8, 0))}
        sizes = [4, 1, 8, 2, 4, 1, 2, 8, 1, 4, 2, 1]
        queue = [QueuedJob(str(i), float(i), shapes[n] if shared else tuple(list(shapes[n])))
                 for i, n in enumerate(sizes)]
        started, considered = schedule_pass(policy, 100.0, queue, [], FreeGpus(cluster))
        return [(q.job_id, o.gpu_type, p.gpu_map()) for q, o, p in started], considered

    assert run(shared=True) == run(shared=False)
    assert run(shared=True)[0]  # something started


def test_a_failed_commit_leaves_no_view_behind(url, monkeypatch):
    """The decision's writes go out with the COMMIT; when it fails the database rolls back, and
    a view that kept the decision would be trusted by this process from then on."""
    import sqlite3

    import infra.statedb.batch as batch_mod

    o = Orchestrator(url, OrchestratorConfig(lease_s=600))
    o.register(parse_cluster({"name": "c", "nodes": [{"name": "n", "gpu_type": "A100-80G", "gpu_count": 4}]}))
    first = o.submit("first", demand_options(o.cluster(), 4))
    waiting = o.submit("waiting", demand_options(o.cluster(), 4))
    real_commit = batch_mod.StatementBatch.commit
    fail = {"once": True}

    def commit(self, transaction):
        if fail.pop("once", False):
            raise sa.exc.OperationalError("COMMIT", {}, sqlite3.OperationalError("database or disk is full"))
        return real_commit(self, transaction)

    monkeypatch.setattr(batch_mod.StatementBatch, "commit", commit)
    with pytest.raises(StateDbError, match="disk is full"):
        o.release(first)  # frees the GPUs and admits "waiting": rolled back
    assert (o.job(first)["state"], o.job(waiting)["state"]) == ("running", "queued")
    o.release(first)  # retried: now it commits, and the waiting job is admitted
    o.reconcile()
    # a view that kept the rolled-back decision holds "waiting" as running already, never
    # admits it, and it starves on an idle cluster
    assert o.job(waiting)["state"] == "running", o.cluster().free_gpus_by_type()
    assert double_booked(o.engine) == 0


def test_a_job_ending_on_a_cordoned_node_does_not_count_its_gpus_as_free(url):
    o = Orchestrator(url, OrchestratorConfig(policy="ect", lease_s=600))
    o.register(parse_cluster({"name": "c", "nodes": [{"name": "n1", "gpu_type": "A100-80G", "gpu_count": 4},
                                                     {"name": "n2", "gpu_type": "A100-80G", "gpu_count": 4}]}))
    job = o.submit("r", demand_options(o.cluster(), 4))
    node = o.admission(job).placement.nodes[0]
    o.cordon(node, reason="faulty")
    o.reconcile()  # this process caches a view that knows the cordon
    o.release(job)  # the job ends on the cordoned node: its GPUs stay unschedulable
    assert o._views["c"].free.by_type == o.cluster().free_gpus_by_type() == {"A100-80G": 4}
