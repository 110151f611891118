"""`forgeflow cluster usage`: GPU-hours by GPU type and queue time, per team or per user.

GPU-hours are a direct sum over the allocation history: every allocation row (one GPU of one
admission; rows stay after their release) counts from its allocation to its release (or now,
while live), clipped to the window. Queue time is each admission's wait, from the job's
(last) queueing to its admission, for jobs admitted in the window (a preempted job is queued
again at its submit time, so its wait counts from there). Preemptions are the records that
ended in the window (the victim released as preempted, or forced at its deadline): suffered by
the victim's team or user, caused by the preempting job's (an elastic resize, recorded there too,
is not a preemption).
"""

from __future__ import annotations

import re
import time
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from infra.statedb import read_transaction
from infra.statedb.schema import allocations, gpus, jobs, preemptions
from scheduler.orchestrator.config import OrchestratorError
import scheduler.orchestrator.inventory as inventory

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_since(text: str) -> float:
    """'7d', '12h', '30m', '2w', '90s' as seconds."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", text or "")
    if not match or float(match.group(1)) <= 0:
        raise OrchestratorError(f"--since {text!r}: give a length of time such as 7d, 12h, 30m, 2w or 90s")
    return float(match.group(1)) * _UNITS[match.group(2)]


def usage(engine: Engine, cluster: str | None = None, *, since_s: float = 7 * 86400, by: str = "team",
          now: float | None = None) -> dict[str, Any]:
    """{"cluster", "since", "until", "by", "rows": [{key, gpu_hours: {type: h}, gpu_hours_total,
    admissions, queue_s_total, queue_s_mean, preemptions_suffered, preemptions_caused}]}; key is
    the team ("" without one) or the submitter."""
    if by not in ("team", "user"):
        raise OrchestratorError(f"--by {by!r}: give team or user")
    now = time.time() if now is None else now
    start = now - since_s
    who = jobs.c.team if by == "team" else jobs.c.submitted_by
    with read_transaction(engine) as conn:
        name = inventory.resolve_cluster(conn, cluster)
        held = conn.execute(
            sa.select(who, gpus.c.gpu_type, allocations.c.allocated_at, allocations.c.released_at, sa.func.count())
            .select_from(allocations.join(jobs, jobs.c.id == allocations.c.job_id)
                         .join(gpus, sa.and_(gpus.c.cluster == allocations.c.cluster, gpus.c.node == allocations.c.node,
                                             gpus.c.gpu_index == allocations.c.gpu_index)))
            .where(allocations.c.cluster == name, allocations.c.allocated_at < now,
                   sa.or_(allocations.c.released_at.is_(None), allocations.c.released_at > start))
            .group_by(who, gpus.c.gpu_type, allocations.c.allocated_at, allocations.c.released_at)).all()
        waits = conn.execute(sa.select(who, jobs.c.admitted_at - jobs.c.queued_at).where(
            jobs.c.cluster == name, jobs.c.admitted_at.is_not(None), jobs.c.admitted_at >= start,
            jobs.c.admitted_at < now)).all()
        preemptor = jobs.alias("preemptor")
        by_preemptor = preemptor.c.team if by == "team" else preemptor.c.submitted_by
        preempted = conn.execute(
            sa.select(who, by_preemptor)
            .select_from(preemptions.join(jobs, jobs.c.id == preemptions.c.job_id)
                         .join(preemptor, preemptor.c.id == preemptions.c.preempted_by))
            .where(preemptions.c.cluster == name, preemptions.c.kind == "preempt",  # not elastic resizes
                   preemptions.c.ended_at.is_not(None),
                   preemptions.c.ended_at >= start, preemptions.c.ended_at < now)).all()
    rows: dict[str, dict[str, Any]] = {}

    def row(key: str | None) -> dict[str, Any]:
        return rows.setdefault(key or "", {by: key or "", "gpu_hours": {}, "gpu_hours_total": 0.0,
                                           "admissions": 0, "queue_s_total": 0.0,
                                           "preemptions_suffered": 0, "preemptions_caused": 0})
    for key, gpu_type, allocated, released, count in held:
        seconds = max(0.0, min(released if released is not None else now, now) - max(allocated, start)) * count
        entry = row(key)
        entry["gpu_hours"][gpu_type] = entry["gpu_hours"].get(gpu_type, 0.0) + seconds / 3600
        entry["gpu_hours_total"] += seconds / 3600
    for key, wait in waits:
        entry = row(key)
        entry["admissions"] += 1
        entry["queue_s_total"] += max(0.0, wait or 0.0)
    for victim, preempting in preempted:
        row(victim)["preemptions_suffered"] += 1
        row(preempting)["preemptions_caused"] += 1
    for entry in rows.values():
        entry["queue_s_mean"] = entry["queue_s_total"] / entry["admissions"] if entry["admissions"] else None
    return {"cluster": name, "since": start, "until": now, "by": by,
            "rows": sorted(rows.values(), key=lambda r: (-r["gpu_hours_total"], r[by]))}
