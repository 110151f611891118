"""save(overlap=True): the host copy runs while the next step computes, and still holds the
saved step bit for bit; a copy that fails never becomes a checkpoint."""

from __future__ import annotations

import pytest
import torch

from checkpoint.engine import CheckpointEngine
from checkpoint.manifest import committed_steps, shard_key
from checkpoint.shard import HostBuffers, SnapshotCopyError, take_snapshot
from infra.storage import open_storage


def _state(step: int, numel: int = 4 << 20) -> dict:
    g = torch.Generator().manual_seed(step)
    weight = torch.randn(numel, generator=g)
    return {"model": {"w": weight, "b": torch.randn(33, generator=g).to(torch.bfloat16)},
            "optimizer": {"exp_avg": torch.randn(numel, generator=g), "step": torch.tensor(float(step))},
            "trainer": {"step": step}}


def _next_update(state: dict) -> None:
    """What the next optimizer step does: change every saved tensor in place."""
    state["model"]["w"].add_(1.0)
    state["model"]["b"].mul_(2)
    state["optimizer"]["exp_avg"].mul_(0.9)
    state["optimizer"]["step"].add_(1)


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_overlapped_copy_is_bit_identical_to_a_synchronous_snapshot_of_the_step(tmp_path, writer):
    state = _state(7)
    with CheckpointEngine(str(tmp_path / "sync"), writer="thread", async_save=False) as sync_engine:
        sync_engine.save(7, state)  # the reference: copied inside save(), then persisted
    overlapped_url = str(tmp_path / "overlap")
    with CheckpointEngine(overlapped_url, writer=writer) as engine:
        outcome = engine.save(7, state, overlap=True)
        assert outcome.started and outcome.overlap and outcome.snapshot_s == 0.0
        forward = sum(t.float().sum() for t in (state["model"]["w"], state["model"]["b"]))  # reads only
        waited = engine.wait_snapshot()  # the loop's call right before the optimizer step
        assert not engine.copying and outcome.copy_wait_s == waited >= 0.0
        _next_update(state)  # the next step ran on while the persist goes on
        assert engine.wait().committed
        loaded = engine.load()
    reference = open_storage(str(tmp_path / "sync")).get_bytes(shard_key(7, 0, 1))
    assert open_storage(overlapped_url).get_bytes(shard_key(7, 0, 1)) == reference
    expected = _state(7)
    assert torch.equal(loaded.state["model"]["w"], expected["model"]["w"])
    assert torch.equal(loaded.state["optimizer"]["exp_avg"], expected["optimizer"]["exp_avg"])
    assert not torch.equal(loaded.state["model"]["w"], state["model"]["w"])  # the update happened
    assert torch.isfinite(forward)


def test_deferred_snapshot_is_not_persistable_until_copied():
    state = _state(3, numel=1024)
    buffers = HostBuffers()
    snapshot = take_snapshot(3, state, buffers, defer_copy=True)
    assert not snapshot.copied and snapshot.pending
    with pytest.raises(SnapshotCopyError, match="has not run"):
        snapshot.chunks()
    snapshot.copy()
    assert snapshot.copied and not snapshot.pending  # sources released once copied
    assert len(b"".join(bytes(c) for c in snapshot.chunks())) == snapshot.nbytes


def test_a_failed_overlapped_copy_commits_nothing_and_the_next_save_does(tmp_path, caplog):
    url = str(tmp_path / "ckpt")
    with CheckpointEngine(url, writer="thread") as engine:
        engine.save(10, _state(10, numel=1024), overlap=True)
        engine.wait_snapshot()
        assert engine.wait().committed
        broken = _state(20, numel=1024)
        broken["optimizer"]["ghost"] = torch.empty(256, device="meta")  # has no data to copy
        assert engine.save(20, broken, overlap=True).started  # the copy fails later, not here
        engine.wait_snapshot()  # returns: the failure is the persist's to report
        report = engine.wait()
        assert not report.committed and "host copy failed" in report.error
        assert committed_steps(open_storage(url)) == [10]
        assert not open_storage(url).exists(shard_key(20, 0, 1))  # not a byte of step 20 written
        assert engine.load().step == 10
        engine.save(30, _state(30, numel=1024), overlap=True)
        engine.wait_snapshot()
        assert engine.wait().committed
    assert committed_steps(open_storage(url)) == [10, 30]
    assert "step 20 NOT committed" in caplog.text
