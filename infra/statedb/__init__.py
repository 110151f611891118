"""forgeflow: infra.statedb — the state database shared by the orchestrator and the diagnosis rules.

    engine      which database (FORGEFLOW_DB_URL, else a SQLite file in the state dir), engines
                with SQLite WAL / busy timeout / immediate transactions, reachability errors
    batch       StatementBatch: a transaction's statements sent together (one round trip on PostgreSQL)
    schema      the tables: clusters, nodes, GPUs, jobs, allocations (+ history), diagnosis rules
    migrate     `open_state_db`: an engine on a database upgraded (Alembic) to this forgeflow's schema;
                refuses a schema from a newer forgeflow
    migrations  the Alembic revisions (one file per schema change)

`open_state_db(url)` is the one entry point: an engine on a migrated database.
"""

from infra.statedb.batch import StatementBatch
from infra.statedb.engine import (
    StateDbError,
    batched_write_transaction,
    database_url,
    is_postgres,
    is_sqlite,
    read_transaction,
    redact,
    write_transaction,
)
from infra.statedb.migrate import forget_engines, open_state_db

__all__ = [
    "StateDbError", "StatementBatch", "batched_write_transaction", "database_url", "forget_engines", "is_postgres", "is_sqlite", "open_state_db",
    "read_transaction", "redact", "write_transaction",
]
