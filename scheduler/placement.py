"""Placement: which nodes and GPUs a plan runs on, and which rank each GPU gets.

Two steps:

1. **HAS** (Frenzy's heterogeneity-aware scheduler, Algorithm 1). Walk the
   ranked plans and take the first one the free GPUs can satisfy (enough idle
   GPUs, on nodes that are not cordoned, whose memory holds the plan). Then
   fill it: among eligible nodes sorted by idle GPUs ascending, give the job
   the first node that alone covers what is still needed (best fit — the
   node with the least sufficient idle GPUs, so big holes stay big); if none
   does, take every idle GPU of the node with the most idle GPUs and repeat.
   GPUs are handed out in whole tensor-parallel groups, because a tp group
   must not straddle nodes.

2. **Cross mapping** (Mobius, `scheduler.offload.mapping`). Ranks follow
   Megatron's order (tp fastest, then dp, then pp), so pipeline stage s owns a
   contiguous block of ranks and each node hosts a contiguous range. Within a
   node, when the inventory knows the PCIe root complex of every GPU, local
   ranks are mapped onto GPUs by exhaustive enumeration (symmetry-pruned) of
   the mapping with the least contention: ranks of stages i != j contend by
   shared(i, j) / |i - j|, shared = GPUs under their common root complex (0 when
   different) — stages close in the pipeline move data over PCIe at about the
   same time, and a root complex's uplink is what they would share.

The result is an explicit `Placement` (node → GPU indices → global ranks)
that renders one torchrun launch per node (`launch_specs`). The cluster's free
lists are updated by `allocate_placement` / `release_placement`.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Iterable, Literal

from scheduler.cluster import Cluster, ClusterError, Node
from scheduler.gpus import CPU_DEVICE
from scheduler.cost_model import LinkSpeeds
from scheduler.offload.mapping import cross_map
from infra.launch import NodeLaunch

DEFAULT_MASTER_PORT = 29500


class PlacementError(ClusterError):
    """A placement cannot be made or applied (e.g. the GPUs are no longer free)."""


@dataclass(frozen=True)
class GpuRequest:
    """What HAS places: `count` GPUs of at least `min_memory_bytes` (of `gpu_type` if given),
    handed out in indivisible groups of `unit` GPUs that must share a node."""

    count: int
    min_memory_bytes: int = 0
    gpu_type: str | None = None
    unit: int = 1

    def __post_init__(self) -> None:
        if self.count < 1 or self.unit < 1 or self.count % self.unit:
            raise PlacementError(
                f"a GPU request needs count >= 1 divisible by unit (got count={self.count}, unit={self.unit})"
            )

    def eligible(self, node: Node) -> bool:
        return (
            not node.cordoned
            and node.gpu_memory_bytes >= self.min_memory_bytes
            and (self.gpu_type is None or node.gpu_type == self.gpu_type)
        )

    def usable_on(self, node: Node) -> int:
        """Idle GPUs of the node this request can use (whole units only)."""
        return (node.idle_count // self.unit) * self.unit


# --- choosing nodes ---------------------------------------------------------


def has_select(cluster: Cluster, request: GpuRequest, nodes: Iterable[Node] | None = None) -> dict[str, int] | None:
    """Frenzy's Algorithm 1: how many GPUs to take from which node, or None if they are not free.

    Returns {node name: GPU count} in the order the nodes were chosen.
    """
    candidates = [n for n in (cluster.nodes if nodes is None else nodes) if request.eligible(n)]
    usable = {n.name: request.usable_on(n) for n in candidates}
    if sum(usable.values()) < request.count:
        return None
    # Ties: smaller GPUs first (keep big-memory GPUs for jobs that need them), then by name.
    pool = sorted(
        (n for n in candidates if usable[n.name] > 0),
        key=lambda n: (usable[n.name], n.gpu_memory_bytes, n.name),
    )
    remaining = request.count
    chosen: dict[str, int] = {}
    while remaining > 0:
        best_fit = next((n for n in pool if usable[n.name] >= remaining), None)
        if best_fit is not None:
            chosen[best_fit.name] = remaining
            return chosen
        # The node with the most idle GPUs (ties: smaller GPUs, then inventory name order).
        largest = max(pool, key=lambda n: (usable[n.name], -n.gpu_memory_bytes))
        pool.remove(largest)
        chosen[largest.name] = usable[largest.name]
        remaining -= usable[largest.name]
    return chosen


def first_fit_select(cluster: Cluster, request: GpuRequest, nodes: Iterable[Node] | None = None) -> dict[str, int] | None:
    """The baseline: nodes in inventory order, take idle GPUs until the request is covered."""
    remaining = request.count
    chosen: dict[str, int] = {}
    for n in (cluster.nodes if nodes is None else nodes):
        if not request.eligible(n):
            continue
        take = min(request.usable_on(n), remaining)
        if take:
            chosen[n.name] = take
            remaining -= take
            if remaining == 0:
                return chosen
    return None


# --- the placement ---------------------------------------------------------


@dataclass(frozen=True)
class NodeAssignment:
    """One node's share: its GPUs in local-rank order and the global rank of each."""

    node: str
    address: str
    gpus: tuple[int, ...]  # GPU index of local rank 0, 1, ... (CUDA_VISIBLE_DEVICES order)
    ranks: tuple[int, ...]  # global rank of local rank 0, 1, ...
    stages: tuple[int, ...]  # pipeline stage of local rank 0, 1, ...
    root_complexes: tuple[int | None, ...]  # root complex of each of `gpus`

    @property
    def nproc(self) -> int:
        return len(self.gpus)


@dataclass
class Placement:
    """Where a job runs: node → GPU indices → global ranks, plus rendezvous hints."""

    job: str
    gpu_type: str
    dp: int
    tp: int
    pp: int
    assignments: list[NodeAssignment]  # in node-rank order
    master_addr: str
    master_port: int = DEFAULT_MASTER_PORT
    plan: Any = None  # the scheduler.planner.Plan placed, if any
    predicted_step_time_s: float | None = None  # re-predicted for the actual spread over nodes
    cross_mapped: bool = False

    @property
    def world_size(self) -> int:
        return sum(a.nproc for a in self.assignments)

    @property
    def nodes(self) -> list[str]:
        return [a.node for a in self.assignments]

    def gpu_map(self) -> dict[str, dict[int, int]]:
        """{node: {GPU index: global rank}}."""
        return {a.node: dict(zip(a.gpus, a.ranks)) for a in self.assignments}

    def launch_specs(self) -> list[NodeLaunch]:
        """One torchrun per node: nnodes, node_rank, nproc_per_node, CUDA_VISIBLE_DEVICES."""
        out, first = [], 0
        for rank, a in enumerate(self.assignments):
            # CPU "devices" are worker processes: there is no device visibility to set.
            devices = "" if self.gpu_type == CPU_DEVICE else ",".join(str(g) for g in a.gpus)
            out.append(NodeLaunch(
                node=a.node, address=a.address, node_rank=rank, nnodes=len(self.assignments),
                nproc_per_node=a.nproc, cuda_visible_devices=devices,
                master_addr=self.master_addr, master_port=self.master_port, first_global_rank=first,
            ))
            first += a.nproc
        return out

    def stage_root_complex_conflicts(self) -> int:
        """Adjacent stage pairs (s, s+1) with GPUs under one root complex of one node."""
        where: dict[int, set[tuple[str, int]]] = defaultdict(set)
        for a in self.assignments:
            for stage, rc in zip(a.stages, a.root_complexes):
                if rc is not None:
                    where[stage].add((a.node, rc))
        return sum(1 for s in range(self.pp - 1) if where[s] & where[s + 1])

    def to_dict(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "gpu_type": self.gpu_type,
            "world_size": self.world_size,
            "dp": self.dp, "tp": self.tp, "pp": self.pp,
            "master_addr": self.master_addr,
            "master_port": self.master_port,
            "cross_mapped": self.cross_mapped,
            "stage_root_complex_conflicts": self.stage_root_complex_conflicts(),
            "predicted_step_time_s": self.predicted_step_time_s,
            "nodes": [
                {
                    "node": a.node, "address": a.address, "node_rank": i,
                    "gpus": list(a.gpus), "ranks": list(a.ranks), "stages": list(a.stages),
                    "root_complexes": list(a.root_complexes),
                }
                for i, a in enumerate(self.assignments)
            ],
            "launch": [vars(spec) for spec in self.launch_specs()],
        }


# --- GPUs within a node, and cross mapping ------------------------------------


def _pick_gpus(node: Node, count: int, spread_root_complexes: bool) -> list[int]:
    """Which idle GPUs of the node to take: the lowest indices, or spread over root
    complexes (round-robin, fullest root complex first) when stages will be cross-mapped."""
    idle = node.idle_gpus
    if not spread_root_complexes or node.pcie_root_complex is None:
        return idle[:count]
    by_rc: dict[int, list[int]] = defaultdict(list)
    for g in idle:
        by_rc[node.pcie_root_complex[g]].append(g)
    queues = sorted(by_rc.values(), key=lambda gs: (-len(gs), gs[0]))
    picked: list[int] = []
    while len(picked) < count:
        for q in queues:
            if q and len(picked) < count:
                picked.append(q.pop(0))
    return sorted(picked)


def _cross_map(node: Node, gpus: list[int], stages: list[int]) -> list[int]:
    """GPU for each local rank: Mobius's contention-minimising mapping over the node's root complexes."""
    return list(cross_map(gpus, node.pcie_root_complex, stage_of_position=stages).gpus)


def build_placement(
    cluster: Cluster,
    chosen: dict[str, int],
    *,
    job: str,
    gpu_type: str,
    dp: int,
    tp: int,
    pp: int,
    cross_map: bool = True,
    master_port: int = DEFAULT_MASTER_PORT,
) -> Placement:
    """Turn {node: GPU count} into an explicit rank map (Megatron order: tp, dp, pp)."""
    per_stage = dp * tp
    assignments: list[NodeAssignment] = []
    next_rank = 0
    any_cross = False
    for name, count in chosen.items():
        node = cluster.node(name)
        ranks = list(range(next_rank, next_rank + count))
        stages = [r // per_stage for r in ranks]
        knows_rc = node.pcie_root_complex is not None
        multi_stage = len(set(stages)) > 1
        spread = cross_map and knows_rc and pp > 1
        gpus = _pick_gpus(node, count, spread)
        if spread and multi_stage:
            gpus = _cross_map(node, gpus, stages)
            any_cross = True
        assignments.append(NodeAssignment(
            node=name, address=node.address or name, gpus=tuple(gpus), ranks=tuple(ranks),
            stages=tuple(stages), root_complexes=tuple(node.root_complex_of(g) for g in gpus),
        ))
        next_rank += count
    return Placement(
        job=job, gpu_type=gpu_type, dp=dp, tp=tp, pp=pp, assignments=assignments,
        master_addr=assignments[0].address, master_port=master_port, cross_mapped=any_cross,
    )


def allocate_placement(cluster: Cluster, placement: Placement) -> None:
    """Mark the placement's GPUs busy on the cluster (all or nothing)."""
    done: list[NodeAssignment] = []
    try:
        for a in placement.assignments:
            cluster.allocate(a.node, a.gpus)
            done.append(a)
    except ClusterError as e:
        for a in done:
            cluster.release(a.node, a.gpus)
        raise PlacementError(f"cannot allocate placement of job {placement.job!r}: {e}") from None


def release_placement(cluster: Cluster, placement: Placement) -> None:
    for a in placement.assignments:
        cluster.release(a.node, a.gpus)


# --- plans → placement -------------------------------------------------------


def placed_step_time(plan: Any, placement: Placement, cluster: Cluster) -> float:
    """The plan's step time for the way it was actually spread over nodes: a job split
    over more nodes than the planner assumed pays for it in data-parallel traffic."""
    densest = max(a.nproc for a in placement.assignments)
    first = cluster.node(placement.assignments[0].node)
    links = LinkSpeeds(intra_node_gbps=first.intra_bandwidth_gbps,
                       inter_node_gbps=cluster.inter_node_bandwidth_gbps)
    used = plan.num_gpus if len(placement.assignments) == 1 else densest
    return plan.step_time_on(peak_tflops=first.peak_tflops, links=links, gpus_per_node_used=used).total_s


def request_for_plan(plan: Any, match: Literal["type", "memory"] = "type") -> GpuRequest:
    """HAS's view of a plan: its GPU count and the memory it needs.

    `type` keeps the plan on the GPU type it was estimated for (a Crius cell);
    `memory` is Frenzy's rule: any GPU with enough memory.
    """
    return GpuRequest(
        count=plan.num_gpus,
        min_memory_bytes=plan.required_memory_bytes,
        gpu_type=plan.gpu_type if match == "type" else None,
        unit=plan.tp,
    )


def place_plans(
    plans: list[Any],
    cluster: Cluster,
    *,
    job: str = "job",
    allocate: bool = False,
    cross_map: bool = True,
    match: Literal["type", "memory"] = "type",
    select: Literal["has", "first_fit"] = "has",
    master_port: int = DEFAULT_MASTER_PORT,
) -> Placement | None:
    """HAS over a ranked plan list: the first plan the free GPUs satisfy, best-fit placed.

    Returns None when no plan fits the free GPUs now (the job waits).
    """
    chooser = has_select if select == "has" else first_fit_select
    free_by_type = cluster.free_gpus_by_type()
    for plan in plans:
        if match == "type" and free_by_type.get(plan.gpu_type, 0) < plan.num_gpus:
            continue  # cheap rejection before walking the nodes
        chosen = chooser(cluster, request_for_plan(plan, match))
        if chosen is None:
            continue
        placement = build_placement(
            cluster, chosen, job=job, gpu_type=plan.gpu_type, dp=plan.dp, tp=plan.tp, pp=plan.pp,
            cross_map=cross_map, master_port=master_port,
        )
        placement.plan = plan
        placement.predicted_step_time_s = placed_step_time(plan, placement, cluster)
        if allocate:
            allocate_placement(cluster, placement)
        return placement
    return None
