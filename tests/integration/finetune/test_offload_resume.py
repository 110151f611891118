"""A killed offloaded fine-tune resumes from its last committed checkpoint and ends where an
uninterrupted run ends: 2 torchrun workers x 3 stages, SIGKILLed (the whole process group)
once a checkpoint has committed, then started again on the same run directory. The loss
trajectory (restored steps + resumed ones) equals fine-tuning without offload within 1e-5,
as in test_offload_executor.py."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time

import psutil
import pytest
from test_offload_executor import LOSS_TOLERANCE, make_tiny_llama

from training.offload.executor import (
    DataSource, OffloadRunConfig, checkpoint_root, committed_checkpoint, train_without_offload,
)
from training.offload.launch import run_local, torchrun_command


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


@pytest.mark.slow  # two torchrun launches of 2 workers (~40 s on a quiet 2-core box)
def test_a_killed_finetune_resumes_from_its_last_committed_checkpoint(tmp_path):
    make_tiny_llama(tmp_path / "model", layers=4, hidden=64)
    cfg = OffloadRunConfig(model_dir=str(tmp_path / "model"), stages=[(0, 2), (2, 4), (4, 6)], steps=24,
                           microbatches=2, seq_length=8, lr=1e-3, out_dir=str(tmp_path / "run"),
                           data=DataSource(distinct_batches=2), checkpoint_every=4)
    out = tmp_path / "run"
    out.mkdir()
    (out / "run.json").write_text(cfg.model_dump_json())
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with open(out / "killed.log", "w") as log:
        proc = subprocess.Popen(torchrun_command(out / "run.json", 2), stdout=log, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not list(checkpoint_root(cfg).glob("step-*/COMMITTED")):
            assert proc.poll() is None, (out / "killed.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint committed in 300 s"
            time.sleep(0.01)
    finally:
        # torchrun and both workers, mid-run (torchrun starts each worker in its own session,
        # so killing its process group alone would leave them running)
        victims = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
        psutil.wait_procs([p for p in map(_process, victims) if p is not None], timeout=30)
    assert not (out / "model").exists(), "the run finished before it was killed: the test proved nothing"
    # what the finetune flow looks up to resume with the checkpoint's partition
    record = committed_checkpoint(out, cfg.model_dir, world=2)
    assert record["stages"] == [[0, 2], [2, 4], [4, 6]] and record["step"] % 4 == 0
    assert committed_checkpoint(out, cfg.model_dir, world=3) is None

    reports = run_local(cfg, workers=2)
    resumed = reports[0]["resumed_from_step"]
    assert resumed > 0 and resumed % 4 == 0 and all(r["resumed_from_step"] == resumed for r in reports)
    assert len(reports[0]["step_times_s"]) == 24 - resumed  # only the steps after the checkpoint ran again
    reference = train_without_offload(cfg)
    diffs = [abs(a - b) for a, b in zip(reports[0]["losses"], reference)]
    assert len(diffs) == 24 and max(diffs) < LOSS_TOLERANCE, diffs
    assert not checkpoint_root(cfg).exists()  # finished: the resume state is gone
    assert (out / "model" / "model.safetensors").is_file()
