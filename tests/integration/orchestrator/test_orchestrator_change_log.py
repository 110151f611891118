"""Decisions from different processes: a cached view is brought up to date from the change log.

Every flow is its own process, so consecutive decisions usually come from different
`Orchestrator`s. Each one's cached view (free GPUs, queue, running jobs) is then a few
versions old; it replays `cluster_changes` instead of reading the whole cluster back.
These tests run two orchestrators in turn on one database (SQLite and PostgreSQL) and
check that (1) after the first read, neither reads the state back again, (2) their
decisions are exactly those one orchestrator makes for the same operations, (3) each
view equals a fresh read of the database, and (4) a change the log does not describe
(a cordon) or a pruned log makes a view read everything back, and decisions stay right.
"""

from __future__ import annotations

import random

import sqlalchemy as sa

from infra.statedb import read_transaction, write_transaction
from infra.statedb.schema import cluster_changes, jobs
from scheduler.cluster import parse_cluster
from scheduler.orchestrator import Orchestrator, OrchestratorConfig, demand_options, double_booked
from scheduler.policy import FreeGpus

MIXED = {"name": "mixed", "nodes": [
    {"name": "a100", "replicas": 3, "gpu_type": "A100-80G", "gpu_count": 4},
    {"name": "a10", "replicas": 4, "gpu_type": "A10", "gpu_count": 2},
]}


def _two_processes(url: str) -> tuple:
    """The MIXED cluster registered by `a`, and a second orchestrator `b` on the same database."""
    cluster = parse_cluster(MIXED)
    config = OrchestratorConfig(policy="has", lease_s=600)
    a, b = Orchestrator(url, config), Orchestrator(url, config)
    a.register(cluster)
    return cluster, a, b


def _counting_reloads(orch: Orchestrator) -> list[int]:
    """Count the orchestrator's full read-backs of the queue (the path the log avoids)."""
    calls = [0]
    original = orch._load_queue

    def load_queue(conn, cname):
        calls[0] += 1
        return original(conn, cname)

    orch._load_queue = load_queue
    return calls


def _script(seed: int, steps: int) -> list[tuple]:
    """Operations: submit a job of 1/2/4 GPUs (some needing 40 GiB), release the oldest running
    job, or cancel a queued one; the same list drives every orchestrator under test."""
    rng = random.Random(seed)
    ops = []
    for i in range(steps):
        r = rng.random()
        ops.append(("submit", rng.choice([1, 1, 2, 4]), rng.choice([0, 0, 40]), rng.choice([0, 0, 1]))
                   if r < 0.5 else ("release",) if r < 0.9 else ("cancel",))
    return ops


def _run(orchs: list[Orchestrator], cluster, ops: list[tuple]) -> list[tuple]:
    """Apply `ops`, the i-th by orchestrator i % len(orchs); returns each decision's admissions (by submit index)."""
    ids: list[int] = []
    decisions = []
    for i, op in enumerate(ops):
        orch = orchs[i % len(orchs)]
        orch.last_pass = None
        if op[0] == "submit":
            _, count, mem, prio = op
            ids.append(orch.submit(f"job-{len(ids)}", demand_options(cluster, count, min_memory_gib=mem, duration_s=600),
                                   priority=prio))
        else:
            with read_transaction(orch.engine) as conn:
                state = "running" if op[0] == "release" else "queued"
                target = conn.execute(sa.select(jobs.c.id).where(jobs.c.state == state).order_by(
                    jobs.c.admitted_at if state == "running" else jobs.c.id, jobs.c.id)).scalars().first()
            if target is None:
                continue
            orch.release(target, outcome="finished" if op[0] == "release" else "cancelled")
        admitted = orch.last_pass.admitted if orch.last_pass else []
        decisions.append((i, sorted(ids.index(j) for j in admitted)))
    return decisions


def _assert_view_is_current(orch: Orchestrator, cname: str) -> None:
    view = orch._views[cname]
    fresh = orch.cluster(cname)
    assert {n.name: sorted(n.free_gpus or []) for n in view.cluster.nodes} == \
        {n.name: sorted(n.free_gpus or []) for n in fresh.nodes}
    assert {t: c for t, c in view.free.by_type.items() if c} == \
        {t: c for t, c in FreeGpus(fresh).by_type.items() if c}
    with read_transaction(orch.engine) as conn:
        queued = conn.execute(sa.select(jobs.c.id).where(jobs.c.cluster == cname, jobs.c.state == "queued")
                              .order_by(jobs.c.priority.desc(), jobs.c.queued_at, jobs.c.id)).scalars().all()
        running = set(conn.execute(sa.select(jobs.c.id).where(jobs.c.cluster == cname,
                                                              jobs.c.state == "running")).scalars())
    assert [int(q.job_id) for q in view.queue] == queued
    assert set(view.running) == running


def test_two_processes_in_turn_replay_the_log_and_decide_as_one(state_db_url, tmp_path):
    cluster = parse_cluster(MIXED)
    ops = _script(seed=7, steps=120)
    config = OrchestratorConfig(policy="has", lease_s=600)

    # reference: one orchestrator makes every decision (its view is always current)
    single = Orchestrator(f"sqlite:///{tmp_path / 'single.db'}", config)
    single.register(cluster)
    expected = _run([single], cluster, ops)

    a, b = Orchestrator(state_db_url, config), Orchestrator(state_db_url, config)
    a.register(cluster)
    reloads_a, reloads_b = _counting_reloads(a), _counting_reloads(b)
    got = _run([a, b], cluster, ops)

    assert got == expected
    assert sum(len(adm) for _, adm in got) > 30  # the script really admits and releases
    # a read the state back when it registered the cluster (before counting), b at its first
    # decision; from then on both replayed the log
    assert (reloads_a[0], reloads_b[0]) == (0, 1)
    for orch in (a, b):
        orch.reconcile("mixed")  # one more decision each, so both views are as of the end
    _assert_view_is_current(a, "mixed")
    _assert_view_is_current(b, "mixed")
    assert double_booked(a.engine) == 0


def test_undescribed_change_and_pruned_log_read_the_state_back(state_db_url):
    cluster, a, b = _two_processes(state_db_url)
    big = [a.submit(f"big-{i}", demand_options(cluster, 4, gpu_type="A100-80G")) for i in range(4)]
    assert [a.job(j)["state"] for j in big] == ["running"] * 3 + ["queued"]
    reloads_a = _counting_reloads(a)

    # a cordon is not described in the log: a's next decision reads everything back
    b.cordon("a100-0", reason="node check failed")
    a.release(big[1])
    assert reloads_a[0] == 1
    assert a.job(big[3])["state"] == "running"  # on the freed node, not the cordoned one
    assert a.admission(big[3]).placement.nodes == ["a100-1"]
    _assert_view_is_current(a, "mixed")

    # a log that was pruned past a's view: a reads everything back and still decides right
    b.release(big[3])
    smalls = [b.submit(f"small-{i}", demand_options(cluster, 2, gpu_type="A100-80G")) for i in range(3)]
    with write_transaction(a.engine) as conn:
        conn.execute(sa.delete(cluster_changes))
    a.release(big[2])
    assert reloads_a[0] == 2
    assert [a.job(j)["state"] for j in smalls] == ["running"] * 3  # 2 on a100-1, then 2 + 2 on a100-2
    _assert_view_is_current(a, "mixed")
    assert double_booked(a.engine) == 0


def test_refresh_outside_the_lock_keeps_a_waiting_process_current(state_db_url):
    """What a flow's lease loop does between its submit and its release (`HeldJob`, `wait_admitted`)."""
    cluster, a, b = _two_processes(state_db_url)
    mine = a.submit("mine", demand_options(cluster, 4, gpu_type="A100-80G"))
    reloads_a = _counting_reloads(a)
    others = [b.submit(f"other-{i}", demand_options(cluster, 2)) for i in range(12)]
    for j in others[:5]:
        b.release(j)
    assert a.refresh("mixed")  # a's view replayed b's 17 decisions, no lock taken
    _assert_view_is_current(a, "mixed")
    a.release(mine)  # nothing left to replay under the lock
    assert reloads_a[0] == 0
    _assert_view_is_current(a, "mixed")

    # a change the log does not describe (a cordon), or a re-registered inventory, drops the view:
    # the next decision reads everything back
    b.cordon("a10-0", reason="test")
    assert not a.refresh("mixed")
    b.uncordon("a10-0")
    a.release(others[5])
    assert reloads_a[0] == 1
    b.release(others[6])
    a.register(parse_cluster({**MIXED, "nodes": MIXED["nodes"] + [
        {"name": "h100", "gpu_type": "H100-80G", "gpu_count": 8}]}))
    assert not b.refresh("mixed")
    b.release(others[7])  # b reads the new inventory back
    _assert_view_is_current(b, "mixed")
    assert "h100" in {n.name for n in b._views["mixed"].cluster.nodes}
    assert double_booked(a.engine) == 0
