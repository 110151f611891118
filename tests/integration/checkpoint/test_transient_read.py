"""S3 failing while a job resumes: the checkpoint is kept, the attempt fails, the flow restarts.

A real S3 server (moto) behind botocore's own retries: reads of the newest shard fail with a
connection error until the retry deadline, as during an outage. The step must not be set
aside; the error every rank raises must be diagnosed as transient storage trouble whose
recovery is a restart (at once the first time, after a backoff on a repeat); once S3 answers, the same step loads.
"""

from __future__ import annotations

import pytest
import torch

from checkpoint.engine import CheckpointEngine, CheckpointStorageUnavailable
from checkpoint.manifest import committed_steps, shard_key
from diagnosis.api import diagnose_log
from diagnosis.recovery import Action, FailureRecord, RecoveryHistory, RecoveryPolicy, next_attempt
from infra.storage import open_storage


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 32, generator=g), "trainer": {"step": step}}


def test_s3_outage_while_resuming_keeps_the_checkpoint_and_is_a_transient_failure(
        moto_s3, tmp_path, monkeypatch):
    from botocore.exceptions import EndpointConnectionError

    monkeypatch.setenv("FORGEFLOW_STATE_DIR", str(tmp_path / "state"))
    # a node with no host copy of the shards (checkpoint.host_copy): every read goes to S3
    monkeypatch.setenv("FORGEFLOW_HOST_CHECKPOINT_DIR", "off")
    url = f"s3://{moto_s3.make_bucket()}/run"
    options = moto_s3.options(retry_deadline_s=1.0)
    with CheckpointEngine(url, storage_options=options, writer="thread", keep_last=5) as engine:
        engine.save(10, _state(10), blocking=True)
        engine.save(20, _state(20), blocking=True)

    newest_shard = shard_key(20, 0, 1)
    failed = []

    def outage(request, **_):
        if newest_shard in request.url:
            failed.append(request.url)
            raise EndpointConnectionError(endpoint_url=request.url)

    with CheckpointEngine(url, storage_options=options, writer="thread") as engine:
        engine.storage.client.meta.events.register("before-send.s3", outage)
        with pytest.raises(CheckpointStorageUnavailable) as raised:
            engine.load()
    assert failed  # botocore really tried (and retried) the read
    assert committed_steps(open_storage(url, options)) == [10, 20]  # nothing set aside

    # What the flow makes of the worker's traceback: transient storage trouble -> restart.
    log = tmp_path / "attempt-0.log"
    log.write_text("\n".join([
        "[rank0]: Traceback (most recent call last):",
        '[rank0]:   File "training/train.py", line 152, in train',
        "[rank0]:     state = checkpointer.load(resume_step, model, optimizer)",
        f"[rank0]: checkpoint.engine.CheckpointStorageUnavailable: {raised.value}",
    ]) + "\n")
    diagnosis = diagnose_log(log)
    assert (diagnosis.root_cause, diagnosis.restart_helps) == ("S3StorageError", True), diagnosis
    decided = next_attempt(diagnosis, 20, RecoveryHistory([FailureRecord(diagnosis.root_cause, 20)]),
                           RecoveryPolicy(backoff_s=2))
    assert decided.action is Action.RESTART and decided.backoff_s == 0  # the first time: at once

    # S3 is back: the next attempt resumes from the same step
    with CheckpointEngine(url, storage_options=options, writer="thread") as engine:
        loaded = engine.load()
    assert loaded.step == 20 and loaded.skipped_steps == []
    assert torch.equal(loaded.state["w"], _state(20)["w"])


@pytest.mark.parametrize("case", ["transient", "corrupt_and_transient"])
def test_ranks_agree_on_a_storage_error_and_on_a_damaged_shard(tmp_path, case):
    """No rank loads while another failed to read; a damaged shard on one rank still wins
    over another rank's storage error (the step is damaged whatever the storage does)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[3]
    url, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, PYTHONPATH=str(repo), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(Path(__file__).with_name("two_ranks_load.py")), str(url), case, str(out)],
        cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in (0, 1)]
    if case == "transient":
        for result in ranks:
            assert "step" not in result and "rank 1: StorageUnavailable" in result["error"], result
            assert result["committed"] == [10, 20]
    else:
        for result in ranks:
            assert (result.get("step"), result.get("skipped")) == (10, [20]), result
            assert result["committed"] == [10]
