"""Send a transaction's statements together: one network round trip on PostgreSQL.

A scheduling decision is a handful of short statements; on PostgreSQL each one sent
and waited for separately costs a round trip to the server — on a loaded machine a
scheduler wake-up of the server process each — which was most of a decision's time.
`StatementBatch` queues SQLAlchemy Core statements and sends them in psycopg's
pipeline mode: `flush()` sends everything queued (plus the BEGIN psycopg adds) in
one round trip and makes each statement's rows available; `commit(transaction)`
sends what is queued *and* the COMMIT in one round trip. Semantics do not change:
the statements run in order, in the caller's transaction, and an error in any of
them (e.g. the unique index refusing a double booking) aborts the transaction and
is raised as SQLAlchemy's wrapped DB-API error, so nothing of it commits.

On SQLite (in-process: no round trip to save) and any other driver, `add()` simply
executes the statement at once through the connection.
"""

from __future__ import annotations

import contextlib
from typing import Any, Sequence

import sqlalchemy as sa
from sqlalchemy.engine import Connection, RootTransaction


class Pending:
    """A statement's outcome once its batch was sent: `rows` (RETURNING / SELECT) and `rowcount`."""

    __slots__ = ("rows", "rowcount", "_sent")

    def __init__(self) -> None:
        self.rows: list[tuple] | None = None
        self.rowcount = -1
        self._sent = False

    def all(self) -> list[tuple]:
        if not self._sent:
            raise RuntimeError("the statement's batch was not sent yet: call flush() first")
        return list(self.rows or [])

    def scalar(self) -> Any:
        rows = self.all()
        return rows[0][0] if rows else None


class _Compiled:
    """A Core statement compiled once for a dialect, with its bind processors."""

    def __init__(self, stmt: sa.Executable, dialect: sa.Dialect, keys: tuple[str, ...]):
        # column_keys: an INSERT/UPDATE without .values() sets the columns its parameters name
        compiled = stmt.compile(dialect=dialect, column_keys=list(keys))
        self.compiled = compiled
        self.sql = compiled.string
        self.processors = {}
        for name, bind in compiled.binds.items():
            proc = bind.type.dialect_impl(dialect).bind_processor(dialect)
            if proc is not None:
                self.processors[compiled.escaped_bind_names.get(name, name)] = proc

    def params(self, values: dict[str, Any] | None) -> dict[str, Any]:
        params = self.compiled.construct_params(values or {})
        for name, proc in self.processors.items():
            if name in params:
                params[name] = proc(params[name])
        return params


_COMPILED: dict[tuple, _Compiled] = {}


def _compiled(stmt: sa.Executable, dialect: sa.Dialect, params: dict[str, Any] | None) -> _Compiled:
    # The hot statements are module-level constants in the callers: each is compiled once per
    # dialect and parameter names (the cache holds the statement, so its id is not reused).
    keys = tuple(sorted(params)) if params else ()
    key = (id(stmt), dialect.name, keys)
    entry = _COMPILED.get(key)
    if entry is None:
        if len(_COMPILED) > 512:  # callers that build statements on the fly: keep the cache bounded
            _COMPILED.clear()
        entry = _COMPILED[key] = _Compiled(stmt, dialect, keys)
    return entry


class StatementBatch:
    """Statements of one transaction of `conn`, sent together where the driver can (see module doc)."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self.pipelined = conn.dialect.name == "postgresql" and conn.dialect.driver == "psycopg"
        self._queued: list[tuple[sa.Executable, Any, Pending]] = []

    def add(self, stmt: sa.Executable, params: dict[str, Any] | Sequence[dict[str, Any]] | None = None) -> Pending:
        """Queue `stmt` (a list of parameter sets: once per set, no rows kept); run at once where not pipelined."""
        pending = Pending()
        if not self.pipelined:
            result = self.conn.execute(stmt, params)
            pending.rows = result.all() if result.returns_rows else None
            pending.rowcount = result.rowcount
            pending._sent = True
        else:
            self._queued.append((stmt, params, pending))
        return pending

    def flush(self) -> None:
        """Send what is queued (one round trip when pipelined) and fill in each statement's outcome."""
        if not self._queued:
            return
        driver = self.conn.connection.driver_connection
        sent = []
        with self._wrapped_errors():
            with driver.pipeline():
                sent = self._send(driver)
            for cursor, pending in sent:
                pending.rows = cursor.fetchall() if cursor.description is not None else None
                pending.rowcount = cursor.rowcount
                pending._sent = True

    def commit(self, transaction: RootTransaction) -> None:
        """Send what is queued and commit `transaction` — in one round trip when pipelined."""
        if not self.pipelined or not self._queued:
            self.flush()
            transaction.commit()
            return
        driver = self.conn.connection.driver_connection
        try:
            with self._wrapped_errors():
                with driver.pipeline():
                    self._send(driver)
                    transaction.commit()  # psycopg queues the COMMIT behind them and syncs
        except BaseException:
            # A statement failed, so the COMMIT was skipped: the server's transaction is aborted,
            # but SQLAlchemy counts it as ended and would pool the connection as it is. Roll back.
            with contextlib.suppress(Exception):
                driver.rollback()
            raise

    def _send(self, driver) -> list[tuple[Any, Pending]]:  # noqa: ANN001 - a psycopg connection
        sent = []
        queued, self._queued = self._queued, []
        for stmt, params, pending in queued:
            many = isinstance(params, (list, tuple))
            entry = _compiled(stmt, self.conn.dialect, params[0] if many and params else None if many else params)
            cursor = driver.cursor()
            if many:
                cursor.executemany(entry.sql, [entry.params(p) for p in params])
            else:
                cursor.execute(entry.sql, entry.params(params))
            sent.append((cursor, pending))
        return sent

    def _wrapped_errors(self):
        return _WrapDbApiErrors(self.conn)


class _WrapDbApiErrors:
    """Raise driver errors as SQLAlchemy's (IntegrityError, OperationalError, ...), as `Connection.execute` does."""

    def __init__(self, conn: Connection):
        self.conn = conn

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, error, tb) -> bool:  # noqa: ANN001
        if error is None or isinstance(error, sa.exc.SQLAlchemyError):
            return False
        dialect = self.conn.dialect
        if isinstance(error, dialect.loaded_dbapi.Error):
            if dialect.is_disconnect(error, self.conn.connection.dbapi_connection, None):
                self.conn.invalidate()  # as Connection.execute does: never pool a dead connection
            raise sa.exc.DBAPIError.instance(None, None, error, dialect.loaded_dbapi.Error) from error
        return False
