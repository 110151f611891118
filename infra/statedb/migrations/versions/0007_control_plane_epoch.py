"""The control plane's own liveness (`control_plane`, one row): when a writer last reached the
database (`seen_at`, on the database's clock) and when it came back after the last gap
(`epoch_at`, with the gap's length in `gap_s`). After an outage no lease is reclaimed until every
holder has had a full lease period to renew: expiry counts from max(last renewal, epoch).

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-28
"""

from alembic import op
import sqlalchemy as sa

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    table = op.create_table(
        "control_plane",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("seen_at", sa.Float, nullable=True),
        sa.Column("epoch_at", sa.Float, nullable=True),
        sa.Column("gap_s", sa.Float, nullable=True),
        sa.CheckConstraint("id = 1", name="ck_control_plane_one_row"),
    )
    op.bulk_insert(table, [{"id": 1, "seen_at": None, "epoch_at": None, "gap_s": None}])


def downgrade() -> None:
    op.drop_table("control_plane")
