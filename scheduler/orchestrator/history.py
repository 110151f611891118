"""After the fact: was any GPU ever held by two live allocations?

Replays `allocation_events` in commit order (their ids are taken under the
scheduler lock) and counts allocations of a GPU that another allocation still
held, plus releases of a GPU by an allocation that did not hold it.
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
