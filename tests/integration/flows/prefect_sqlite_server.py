"""`python -m tests.integration.flows.prefect_sqlite_server server start ...`: Prefect's CLI with
every transaction on its SQLite database taking the write lock when it begins (BEGIN IMMEDIATE,
which Prefect itself uses only where a caller asks `with_for_update`), for the test servers.

Why: many of Prefect's services (foreman, scheduler, late runs, repossessor, cancellation
clean-up) read and then write in one DEFERRED transaction. On SQLite in WAL mode that upgrade
fails at once with "database is locked" when another connection wrote since the read began: the
busy timeout Prefect sets (60 s) only covers waiting for a lock, not a snapshot that went stale,
so it never helps. On a loaded machine the window is long enough to hit (seen: the foreman's
`_mark_work_pools_as_not_ready`, a 212 ms transaction, while a test's workers stopped), and the
traceback lands in the server's log, which the deployment tests require to be clean. Taken up
front, the lock is waited for (the busy timeout) instead of refused. Upstream fixes the same
class one call at a time (PrefectHQ/prefect#22967 added `with_for_update` to
`mark_deployments_ready`); PostgreSQL, production's database, has no such failure.
"""

from __future__ import annotations

from prefect.server.database.configurations import AioSqliteConfiguration

_prefect_begin = AioSqliteConfiguration.begin_transaction


def _begin_immediate(self, session, with_for_update: bool = False):  # noqa: ANN001, ANN202 - Prefect's signature
    return _prefect_begin(self, session, with_for_update=True)


AioSqliteConfiguration.begin_transaction = _begin_immediate

if __name__ == "__main__":
    from prefect.cli import app

    app()
