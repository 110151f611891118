"""Preemptions on record (issue 30 item 5, issue 31 item 1): `preemptions` keeps who gave way to
whom, so `forgeflow cluster usage` can count preemptions suffered and caused per team or user.
The stop request on the victim's job row is cleared when it is queued again, so it cannot serve.

On PostgreSQL (row-level security, as 0008): every role reads the records; the decider (the
operator role) writes them when it asks a victim to stop and when it force-releases one; the
victim's own flow (its owner or a team admin) may end the record of its own job when it releases
as preempted, and may change nothing else.

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-28
"""

from alembic import op
import sqlalchemy as sa

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "preemptions",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("cluster", sa.String(200), nullable=False),
        sa.Column("job_id", sa.Integer, sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("preempted_by", sa.Integer, sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("asked_at", sa.Float, nullable=False),
        sa.Column("ended_at", sa.Float, nullable=True),
        sa.Column("forced", sa.Boolean, nullable=False, server_default=sa.false()),
    )
    op.create_index("ix_preemptions_job_open", "preemptions", ["job_id"], sqlite_where=sa.text("ended_at IS NULL"),
                    postgresql_where=sa.text("ended_at IS NULL"))
    if op.get_bind().dialect.name == "postgresql":
        run = op.execute
        # 0008's default privileges already give every role SELECT and the operator role all of it
        run("GRANT UPDATE (ended_at) ON preemptions TO PUBLIC")
        run("ALTER TABLE preemptions ENABLE ROW LEVEL SECURITY")
        run("ALTER TABLE preemptions FORCE ROW LEVEL SECURITY")
        operator_only = "((SELECT forgeflow_is_operator()))"
        run("CREATE POLICY preemptions_see ON preemptions FOR SELECT USING (true)")
        run(f"CREATE POLICY preemptions_ask ON preemptions FOR INSERT WITH CHECK {operator_only}")
        run(f"CREATE POLICY preemptions_end ON preemptions FOR UPDATE USING ({operator_only} OR "
            f"forgeflow_may_change_job_id(job_id)) WITH CHECK ({operator_only} OR forgeflow_may_change_job_id(job_id))")
        run(f"CREATE POLICY preemptions_remove ON preemptions FOR DELETE USING {operator_only}")


def downgrade() -> None:
    op.drop_index("ix_preemptions_job_open", table_name="preemptions")
    op.drop_table("preemptions")
