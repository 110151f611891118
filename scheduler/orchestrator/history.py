"""After the fact: was any GPU ever held by two live allocations, or a team over its quota?

Replays `allocation_events` in commit order (their ids are taken under the
scheduler lock) and counts allocations of a GPU that another allocation still
held, plus releases of a GPU by an allocation that did not hold it (`double_booked`);
`over_quota` counts allocations that took a team past its quota plus borrowing limit.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from infra.statedb import read_transaction
from infra.statedb.schema import allocation_events


def double_booked(engine: Engine, cluster: str | None = None) -> int:
    query = sa.select(allocation_events.c.allocation_id, allocation_events.c.cluster, allocation_events.c.node,
                      allocation_events.c.gpu_index, allocation_events.c.event).order_by(allocation_events.c.id)
    if cluster is not None:
        query = query.where(allocation_events.c.cluster == cluster)
    holder: dict[tuple[str, str, int], int] = {}
    conflicts = 0
    with read_transaction(engine) as conn:
        for alloc_id, cl, node, gpu, event in conn.execute(query):
            key = (cl, node, gpu)
            if event == "allocate":
                if key in holder:
                    conflicts += 1
                holder[key] = alloc_id
            elif holder.get(key) != alloc_id:
                conflicts += 1  # released something it did not hold
            else:
                del holder[key]
    return conflicts


def over_quota(engine: Engine, cluster: str) -> int:
    """Allocations that took a team above its nominal quota plus borrowing limit of a GPU type
    (the quotas as set now; a job without a team is team ""), replaying `allocation_events` in
    commit order like `double_booked`. Teams without a quota row of a type borrow without limit."""
    from infra.statedb.schema import gpus, jobs, quotas

    with read_transaction(engine) as conn:
        limits = {(t, g): (n + b if b is not None else None) for t, g, n, b in conn.execute(sa.select(
            quotas.c.team, quotas.c.gpu_type, quotas.c.nominal, quotas.c.borrowing_limit).where(
            quotas.c.cluster == cluster))}
        type_of = {(n, i): t for n, i, t in conn.execute(sa.select(gpus.c.node, gpus.c.gpu_index, gpus.c.gpu_type)
                                                        .where(gpus.c.cluster == cluster))}
        team_of = dict(conn.execute(sa.select(jobs.c.id, jobs.c.team).where(jobs.c.cluster == cluster)).all())
        events = conn.execute(sa.select(allocation_events.c.job_id, allocation_events.c.node,
                                        allocation_events.c.gpu_index, allocation_events.c.event)
                              .where(allocation_events.c.cluster == cluster).order_by(allocation_events.c.id)).all()
    held: dict[tuple[str, str], int] = {}
    over = 0
    for job_id, node, gpu, event in events:
        key = (team_of.get(job_id) or "", type_of.get((node, gpu), "?"))
        held[key] = held.get(key, 0) + (1 if event == "allocate" else -1)
        limit = limits.get(key)
        if event == "allocate" and limit is not None and held[key] > limit:
            over += 1
    return over
