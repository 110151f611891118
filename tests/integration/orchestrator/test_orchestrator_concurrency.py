"""Many processes share one cluster through the orchestrator, on a real PostgreSQL and on SQLite.

Clients are processes forked from a fresh one (nothing shared but the database): they submit,
wait for admission, renew and release at the same time. Afterwards the
allocation history — not only the final state — must show no GPU held twice.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time

import pytest
import sqlalchemy as sa

from infra.statedb import forget_engines, read_transaction
from infra.statedb.schema import allocation_events, allocations, jobs
from scheduler.cluster import parse_cluster
from scheduler.orchestrator import Orchestrator, OrchestratorConfig, demand_options, double_booked

# 64 GPUs of four types, two node shapes.
INVENTORY = {
    "name": "shared",
    "nodes": [
        {"name": "a100", "replicas": 2, "gpu_type": "A100-80G", "gpu_count": 8},
        {"name": "v100", "replicas": 2, "gpu_type": "V100-32G", "gpu_count": 8},
        {"name": "a10", "replicas": 2, "gpu_type": "A10", "gpu_count": 8},
        {"name": "a40", "replicas": 4, "gpu_type": "A40", "gpu_count": 4},
    ],
}
CLIENTS = 32
JOBS_PER_CLIENT = 2

# Clients fork from a server process started fresh (multiprocessing's forkserver), not from this
# pytest worker: a fork copies only the forking thread, so a lock another thread of the worker
# held at that moment (an earlier test's Prefect or logging thread) stays held in the child for
# ever, and that client hangs holding its GPUs until its lease expires (the likeliest cause of a
# client that once timed out waiting, under a loaded suite).
_fork = multiprocessing.get_context("forkserver")
_fork.set_forkserver_preload(["scheduler.orchestrator", "infra.statedb", __name__])


def _client(url: str, seed: int, team: str | None = None) -> None:
    """One user: submit a job, wait for it, renew its lease while it 'runs', release it; twice."""
    code = 1
    try:
        orch = Orchestrator(url, OrchestratorConfig(lease_s=120, grace_s=30))
        rng = random.Random(seed)
        cluster = orch.cluster()
        for k in range(JOBS_PER_CLIENT):
            options = demand_options(cluster, rng.choice([1, 2, 4, 8]), min_memory_gib=rng.choice([0, 30, 60]),
                                     duration_s=rng.uniform(10, 100))
            job = orch.submit(f"c{seed}-{k}", options, team=team)
            orch.wait_admitted(job, poll_s=0.2, timeout_s=240)
            for _ in range(2):
                orch.renew(job)
                time.sleep(rng.uniform(0, 0.03))
            orch.release(job)
        code = 0
    finally:
        os._exit(code)


def _start(url: str, target, *args) -> multiprocessing.Process:
    proc = _fork.Process(target=target, args=(url, *args))
    proc.start()
    return proc


@pytest.mark.slow
def test_32_processes_never_double_book_a_gpu(state_db_url):
    Orchestrator(state_db_url).register(parse_cluster(INVENTORY))
    procs = [_start(state_db_url, _client, seed) for seed in range(CLIENTS)]
    for p in procs:
        p.join(timeout=300)
    assert [p.exitcode for p in procs] == [0] * CLIENTS

    orch = Orchestrator(state_db_url)
    with read_transaction(orch.engine) as conn:
        states = dict(conn.execute(sa.select(jobs.c.state, sa.func.count()).group_by(jobs.c.state)).all())
        events = dict(conn.execute(sa.select(allocation_events.c.event, sa.func.count())
                                   .group_by(allocation_events.c.event)).all())
        live = conn.execute(sa.select(sa.func.count()).select_from(allocations)
                            .where(allocations.c.released_at.is_(None))).scalar()
        once = conn.execute(sa.select(sa.func.max(jobs.c.attempts))).scalar()
    assert states == {"finished": CLIENTS * JOBS_PER_CLIENT}  # every job admitted and released
    assert once == 1 and live == 0
    assert events["allocate"] == events["release"] > CLIENTS * JOBS_PER_CLIENT
    assert double_booked(orch.engine) == 0


@pytest.mark.slow
def test_32_processes_of_three_teams_keep_to_their_quotas(state_db_url):
    """The same 32 clients, of teams A, B, C (quotas 8/4/4 of each type, borrowing up to as much
    again): no allocation in the history takes a team past its quota and borrowing limit."""
    from infra.statedb import write_transaction
    from infra.statedb.schema import teams
    from scheduler.orchestrator.history import over_quota

    orch = Orchestrator(state_db_url)
    orch.register(parse_cluster(INVENTORY))
    with write_transaction(orch.engine) as conn:
        conn.execute(sa.insert(teams), [{"name": "A", "weight": 2.0}, {"name": "B", "weight": 1.0},
                                        {"name": "C", "weight": 1.0}])
    for gpu_type in ("A100-80G", "V100-32G", "A10", "A40"):
        for team, nominal in (("A", 8), ("B", 4), ("C", 4)):
            orch.set_quota(team, gpu_type, nominal, nominal)
    procs = [_start(state_db_url, _client, seed, "ABC"[seed % 3]) for seed in range(CLIENTS)]
    for p in procs:
        p.join(timeout=300)
    assert [p.exitcode for p in procs] == [0] * CLIENTS
    orch = Orchestrator(state_db_url)
    with read_transaction(orch.engine) as conn:
        states = dict(conn.execute(sa.select(jobs.c.state, sa.func.count()).group_by(jobs.c.state)).all())
        by_team = dict(conn.execute(sa.select(jobs.c.team, sa.func.count()).group_by(jobs.c.team)).all())
    assert states == {"finished": CLIENTS * JOBS_PER_CLIENT}
    assert by_team == {"A": 22, "B": 22, "C": 20}
    assert over_quota(orch.engine, "shared") == 0
    assert double_booked(orch.engine) == 0


def _holder(url: str, ready) -> None:
    try:
        orch = Orchestrator(url, OrchestratorConfig(lease_s=1.0, grace_s=0.5))
        job = orch.submit("holder", demand_options(orch.cluster(), 16, gpu_type="A100-80G"))
        orch.wait_admitted(job, poll_s=0.05, timeout_s=60)
        ready.send(job)
        while True:  # a running attempt renews its lease until it is killed
            orch.renew(job)
            time.sleep(0.2)
    finally:
        os._exit(1)


def test_a_killed_holder_loses_its_lease_and_the_next_job_starts(state_db_url):
    Orchestrator(state_db_url).register(parse_cluster(INVENTORY))
    ready, ready_child = _fork.Pipe(duplex=False)
    holder = _start(state_db_url, _holder, ready_child)
    assert ready.poll(60), "the holder was never admitted"
    holder_job = ready.recv()
    orch = Orchestrator(state_db_url, OrchestratorConfig(lease_s=1.0, grace_s=0.5, on_lost="fail"))
    waiter = orch.submit("waiter", demand_options(orch.cluster(), 16, gpu_type="A100-80G"))
    time.sleep(2.0)  # longer than lease + grace: only the holder's renewals keep its GPUs
    assert orch.job(waiter)["state"] == "queued" and orch.job(holder_job)["state"] == "running"

    os.kill(holder.pid, signal.SIGKILL)
    holder.join()
    admitted = orch.wait_admitted(waiter, poll_s=0.1, timeout_s=60)
    assert set(admitted.placement.nodes) == {"a100-0", "a100-1"}
    lost = orch.job(holder_job)
    assert lost["state"] == "failed" and "lease expired" in lost["reason"]
    with read_transaction(orch.engine) as conn:
        expired = conn.execute(sa.select(sa.func.count()).select_from(allocation_events).where(
            allocation_events.c.event == "expire", allocation_events.c.job_id == holder_job)).scalar()
    assert expired == 16
    assert double_booked(orch.engine) == 0


def _cordon_then_exit(url: str) -> None:
    try:
        orch = Orchestrator(url)
        orch.cordon("a100-0", reason="node check: slow allreduce")
        orch.drain("v100-1", reason="maintenance")
    finally:
        os._exit(0)


def test_health_set_by_another_process_is_kept_and_respected(state_db_url):
    Orchestrator(state_db_url).register(parse_cluster(INVENTORY))
    child = _start(state_db_url, _cordon_then_exit)
    child.join()
    forget_engines()  # as after a restart: nothing cached in this process
    orch = Orchestrator(state_db_url)
    cluster = orch.cluster()
    assert cluster.node("a100-0").cordoned and cluster.node("v100-1").cordoned
    ids = [orch.submit(f"fill{i}", demand_options(cluster, 1)) for i in range(50)]
    used = {node for i in ids if orch.job(i)["state"] == "running" for node in orch.admission(i).placement.nodes}
    assert used == {"a100-1", "v100-0", "a10-0", "a10-1", "a40-0", "a40-1", "a40-2", "a40-3"}
    assert sum(orch.job(i)["state"] == "running" for i in ids) == 64 - 16
