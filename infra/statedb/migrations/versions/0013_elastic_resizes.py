"""Elastic resizes (issue 31 items 3-4): the orchestrator carries out `scheduler.elastic`'s resizes
through the preemption path, so they are recorded where preemptions are.

- `preemptions.kind`: ``preempt`` (issue 31 item 1), ``shrink`` (the job gave GPUs to the waiting
  job `preempted_by`) or ``grow`` (into idle GPUs; `preempted_by` is the job itself);
  `from_gpus` / `to_gpus`: its GPU count before and after (NULL for a preemption).
- `jobs.promised`: the admission a resize promised the job (`{"option", "placement", "reason",
  "until"}`: the layout and GPUs it is admitted on once they are free, and until when the promise
  holds); its GPUs are kept from everyone else meanwhile. Cleared when it is admitted.

On PostgreSQL both tables keep their privileges and row-level policies (0008, 0012): the decider
(the operator role) writes the records and the promises.

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-29
"""

from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    with op.batch_alter_table("preemptions") as batch:
        batch.add_column(sa.Column("kind", sa.String(10), nullable=False, server_default="preempt"))
        batch.add_column(sa.Column("from_gpus", sa.Integer, nullable=True))
        batch.add_column(sa.Column("to_gpus", sa.Integer, nullable=True))
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("promised", JSON, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("promised")
    with op.batch_alter_table("preemptions") as batch:
        batch.drop_column("to_gpus")
        batch.drop_column("from_gpus")
        batch.drop_column("kind")
