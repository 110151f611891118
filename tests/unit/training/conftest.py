"""Shared fixtures of the training unit tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def dist_env():
    """torch.distributed and megatron's groups as a world of one (no torchrun), torn down
    after the module unless something else had started them."""
    from training.model import init_distributed, shutdown_distributed

    owned = not torch.distributed.is_initialized()
    env = init_distributed(tensor_parallel=1)
    yield env
    if owned:
        shutdown_distributed()
