"""What the training worker (`python -m training.train`) can run: the one description.

The job-spec check (training.config), the planner (`scheduler.planner.worker_planner_config`,
used by `forgeflow plan` and the pretrain flow) and the flow's out-of-memory hint all
read it, so none of them proposes a layout the worker then rejects. When the worker
learns something new (pipeline stages, sequence parallelism), change it here.

Each entry says what holds it down, so the next change knows where to look.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class WorkerCapabilities:
    # Pipeline stages run with megatron's 1F1B / interleaved schedules (training/train.py),
    # uneven cuts included (training/model.py); nothing in the worker bounds the count
    # below model.num_layers, so this is the planner's own search bound.
    max_pipeline_stages: int = 16
    # Any degree that divides the attention heads, query groups and FFN width.
    max_tensor_parallel: int | None = None
    # The worker uses megatron's local layer spec, whose torch LayerNorm refuses
    # sequence parallelism (Transformer Engine would be needed), on CPU and GPU alike.
    sequence_parallel: bool = False
    # Both recompute modes run on CPU too (training/megatron_compat.py, item 7).
    recompute: tuple[str, ...] = ("none", "selective", "full")
    # megatron's DistributedOptimizer runs on gloo as well (megatron_compat.py, item 8).
    distributed_optimizer: bool = True


# One worker for CPU and GPU: the only difference, fp32-only on CPU, is checked in training/model.py.
WORKER = WorkerCapabilities()
