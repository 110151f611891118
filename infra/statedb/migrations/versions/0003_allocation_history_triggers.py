"""The allocation history is written by the database itself: triggers on `allocations` append an
`allocation_events` row for every allocation inserted and every live allocation released, and
`allocations.release_event` says whether that end was a `release` or an `expire`.

Why: the double-booking replay (`scheduler.orchestrator.history`) must see every change of a live
allocation; a trigger records it in the same statement, whatever code path (or hand-written SQL)
made the change, and the orchestrator no longer spends a statement per decision writing it.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23
"""

from alembic import op
import sqlalchemy as sa

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

COLUMNS = "allocation_id, job_id, cluster, node, gpu_index, event, at"
ALLOCATE = "NEW.id, NEW.job_id, NEW.cluster, NEW.node, NEW.gpu_index, 'allocate', NEW.allocated_at"
RELEASE = ("NEW.id, NEW.job_id, NEW.cluster, NEW.node, NEW.gpu_index, "
           "COALESCE(NEW.release_event, 'release'), NEW.released_at")
RELEASED = "OLD.released_at IS NULL AND NEW.released_at IS NOT NULL"

SQLITE = [
    f"""CREATE TRIGGER allocations_history_allocate AFTER INSERT ON allocations
        BEGIN INSERT INTO allocation_events ({COLUMNS}) VALUES ({ALLOCATE}); END""",
    f"""CREATE TRIGGER allocations_history_release AFTER UPDATE OF released_at ON allocations
        WHEN {RELEASED}
        BEGIN INSERT INTO allocation_events ({COLUMNS}) VALUES ({RELEASE}); END""",
]

POSTGRES = [
    f"""CREATE FUNCTION forgeflow_allocation_history() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF TG_OP = 'INSERT' THEN
                INSERT INTO allocation_events ({COLUMNS}) VALUES ({ALLOCATE});
            ELSE
                INSERT INTO allocation_events ({COLUMNS}) VALUES ({RELEASE});
            END IF;
            RETURN NULL;
        END $$""",
    """CREATE TRIGGER allocations_history_allocate AFTER INSERT ON allocations
        FOR EACH ROW EXECUTE FUNCTION forgeflow_allocation_history()""",
    f"""CREATE TRIGGER allocations_history_release AFTER UPDATE OF released_at ON allocations
        FOR EACH ROW WHEN ({RELEASED}) EXECUTE FUNCTION forgeflow_allocation_history()""",
]


def upgrade() -> None:
    with op.batch_alter_table("allocations") as batch:
        batch.add_column(sa.Column("release_event", sa.String(10), nullable=True))
    for statement in (POSTGRES if op.get_bind().dialect.name == "postgresql" else SQLITE):
        op.execute(statement)


def downgrade() -> None:
    op.execute("DROP TRIGGER IF EXISTS allocations_history_release" +
               (" ON allocations" if op.get_bind().dialect.name == "postgresql" else ""))
    op.execute("DROP TRIGGER IF EXISTS allocations_history_allocate" +
               (" ON allocations" if op.get_bind().dialect.name == "postgresql" else ""))
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP FUNCTION IF EXISTS forgeflow_allocation_history()")
    with op.batch_alter_table("allocations") as batch:
        batch.drop_column("release_event")
