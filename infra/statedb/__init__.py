"""forgeflow: infra.statedb — the state database shared by the orchestrator and the diagnosis rules.

    url         which database (FORGEFLOW_DB_URL, else a SQLite file in the state dir), without
                importing SQLAlchemy
    transactions  engines and the transactions every write goes through (SQLite WAL / busy
                timeout / immediate transactions; PostgreSQL row locks, one small PgBouncer-safe
                pool per process, multi-host failover URLs), reachability errors
    retry       StateDbRetry: a call the database did not answer waits and is retried with
                backoff, logged, with an alert once the outage lasts
    batch       StatementBatch: a transaction's statements sent together (one round trip on PostgreSQL)
    clock       db_now(): the database's clock in SQL, which lease, queue and heartbeat times are on
    schema      the tables: clusters, nodes, GPUs, jobs, allocations (+ history), diagnosis rules
    migrate     `open_state_db`: an engine on a database upgraded (Alembic) to this forgeflow's schema;
                refuses a schema from a newer forgeflow
    migrations  the Alembic revisions (one file per schema change)
    identity    who a PostgreSQL connection is (its role, operator standing, teams); the operator
                role's name (FORGEFLOW_OPERATOR_ROLE); none of it on single-user SQLite

`open_state_db(url)` is the one entry point: an engine on a migrated database.
"""

# Exports are resolved on first use (PEP 562) so `infra.statedb.url` — the database URL alone —
# can be imported without SQLAlchemy/Alembic; `from infra.statedb import X` works as before.
_EXPORTS = {
    "StatementBatch": "infra.statedb.batch",
    "StateDbError": "infra.statedb.transactions",
    "StateDbUnreachable": "infra.statedb.transactions",
    "StateDbRetry": "infra.statedb.retry",
    "OutagePolicy": "infra.statedb.retry",
    "batched_write_transaction": "infra.statedb.transactions",
    "database_url": "infra.statedb.url",
    "is_postgres": "infra.statedb.transactions",
    "is_sqlite": "infra.statedb.transactions",
    "read_transaction": "infra.statedb.transactions",
    "redact": "infra.statedb.transactions",
    "write_transaction": "infra.statedb.transactions",
    "forget_engines": "infra.statedb.migrate",
    "open_state_db": "infra.statedb.migrate",
}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'infra.statedb' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "OutagePolicy", "StateDbError", "StateDbRetry", "StateDbUnreachable", "StatementBatch", "batched_write_transaction", "database_url", "forget_engines", "is_postgres", "is_sqlite", "open_state_db",
    "read_transaction", "redact", "write_transaction",
]
