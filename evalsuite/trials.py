"""A trial: one model load, then inference over one or more dataset shards.

`Trial` is a plain, serialisable description (pydantic). `run_trial(trial)` runs
it in the current thread; `python -m evalsuite.trials < trial.json` runs the same
function in a fresh process (what a process pool or a remote worker does, with
its own CUDA_VISIBLE_DEVICES). A shard whose output file is already complete is
skipped, so re-running a trial after a crash redoes only the unfinished shards.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel, Field

from evalsuite.datasets import DatasetRef, PromptCache
from evalsuite.errors import TrialError
from evalsuite.records import ShardWriter, read_completion, shard_output_path


class ShardSpec(BaseModel):
    dataset: DatasetRef
    shard: int
    start: int
    stop: int
    predicted_gpu_s: float = 0.0
    predicted_metric_s: float = 0.0

    @property
    def samples(self) -> int:
        return self.stop - self.start

    def output_path(self, output_dir: str | Path) -> Path:
        return shard_output_path(output_dir, self.dataset.name, self.shard)


class Trial(BaseModel):
    trial_id: str
    shards: list[ShardSpec]
    backend: str
    backend_options: dict = Field(default_factory=dict)
    model_path: str = ""           # a local folder (the node's preload), filled in at run time
    model_source: str = ""         # where it lives in storage: loaded from there when not preloaded
    output_dir: str
    prompt_cache_dir: str | None = None
    device: str | None = None      # e.g. "cuda:3": the slot's GPU (process isolation sets CUDA_VISIBLE_DEVICES)
    predicted_load_s: float = 0.0
    predicted_gpu_s: float = 0.0
    predicted_metric_s: float = 0.0

    @property
    def predicted_slot_s(self) -> float:
        return self.predicted_load_s + self.predicted_gpu_s


class ShardTiming(BaseModel):
    dataset: str
    shard: int
    samples: int
    seconds: float
    skipped: bool


class TrialResult(BaseModel):
    trial_id: str
    load_s: float
    shards: list[ShardTiming]
    total_s: float


def run_trial(trial: Trial, on_progress: Callable[[str, int], None] | None = None) -> TrialResult:
    """Run every shard of `trial`; complete shards are skipped (resume)."""
    from evalsuite.backends import load_backend

    started = time.perf_counter()
    todo = [s for s in trial.shards if read_completion(s.output_path(trial.output_dir)) is None]
    timings = [ShardTiming(dataset=s.dataset.name, shard=s.shard, samples=s.samples, seconds=0.0, skipped=True)
               for s in trial.shards if s not in todo]
    if not todo:
        return TrialResult(trial_id=trial.trial_id, load_s=0.0, shards=timings,
                           total_s=time.perf_counter() - started)
    scratch = None
    model_path = trial.model_path
    if model_path and not Path(model_path).is_dir() and trial.model_source:
        # A worker on another node: its precursor has not run here yet. preload() copies
        # once per node (locked), so the node's later trials find it in place.
        from evalsuite.preload import preload

        model_path = str(preload(trial.model_source, Path(model_path).parent))
    if not model_path:
        # No preload on this node: fetch from storage for this trial alone (the naive way).
        from evalsuite.preload import copy_from_storage

        scratch = Path(tempfile.mkdtemp(prefix=f"trial-{trial.trial_id}-"))
        copy_from_storage(trial.model_source, scratch)
        model_path = str(scratch)
    try:
        options = dict(trial.backend_options)
        if trial.device and "device" not in options:
            options["device"] = trial.device
        backend = load_backend(trial.backend, model_path, options)
        load_s = time.perf_counter() - started
        cache = PromptCache(trial.prompt_cache_dir) if trial.prompt_cache_dir else PromptCache()
        try:
            for spec in todo:
                t0 = time.perf_counter()
                dataset = spec.dataset.resolve()
                tokenizer = getattr(backend, "tokenizer", None) or _tokenizer(model_path)
                requests = dataset.tokenized_requests(tokenizer, spec.start, spec.stop, cache)
                writer = ShardWriter(spec.output_path(trial.output_dir), dataset.name, spec.shard, trial.backend)
                try:
                    backend.run_shard(dataset, requests, writer,
                                      on_progress=(lambda n, t=trial.trial_id: on_progress(t, n)) if on_progress else None)
                finally:
                    writer.close()
                timings.append(ShardTiming(dataset=dataset.name, shard=spec.shard, samples=spec.samples,
                                           seconds=time.perf_counter() - t0, skipped=False))
        finally:
            backend.close()
    except Exception as e:
        raise TrialError(f"trial {trial.trial_id} failed: {type(e).__name__}: {e}") from e
    finally:
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    return TrialResult(trial_id=trial.trial_id, load_s=load_s, shards=timings,
                       total_s=time.perf_counter() - started)


def _tokenizer(model_path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def run_trial_in_process(trial: Trial, timeout_s: float | None = None) -> TrialResult:
    """The same trial in a fresh interpreter (its own GPU via CUDA_VISIBLE_DEVICES)."""
    env = dict(os.environ)
    if trial.device and trial.device.startswith("cuda:"):
        env["CUDA_VISIBLE_DEVICES"] = trial.device.split(":", 1)[1]
        trial = trial.model_copy(update={"device": "cuda"})
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-m", "evalsuite.trials"], input=trial.model_dump_json(),
                          capture_output=True, text=True, env=env, timeout=timeout_s)
    if proc.returncode != 0:
        raise TrialError(f"trial {trial.trial_id} failed in its worker process (exit {proc.returncode}): "
                         f"{proc.stderr.strip()[-2000:]}")
    return TrialResult.model_validate_json(proc.stdout.strip().splitlines()[-1])


def _main() -> int:
    trial = Trial.model_validate_json(sys.stdin.read())
    result = run_trial(trial)
    print(json.dumps(result.model_dump()))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
