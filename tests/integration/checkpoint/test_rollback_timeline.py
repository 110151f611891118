"""A spike rollback abandons the post-spike timeline for good, on a local disk and on S3.

The pretrain flow's sequence without torchrun: the checkpoint engine commits the spike's
timeline, the decision table (diagnosis.recovery.next_attempt) rolls back, the flow sets
aside what the rollback abandons (checkpoint.manifest.set_aside_after), the rollback's
attempt fails before its first checkpoint, and the next attempt — a plain restart from
"the newest committed checkpoint" — must resume on the rollback's timeline and keep
skipping the spike's batches.
"""

from __future__ import annotations

import pytest
import torch

from checkpoint.engine import CheckpointEngine
from checkpoint.manifest import committed_steps, read_latest, set_aside_after, set_aside_key
from diagnosis.recovery import (
    Action,
    AttemptOverrides,
    FailureRecord,
    RecoveryHistory,
    RecoveryPolicy,
    next_attempt,
)
from diagnosis.vocabulary import Diagnosis
from infra.storage import open_storage


def _state(step: int, timeline: str) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 32, generator=g), "trainer": {"step": step, "timeline": timeline}}


@pytest.fixture(params=["local", "s3"])
def where(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "ckpt"), None
    moto_s3 = request.getfixturevalue("moto_s3")
    return f"s3://{moto_s3.make_bucket()}/run", moto_s3.options()


def test_a_restart_after_a_rollback_resumes_on_the_rollbacks_timeline(where):
    url, options = where
    engine_args = dict(writer="thread", keep_last=10, storage_options=options)
    # attempt 0: the loss spikes from step 9 on, confirmed at step 11; 10 was committed meanwhile
    with CheckpointEngine(url, **engine_args) as engine:
        for step in (2, 4, 6, 8, 10):
            engine.save(step, _state(step, "spike"), blocking=True)

    def listed():
        return committed_steps(open_storage(url, options))

    policy = RecoveryPolicy(skip_batches=3)
    history = RecoveryHistory([FailureRecord("LossSpike", 11)])
    rollback = next_attempt(Diagnosis("LossSpike", "training", True), 11, history, policy,
                            committed_steps=listed, spike_onset_step=9)
    assert (rollback.action, rollback.resume_from, rollback.set_aside_after) == (Action.ROLLBACK, 8, 8)
    # what flows/pretrain.py does before relaunching (twice: a retry after a crash is harmless)
    assert set_aside_after(url, rollback.set_aside_after, "rollback", options) == [10]
    assert set_aside_after(url, rollback.set_aside_after, "rollback", options) == []
    history.rollback = rollback.rollback
    history.restarts += 1
    assert listed() == [2, 4, 6, 8] and read_latest(url, options).step == 8
    assert open_storage(url, options).exists(set_aside_key(10))  # a note, and the shards stay
    assert open_storage(url, options).list("step-00000010/rank-")

    # attempt 1 (the rollback) loads step 8 and fails (a CUDA error at step 9) before step 10
    with CheckpointEngine(url, **engine_args) as engine:
        assert engine.load(step=rollback.resume_from).state["trainer"]["step"] == 8
    history.failures.append(FailureRecord("CUDAError", 9))
    restart = next_attempt(Diagnosis("CUDAError", "infrastructure", True, suspect_nodes=["n1"]), 9,
                           history, policy, committed_steps=listed)
    assert restart.action is Action.NODE_CHECK_RESTART
    assert restart.resume_from is None  # "the newest committed" ...
    with CheckpointEngine(url, **engine_args) as engine:
        assert engine.load().step == 8  # ... is the rollback's, not the spike's step 10
    assert restart.overrides == AttemptOverrides(skip_batches=3, skip_from_step=9)  # still skipped
    history.rollback = restart.rollback
    history.restarts += 1

    # attempt 2 commits step 10 of the rollback's timeline (into the folder set aside before)
    with CheckpointEngine(url, **engine_args) as engine:
        engine.save(10, _state(10, "rollback"), blocking=True)
    assert listed() == [2, 4, 6, 8, 10] and read_latest(url, options).step == 10
    assert not open_storage(url, options).exists(set_aside_key(10))
    with CheckpointEngine(url, **engine_args) as engine:
        assert engine.load().state["trainer"] == {"step": 10, "timeline": "rollback"}
    # ... and fails later: its own checkpoint records the skip, the arguments no longer do
    history.failures.append(FailureRecord("CUDAError", 11))
    later = next_attempt(Diagnosis("CUDAError", "infrastructure", True), 11, history, policy,
                         committed_steps=listed)
    assert later.overrides == AttemptOverrides() and later.rollback is None
