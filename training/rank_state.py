"""One rank's state beyond its sharded tensors, for training.checkpointing.

RNG states (python, numpy, torch CPU/CUDA, megatron's tracker), how the distributed
optimizer lays out its checkpoint state, and its state preparation before a load.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture_rng_states() -> dict[str, Any]:
    from megatron.core import tensor_parallel

    states: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch_cpu": torch.get_rng_state(),
        "megatron_tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        states["torch_cuda"] = torch.cuda.get_rng_state()
    return states


def restore_rng_states(states: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch_cpu"])
    if torch.cuda.is_available() and "torch_cuda" in states:
        torch.cuda.set_rng_state(states["torch_cuda"])
    tracker_states = states.get("megatron_tracker") or {}
    if tracker_states:
        tensor_parallel.get_cuda_rng_tracker().set_states(tracker_states)


def OPTIMIZER_CHECKPOINT_METADATA() -> dict[str, Any]:
    """How megatron's distributed optimizer lays out its state in a checkpoint.

    Its default format ('fully_sharded_model_space') needs flattened ShardedTensors, which
    dist_checkpointing 0.16.1 refuses; 'fully_reshardable' gathers each parameter's state
    whole (and reshards on load to any data-parallel size). On CPU the gather must go
    over the gloo group ("mem_efficient": distrib_optimizer.py:1443-1445; the other path
    moves buffers to CUDA, :1089). The plain optimizer ignores these keys.
    """
    return {"distrib_optim_sharding_type": "fully_reshardable",
            "distrib_optim_fully_reshardable_mem_efficient": not torch.cuda.is_available()}


def ensure_distributed_optimizer_state(optimizer) -> None:
    """Give a fresh DistributedOptimizer's Adam an (empty) state before loading into it.

    Without Apex/TE, DistributedOptimizer.state_dict() reads the common Adam `step` of
    its state (distrib_optimizer.py:640-642) and fails on a never-stepped optimizer; the
    zeros set here are overwritten by the checkpoint's values.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not isinstance(sub, DistributedOptimizer) or sub.optimizer is None:
            continue
        for group in sub.optimizer.param_groups:
            for param in group["params"]:
                state = sub.optimizer.state[param]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(param)
                    state["exp_avg_sq"] = torch.zeros_like(param)
