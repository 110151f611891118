"""A decider (`Orchestrator.serve`, `forgeflow cluster serve`): processes with stale views leave their
policy passes to it; if it stops or dies, they (and waiting jobs) make their own passes again.

Real parts: the decider runs in its own forked process on the same database (SQLite and a real
PostgreSQL); the releasing and submitting "flows" are fresh orchestrators with no view.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

import sqlalchemy as sa

import scheduler.orchestrator.service as service
from infra.statedb import forget_engines, read_transaction
from infra.statedb.schema import clusters
from scheduler.cluster import parse_cluster
from scheduler.orchestrator import Orchestrator, OrchestratorConfig, demand_options, double_booked

_fork = multiprocessing.get_context("fork")
POOL = {"name": "pool", "nodes": [{"name": "n", "replicas": 2, "gpu_type": "A100-80G", "gpu_count": 4}]}
CONFIG = OrchestratorConfig(policy="has", lease_s=600)


def _serve(url: str) -> None:
    code = 1
    try:
        forget_engines()  # the parent's pooled connections are not this process's
        Orchestrator(url, CONFIG).serve("pool", on_pass=lambda r: None, busy_poll_s=0.001, idle_poll_s=0.01)
        code = 0
    finally:
        os._exit(code)


def _start_decider(url: str):
    forget_engines()
    proc = _fork.Process(target=_serve, args=(url,), daemon=True)
    proc.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # its first heartbeat
        with read_transaction(Orchestrator(url, CONFIG).engine) as conn:
            if conn.execute(sa.select(clusters.c.decider_seen_at)).scalar() is not None:
                return proc
        time.sleep(0.02)
    raise AssertionError("the decider never beat")


def _fresh(url: str) -> Orchestrator:
    """A flow's orchestrator with no view (and a counter of its full read-backs)."""
    orch = Orchestrator(url, CONFIG)
    orch.reads_back = 0
    load = orch._load_queue

    def counted(conn, cname):
        orch.reads_back += 1
        return load(conn, cname)

    orch._load_queue = counted
    return orch


def test_flows_leave_their_passes_to_the_decider(state_db_url):
    cluster = parse_cluster(POOL)
    Orchestrator(state_db_url, CONFIG).register(cluster)
    decider = _start_decider(state_db_url)
    try:
        flows = [_fresh(state_db_url) for _ in range(6)]
        jobs = [flows[i].submit(f"job-{i}", demand_options(cluster, 4)) for i in range(6)]
        admitted = [flows[i].wait_admitted(j, poll_s=0.02, timeout_s=20) for i, j in enumerate(jobs[:2])]
        assert sorted(n for a in admitted for n in a.placement.nodes) == ["n-0", "n-1"]
        for i in range(2, 6):
            assert flows[i].job(jobs[i])["state"] == "queued"
        # each release comes from a process with no view: it writes its change and the decider
        # admits the next job in queue order
        releasers = [_fresh(state_db_url) for _ in range(4)]
        for i, releaser in enumerate(releasers):
            releaser.release(jobs[i])
            flows[i + 2].wait_admitted(jobs[i + 2], poll_s=0.02, timeout_s=20)
        assert [f.reads_back for f in flows + releasers] == [0] * 10
        with read_transaction(flows[0].engine) as conn:
            assert conn.execute(sa.select(clusters.c.pass_pending)).scalar() is False
        assert double_booked(flows[0].engine) == 0
    finally:
        decider.terminate()
        decider.join(10)


def test_a_dead_decider_is_replaced_by_waiting_jobs_and_a_stopped_one_by_everyone(state_db_url, monkeypatch):
    monkeypatch.setattr(service, "DECIDER_TTL_S", 1.5)
    cluster = parse_cluster(POOL)
    Orchestrator(state_db_url, CONFIG).register(cluster)
    first = Orchestrator(state_db_url, CONFIG)
    big = [first.submit(f"big-{i}", demand_options(cluster, 4)) for i in range(3)]
    assert first.job(big[2])["state"] == "queued"

    decider = _start_decider(state_db_url)
    os.kill(decider.pid, signal.SIGKILL)  # dies with its heartbeat still fresh
    decider.join(10)
    releaser = _fresh(state_db_url)
    releaser.release(big[0])  # trusts the heartbeat: leaves the pass to the dead decider
    assert releaser.reads_back == 0 and first.job(big[2])["state"] == "queued"
    waiter = _fresh(state_db_url)
    t0 = time.monotonic()
    waiter.wait_admitted(big[2], poll_s=0.05, timeout_s=20)  # makes the pass once the beat is stale
    assert time.monotonic() - t0 < 10

    # a decider that stops cleanly clears its heartbeat: the next release passes itself at once
    stop = threading.Event()
    serving = threading.Thread(target=Orchestrator(state_db_url, CONFIG).serve, args=("pool",),
                               kwargs={"stop": stop})
    serving.start()
    while _heartbeat(first) is None:
        time.sleep(0.01)
    stop.set()
    serving.join(10)
    assert _heartbeat(first) is None
    small = _fresh(state_db_url).submit("small", demand_options(cluster, 2))
    releaser = _fresh(state_db_url)
    releaser.release(big[1])
    assert releaser.reads_back == 1  # no decider: it read the state back and made the pass
    assert first.job(small)["state"] == "running"
    assert double_booked(first.engine) == 0


def _heartbeat(orch: Orchestrator) -> float | None:
    with read_transaction(orch.engine) as conn:
        return conn.execute(sa.select(clusters.c.decider_seen_at)).scalar()


def test_forgeflow_cluster_serve_command(tmp_path):
    """The real command: it decides for a flow's release, and a clean stop clears its heartbeat."""
    import json
    import subprocess
    import sys

    url = f"sqlite:///{tmp_path / 'state.db'}"
    cluster = parse_cluster(POOL)
    setup = Orchestrator(url, CONFIG)
    setup.register(cluster)
    blockers = [setup.submit(f"b-{i}", demand_options(cluster, 4)) for i in range(2)]
    waiting = setup.submit("waiting", demand_options(cluster, 4))
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "cluster", "serve", "--db", url, "--json"],
                            stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while _heartbeat(setup) is None:
            assert proc.poll() is None and time.monotonic() < deadline, "forgeflow cluster serve never beat"
            time.sleep(0.05)
        releaser = _fresh(url)
        releaser.release(blockers[0])
        assert releaser.reads_back == 0  # left the pass to the decider
        setup.wait_admitted(waiting, poll_s=0.05, timeout_s=20)
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert json.loads(out)["admitted"] >= 1
    assert _heartbeat(setup) is None
