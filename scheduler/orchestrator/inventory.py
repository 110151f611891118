"""The registered inventory: write a `Cluster` into the state database, read it back with health.

Static node facts (type, memory, links, root complexes) are cached per process and
cluster *generation* (bumped by each register), so a scheduling pass reads only
what changes: node health and live allocations.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from infra.statedb.schema import allocations, clusters, gpus, jobs, nodes
from scheduler.cluster import Cluster, Node
from scheduler.orchestrator.config import OrchestratorError

HEALTH_STATES = ("ready", "cordoned", "drained")


def register(conn: Connection, cluster: Cluster, *, source: str | None, by: str) -> dict[str, Any]:
    """Insert or update a cluster's inventory (inside the caller's write transaction).

    Health of nodes that stay is kept. GPUs leave with their node, or when a node's
    `gpu_count` shrinks (the highest indices go); that is refused while a job holds
    one of them. Released allocations of GPUs that leave are deleted with them (the
    history stays in `allocation_events`, which has no foreign key and no DELETE trigger).
    """
    now = time.time()
    row = conn.execute(sa.select(clusters.c.generation).where(clusters.c.name == cluster.name)).one_or_none()
    existing = {r.name: r for r in conn.execute(
        sa.select(nodes.c.name, nodes.c.state, nodes.c.gpu_count).where(nodes.c.cluster == cluster.name))}
    wanted = {n.name: n for n in cluster.nodes}
    removed = sorted(set(existing) - set(wanted))
    shrunk = {name: wanted[name].gpu_count for name in existing
              if name in wanted and wanted[name].gpu_count < existing[name].gpu_count}
    leaving = _gpus_leaving(cluster.name, removed, shrunk)
    if leaving is not None:
        _refuse_if_held(conn, cluster.name, leaving, removed, shrunk)
        # Released allocations of these GPUs hold the foreign key to them; their history is in
        # allocation_events (written on INSERT / UPDATE of allocations, untouched by a DELETE).
        conn.execute(sa.delete(allocations).where(leaving, allocations.c.released_at.is_not(None)))
    if row is None:
        conn.execute(sa.insert(clusters).values(name=cluster.name, generation=1, registered_at=now, source=source,
                                                inter_node_bandwidth_gbps=cluster.inter_node_bandwidth_gbps,
                                                policy=cluster.policy,
                                                usage_half_life_s=cluster.usage_half_life_hours * 3600))
    else:
        conn.execute(sa.update(clusters).where(clusters.c.name == cluster.name).values(
            generation=row.generation + 1, registered_at=now, source=source,
            inter_node_bandwidth_gbps=cluster.inter_node_bandwidth_gbps, policy=cluster.policy,
            usage_half_life_s=cluster.usage_half_life_hours * 3600))
    if removed:
        conn.execute(sa.delete(gpus).where(gpus.c.cluster == cluster.name, gpus.c.node.in_(removed)))
        conn.execute(sa.delete(nodes).where(nodes.c.cluster == cluster.name, nodes.c.name.in_(removed)))
    added = 0
    for position, node in enumerate(cluster.nodes):
        spec = node.model_dump(mode="json", exclude={"free_gpus", "cordoned"})
        values = dict(position=position, spec=spec, gpu_type=node.gpu_type, gpu_count=node.gpu_count)
        if node.name in existing:
            conn.execute(sa.update(nodes).where(nodes.c.cluster == cluster.name, nodes.c.name == node.name)
                         .values(**values))
            conn.execute(sa.delete(gpus).where(gpus.c.cluster == cluster.name, gpus.c.node == node.name,
                                               gpus.c.gpu_index >= node.gpu_count))
            have = {g for (g,) in conn.execute(sa.select(gpus.c.gpu_index).where(
                gpus.c.cluster == cluster.name, gpus.c.node == node.name))}
        else:
            added += 1
            state = "cordoned" if node.cordoned else "ready"
            conn.execute(sa.insert(nodes).values(
                cluster=cluster.name, name=node.name, state=state, changed_by=by, changed_at=now,
                reason="cordoned in the inventory file" if node.cordoned else None, **values))
            have = set()
        rows = [dict(cluster=cluster.name, node=node.name, gpu_index=i, gpu_type=node.gpu_type,
                     memory_gib=node.gpu_memory_gib, root_complex=node.root_complex_of(i))
                for i in range(node.gpu_count) if i not in have]
        if rows:
            conn.execute(sa.insert(gpus), rows)
    return {"cluster": cluster.name, "nodes": len(cluster.nodes), "gpus": cluster.total_gpus,
            "added": added, "removed": removed, "generation": 1 if row is None else row.generation + 1}


def _gpus_leaving(cluster: str, removed: list[str], shrunk: dict[str, int]) -> sa.ColumnElement[bool] | None:
    """Which allocations sit on GPUs that leave the inventory (None: no GPU leaves)."""
    where = [allocations.c.node.in_(removed)] if removed else []
    where += [sa.and_(allocations.c.node == name, allocations.c.gpu_index >= count) for name, count in shrunk.items()]
    return sa.and_(allocations.c.cluster == cluster, sa.or_(*where)) if where else None


def _refuse_if_held(conn: Connection, cluster: str, leaving: sa.ColumnElement[bool], removed: list[str],
                    shrunk: dict[str, int]) -> None:
    """A clear refusal when a live allocation sits on a GPU that would leave the inventory."""
    held = conn.execute(
        sa.select(allocations.c.node, allocations.c.gpu_index, jobs.c.id, jobs.c.name)
        .join(jobs, jobs.c.id == allocations.c.job_id)
        .where(leaving, allocations.c.released_at.is_(None))
        .order_by(allocations.c.node, allocations.c.gpu_index)).all()
    if not held:
        return
    by_node: dict[str, tuple[list[int], dict[int, str]]] = {}
    for node, gpu, job_id, name in held:
        gpus_held, holders = by_node.setdefault(node, ([], {}))
        gpus_held.append(gpu)
        holders[job_id] = name
    parts = []
    for node, (gpus_held, holders) in by_node.items():
        change = "removed" if node in removed else f"shrunk to {shrunk[node]} GPU(s)"
        jobs_text = ", ".join(f"{job_id} ({name})" for job_id, name in sorted(holders.items()))
        parts.append(f"node {node!r} ({change}): GPU(s) {gpus_held} held by job(s) {jobs_text}")
    nodes_text = ", ".join(by_node)
    raise OrchestratorError(
        f"cannot register this inventory of cluster {cluster!r}: jobs hold GPUs it removes; "
        + "; ".join(parts)
        + f". Drain the node(s) (`forgeflow cluster drain NODE --cluster {cluster}` for {nodes_text}) and wait "
        "for those jobs to finish (or cancel their flow runs), then register again"
    )


_CACHE: dict[tuple[str, str, int], Cluster] = {}
_CACHE_LOCK = threading.Lock()


def cluster_names(conn: Connection) -> list[str]:
    return [n for (n,) in conn.execute(sa.select(clusters.c.name).order_by(clusters.c.name))]


def resolve_cluster(conn: Connection, name: str | None) -> str:
    """The named cluster, or the only registered one; a clear error otherwise."""
    names = cluster_names(conn)
    if name is None:
        if len(names) == 1:
            return names[0]
        if not names:
            raise OrchestratorError("no cluster is registered; run `forgeflow cluster register CLUSTER.yaml` first")
        raise OrchestratorError(f"several clusters are registered ({', '.join(names)}); name one with --cluster")
    if name not in names:
        raise OrchestratorError(
            f"no cluster named {name!r} is registered (registered: {', '.join(names) or 'none'}); "
            "run `forgeflow cluster register CLUSTER.yaml`"
        )
    return name


def load_cluster(conn: Connection, name: str, *, generation: int | None = None, url: str = "") -> Cluster:
    """The cluster as it is now: its nodes with health (cordoned = not ready) and free GPUs.

    The returned object is shared per (database, cluster, generation) and rewritten in
    place on every call; use it inside one transaction only (the scheduler lock makes
    that safe), or `copy_state()` it.
    """
    if generation is None:
        generation = conn.execute(sa.select(clusters.c.generation).where(clusters.c.name == name)).scalar_one()
    key = (url, name, generation)
    with _CACHE_LOCK:
        cluster = _CACHE.get(key)
    if cluster is None:
        bw = conn.execute(sa.select(clusters.c.inter_node_bandwidth_gbps).where(clusters.c.name == name)).scalar_one()
        specs = [r.spec for r in conn.execute(
            sa.select(nodes.c.spec).where(nodes.c.cluster == name).order_by(nodes.c.position))]
        cluster = Cluster(name=name, inter_node_bandwidth_gbps=bw, nodes=[Node.model_validate(s) for s in specs])
        with _CACHE_LOCK:
            for old in [k for k in _CACHE if k[:2] == key[:2]]:
                del _CACHE[old]
            _CACHE[key] = cluster
    health = dict(conn.execute(sa.select(nodes.c.name, nodes.c.state).where(nodes.c.cluster == name)).all())
    held: dict[str, set[int]] = {}
    for node, gpu in conn.execute(sa.select(allocations.c.node, allocations.c.gpu_index).where(
            allocations.c.cluster == name, allocations.c.released_at.is_(None))):
        held.setdefault(node, set()).add(gpu)
    for node in cluster.nodes:
        node.cordoned = health.get(node.name, "ready") != "ready"
        busy = held.get(node.name)
        node.free_gpus = [i for i in range(node.gpu_count) if i not in busy] if busy else list(range(node.gpu_count))
    return cluster


def live_jobs_on(conn: Connection, cluster: str, node: str) -> list[int]:
    return sorted({j for (j,) in conn.execute(sa.select(allocations.c.job_id).where(
        allocations.c.cluster == cluster, allocations.c.node == node, allocations.c.released_at.is_(None)))})
