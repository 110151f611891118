"""Learned diagnosis rules get an owner, a scope and a review state (issue 29, item 11):

- `owner`: who added the rule: "agent" (the failure agent learned it) or the person;
- `job_family`: the job family whose failure taught it (NULL: none was named);
- `review`: proposed | approved | rejected; `scope`: family | global; `reviewed_by`, `reviewed_at`.

A proposed rule applies only to diagnoses of the family that learned it; an approved one to its
family, or to every job once approved with scope global; a rejected one to none
(`forgeflow rules approve|reject`). Rules already stored: a person's become approved and global
(as they applied before); the agent's become proposed with no family, so they no longer
outrank the seed rules for every job until an operator approves them.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-28
"""

from alembic import op
import sqlalchemy as sa

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("diagnosis_rules") as batch:
        batch.add_column(sa.Column("owner", sa.Text, nullable=False, server_default="agent"))
        batch.add_column(sa.Column("job_family", sa.String(200), nullable=True))
        batch.add_column(sa.Column("review", sa.String(20), nullable=False, server_default="proposed"))
        batch.add_column(sa.Column("scope", sa.String(20), nullable=False, server_default="family"))
        batch.add_column(sa.Column("reviewed_by", sa.Text, nullable=True))
        batch.add_column(sa.Column("reviewed_at", sa.Float, nullable=True))
    rules = sa.table("diagnosis_rules", sa.column("id", sa.Integer), sa.column("rule", sa.JSON),
                     sa.column("owner", sa.Text), sa.column("review", sa.String), sa.column("scope", sa.String),
                     sa.column("reviewed_by", sa.Text))
    conn = op.get_bind()
    for rule_id, rule in conn.execute(sa.select(rules.c.id, rules.c.rule)).all():
        if (rule or {}).get("source") == "user":   # a person's rule applied everywhere before: it still does
            conn.execute(sa.update(rules).where(rules.c.id == rule_id).values(
                owner="user (before review states)", review="approved", scope="global",
                reviewed_by="migration 0010"))


def downgrade() -> None:
    with op.batch_alter_table("diagnosis_rules") as batch:
        for column in ("reviewed_at", "reviewed_by", "scope", "review", "job_family", "owner"):
            batch.drop_column(column)
