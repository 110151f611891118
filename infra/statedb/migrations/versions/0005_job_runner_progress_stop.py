"""What a submitted job needs to run and be watched with nobody at the terminal: who runs it
(`runner`: the detached runner's host, pid and log, or the Prefect flow run), how far it got
(`progress`: phase, step, loss, measured step time, last diagnosis; written by its flow), and a
request to stop it (`stop_requested`: by whom, why, when; `forgeflow cancel` writes it, the
job's flow stops the ranks gracefully and ends the job as cancelled).

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-28
"""

from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("runner", JSON, nullable=True))
        batch.add_column(sa.Column("progress", JSON, nullable=True))
        batch.add_column(sa.Column("stop_requested", JSON, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("stop_requested")
        batch.drop_column("progress")
        batch.drop_column("runner")
