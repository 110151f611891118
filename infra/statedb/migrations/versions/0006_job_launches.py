"""What each launch of a job runs on its nodes (`job_launches`): the launch request the job's
flow built (worker command, environment, rendezvous, run directory), keyed by the job and the
launch's name. A `node-launch` flow run takes only (job id, launch name, node) and runs what is
recorded here, and only while the job holds that node: reaching the Prefect API no longer
means choosing the command a GPU node runs.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-28
"""

from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    op.create_table(
        "job_launches",
        sa.Column("job_id", sa.Integer, sa.ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("launch", sa.String(200), primary_key=True),
        sa.Column("request", JSON, nullable=False),
        sa.Column("recorded_at", sa.Float, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("job_launches")
