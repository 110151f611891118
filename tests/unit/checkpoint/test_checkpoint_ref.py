"""The typed checkpoint reference end to end at the checkpoint layer: it round-trips, `locate`
finds it with one listing, and `read_checkpoint` opens it read-only: one manifest read, no
listing, no writer process or thread. Real commits by the engine into a temp folder; reads are
counted by a real local storage that counts what it is asked."""

from __future__ import annotations

import json
import os
import threading
from collections import Counter

import pytest
import torch

from checkpoint.engine import CheckpointEngine, CheckpointError, read_checkpoint
from checkpoint.manifest import (
    CheckpointRef,
    committed_checkpoints,
    locate,
    manifest_key,
    set_aside,
)
from checkpoint.sharded import GlobalPiece, PieceRequest
from infra.storage import LocalStorage, StorageOptions


class CountingStorage(LocalStorage):
    """A local storage that counts its reads and listings (and reads like any other)."""

    def __init__(self, root_url: str):
        super().__init__(root_url, StorageOptions())
        self.reads: Counter[str] = Counter()
        self.listings = 0

    def get_bytes(self, key: str) -> bytes:
        self.reads[key] += 1
        return super().get_bytes(key)

    def list(self, prefix: str = ""):
        self.listings += 1
        return super().list(prefix)


def _commit(url: str, *steps: int) -> None:
    weight = torch.arange(32, dtype=torch.float32).reshape(8, 4)
    with CheckpointEngine(url, writer="thread", keep_last=10) as engine:
        for step in steps:
            engine.save(step, {"rng": step}, pieces=[GlobalPiece("w", (8, 4), (0, 0), weight + step)],
                        common={"trainer": {"step": step}}, blocking=True)


def _children(pid: int) -> set[int]:
    """This process's child processes, from /proc (a writer process would be one)."""
    found = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            found |= {int(p) for p in f.read().split()}
    return found


def test_the_reference_round_trips_and_refuses_what_it_cannot_be():
    ref = CheckpointRef("s3://bucket/job/checkpoints", 40)
    assert ref.format == "sharded" and ref.name == "step-00000040"
    assert ref.step_url == "s3://bucket/job/checkpoints/step-00000040"
    assert CheckpointRef.from_dict(json.loads(json.dumps(ref.to_dict()))) == ref  # as an event payload
    assert CheckpointRef.from_dict(ref) is ref
    with pytest.raises(ValueError, match="expected an object with url, step"):
        CheckpointRef.from_dict({"url": "s3://b/c"})
    with pytest.raises(ValueError, match="expected an object with url, step"):
        CheckpointRef.from_dict({"url": "s3://b/c", "step": 1, "path": "x"})
    with pytest.raises(ValueError, match="step must be a whole number"):
        CheckpointRef("s3://b/c", -1)
    with pytest.raises(ValueError, match="format 'torch' is not one this forgeflow reads; use one of sharded"):
        CheckpointRef("s3://b/c", 1, "torch")


def test_locate_a_step_or_a_root_with_one_listing(tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    _commit(str(root), 10, 20, 30)
    newest = locate(str(root))
    assert newest == CheckpointRef(str(root), 30)
    assert locate(f"{root}/step-00000020/") == CheckpointRef(str(root), 20)
    assert [r.ref for r in committed_checkpoints(str(root))] == [CheckpointRef(str(root), s) for s in (10, 20, 30)]
    # A relative root is located as an absolute path: the reference means the same elsewhere.
    monkeypatch.chdir(tmp_path)
    assert locate("ckpt/step-00000010") == CheckpointRef(str(root), 10)
    # What does not count as a checkpoint is not located.
    set_aside(LocalStorage(str(root), StorageOptions()), 20, "damaged")
    assert locate(f"{root}/step-00000020") is None
    assert locate(str(tmp_path / "nothing")) is None


def test_reading_a_reference_reads_its_manifest_once_and_starts_no_writer(tmp_path):
    root = str(tmp_path / "ckpt")
    _commit(root, 10, 20)
    storage = CountingStorage(root)
    threads_before, children_before = set(threading.enumerate()), _children(os.getpid())

    loaded = read_checkpoint(storage, 20, [PieceRequest("w", (8, 4), (0, 0), (8, 4), torch.float32)])

    assert set(threading.enumerate()) == threads_before            # no persist or writer thread
    assert _children(os.getpid()) == children_before               # no writer process
    assert torch.equal(loaded.pieces[0], torch.arange(32, dtype=torch.float32).reshape(8, 4) + 20)
    assert loaded.common == {"trainer": {"step": 20}} and loaded.state is None  # a reader gets no rank state
    assert storage.reads[manifest_key(20)] == 1 and storage.listings == 0     # located already: no listing
    assert sum(storage.reads.values()) == 2                                   # the manifest and one shard
    assert not [p for p in (tmp_path / "ckpt" / "step-00000020").iterdir() if p.name.startswith("lease-")]


def test_a_refused_or_damaged_reference_is_one_error_and_no_shard_is_read(tmp_path):
    root = str(tmp_path / "ckpt")
    _commit(root, 10)
    storage = CountingStorage(root)
    with pytest.raises(CheckpointError, match=r"step-00000010: cannot be loaded as asked: trained at step 10"):
        read_checkpoint(storage, 10, accept=lambda manifest, common: f"trained at step {common['trainer']['step']}")
    assert list(storage.reads) == [manifest_key(10)]
    with pytest.raises(CheckpointError, match=r"step-00000099: is damaged \(failed verification\): manifest unreadable"):
        read_checkpoint(storage, 99)
