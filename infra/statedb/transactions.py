"""Which state database, and engines that make concurrent writers safe on it.

The URL comes from an explicit argument, else `$FORGEFLOW_DB_URL`
(`postgresql+psycopg://user:pw@host/db` in production), else the embedded
default: a SQLite file `forgeflow.db` in the forgeflow state dir
(`$FORGEFLOW_STATE_DIR`, default `~/.forgeflow/state`), which is what
`make demo` uses without any set-up.

Concurrency: every write goes through `write_transaction`. On SQLite that is
`BEGIN IMMEDIATE` (the write lock is taken when the transaction starts, so two
processes never both read the free GPUs and then both write) in WAL mode with a
busy timeout (writers queue instead of failing); on PostgreSQL the caller takes
row locks (`SELECT ... FOR UPDATE`) inside it.

Connections (PostgreSQL): one small pool per process (POOL_SIZE kept open, POOL_OVERFLOW more
under a burst, closed when returned), no server-side prepared statements (psycopg's
`prepare_threshold=None`), so the URL may point at PgBouncer in transaction pooling mode; and a
multi-host URL (`?host=a:5432,b:5433&target_session_attrs=read-write`) connects to whichever
host takes writes, so a promoted standby is found after a failover. A transaction the database
does not answer raises `StateDbUnreachable` (`infra.statedb.retry` waits it out).
"""

from __future__ import annotations

import os
import re
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine

from infra.statedb.batch import StatementBatch
from infra.statedb.url import DB_FILE, DB_URL_ENV, database_url  # noqa: F401  (re-exported)

SQLITE_BUSY_TIMEOUT_S = 60.0
SQLITE_TX_NOW = "forgeflow_tx_now"  # the SQL function infra.statedb.clock.db_now() calls on SQLite
PING_AFTER_IDLE_S = 5.0  # a PostgreSQL connection idle in the pool this long is checked before use
# Connections per process (README, "Sizing the state database"): a flow uses one at a time in its
# main thread and one in its lease thread; `cluster serve` one. POOL_OVERFLOW more are opened
# only under a burst and closed when returned; a process waiting longer than POOL_TIMEOUT_S for
# one of its own connections has a bug, not a busy database.
POOL_SIZE = 2
POOL_OVERFLOW = 2
POOL_TIMEOUT_S = 30.0
CONNECT_TIMEOUT_S = 10  # libpq's, per host tried: a host that does not answer is passed over


class StateDbError(RuntimeError):
    """The state database cannot be used: unreachable, bad URL, or a schema from a newer forgeflow."""


class StateDbUnreachable(StateDbError):
    """The state database did not answer or refused the transaction (down, restarting, failing over
    to a standby, out of connections, disk full): the same call may succeed later
    (`infra.statedb.retry` waits and retries). A bad URL or a newer schema is a plain StateDbError."""


# scheme ':' any slashes, user, ':' password up to the last '@' (a password may hold '@')
_USERINFO_PASSWORD = re.compile(r"^([^:/?#@\s]*:/*[^:/@\s]*):.*@")


def redact(url: str) -> str:
    """The URL with its password hidden, for error messages; also a URL that does not parse
    (a bad port, a stray character), whose password is whatever sits between the user's ':'
    and the last '@'."""
    try:
        return sa.make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - unparseable: hide the userinfo's password by its shape
        return _USERINFO_PASSWORD.sub(r"\1:***@", url, count=1)


def is_sqlite(engine_or_conn: Engine | Connection) -> bool:
    return engine_or_conn.dialect.name == "sqlite"


def is_postgres(engine_or_conn: Engine | Connection) -> bool:
    return engine_or_conn.dialect.name == "postgresql"


def _sqlite_engine(url: sa.URL) -> Engine:
    if url.database and url.database != ":memory:":
        Path(url.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    engine = sa.create_engine(url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_S})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record):  # noqa: ANN001 - DB-API objects
        # Let SQLAlchemy's "begin" event below issue BEGIN itself (pysqlite would defer it).
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute(f"PRAGMA busy_timeout={int(SQLITE_BUSY_TIMEOUT_S * 1000)}")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: durable at checkpoints, fast commits
        cur.close()
        # The database's clock (infra.statedb.clock): one time per transaction, as PostgreSQL's
        # transaction_timestamp(), stamped in "begin" below; the local clock outside a transaction.
        stamp = _record.info["forgeflow_tx_now"] = [None]
        dbapi_conn.create_function(SQLITE_TX_NOW, 0, lambda: stamp[0] if stamp[0] is not None else time.time())

    @event.listens_for(engine, "begin")
    def _on_begin(conn):  # noqa: ANN001
        # Reads (read_transaction) take no write lock; everything else takes it up front.
        conn.exec_driver_sql("BEGIN" if conn.get_execution_options().get("forgeflow_read") else "BEGIN IMMEDIATE")
        # stamped once the write lock is held: a transaction that waited for it is later than the
        # one it waited for (a job admitted after a release is never stamped before that release)
        conn.connection.info["forgeflow_tx_now"][0] = time.time()

    @event.listens_for(engine, "commit")
    @event.listens_for(engine, "rollback")
    def _on_end(conn):  # noqa: ANN001
        stamp = conn.connection.info.get("forgeflow_tx_now")
        if stamp is not None:
            stamp[0] = None

    return engine


def _multihost(url: sa.URL) -> sa.URL:
    """libpq's comma-separated host list (`?host=a:5432,b:5433`) as the repeated `host` SQLAlchemy
    splits into libpq's host and port lists (given as one value it would be taken as one host)."""
    hosts = url.query.get("host")
    if hosts is None:
        return url
    split = [h.strip() for h in ([hosts] if isinstance(hosts, str) else hosts) for h in h.split(",") if h.strip()]
    return url.update_query_dict({"host": split if len(split) > 1 else split[0]})


def _postgres_engine(url: sa.URL) -> Engine:
    # prepare_threshold=None: psycopg never prepares a statement on the server, which PgBouncer's
    # transaction pooling would send to another server connection than the one that prepared it.
    connect_args = {"prepare_threshold": None}
    if "connect_timeout" not in url.query:
        connect_args["connect_timeout"] = CONNECT_TIMEOUT_S
    engine = sa.create_engine(_multihost(url), pool_size=POOL_SIZE, max_overflow=POOL_OVERFLOW,
                              pool_timeout=POOL_TIMEOUT_S, connect_args=connect_args)

    # A pooled connection may be dead (the server restarted). SQLAlchemy's pool_pre_ping checks
    # on every checkout, which on psycopg is two round trips (BEGIN, SELECT 1) per transaction —
    # as many as a whole scheduling decision needs — so only a connection that sat idle in the
    # pool for a while is checked; a dead one is replaced before use.
    @event.listens_for(engine, "checkin")
    def _on_checkin(_dbapi_conn, record):  # noqa: ANN001 - DB-API objects
        record.info["idle_since"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _on_checkout(dbapi_conn, record, _proxy):  # noqa: ANN001
        since = record.info.get("idle_since")
        if since is None or time.monotonic() - since < PING_AFTER_IDLE_S:
            return
        try:
            dbapi_conn.execute("SELECT 1")
            dbapi_conn.rollback()
        except Exception:
            raise sa.exc.DisconnectionError("pooled connection is dead; reconnecting") from None

    return engine


def make_engine(url: str) -> Engine:
    """An engine for `url` (no schema check; see `open_state_db`)."""
    try:
        parsed = sa.make_url(url)
    except (sa.exc.ArgumentError, ValueError) as e:  # ValueError: e.g. a port that is not a number
        raise StateDbError(
            f"{DB_URL_ENV}={redact(url)!r} is not a database URL ({e}); use e.g. "
            "postgresql+psycopg://user:password@host:5432/forgeflow or sqlite:////path/forgeflow.db"
        ) from None
    if parsed.get_backend_name() == "sqlite":
        return _sqlite_engine(parsed)
    if parsed.get_backend_name() == "postgresql":
        if parsed.drivername == "postgresql":
            parsed = parsed.set(drivername="postgresql+psycopg")  # the driver forgeflow installs
        return _postgres_engine(parsed)
    raise StateDbError(
        f"state database {redact(url)!r}: backend {parsed.get_backend_name()!r} is not supported; "
        "use postgresql+psycopg://... or sqlite:///..."
    )


# what a database that went away (or never answered) raises: the pool's connect, a dead connection
_UNREACHABLE = (sa.exc.OperationalError, sa.exc.InterfaceError, sa.exc.DisconnectionError)


def _transaction_failed(engine: Engine, e: Exception) -> StateDbUnreachable:
    orig = getattr(e, "orig", None)
    reason = (str(orig) if orig is not None else str(e)).strip().splitlines()
    return StateDbUnreachable(f"the state database {redact(str(engine.url))} failed a transaction "
                              f"({reason[0] if reason else type(e).__name__}); "
                              "check that it is reachable and not read-only")


@contextmanager
def write_transaction(engine: Engine) -> Iterator[Connection]:
    """One write transaction: BEGIN IMMEDIATE on SQLite (the event above), plain BEGIN on PostgreSQL."""
    try:
        with engine.begin() as conn:
            yield conn
    except _UNREACHABLE as e:
        raise _transaction_failed(engine, e) from None


@contextmanager
def batched_write_transaction(engine: Engine) -> Iterator[tuple[Connection, StatementBatch]]:
    """`write_transaction` with a `StatementBatch`: what is still queued in it at the end is sent
    together with the COMMIT (one round trip on PostgreSQL)."""
    try:
        with engine.connect() as conn:
            transaction = conn.begin()
            batch = StatementBatch(conn)
            try:
                yield conn, batch
                batch.commit(transaction)
            except BaseException:
                if transaction.is_active:
                    transaction.rollback()
                raise
    except _UNREACHABLE as e:
        raise _transaction_failed(engine, e) from None


@contextmanager
def read_transaction(engine: Engine) -> Iterator[Connection]:
    """A consistent read (a deferred transaction on SQLite: it waits for no writer)."""
    try:
        with engine.connect() as conn:
            conn = conn.execution_options(forgeflow_read=True)
            with conn.begin():
                yield conn
    except _UNREACHABLE as e:
        raise _transaction_failed(engine, e) from None
