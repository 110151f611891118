"""Shard format and host snapshot buffers: round trips, reuse, corruption, part cutting."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from checkpoint.shard import (
    HostBuffers,
    ShardFormatError,
    read_shard,
    split_state,
    take_snapshot,
)
from infra.storage import iter_parts


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(64, 32, generator=g)
    return {
        "model": {"w": weight, "w_t": weight.t(), "b": torch.randn(7, generator=g).to(torch.bfloat16)},
        "optimizer": {"state": {0: {"exp_avg": torch.randn(64, 32, generator=g), "step": torch.tensor(5.0)}},
                      "param_groups": [{"lr": 1e-3, "params": [0]}]},
        "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                "python": random.getstate()},
        "trainer": {"step": 12, "consumed": [3, (4, 5)], "ids": torch.arange(5, dtype=torch.int64)},
        "empty": torch.empty(0, 3),
        "tied": weight,  # the same tensor object reachable twice
    }


def _bytes(snapshot) -> bytes:
    return b"".join(bytes(c) for c in snapshot.chunks())


def test_round_trip_preserves_every_value_dtype_and_layout():
    state = _state()
    buffers = HostBuffers()
    data = _bytes(take_snapshot(12, state, buffers))
    step, back = read_shard(data)
    assert step == 12
    assert torch.equal(back["model"]["w"], state["model"]["w"])
    assert torch.equal(back["model"]["w_t"], state["model"]["w_t"])  # non-contiguous source
    assert back["model"]["b"].dtype == torch.bfloat16 and torch.equal(back["model"]["b"], state["model"]["b"])
    assert torch.equal(back["optimizer"]["state"][0]["exp_avg"], state["optimizer"]["state"][0]["exp_avg"])
    assert back["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
    assert torch.equal(back["rng"]["torch"], state["rng"]["torch"])
    assert back["rng"]["python"] == state["rng"]["python"]
    assert np.array_equal(back["rng"]["numpy"][1], state["rng"]["numpy"][1])
    assert back["trainer"]["consumed"] == [3, (4, 5)]
    assert back["empty"].shape == (0, 3)
    assert back["tied"] is back["model"]["w"]  # stored once, shared again on load


def test_snapshot_is_a_copy_training_may_change_state_right_after():
    state = _state()
    expected = state["model"]["w"].clone()
    buffers = HostBuffers()
    snapshot = take_snapshot(1, state, buffers)
    state["model"]["w"].add_(1.0)  # the next optimizer step
    _, back = read_shard(_bytes(snapshot))
    assert torch.equal(back["model"]["w"], expected)


def test_buffers_are_allocated_once_and_reused():
    buffers = HostBuffers()
    for step in range(4):
        take_snapshot(step, _state(step), buffers)
    dtypes = {t.dtype for t in split_state(_state())[1]}
    assert buffers.allocations == len(dtypes)  # one flat buffer per dtype, never regrown
    before = buffers.total_bytes()
    take_snapshot(9, _state(9), buffers)
    assert buffers.total_bytes() == before


def test_shared_buffers_round_trip_and_release():
    buffers = HostBuffers(shared=True, pin=False)
    snapshot = take_snapshot(3, _state(), buffers)
    names = [p["shm"] for p in snapshot.pieces() if "shm" in p]
    assert names and all(n for n in names)
    _, back = read_shard(_bytes(snapshot))
    assert torch.equal(back["model"]["w"], _state()["model"]["w"])
    del snapshot
    buffers.close()
    from multiprocessing import shared_memory

    for name in names:
        with pytest.raises(FileNotFoundError):
            shared_memory.SharedMemory(name=name)


@pytest.mark.parametrize("damage", ["truncate", "magic", "header"])
def test_damaged_shards_are_refused(damage):
    data = bytearray(_bytes(take_snapshot(1, _state(), HostBuffers())))
    if damage == "truncate":
        data = data[:-10]
    elif damage == "magic":
        data[0] ^= 0xFF
    else:
        data[20] = ord("}")
    with pytest.raises(ShardFormatError):
        read_shard(bytes(data))


def test_iter_parts_cuts_exact_parts_and_keeps_views_inside_chunks():
    chunks = [b"a" * 3, memoryview(bytearray(b"b" * 25)), b"c" * 4]
    parts = list(iter_parts(chunks, 10))
    assert [len(p) for p in parts] == [10, 10, 10, 2]
    assert b"".join(bytes(p) for p in parts) == b"".join(bytes(c) for c in chunks)
    big = memoryview(bytearray(100))
    inner = list(iter_parts([big], 40))
    assert all(isinstance(p, memoryview) for p in inner)  # no copies within one chunk
