"""Delegated jobs (issue 32): a job a site's batch system places (Slurm's delegate mode) is kept in
the orchestrator as a mirror, not admitted onto its GPUs.

- `jobs.state` may be ``delegated``: the job is in the batch system, which decides where and when
  it runs. It holds no lease and no allocation, no policy pass admits it and nothing counts it as
  holding GPUs; it ends finished / failed / cancelled as every job does, and `forgeflow cancel`
  reaches its flow through `stop_requested` as for a running job.
- `jobs.batch`: what the batch system says of it, written by its flow when that changes
  (`{"system": "slurm", "id", "state", "reason", "nodes", "gpus", "at"}`).

On PostgreSQL the jobs table keeps its privileges and row-level policies (0008): every role has
table-wide UPDATE on jobs and `jobs_change` lets only the job's owner, a team admin of its team or
an operator change its row, so the new column needs no grant of its own and no new policy (the
same as 0013's `jobs.promised`). The check constraint is replaced. SQLite cannot alter a check
constraint, and rebuilding `jobs` would cascade-delete its allocations, launches and preemption
records (foreign keys are on, and cannot be switched off inside the migration's transaction):
the constraint's text in the schema is rewritten instead (SQLite's documented procedure for a
change that does not touch the stored rows: writable_schema and a new schema_version).

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-29
"""

from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")

BEFORE = "'queued', 'running', 'finished', 'failed', 'cancelled'"
AFTER = BEFORE + ", 'delegated'"


def _set_states(before: str, after: str) -> None:
    bind = op.get_bind()
    if bind.dialect.name == "postgresql":
        op.execute("ALTER TABLE jobs DROP CONSTRAINT ck_jobs_state")
        op.execute(f"ALTER TABLE jobs ADD CONSTRAINT ck_jobs_state CHECK (state in ({after}))")
        return
    old = f"CHECK (state in ({before}))"
    sql = bind.exec_driver_sql("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'jobs'").scalar()
    if sql is None or sql.count(old) != 1:
        raise RuntimeError(f"migration {revision}: the jobs table's check constraint is not {old!r} "
                           f"(schema: {sql!r}); not changing it")
    version = bind.exec_driver_sql("PRAGMA schema_version").scalar()
    bind.exec_driver_sql("PRAGMA writable_schema=ON")
    try:
        bind.exec_driver_sql("UPDATE sqlite_master SET sql = ? WHERE type = 'table' AND name = 'jobs'",
                             (sql.replace(old, f"CHECK (state in ({after}))"),))
        bind.exec_driver_sql(f"PRAGMA schema_version={int(version) + 1}")
    finally:
        bind.exec_driver_sql("PRAGMA writable_schema=OFF")


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("batch", JSON, nullable=True))
    _set_states(BEFORE, AFTER)


def downgrade() -> None:
    # an older forgeflow knows no delegated job: one still in the batch system ends (its flow, if
    # any, finds it ended and stops)
    op.execute("UPDATE jobs SET state = 'cancelled', reason = 'delegated job ended by a schema downgrade' "
               "WHERE state = 'delegated'")
    _set_states(AFTER, BEFORE)
    # (SQLite's own DROP COLUMN, not a batch rebuild: that would cascade-delete the job's children)
    op.execute("ALTER TABLE jobs DROP COLUMN batch")
