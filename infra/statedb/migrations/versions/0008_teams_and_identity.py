"""Teams and identity: `teams` (name, fair-share weight), `team_members` (a database role in a
team, perhaps its admin) and `jobs.team` (the submitting role's team). On PostgreSQL a person's
or a flow's identity is the database role it connects as (`current_user`).

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-28
"""

from alembic import op
import sqlalchemy as sa

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "teams",
        sa.Column("name", sa.Text, primary_key=True),
        sa.Column("weight", sa.Float(precision=53), nullable=False, server_default="1"),
    )
    op.create_table(
        "team_members",
        sa.Column("member", sa.Text, primary_key=True),
        sa.Column("team", sa.Text, sa.ForeignKey("teams.name"), primary_key=True),
        sa.Column("is_admin", sa.Boolean, nullable=False, server_default=sa.false()),
    )
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("team", sa.Text, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("team")
    op.drop_table("team_members")
    op.drop_table("teams")
