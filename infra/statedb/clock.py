"""The database's clock, in SQL: `db_now()` is the time (seconds since the epoch, float) as the
state database sees it, evaluated by the database inside the statement that uses it.

Lease, queue and heartbeat times are written and compared on this one clock, so a writer whose
own clock runs ahead or behind neither expires another's lease early nor keeps its own too long.
PostgreSQL: `transaction_timestamp()` (`now()`: one value for the whole transaction, so a
release and the admission its pass makes carry the same time, and several uses in one UPDATE
agree; a transaction is milliseconds long, a lease a minute). SQLite: the local clock (the
database is a file on one host, so every writer shares that host's clock anyway), read once per
transaction too, once its lock is held (`forgeflow_tx_now()`, registered on every connection by
`infra.statedb.transactions`); SQLite's own `julianday('now')` changes from one statement to the
next, so a release's end and the admission its pass makes (the time read with the lock) would
disagree by a millisecond, the admission first.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.functions import FunctionElement

from infra.statedb.transactions import SQLITE_TX_NOW


class db_now(FunctionElement):  # noqa: N801 - reads like the SQL function it stands for
    """The database's current time in seconds since the epoch (a SQL expression)."""

    type = sa.Float()
    name = "db_now"
    inherit_cache = True


@compiles(db_now, "postgresql")
def _postgres_now(_element, _compiler, **_kw) -> str:  # noqa: ANN001
    return "CAST(EXTRACT(EPOCH FROM transaction_timestamp()) AS DOUBLE PRECISION)"


@compiles(db_now)
def _local_now(_element, _compiler, **_kw) -> str:  # noqa: ANN001 - SQLite and anything else
    return f"{SQLITE_TX_NOW}()"
