"""The state database's tables (SQLAlchemy Core), shared by the orchestrator and the diagnosis rules.

Times are seconds since the epoch (float). Lease, queue, job, allocation (and so history),
health and heartbeat times are on the database's clock (`infra.statedb.clock.db_now`:
PostgreSQL's; on SQLite the one host's); `registered_at` and JSON stamps ("at") are the writer's.
Allocation rows stay after their release (only a GPU that leaves the inventory takes
its released rows with it): a live allocation has `released_at` NULL, and
the partial unique index `uq_allocations_live_gpu` lets the database itself refuse
a second live allocation of one GPU. `allocation_events` is the append-only
history (allocate / release / expire, in commit order) that double-booking is
checked against after the fact; the database writes it itself, from triggers on
`allocations` (migration 0003), so no code path can change a live allocation
without leaving its event. `cluster_changes` (migration 0004) is the log of scheduling
transactions that lets a process bring its cached view up to date cheaply.

A change here needs a new Alembic revision in `migrations/versions/`.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

metadata = sa.MetaData()

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")

clusters = sa.Table(
    "clusters", metadata,
    sa.Column("name", sa.String(200), primary_key=True),
    sa.Column("inter_node_bandwidth_gbps", sa.Float, nullable=False),
    sa.Column("generation", sa.Integer, nullable=False, default=1),  # bumped when the inventory changes
    # bumped by every scheduling transaction: a process whose last write was version v-1 may keep
    # its in-memory view of free GPUs and the queue (nobody else changed them)
    sa.Column("state_version", sa.Integer, nullable=False, server_default="0"),
    # A decider (`forgeflow cluster serve`) keeps a current view and makes the policy passes; while
    # its heartbeat is fresh, a process with a stale view leaves its pass to it. `pass_pending`:
    # the last change has not been followed by a policy pass yet.
    sa.Column("decider", sa.String(200), nullable=True),
    sa.Column("decider_seen_at", sa.Float, nullable=True),
    sa.Column("pass_pending", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Column("registered_at", sa.Float, nullable=False),
    sa.Column("source", sa.Text, nullable=True),  # the file it was registered from
    # (migration 0009) from the cluster file: the policy (has | easy | ect) and fair share's half-life
    sa.Column("policy", sa.String(10), nullable=False, server_default="has"),
    sa.Column("usage_half_life_s", sa.Float, nullable=False, server_default="604800"),
)

nodes = sa.Table(
    "nodes", metadata,
    sa.Column("cluster", sa.String(200), sa.ForeignKey("clusters.name", ondelete="CASCADE"), primary_key=True),
    sa.Column("name", sa.String(200), primary_key=True),
    sa.Column("position", sa.Integer, nullable=False),  # inventory order (first-fit walks it)
    sa.Column("spec", JSON, nullable=False),  # the validated scheduler.cluster.Node, minus free/cordon
    sa.Column("gpu_type", sa.String(100), nullable=False),
    sa.Column("gpu_count", sa.Integer, nullable=False),
    # health: ready | cordoned (faulty: place nothing) | drained (finish running work, admit nothing)
    sa.Column("state", sa.String(20), nullable=False, default="ready"),
    sa.Column("reason", sa.Text, nullable=True),
    sa.Column("changed_by", sa.String(200), nullable=True),
    sa.Column("changed_at", sa.Float, nullable=True),
    sa.CheckConstraint("state in ('ready', 'cordoned', 'drained')", name="ck_nodes_state"),
)

gpus = sa.Table(
    "gpus", metadata,
    sa.Column("cluster", sa.String(200), primary_key=True),
    sa.Column("node", sa.String(200), primary_key=True),
    sa.Column("gpu_index", sa.Integer, primary_key=True),
    sa.Column("gpu_type", sa.String(100), nullable=False),
    sa.Column("memory_gib", sa.Float, nullable=False),
    sa.Column("root_complex", sa.Integer, nullable=True),
    sa.ForeignKeyConstraint(["cluster", "node"], ["nodes.cluster", "nodes.name"], ondelete="CASCADE"),
)

jobs = sa.Table(
    "jobs", metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("cluster", sa.String(200), sa.ForeignKey("clusters.name", ondelete="CASCADE"), nullable=False),
    sa.Column("name", sa.String(200), nullable=False),
    sa.Column("spec", JSON, nullable=True),  # the job spec as submitted (JobSpec dump or a GPU demand)
    sa.Column("options", JSON, nullable=False),  # {policy: [Option, ...]} from MARP plans at submit
    sa.Column("priority", sa.Integer, nullable=False, default=0),
    # queued | running | finished | failed | cancelled (lost jobs are re-queued or failed);
    # (migration 0014) delegated: in a batch system that decides where and when it runs (Slurm's
    # delegate mode): never admitted onto the orchestrator's GPUs, no lease, no allocation
    sa.Column("state", sa.String(20), nullable=False, default="queued"),
    sa.Column("submitted_at", sa.Float, nullable=False),
    sa.Column("queued_at", sa.Float, nullable=False),  # submit, or the last re-queue
    sa.Column("admitted_at", sa.Float, nullable=True),
    sa.Column("finished_at", sa.Float, nullable=True),
    sa.Column("predicted_run_s", sa.Float, nullable=True),
    sa.Column("placement", JSON, nullable=True),  # scheduler.placement.Placement.to_dict() while running
    sa.Column("attempts", sa.Integer, nullable=False, default=0),  # admissions so far
    sa.Column("lost_count", sa.Integer, nullable=False, default=0),
    sa.Column("reason", sa.Text, nullable=True),
    sa.Column("submitted_by", sa.String(200), nullable=True),
    # (migration 0005) who runs the job: {"kind": "local", "host", "pid", "log"} for the detached
    # runner of `forgeflow submit`, {"kind": "prefect", "flow_run_id", "url"} for a deployment run
    sa.Column("runner", JSON, nullable=True),
    # written by the job's flow: {"phase", "step", "steps", "loss", "step_s", "diagnosis", "at"}
    sa.Column("progress", JSON, nullable=True),
    # `forgeflow cancel` on a running job: {"by", "reason", "at"}; its flow stops the ranks
    # gracefully (they commit the step they are on) and ends the job as cancelled
    sa.Column("stop_requested", JSON, nullable=True),
    # (migration 0008) the submitting role's team (NULL on SQLite and while no team is defined)
    sa.Column("team", sa.Text, nullable=True),
    # (migration 0013) the admission an elastic resize promised the job: {"option", "placement",
    # "reason", "until"}; its GPUs are kept from other jobs until then; cleared when admitted
    sa.Column("promised", JSON, nullable=True),
    # (migration 0014) a delegated job's mirror of what the batch system says, written by its flow:
    # {"system": "slurm", "id", "state" (PENDING, RUNNING, ...), "reason", "nodes", "gpus", "at"}
    sa.Column("batch", JSON, nullable=True),
    sa.CheckConstraint("state in ('queued', 'running', 'finished', 'failed', 'cancelled', 'delegated')",
                       name="ck_jobs_state"),
)
sa.Index("ix_jobs_cluster_state", jobs.c.cluster, jobs.c.state)

live = sa.text("released_at IS NULL")
allocations = sa.Table(
    "allocations", metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("job_id", sa.Integer, sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
    sa.Column("cluster", sa.String(200), nullable=False),
    sa.Column("node", sa.String(200), nullable=False),
    sa.Column("gpu_index", sa.Integer, nullable=False),
    sa.Column("allocated_at", sa.Float, nullable=False),
    sa.Column("lease_expires_at", sa.Float, nullable=False),
    sa.Column("released_at", sa.Float, nullable=True),
    sa.Column("release_event", sa.String(10), nullable=True),  # how it ended: release | expire
    sa.ForeignKeyConstraint(["cluster", "node", "gpu_index"], ["gpus.cluster", "gpus.node", "gpus.gpu_index"]),
)
# The guarantee: at most one live allocation per GPU, enforced by the database.
sa.Index("uq_allocations_live_gpu", allocations.c.cluster, allocations.c.node, allocations.c.gpu_index,
         unique=True, sqlite_where=live, postgresql_where=live)
sa.Index("ix_allocations_job_live", allocations.c.job_id, sqlite_where=live, postgresql_where=live)
sa.Index("ix_allocations_live_lease", allocations.c.cluster, allocations.c.lease_expires_at,
         sqlite_where=live, postgresql_where=live)

# (migration 0012) Who gave way to whom: the decider records each preemption it asks for
# (`asked_at`); the victim's release as preempted, or the decider's forced release at the
# deadline, ends it (`ended_at`, `forced`). A victim that finished or was cancelled before it
# stopped keeps `ended_at` NULL: it was asked, not preempted. `forgeflow cluster usage` counts
# the ended ones, suffered by the victim's team or user and caused by the preemptor's.
preemptions = sa.Table(
    "preemptions", metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("cluster", sa.String(200), nullable=False),
    sa.Column("job_id", sa.Integer, sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
    sa.Column("preempted_by", sa.Integer, sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
    sa.Column("asked_at", sa.Float, nullable=False),
    sa.Column("ended_at", sa.Float, nullable=True),
    sa.Column("forced", sa.Boolean, nullable=False, server_default=sa.false()),
    # (migration 0013) preempt | shrink (for the waiting job `preempted_by`) | grow (`preempted_by`:
    # the job itself); an elastic resize's GPU count before and after
    sa.Column("kind", sa.String(10), nullable=False, server_default="preempt"),
    sa.Column("from_gpus", sa.Integer, nullable=True),
    sa.Column("to_gpus", sa.Integer, nullable=True),
)
sa.Index("ix_preemptions_job_open", preemptions.c.job_id, sqlite_where=sa.text("ended_at IS NULL"),
         postgresql_where=sa.text("ended_at IS NULL"))

allocation_events = sa.Table(
    "allocation_events", metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),  # commit order under the scheduler lock
    sa.Column("allocation_id", sa.Integer, nullable=False),
    sa.Column("job_id", sa.Integer, nullable=False),
    sa.Column("cluster", sa.String(200), nullable=False),
    sa.Column("node", sa.String(200), nullable=False),
    sa.Column("gpu_index", sa.Integer, nullable=False),
    sa.Column("event", sa.String(10), nullable=False),  # allocate | release | expire
    sa.Column("at", sa.Float, nullable=False),
)

# What each scheduling transaction changed, keyed by the cluster's `state_version` it made: a
# process whose in-memory view is a few versions old replays these instead of reading the whole
# cluster and queue back (every flow is its own process, so consecutive decisions usually come
# from different processes). {"ops": [...]} lists the changes in order; {"reload": true} marks a
# change that is not described (health, expiry, re-queue): a process behind it reads everything
# back. Old rows are pruned; a view older than what is kept is read back too.
cluster_changes = sa.Table(
    "cluster_changes", metadata,
    sa.Column("cluster", sa.String(200), sa.ForeignKey("clusters.name", ondelete="CASCADE"), primary_key=True),
    sa.Column("version", sa.Integer, primary_key=True),
    sa.Column("change", JSON, nullable=False),
)

# What each launch of a job runs (migration 0006): the request its flow built, by launch name
# ("JOB-aN" for attempt N, "nodecheck-K-a0" for a node check's worlds). node-launch runs only this.
job_launches = sa.Table(
    "job_launches", metadata,
    sa.Column("job_id", sa.Integer, sa.ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True),
    sa.Column("launch", sa.String(200), primary_key=True),
    sa.Column("request", JSON, nullable=False),  # infra.launch.LaunchRequest.to_dict()
    sa.Column("recorded_at", sa.Float, nullable=False),
)

# The control plane's own liveness (migration 0007, one row, id 1): `seen_at` is when a writer
# last reached the database (database clock, refreshed at most about once a second), `epoch_at`
# when the first writer after a gap (an outage) came back and `gap_s` how long that gap was.
# Expiry counts from max(last renewal, epoch): every holder gets a full lease period to renew.
control_plane = sa.Table(
    "control_plane", metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("seen_at", sa.Float, nullable=True),
    sa.Column("epoch_at", sa.Float, nullable=True),
    sa.Column("gap_s", sa.Float, nullable=True),
    sa.CheckConstraint("id = 1", name="ck_control_plane_one_row"),
)

# Teams (migration 0008): a team's fair-share weight, and which database roles belong to it
# (an admin may manage every job of the team).
teams = sa.Table(
    "teams", metadata,
    sa.Column("name", sa.Text, primary_key=True),
    sa.Column("weight", sa.Float(precision=53), nullable=False, server_default="1"),
)
team_members = sa.Table(
    "team_members", metadata,
    sa.Column("member", sa.Text, primary_key=True),  # a database role (PostgreSQL)
    sa.Column("team", sa.Text, sa.ForeignKey("teams.name"), primary_key=True),
    sa.Column("is_admin", sa.Boolean, nullable=False, server_default=sa.false()),
)

diagnosis_rules = sa.Table(
    "diagnosis_rules", metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),  # newest learned = highest id
    sa.Column("name", sa.String(300), nullable=False, unique=True),
    sa.Column("pattern", sa.Text, nullable=False, unique=True),
    sa.Column("rule", JSON, nullable=False),  # diagnosis.rules.DiagnosisRule.model_dump()
    # who added it, which family's failure taught it, and its review (migration 0010): a proposed
    # rule applies to its family only, an approved one to its family or (scope global) every job
    sa.Column("owner", sa.Text, nullable=False, server_default="agent"),
    sa.Column("job_family", sa.String(200), nullable=True),
    sa.Column("review", sa.String(20), nullable=False, server_default="proposed"),  # proposed|approved|rejected
    sa.Column("scope", sa.String(20), nullable=False, server_default="family"),    # family|global
    sa.Column("reviewed_by", sa.Text, nullable=True),
    sa.Column("reviewed_at", sa.Float, nullable=True),
)

# Quotas and priority classes (migration 0009; `scheduler.fair_share`): per cluster, team and GPU
# type a nominal quota and how many GPUs above it the team may borrow (NULL: any idle quota);
# the operator's named priority classes, and the highest class each team may submit at.
quotas = sa.Table(
    "quotas", metadata,
    sa.Column("cluster", sa.String(200), sa.ForeignKey("clusters.name", ondelete="CASCADE"), primary_key=True),
    sa.Column("team", sa.Text, sa.ForeignKey("teams.name", ondelete="CASCADE"), primary_key=True),
    sa.Column("gpu_type", sa.String(100), primary_key=True),
    sa.Column("nominal", sa.Integer, nullable=False),
    sa.Column("borrowing_limit", sa.Integer, nullable=True),
    sa.CheckConstraint("nominal >= 0 AND (borrowing_limit IS NULL OR borrowing_limit >= 0)", name="ck_quotas_counts"),
)
priority_classes = sa.Table(
    "priority_classes", metadata,
    sa.Column("name", sa.String(100), primary_key=True),
    sa.Column("value", sa.Integer, nullable=False),  # jobs.priority holds the class's value
    sa.Column("description", sa.Text, nullable=True),
)
team_class_caps = sa.Table(
    "team_class_caps", metadata,
    sa.Column("team", sa.Text, sa.ForeignKey("teams.name", ondelete="CASCADE"), primary_key=True),
    sa.Column("priority_class", sa.String(100), sa.ForeignKey("priority_classes.name"), nullable=False),
)
