"""Real transformers inference on CPU with a tiny model; resume after a killed trial."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from evalsuite.datasets import DatasetRef, get_dataset
from evalsuite.metrics import MetricJob, aggregate_dataset, run_metric_job
from evalsuite.records import GenerationRecord, LoglikelihoodRecord, ShardWriter, read_completion, read_records
from evalsuite.trials import ShardSpec, Trial, run_trial

REPO = Path(__file__).resolve().parents[3]


def test_generation_and_loglikelihood_records(tiny_backend, tmp_path):
    gen_ds = get_dataset("arith-em", {"limit": 5})
    writer = ShardWriter(tmp_path / "gen.jsonl", gen_ds.name, 0, "transformers")
    done = tiny_backend.run_shard(gen_ds, gen_ds.tokenized_requests(tiny_backend.tokenizer), writer)
    records = read_records(writer.path)
    assert done.records == 5 and [r.sample_index for r in records] == list(range(5))
    assert all(isinstance(r, GenerationRecord) and "\n" not in r.outputs[0] for r in records)

    # Greedy decoding is deterministic: same prompt, same text.
    prompt = gen_ds.tokenized_requests(tiny_backend.tokenizer)[0].prompt_ids
    a = tiny_backend.generate([prompt], gen_ds.generation)
    b = tiny_backend.generate([prompt, prompt[:3]], gen_ds.generation)
    assert a[0] == b[0]

    mc = get_dataset("capitals-mc", {"limit": 2})
    writer = ShardWriter(tmp_path / "mc.jsonl", mc.name, 0, "transformers")
    tiny_backend.run_shard(mc, mc.tokenized_requests(tiny_backend.tokenizer), writer)
    lls = read_records(writer.path)
    assert len(lls) == 8 and all(isinstance(r, LoglikelihoodRecord) and r.logprob < 0 for r in lls)
    # A batched log-likelihood equals the one computed alone (padding does not leak).
    reqs = mc.tokenized_requests(tiny_backend.tokenizer)
    alone = tiny_backend.loglikelihood([(reqs[3].context_ids, reqs[3].continuation_ids)])[0][0]
    assert math.isclose(alone, lls[3].logprob, rel_tol=1e-4, abs_tol=1e-4)


def test_perplexity_end_to_end(tiny_model, tiny_backend, tmp_path):
    ref = DatasetRef(name="perplexity", options={"data_dir": str(tiny_model / "data"), "max_windows": 4, "seq_len": 64})
    ds = ref.resolve()
    writer = ShardWriter(tmp_path / "ppl.jsonl", ds.name, 0, "transformers")
    tiny_backend.run_shard(ds, ds.tokenized_requests(tiny_backend.tokenizer), writer)
    score = run_metric_job(MetricJob(dataset=ref, shard=0, output_path=str(writer.path),
                                     score_path=str(tmp_path / "ppl-score.json")))
    result = aggregate_dataset(ds, [score])
    assert result["tokens"] == 4 * 63
    # A random model is close to uniform over its vocabulary.
    vocab = len(tiny_backend.tokenizer)
    assert vocab / 4 < result["perplexity"] < vocab * 4


def _trial(tiny_model: Path, out: Path, limit: int) -> Trial:
    ref = DatasetRef(name="humaneval", options={"limit": limit, "max_new_tokens": 32})
    shards = [ShardSpec(dataset=ref, shard=0, start=0, stop=2), ShardSpec(dataset=ref, shard=1, start=2, stop=limit)]
    return Trial(trial_id="resume", shards=shards, backend="transformers",
                 backend_options={"batch_size": 1, "device": "cpu"}, model_path=str(tiny_model),
                 output_dir=str(out))


@pytest.mark.slow  # ~20 s on 2 cores: trials in processes, one killed and resumed
def test_resume_after_killed_trial(tiny_model, tmp_path):
    trial = _trial(tiny_model, tmp_path / "out", limit=10)
    first, second = (s.output_path(trial.output_dir) for s in trial.shards)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-m", "evalsuite.trials"], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, text=True)
    proc.stdin.write(trial.model_dump_json())
    proc.stdin.close()
    try:
        deadline = time.time() + 120
        # Kill once the first shard is complete and the second has started.
        while not (read_completion(first) and second.is_file() and second.stat().st_size > 0):
            assert proc.poll() is None, "the trial ended before it could be killed"
            assert time.time() < deadline
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert read_completion(first) is not None and read_completion(second) is None
    first_bytes = first.read_bytes()

    result = run_trial(trial)
    skipped = {t.shard: t.skipped for t in result.shards}
    assert skipped == {0: True, 1: False}
    assert first.read_bytes() == first_bytes                 # not redone
    done = read_completion(second)
    assert done is not None and done.records == 8          # redone whole, once
    assert [r.sample_index for r in read_records(second)] == list(range(2, 10))

    again = run_trial(trial)                                 # everything complete: nothing to do
    assert all(t.skipped for t in again.shards) and again.load_s == 0.0
