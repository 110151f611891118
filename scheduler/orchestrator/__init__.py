"""forgeflow: scheduler.orchestrator — shared, persistent cluster state and the job queue (Frenzy's third part).

    config      OrchestratorConfig (policy, lease, grace, what happens to a lost job) and typed errors
    inventory   register a cluster inventory; load it back as a `scheduler.cluster.Cluster` with health
    options     a job's ways to run: MARP plans of a JobSpec, or a plain GPU demand; placements as data
    service     `Orchestrator`: submit, admit (one policy pass, `scheduler.policy`), renew, release,
                expire leases, cordon / drain / uncordon, wait for admission; a job's stop request
                (`forgeflow cancel`), progress and runner
    lease       HeldJob: renew an admitted job's lease in the background, release it on every exit
    node_lease  a node's look at its job's lease in the database (infra.lease_guard runs it): held, gone or unknown
    epoch       the outage epoch: after the database was out of reach, every holder has a full lease to renew
    seat        a flow's job on the cluster: join, plan and queue (or adopt a submitted job), wait,
                cordon, placed again (Seat), report progress
    views       cluster status and queue snapshots, the jobs table, and the nodes x GPUs table (markdown)
    start_estimates  when each queued job is expected to start and why it waits (the policy run forward)
    job_logs    a job's logs found from its row (node consoles, rank logs, runner log) and followed
    history     double-booking and over-quota checks over the allocation history
    identity    who the caller is (the database role on PostgreSQL, user@host on SQLite), its team
                for a submit, and the database's refusals as one line (AccessRefused)
    teams       an operator's teams: add a team (weight), put a database role in it (admin), list
    quotas      teams' quotas, priority classes and caps (operator changes, checks), and a view's team state
    usage       `forgeflow cluster usage`: GPU-hours by GPU type and queue time per team or user
    cli         `forgeflow cluster register|status|queue|cordon|drain|uncordon|serve|team|quota|class|usage`, `forgeflow jobs|cancel|logs`

State lives in the state database (`infra.statedb`: SQLite by default, PostgreSQL
through FORGEFLOW_DB_URL). Every change is one write transaction that holds the
scheduler lock (BEGIN IMMEDIATE on SQLite, the cluster row FOR UPDATE on
PostgreSQL), and the database refuses a second live allocation of one GPU.
"""

from scheduler.orchestrator.config import (
    LeaseLostError,
    OrchestratorConfig,
    OrchestratorError,
)
from scheduler.orchestrator.history import double_booked
from scheduler.orchestrator.options import demand_options, job_options, placement_from_dict
from scheduler.orchestrator.service import Admission, Orchestrator

__all__ = [
    "Admission", "LeaseLostError", "Orchestrator", "OrchestratorConfig", "OrchestratorError",
    "demand_options", "double_booked", "job_options", "placement_from_dict",
]
