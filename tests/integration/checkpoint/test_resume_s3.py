"""Bit-exact resume through the checkpoint engine and a real S3 server, under torchrun.

Two gloo ranks train a tiny megatron GPT for 30 steps, checkpointing every 10 to
SeaweedFS. Run A is never interrupted. Run B's rank 1 dies (os._exit, the
exit_mid_checkpoint fault) while the step-20 checkpoint is being persisted; the
same command then resumes it — from step 10, because step 20 never committed — to
step 30. Losses of every step and the final weights and optimizer state must be
identical to run A's.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from testing.local_s3 import ACCESS_KEY, SECRET_KEY
from training.cli import torchrun_command

REPO = Path(__file__).resolve().parents[3]

TINY_JOB = {
    "name": "ckpt-resume",
    "model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
              "ffn_hidden_size": 128, "vocab_size": 512, "seq_length": 64},
    "training": {"global_batch_size": 8, "micro_batch_size": 2, "steps": 30, "lr": 1.0e-3,
                 "min_lr": 1.0e-4, "warmup_steps": 2, "seed": 1234, "torch_threads": 1},
    "data": {"corpus": ["stdlib"], "max_corpus_mb": 1.0, "val_fraction": 0.05},
    "checkpoint": {"interval": 10, "keep_last": 5, "async_save": True},
}


@pytest.fixture(scope="module")
def prepared_job(tmp_path_factory) -> dict:
    from training.config import parse_job_spec
    from training.data import prepare_data

    job = copy.deepcopy(TINY_JOB)
    job["data"]["data_dir"] = str(tmp_path_factory.mktemp("ckpt-data"))
    job["checkpoint"]["url"] = str(tmp_path_factory.mktemp("unused"))
    prepare_data(parse_job_spec(copy.deepcopy(job)), progress=False)
    return job


def _write_job(job: dict, tmp_path: Path, name: str, url: str, endpoint: str) -> tuple[Path, Path]:
    job = copy.deepcopy(job)
    run_dir = tmp_path / name
    job["run_dir"] = str(run_dir)
    # No save at a peer's failure: rank 0 would commit the step it reached when rank 1 died
    # mid-persist (training/checkpointing.py; test_worker covers it), and these tests are about
    # what the commit protocol leaves behind such a death.
    job["checkpoint"].update(url=url, endpoint_url=endpoint, region="us-east-1", save_on_failure=False)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job))
    return path, run_dir


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1",
               AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
    env.pop("FORGEFLOW_FAULT", None)
    env.update(extra)
    return env


def _torchrun(config: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(torchrun_command(str(config), 2, []),  # as `forgeflow train` starts it
        cwd=REPO, env=env, capture_output=True, text=True, timeout=400)


def _final_shards(url: str, options, step: int) -> list[dict]:
    from checkpoint.manifest import read_manifest
    from checkpoint.shard import read_shard
    from infra.storage import open_storage

    storage = open_storage(url, options)
    manifest = read_manifest(storage, step)
    return [read_shard(storage.get_bytes(s.key))[1] for s in manifest.shards]


def _tensors(tree, prefix=""):
    if isinstance(tree, torch.Tensor):
        yield prefix, tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from _tensors(v, f"{prefix}/{k}")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _tensors(v, f"{prefix}/{i}")


def test_kill_mid_persist_and_resume_from_s3_is_bit_exact(seaweed, prepared_job, tmp_path):
    from checkpoint.manifest import committed_steps
    from infra.storage import open_storage
    from infra.runfiles import log_path
    from training.runlog import read_steps

    bucket = seaweed.make_bucket()
    options = seaweed.options()
    url_a, url_b = f"s3://{bucket}/straight", f"s3://{bucket}/killed"
    config_a, run_a = _write_job(prepared_job, tmp_path, "straight", url_a, seaweed.endpoint)
    config_b, run_b = _write_job(prepared_job, tmp_path, "killed", url_b, seaweed.endpoint)

    straight = _torchrun(config_a, _env())
    assert straight.returncode == 0, straight.stderr[-4000:]

    killed = _torchrun(config_b, _env(FORGEFLOW_FAULT="exit_mid_checkpoint@20:1"))
    assert killed.returncode != 0, "the injected fault did not fire"
    assert committed_steps(open_storage(url_b, options)) == [10]  # step 20 never committed

    resumed = _torchrun(config_b, _env())
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "event=resumed step=10" in log_path(run_b, 0).read_text()

    for rank in (0, 1):
        losses_a = [(r.step, r.loss) for r in read_steps(log_path(run_a, rank))]
        losses_b = [(r.step, r.loss) for r in read_steps(log_path(run_b, rank))]
        assert len(losses_a) == 30 and losses_a == losses_b

    final_a, final_b = _final_shards(url_a, options, 30), _final_shards(url_b, options, 30)
    for rank, (a, b) in enumerate(zip(final_a, final_b)):
        # Each rank's share of the global pieces (weights, Adam moments): key -> tensor.
        tensors_a = {f"{p['key']}@{p['global_offset']}": p["data"] for p in a["pieces"]
                     if not p["object"]}
        tensors_b = {f"{p['key']}@{p['global_offset']}": p["data"] for p in b["pieces"]
                     if not p["object"]}
        assert tensors_a.keys() == tensors_b.keys() and len(tensors_a) > 10
        assert any(k.startswith("optimizer.") for k in tensors_a)
        different = [k for k in tensors_a if not torch.equal(tensors_a[k], tensors_b[k])]
        assert not different, f"rank {rank}: {different[:5]}"
        assert dict(_tensors(a["local"])).keys() == dict(_tensors(b["local"])).keys()


def test_worker_with_bad_credentials_stops_before_any_step(seaweed, prepared_job, tmp_path):
    from infra.runfiles import log_path

    config, run_dir = _write_job(prepared_job, tmp_path, "badcreds",
                                 f"s3://{seaweed.make_bucket()}/run", seaweed.endpoint)
    proc = subprocess.run([sys.executable, "-m", "training.train", str(config)], cwd=REPO,
                          env=_env(AWS_SECRET_ACCESS_KEY="not-the-secret"), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "InvalidCredentials" in last and "AWS_ACCESS_KEY_ID" in last
    assert "Traceback" not in proc.stderr
    log = log_path(run_dir, 0)
    assert not log.exists() or " step=" not in log.read_text()
