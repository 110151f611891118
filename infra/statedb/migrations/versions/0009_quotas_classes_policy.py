"""Quotas, priority classes and the cluster's policy (issue 30 items 2-4):

- `quotas` (cluster, team, GPU type): the team's nominal quota and how many GPUs above it it may
  borrow from other teams' idle quota (NULL: no limit);
- `priority_classes` (name, value): the classes an operator defines (higher value first);
  `team_class_caps`: the highest class a team may submit at;
- `clusters.policy` (has | easy | ect, from the cluster file) and `clusters.usage_half_life_s`
  (fair share: how fast past usage is forgotten).

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-28
"""

from alembic import op
import sqlalchemy as sa

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "quotas",
        sa.Column("cluster", sa.String(200), sa.ForeignKey("clusters.name", ondelete="CASCADE"), primary_key=True),
        sa.Column("team", sa.Text, sa.ForeignKey("teams.name", ondelete="CASCADE"), primary_key=True),
        sa.Column("gpu_type", sa.String(100), primary_key=True),
        sa.Column("nominal", sa.Integer, nullable=False),
        sa.Column("borrowing_limit", sa.Integer, nullable=True),
        sa.CheckConstraint("nominal >= 0 AND (borrowing_limit IS NULL OR borrowing_limit >= 0)",
                           name="ck_quotas_counts"),
    )
    op.create_table(
        "priority_classes",
        sa.Column("name", sa.String(100), primary_key=True),
        sa.Column("value", sa.Integer, nullable=False),
        sa.Column("description", sa.Text, nullable=True),
    )
    op.create_table(
        "team_class_caps",
        sa.Column("team", sa.Text, sa.ForeignKey("teams.name", ondelete="CASCADE"), primary_key=True),
        sa.Column("priority_class", sa.String(100), sa.ForeignKey("priority_classes.name"), nullable=False),
    )
    with op.batch_alter_table("clusters") as batch:
        batch.add_column(sa.Column("policy", sa.String(10), nullable=False, server_default="has"))
        batch.add_column(sa.Column("usage_half_life_s", sa.Float, nullable=False, server_default="604800"))


def downgrade() -> None:
    with op.batch_alter_table("clusters") as batch:
        batch.drop_column("usage_half_life_s")
        batch.drop_column("policy")
    op.drop_table("team_class_caps")
    op.drop_table("priority_classes")
    op.drop_table("quotas")
