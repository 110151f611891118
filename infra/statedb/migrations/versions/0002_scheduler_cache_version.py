"""A per-cluster state version (bumped by every scheduling transaction, so a process can keep its
view of free GPUs and the queue between its own decisions), and an index for lease expiry.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23
"""

from alembic import op
import sqlalchemy as sa

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

LIVE = sa.text("released_at IS NULL")


def upgrade() -> None:
    with op.batch_alter_table("clusters") as batch:
        batch.add_column(sa.Column("state_version", sa.Integer, nullable=False, server_default="0"))
    op.create_index("ix_allocations_live_lease", "allocations", ["cluster", "lease_expires_at"],
                    sqlite_where=LIVE, postgresql_where=LIVE)


def downgrade() -> None:
    op.drop_index("ix_allocations_live_lease", "allocations")
    with op.batch_alter_table("clusters") as batch:
        batch.drop_column("state_version")
