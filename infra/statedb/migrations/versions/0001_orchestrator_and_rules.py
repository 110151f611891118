"""Cluster state (clusters, nodes, GPUs, health), the job queue, allocations with leases and
their history, and the learned diagnosis rules.

Revision ID: 0001
Revises:
Create Date: 2026-11-23
"""

from alembic import op
import sqlalchemy as sa

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

JSON = sa.JSON().with_variant(sa.dialects.postgresql.JSONB(), "postgresql")
LIVE = sa.text("released_at IS NULL")


def upgrade() -> None:
    op.create_table(
        "clusters",
        sa.Column("name", sa.String(200), primary_key=True),
        sa.Column("inter_node_bandwidth_gbps", sa.Float, nullable=False),
        sa.Column("generation", sa.Integer, nullable=False),
        sa.Column("registered_at", sa.Float, nullable=False),
        sa.Column("source", sa.Text, nullable=True),
    )
    op.create_table(
        "nodes",
        sa.Column("cluster", sa.String(200), sa.ForeignKey("clusters.name", ondelete="CASCADE"), primary_key=True),
        sa.Column("name", sa.String(200), primary_key=True),
        sa.Column("position", sa.Integer, nullable=False),
        sa.Column("spec", JSON, nullable=False),
        sa.Column("gpu_type", sa.String(100), nullable=False),
        sa.Column("gpu_count", sa.Integer, nullable=False),
        sa.Column("state", sa.String(20), nullable=False),
        sa.Column("reason", sa.Text, nullable=True),
        sa.Column("changed_by", sa.String(200), nullable=True),
        sa.Column("changed_at", sa.Float, nullable=True),
        sa.CheckConstraint("state in ('ready', 'cordoned', 'drained')", name="ck_nodes_state"),
    )
    op.create_table(
        "gpus",
        sa.Column("cluster", sa.String(200), primary_key=True),
        sa.Column("node", sa.String(200), primary_key=True),
        sa.Column("gpu_index", sa.Integer, primary_key=True),
        sa.Column("gpu_type", sa.String(100), nullable=False),
        sa.Column("memory_gib", sa.Float, nullable=False),
        sa.Column("root_complex", sa.Integer, nullable=True),
        sa.ForeignKeyConstraint(["cluster", "node"], ["nodes.cluster", "nodes.name"], ondelete="CASCADE"),
    )
    op.create_table(
        "jobs",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("cluster", sa.String(200), sa.ForeignKey("clusters.name", ondelete="CASCADE"), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("spec", JSON, nullable=True),
        sa.Column("options", JSON, nullable=False),
        sa.Column("priority", sa.Integer, nullable=False),
        sa.Column("state", sa.String(20), nullable=False),
        sa.Column("submitted_at", sa.Float, nullable=False),
        sa.Column("queued_at", sa.Float, nullable=False),
        sa.Column("admitted_at", sa.Float, nullable=True),
        sa.Column("finished_at", sa.Float, nullable=True),
        sa.Column("predicted_run_s", sa.Float, nullable=True),
        sa.Column("placement", JSON, nullable=True),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("lost_count", sa.Integer, nullable=False),
        sa.Column("reason", sa.Text, nullable=True),
        sa.Column("submitted_by", sa.String(200), nullable=True),
        sa.CheckConstraint("state in ('queued', 'running', 'finished', 'failed', 'cancelled')", name="ck_jobs_state"),
    )
    op.create_index("ix_jobs_cluster_state", "jobs", ["cluster", "state"])
    op.create_table(
        "allocations",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.Integer, sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("cluster", sa.String(200), nullable=False),
        sa.Column("node", sa.String(200), nullable=False),
        sa.Column("gpu_index", sa.Integer, nullable=False),
        sa.Column("allocated_at", sa.Float, nullable=False),
        sa.Column("lease_expires_at", sa.Float, nullable=False),
        sa.Column("released_at", sa.Float, nullable=True),
        sa.ForeignKeyConstraint(["cluster", "node", "gpu_index"], ["gpus.cluster", "gpus.node", "gpus.gpu_index"]),
    )
    op.create_index("uq_allocations_live_gpu", "allocations", ["cluster", "node", "gpu_index"], unique=True,
                    sqlite_where=LIVE, postgresql_where=LIVE)
    op.create_index("ix_allocations_job_live", "allocations", ["job_id"], sqlite_where=LIVE, postgresql_where=LIVE)
    op.create_table(
        "allocation_events",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("allocation_id", sa.Integer, nullable=False),
        sa.Column("job_id", sa.Integer, nullable=False),
        sa.Column("cluster", sa.String(200), nullable=False),
        sa.Column("node", sa.String(200), nullable=False),
        sa.Column("gpu_index", sa.Integer, nullable=False),
        sa.Column("event", sa.String(10), nullable=False),
        sa.Column("at", sa.Float, nullable=False),
    )
    op.create_table(
        "diagnosis_rules",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("name", sa.String(300), nullable=False, unique=True),
        sa.Column("pattern", sa.Text, nullable=False, unique=True),
        sa.Column("rule", JSON, nullable=False),
    )


def downgrade() -> None:
    for table in ("diagnosis_rules", "allocation_events", "allocations", "jobs", "gpus", "nodes", "clusters"):
        op.drop_table(table)
