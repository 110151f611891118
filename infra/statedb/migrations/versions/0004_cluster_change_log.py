"""A log of what each scheduling transaction changed (`cluster_changes`), keyed by the cluster's
`state_version`: a process whose cached view of free GPUs and the queue is a few versions behind
replays the missing changes (one indexed read, sent with the lock) instead of reading the whole
cluster and queue back, which cost ~20-30 ms per decision once decisions came from different
processes (every flow is its own process).

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-25
"""

from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    op.create_table(
        "cluster_changes",
        sa.Column("cluster", sa.String(200), sa.ForeignKey("clusters.name", ondelete="CASCADE"), primary_key=True),
        sa.Column("version", sa.Integer, primary_key=True),
        sa.Column("change", JSON, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("cluster_changes")
