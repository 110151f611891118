"""Bring a state database to this forgeflow's schema with Alembic, or refuse one that is newer.

Runs inside one write transaction (BEGIN IMMEDIATE on SQLite, an advisory lock on
PostgreSQL), so processes that start together against a fresh database do not race
to create the tables.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Engine

from infra.statedb.transactions import (DB_URL_ENV, SQLITE_BUSY_TIMEOUT_S, StateDbError, StateDbUnreachable, database_url,
                                        is_postgres, make_engine, redact)

MIGRATIONS = Path(__file__).resolve().parent / "migrations"
_ADVISORY_KEY = 0x466F7267  # "Forg": one lock id for schema changes


def alembic_config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    return cfg


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def ensure_schema(engine: Engine) -> None:
    """Upgrade to head if behind; StateDbError if the database holds a revision this code does not know."""
    script = ScriptDirectory.from_config(alembic_config())
    head = script.get_current_head()
    if current_revision(engine) == head:
        return
    cfg = alembic_config()
    with engine.begin() as conn:
        if is_postgres(conn):
            conn.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": _ADVISORY_KEY})
        revision = MigrationContext.configure(conn).get_current_revision()
        if revision is not None:
            try:
                known = script.get_revision(revision)
            except Exception:
                known = None
            if known is None:
                raise StateDbError(
                    f"the state database {redact(str(engine.url))} has schema revision {revision!r}, which "
                    f"this forgeflow does not know (its newest is {head!r}): it was written by a newer "
                    "forgeflow; upgrade forgeflow (or point FORGEFLOW_DB_URL at another database)"
                )
        if revision != head:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")


def _ensure_schema_waiting(engine: Engine) -> None:
    """`ensure_schema`, waiting out SQLite's "database is locked" while another process creates a fresh
    database: switching a new file to WAL (on connect) and the first migration can refuse a second
    process at once, without SQLite's busy handler; it is retried for the usual busy timeout."""
    deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT_S
    delay = 0.01
    while True:
        try:
            return ensure_schema(engine)
        except sa.exc.OperationalError as e:
            locked = engine.dialect.name == "sqlite" and "locked" in str(e.orig)
            if not locked or time.monotonic() > deadline:
                raise
            engine.dispose()  # a connection that failed half-way through its set-up is not reused
            time.sleep(delay)
            delay = min(delay * 2, 0.5)


_ENGINES: dict[str, Engine] = {}
_LOCK = threading.Lock()


def open_state_db(url: str | None = None, *, state_dir: str | os.PathLike | None = None) -> Engine:
    """An engine on the state database, migrated to this forgeflow's schema (once per process and URL).

    Raises StateDbError when the database cannot be reached or its schema is newer than this code.
    """
    url = database_url(url, folder=state_dir)
    with _LOCK:
        engine = _ENGINES.get(url)
        if engine is None:
            engine = make_engine(url)
            try:
                _ensure_schema_waiting(engine)
            except (sa.exc.OperationalError, sa.exc.InterfaceError) as e:
                engine.dispose()
                reason = str(e.orig).strip().splitlines()[0] if e.orig is not None else str(e)
                raise StateDbUnreachable(
                    f"cannot reach the state database {redact(url)} ({reason}); start it or point "
                    f"{DB_URL_ENV} at a reachable database"
                ) from None
            except StateDbError:
                engine.dispose()
                raise
            _ENGINES[url] = engine
        return engine


def forget_engines() -> None:
    """Dispose of cached engines (tests that stop a database server; a forked child)."""
    with _LOCK:
        for engine in _ENGINES.values():
            engine.dispose()
        _ENGINES.clear()
