"""The pretrain flow's checkpoint-committed announcements (the evaluate deployment's trigger),
over real commits: a checkpoint engine writes shards and manifests into a temp folder."""

from __future__ import annotations

import pytest
import torch

from checkpoint.engine import CheckpointEngine
from checkpoint.manifest import CheckpointRef, shard_key
from infra.storage import LocalStorage, StorageUnavailable
from tasks import checkpoint_events
from training.config import parse_job_spec


@pytest.fixture
def job(tmp_path):
    spec = parse_job_spec({
        "name": "job", "checkpoint": {"url": str(tmp_path / "ckpt"), "keep_last": 10},
        "model": {"num_layers": 1, "hidden_size": 8, "num_attention_heads": 1, "vocab_size": 16,
                  "seq_length": 4},
        "training": {"global_batch_size": 1, "steps": 1}})
    engine = CheckpointEngine(spec.checkpoint.url, writer="thread", keep_last=10)
    yield spec, engine
    engine.close()


def _commit(engine: CheckpointEngine, step: int) -> None:
    engine.save(step, {"w": torch.full((4,), float(step))}, blocking=True)


def test_announces_each_new_commit_once_and_not_the_ones_before_it_started(job, monkeypatch):
    spec, engine = job
    emitted = []
    monkeypatch.setattr(checkpoint_events, "emit_checkpoint_committed",
                        lambda ref, spec: emitted.append((ref, spec)))
    _commit(engine, 10)  # from an earlier run of the job
    announcer = checkpoint_events.CommitAnnouncer(spec, every_s=3600)

    assert announcer.poll(force=True) == [] and emitted == []
    _commit(engine, 20)
    # A persist that crashed before its manifest is not a checkpoint: never announced.
    engine.storage.put_bytes(shard_key(25, 0, 1), b"half a shard")
    _commit(engine, 30)
    assert announcer.poll() == []  # throttled: storage is listed at most every `every_s`
    assert announcer.poll(force=True) == [20, 30]
    assert announcer.poll(force=True) == []
    root = spec.checkpoint.url   # absolute: the reference means the same in any process
    assert emitted == [(CheckpointRef(root, 20), spec), (CheckpointRef(root, 30), spec)]
    assert emitted[0][0].step_url == f"{root}/step-00000020" and emitted[0][0].format == "sharded"


def test_a_storage_error_is_retried_on_the_next_poll(job, monkeypatch):
    spec, engine = job
    emitted = []
    monkeypatch.setattr(checkpoint_events, "emit_checkpoint_committed", lambda ref, spec: emitted.append(ref.step_url))
    announcer = checkpoint_events.CommitAnnouncer(spec)
    _commit(engine, 10)
    real_list = LocalStorage.list

    def down(self, prefix=""):
        raise StorageUnavailable("storage down", self.url())

    monkeypatch.setattr(LocalStorage, "list", down)
    assert announcer.poll(force=True) == []  # the outage costs nothing
    monkeypatch.setattr(LocalStorage, "list", real_list)
    assert announcer.poll(force=True) == [10] and emitted[0].endswith("/step-00000010")


def test_on_commit_gets_the_newest_new_commit_and_its_time(job, monkeypatch):
    """What the flow records as the job's progress (`ProgressReport.committed`): the work a
    preemption would lose is the work since this commit (scheduler/preemption.py)."""
    spec, engine = job
    monkeypatch.setattr(checkpoint_events, "emit_checkpoint_committed", lambda ref, spec: None)
    seen = []
    announcer = checkpoint_events.CommitAnnouncer(spec, every_s=3600, on_commit=lambda s, t: seen.append((s, t)))
    _commit(engine, 10)
    _commit(engine, 20)
    assert announcer.poll(force=True) == [10, 20]
    assert [s for s, _ in seen] == [20] and seen[0][1] > 0
    assert announcer.poll(force=True) == [] and len(seen) == 1  # nothing new: not called
