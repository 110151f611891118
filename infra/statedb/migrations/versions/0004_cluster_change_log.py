"""A log of what each scheduling transaction changed (`cluster_changes`), keyed by the cluster's
`state_version`: a process whose cached view of free GPUs and the queue is a few versions behind
replays the missing changes (one indexed read, sent with the lock) instead of reading the whole
cluster and queue back, which cost ~20-30 ms per decision once decisions came from different
processes (every flow is its own process). And the decider's columns on `clusters`: who keeps a
current view and makes the policy passes (`forgeflow cluster serve`), its heartbeat, and whether a
change still waits for a pass.

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
    with op.batch_alter_table("clusters") as batch:
        batch.add_column(sa.Column("decider", sa.String(200), nullable=True))
        batch.add_column(sa.Column("decider_seen_at", sa.Float, nullable=True))
        batch.add_column(sa.Column("pass_pending", sa.Boolean, nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("clusters") as batch:
        batch.drop_column("pass_pending")
        batch.drop_column("decider_seen_at")
        batch.drop_column("decider")
    op.drop_table("cluster_changes")
