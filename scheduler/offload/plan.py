"""A Mobius offload plan for a job no GPU-resident plan can hold.

When MARP finds no layout that fits the GPUs' memory, the planner asks here:
keep the model in host DRAM, cut it into stages (the partition MIP on an
analytic profile of the model on these GPUs), map positions onto GPUs by root
complex (cross mapping), and predict the step time (the partition's model).
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.cluster import Cluster, Node
from scheduler.gpus import CPU_DEVICE
from scheduler.offload.mapping import cross_map
from scheduler.offload.measure import hardware_for
from scheduler.offload.partition import NoFeasiblePartition, Partition, solve_partition
from scheduler.offload.profile import analytic_profile
from training.config import ModelConfig


@dataclass
class OffloadPlan:
    node: str
    gpu_type: str
    num_gpus: int
    partition: Partition
    gpu_of_position: tuple[int, ...]
    host_state_bytes: int

    @property
    def predicted_step_time_s(self) -> float:
        return self.partition.step.total_s

    def summary(self) -> str:
        return (f"Mobius offload on {self.node}: {self.num_gpus}x {self.gpu_type}, {self.partition.num_stages} "
                f"stages in host memory ({self.host_state_bytes / 1024**3:.1f} GiB), GPUs "
                f"{list(self.gpu_of_position)}, predicted step {self.predicted_step_time_s:.2f} s")

    def to_dict(self) -> dict:
        return {"node": self.node, "gpu_type": self.gpu_type, "num_gpus": self.num_gpus,
                "gpu_of_position": list(self.gpu_of_position), "host_state_gib": self.host_state_bytes / 1024**3,
                "predicted_step_time_s": self.predicted_step_time_s, "partition": self.partition.to_dict()}


def plan_offload(model: ModelConfig, global_batch: int, cluster: Cluster, *, micro_batch: int = 1,
                 memory_margin: float = 0.10, time_limit_s: float = 2.0) -> OffloadPlan | None:
    """The fastest single-node offload plan over the cluster's schedulable nodes (None if none fits,
    e.g. host RAM too small for weights + gradients + Adam state)."""
    best: OffloadPlan | None = None
    microbatches = max(1, global_batch // micro_batch)
    for node in cluster.schedulable_nodes():
        if node.gpu_type == CPU_DEVICE or node.idle_count == 0:
            continue
        plan = _plan_on_node(model, node, micro_batch, microbatches, memory_margin, time_limit_s)
        if plan is not None and (best is None or plan.predicted_step_time_s < best.predicted_step_time_s):
            best = plan
    return best


def _plan_on_node(model: ModelConfig, node: Node, micro_batch: int, microbatches: int, memory_margin: float,
                  time_limit_s: float) -> OffloadPlan | None:
    profile = analytic_profile(model, micro_batch=micro_batch, microbatches=microbatches,
                               peak_tflops=node.peak_tflops)
    state = profile.model_state_bytes
    if node.host_ram_gib is not None and state > node.host_ram_gib * 1024**3 * 0.9:
        return None
    hw = hardware_for(node, gpus=node.idle_count, memory_margin=memory_margin)
    try:
        part = solve_partition(profile, hw, time_limit_s=time_limit_s)
    except NoFeasiblePartition:
        return None
    gpus = node.idle_gpus
    if node.pcie_root_complex is not None:
        mapping = cross_map(gpus, node.pcie_root_complex, num_stages=part.num_stages).gpus
    else:
        mapping = tuple(gpus)
    return OffloadPlan(node.name, node.gpu_type, len(gpus), part, tuple(mapping), state)
