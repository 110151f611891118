"""Snapshots a person reads: nodes with health and who holds each GPU; the queue; the jobs
(`forgeflow jobs`); a markdown table. A delegated job (a site's batch system places it: Slurm's
delegate mode) holds no GPU here; the queue and the jobs list show what the batch system says
of it ("slurm 123: PENDING (Priority)", "slurm 123: RUNNING on n1").

On PostgreSQL every read is the caller's role's: row-level security (migration 0008) shows it
its own jobs, its teams' and, to an operator, every job; nodes and which GPUs are busy are
visible to all (a GPU held by a job the role may not see shows as held, without the job's name).

Plain data (dicts) so the CLI prints them as JSON or rich tables and the flows
publish them as Prefect artifacts.
"""

from __future__ import annotations

import time
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from infra.statedb import read_transaction
from infra.statedb.schema import allocations, jobs, nodes
import scheduler.orchestrator.inventory as inventory
import scheduler.orchestrator.quotas as quotas
from scheduler.orchestrator.start_estimates import WaitingJob, queue_estimates, queue_order

DELEGATED = "delegated"  # (service.DELEGATED) in a batch system that decides where and when it runs
ACTIVE_STATES = ("queued", "running", DELEGATED)


def batch_text(batch: dict[str, Any] | None) -> str:
    """A delegated job's mirror as people read it: "slurm 123: PENDING (Priority)", "slurm 123:
    RUNNING on n1, n2", "slurm: not submitted yet"; "" for none."""
    if not batch:
        return ""
    system = batch.get("system") or "batch"
    if not batch.get("id"):
        return f"{system}: not submitted yet"
    text = f"{system} {batch['id']}: {batch.get('state') or 'unknown'}"
    if batch.get("reason"):
        text += f" ({batch['reason']})"
    if batch.get("nodes") and batch.get("state") != "PENDING":
        text += f" on {', '.join(batch['nodes'])}"
    return text

RECENT_S = 3600.0  # `forgeflow jobs` without --all shows jobs that ended this recently
HIDDEN_JOB = "(another team's)"  # the name shown for a GPU's holder the caller may not see


def cluster_status(engine: Engine, cluster: str | None = None) -> dict[str, Any]:
    """Every node: type, health (with reason, who, when), and per GPU the job holding it."""
    with read_transaction(engine) as conn:
        name = inventory.resolve_cluster(conn, cluster)
        holders: dict[tuple[str, int], tuple[int, str, float]] = {}
        for node, gpu, job_id, job_name, lease in conn.execute(
                sa.select(allocations.c.node, allocations.c.gpu_index, allocations.c.job_id, jobs.c.name,
                          allocations.c.lease_expires_at)
                .outerjoin(jobs, jobs.c.id == allocations.c.job_id)  # a hidden job's GPUs are still busy
                .where(allocations.c.cluster == name, allocations.c.released_at.is_(None))):
            holders[(node, gpu)] = (job_id, HIDDEN_JOB if job_name is None else job_name, lease)
        rows = conn.execute(sa.select(nodes).where(nodes.c.cluster == name).order_by(nodes.c.position)).all()
        counts = dict(conn.execute(sa.select(jobs.c.state, sa.func.count()).where(jobs.c.cluster == name)
                                   .group_by(jobs.c.state)).all())
    out_nodes = []
    free_by_type: dict[str, int] = {}
    total_by_type: dict[str, int] = {}
    for r in rows:
        gpus = []
        for i in range(r.gpu_count):
            held = holders.get((r.name, i))
            gpus.append({"index": i, "job_id": held[0] if held else None, "job": held[1] if held else None,
                         "lease_expires_at": held[2] if held else None})
        busy = sum(1 for g in gpus if g["job_id"] is not None)
        total_by_type[r.gpu_type] = total_by_type.get(r.gpu_type, 0) + r.gpu_count
        free_by_type[r.gpu_type] = free_by_type.get(r.gpu_type, 0) + (r.gpu_count - busy if r.state == "ready" else 0)
        state = "draining" if r.state == "drained" and busy else r.state
        out_nodes.append({"node": r.name, "gpu_type": r.gpu_type, "gpu_count": r.gpu_count, "state": state,
                          "reason": r.reason, "changed_by": r.changed_by, "changed_at": r.changed_at,
                          "busy_gpus": busy, "gpus": gpus})
    return {"cluster": name, "nodes": out_nodes, "gpus_by_type": total_by_type, "free_by_type": free_by_type,
            "jobs_by_state": counts, "at": time.time()}


def queue_snapshot(engine: Engine, cluster: str | None = None, *, include_done: int = 0) -> dict[str, Any]:
    """Queued jobs in queue order (with position), running jobs, delegated jobs (in the batch
    system, with what it says: `batch`), and the last `include_done` ended ones."""
    cols = [jobs.c.id, jobs.c.name, jobs.c.state, jobs.c.priority, jobs.c.submitted_at, jobs.c.queued_at,
            jobs.c.admitted_at, jobs.c.finished_at, jobs.c.reason, jobs.c.submitted_by, jobs.c.attempts,
            jobs.c.lost_count, jobs.c.placement, jobs.c.options, jobs.c.team, jobs.c.batch]
    with read_transaction(engine) as conn:
        name = inventory.resolve_cluster(conn, cluster)
        queued = conn.execute(sa.select(*cols).where(jobs.c.cluster == name, jobs.c.state == "queued")
                              .order_by(jobs.c.priority.desc(), jobs.c.queued_at, jobs.c.id)).all()
        teams = quotas.TeamState.load(conn, name)  # None while no team is defined
        if teams is not None:
            teams.learn_teams(conn, [r.id for r in queued])
        running = conn.execute(sa.select(*cols).where(jobs.c.cluster == name, jobs.c.state == "running")
                               .order_by(jobs.c.admitted_at)).all()
        delegated = conn.execute(sa.select(*cols).where(jobs.c.cluster == name, jobs.c.state == DELEGATED)
                                 .order_by(jobs.c.id)).all()
        done = conn.execute(sa.select(*cols).where(jobs.c.cluster == name, jobs.c.state.in_(
            ("finished", "failed", "cancelled"))).order_by(jobs.c.id.desc()).limit(include_done)).all() \
            if include_done else []

    def entry(r, position: int | None = None) -> dict[str, Any]:
        first = (r.options.get("has") or r.options.get("ect") or [{}])[0]
        e = {"job_id": r.id, "name": r.name, "state": r.state, "priority": r.priority,
             "submitted_at": r.submitted_at, "admitted_at": r.admitted_at, "finished_at": r.finished_at,
             "attempts": r.attempts, "lost": r.lost_count, "reason": r.reason, "submitted_by": r.submitted_by,
             "team": r.team,
             "wants": f"{first.get('num_gpus', '?')}x {first.get('gpu_type', '?')}" if first else None,
             "options": sum(len(v) for v in r.options.values())}
        if position is not None:
            e["position"] = position
        if r.placement:
            e["placement"] = {"gpu_type": r.placement["gpu_type"], "world_size": r.placement["world_size"],
                              "nodes": {n["node"]: n["gpus"] for n in r.placement["nodes"]}}
        if r.state == DELEGATED:
            e["batch"], e["batch_text"] = r.batch, batch_text(r.batch)
            if (r.batch or {}).get("gpus"):
                e["wants"] = r.batch["gpus"]
        return e

    # in the order the next pass takes them (with teams: fair-share order), as `forgeflow jobs` counts
    order = queue_order([WaitingJob(r.id, r.name, r.priority, r.queued_at, ()) for r in queued], teams, time.time())
    by_id = {r.id: r for r in queued}
    queued = [by_id[w.job_id] for w in order]
    return {"cluster": name, "queued": [entry(r, i + 1) for i, r in enumerate(queued)],
            "running": [entry(r) for r in running], "delegated": [entry(r) for r in delegated],
            "ended": [entry(r) for r in done]}


def display_state(row: Any) -> str:
    """The state a person reads: the database's, plus `recovering` (running while its flow
    recovers from a failure: `progress.phase`), `waiting` (running, its batch job queued in Slurm)
    and `preempted` (queued again after it ran: its
    lease was lost, a node check or a preemption put it back; `jobs.attempts` counts admissions).
    A delegated job reads as the batch system has it: `waiting` while it keeps the batch job
    PENDING, `running` (or `recovering`) once it runs, `delegated` before it was submitted."""
    if row.state == DELEGATED:
        batch = getattr(row, "batch", None) or {}
        if batch.get("state") == "PENDING" or (row.progress or {}).get("phase") == "waiting":
            return "waiting"
        if (row.progress or {}).get("phase") == "recovering":
            return "recovering"
        return "running" if batch.get("state") == "RUNNING" else DELEGATED
    if row.state == "running" and (row.progress or {}).get("phase") in ("recovering", "waiting"):
        return (row.progress or {})["phase"]  # waiting: Slurm keeps its batch job queued
    if row.state == "queued" and (row.attempts or row.lost_count):
        return "preempted"
    return row.state


def job_list(engine: Engine, *, cluster: str | None = None, user: str | None = None, include_all: bool = False,
             now: float | None = None, exact_owner: bool = False) -> dict[str, Any]:
    """Jobs for `forgeflow jobs`: every queued and running job the caller may see and those that
    ended in the last RECENT_S (every ended one with `include_all`), oldest first, with owner and
    team; `user` keeps the jobs submitted by that user (`exact_owner`: the database role
    `submitted_by` names, on PostgreSQL; else the user of user@host, on SQLite). A queued job
    carries its position, why it waits and its estimated start (`start_estimates`); a running
    one its step, loss and last diagnosis."""
    now = time.time() if now is None else now
    cols = [jobs.c.id, jobs.c.cluster, jobs.c.name, jobs.c.state, jobs.c.priority, jobs.c.submitted_at,
            jobs.c.admitted_at, jobs.c.finished_at, jobs.c.reason, jobs.c.submitted_by, jobs.c.attempts,
            jobs.c.lost_count, jobs.c.placement, jobs.c.progress, jobs.c.runner, jobs.c.stop_requested, jobs.c.team,
            jobs.c.batch]
    query = sa.select(*cols).order_by(jobs.c.id)
    if user is not None and exact_owner:
        query = query.where(jobs.c.submitted_by == user)
    if not include_all:
        query = query.where(sa.or_(jobs.c.state.in_(ACTIVE_STATES), jobs.c.finished_at >= now - RECENT_S))
    with read_transaction(engine) as conn:
        if cluster is not None:
            query = query.where(jobs.c.cluster == inventory.resolve_cluster(conn, cluster))
        rows = conn.execute(query).all()
    if user is not None and not exact_owner:
        rows = [r for r in rows if (r.submitted_by or "").split("@")[0] == user]
    estimates = {}
    for name in sorted({r.cluster for r in rows if r.state == "queued"}):
        estimates.update(queue_estimates(engine, name, now=now))
    return {"at": now, "jobs": [_job_entry(r, estimates.get(r.id), now) for r in rows]}


def _job_entry(r: Any, estimate: Any, now: float) -> dict[str, Any]:
    progress = r.progress or {}
    entry = {"job_id": r.id, "name": r.name, "cluster": r.cluster, "owner": r.submitted_by, "team": r.team,
             "state": display_state(r), "priority": r.priority, "gpus": None,
             "step": progress.get("step"), "steps": progress.get("steps"), "loss": progress.get("loss"),
             "step_s": progress.get("step_s"), "diagnosis": progress.get("diagnosis"),
             "waiting": progress.get("waiting") if progress.get("phase") == "waiting" else None,
             "submitted_at": r.submitted_at, "admitted_at": r.admitted_at, "finished_at": r.finished_at,
             "reason": r.reason, "attempts": r.attempts, "runner": r.runner, "stop_requested": r.stop_requested}
    if r.state in ACTIVE_STATES:
        entry["runner_alive"] = runner_alive(r.runner)
    if r.state == DELEGATED or (r.batch and r.state != "queued"):  # (an ended one: what Slurm said last)
        entry["delegated"] = True
        entry["batch"] = batch_text(r.batch)
        if (r.batch or {}).get("gpus"):
            entry["gpus"] = r.batch["gpus"]
        if (r.batch or {}).get("nodes") and (r.batch or {}).get("state") != "PENDING":
            entry["nodes"] = list(r.batch["nodes"])
    if r.placement and r.state != "queued":
        entry["gpus"] = f"{r.placement['world_size']}x {r.placement['gpu_type']}"
        entry["nodes"] = [n["node"] for n in r.placement["nodes"]]
    if estimate is not None:
        entry.update(gpus=estimate.option, position=estimate.position, waiting_reason=estimate.reason,
                     why=estimate.why, behind=estimate.behind, estimated_start=estimate.start_s,
                     estimated_start_in_s=None if estimate.start_s is None else max(0.0, estimate.start_s - now))
    return entry


def runner_alive(runner: dict[str, Any] | None) -> bool | None:
    """Whether the process running a job (the detached runner of `forgeflow submit`, or a
    foreground `forgeflow pretrain`) is still there: known only on the host it runs on (None
    elsewhere, and for a Prefect flow run, which its worker and the lease watch). A job whose
    runner is gone is run by nobody: cancel it and submit it again."""
    import os
    import socket

    if not runner or runner.get("kind") not in ("local", "foreground") or runner.get("host") != socket.gethostname():
        return None
    try:
        os.kill(int(runner["pid"]), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process of that pid: alive
        return True
    return True


def cluster_markdown(status: dict[str, Any], *, max_nodes: int = 64) -> str:
    """Nodes x GPUs: each cell the job holding the GPU, `·` when free, the node's state when not ready."""
    widest = max((n["gpu_count"] for n in status["nodes"]), default=0)
    head = "| node | type | state | " + " | ".join(f"GPU {i}" for i in range(widest)) + " |"
    sep = "|" + "---|" * (3 + widest)
    lines = [f"### Cluster `{status['cluster']}`", "",
             "free GPUs: " + ", ".join(f"{t} {status['free_by_type'].get(t, 0)}/{n}"
                                       for t, n in status["gpus_by_type"].items()), "", head, sep]
    for node in status["nodes"][:max_nodes]:
        state = node["state"] + (f" ({node['reason']})" if node["reason"] else "")
        cells = []
        for g in node["gpus"]:
            if g["job"] is not None:
                cells.append(f"**{g['job']}** #{g['job_id']}")
            else:
                cells.append("·" if node["state"] == "ready" else node["state"])
        cells += [""] * (widest - len(cells))
        lines.append(f"| {node['node']} | {node['gpu_type']} | {state} | " + " | ".join(cells) + " |")
    if len(status["nodes"]) > max_nodes:
        lines.append(f"\n… and {len(status['nodes']) - max_nodes} more nodes")
    return "\n".join(lines)
