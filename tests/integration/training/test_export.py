"""HF export: a real megatron checkpoint -> LlamaForCausalLM with the same logits.

Tolerance: fp32 on CPU, max |logit difference| < 1e-4 (observed ~1e-6; the two
implementations differ only in the order of floating-point operations).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from training.config import parse_job_spec

TOLERANCE = 1e-4


@pytest.fixture
def world():
    from training.model import init_distributed, shutdown_distributed

    env = init_distributed(1)
    yield env
    shutdown_distributed()


def _randomise(model, seed: int = 0) -> None:
    """Weights far from init (norms != 1, larger matrices) so a wrong mapping shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))


def _sample_tokens(prepared, n: int, seq: int) -> torch.Tensor:
    import numpy as np

    tokens = np.memmap(prepared.val_path, dtype=prepared.dtype, mode="r")
    return torch.from_numpy(np.array(tokens[: n * seq], dtype=np.int64)).reshape(n, seq)


def _save_checkpoint(spec, env, root: Path, step: int, model, optimizer) -> None:
    """A checkpoint written by the worker's own checkpointer."""
    from training.checkpointing import Checkpointer

    cfg = spec.checkpoint.model_copy(update={"url": str(root), "async_save": False})
    # Persisted inline by a writer thread (no writer process to start: faster test).
    checkpointer = Checkpointer(cfg, env, writer="thread")
    checkpointer.save(step, model, optimizer, {"world_size": env.world_size,
                                               "config_hash": spec.config_hash(),
                                               "model_config": spec.model.model_dump(mode="json")})
    checkpointer.close()


def test_checkpoint_export_matches_megatron_logits(world, tiny_job_dict, tiny_prepared, tmp_path, capsys):
    import yaml
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from flows.cli import main
    from training.model import build_model, build_optimizer, wrap_data_parallel

    job = copy.deepcopy(tiny_job_dict)
    job["model"]["rope_theta"] = 50000.0  # a non-default theta must survive the export
    spec = parse_job_spec(job)
    model = build_model(spec.model, spec.training)
    _randomise(model)
    optimizer = build_optimizer(wrap_data_parallel(model, spec.training), spec.training)
    root = tmp_path / "checkpoints"
    _save_checkpoint(spec, world, root, 7, model, optimizer)

    tokens = _sample_tokens(tiny_prepared, 2, spec.model.seq_length)
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    model.eval()
    with torch.no_grad():
        megatron_logits = model(tokens, positions, None)

    # through `forgeflow export --json`, as a user runs it; the root: newest complete step
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    capsys.readouterr()
    assert main(["export", str(root), str(tmp_path / "hf"), "--config", str(tmp_path / "job.yaml"), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    out = Path(printed["out_dir"])
    assert out == tmp_path / "hf" and printed["job"] == spec.name and "model.safetensors" in printed["files"]
    assert sorted(p.name for p in out.iterdir()) == sorted([
        "config.json", "generation_config.json", "model.safetensors", "forgeflow.json",
        "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"])
    provenance = json.loads((out / "forgeflow.json").read_text())
    assert provenance["step"] == 7 and provenance["checkpoint_format"] == "sharded"
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == "LlamaForCausalLM" and hf.config.num_key_value_heads == 2
    with torch.no_grad():
        hf_logits = hf(tokens).logits
    diff = (hf_logits - megatron_logits).abs().max().item()
    assert diff < TOLERANCE, f"max |logit diff| {diff:.3g}"
    assert megatron_logits.abs().max() > 1.0  # logits large enough that the check means something

    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.eos_token_id == hf.generation_config.eos_token_id == tiny_prepared.eot_token_id
    generated = hf.generate(tokens[:1, :8], max_new_tokens=4, do_sample=False)
    assert generated.shape == (1, 12)


def test_a_wrong_mapping_would_be_caught(world, tiny_job_dict, tiny_prepared, tmp_path):
    """Negative control: swapping SwiGLU gate/up halves breaks parity by far more than 1e-4."""
    from transformers import LlamaForCausalLM

    from training.export import llama_config, megatron_state_dict_to_llama
    from training.model import build_model

    spec = parse_job_spec(copy.deepcopy(tiny_job_dict))
    model = build_model(spec.model, spec.training).eval()
    _randomise(model, seed=1)
    tokens = _sample_tokens(tiny_prepared, 1, spec.model.seq_length)
    with torch.no_grad():
        reference = model(tokens, torch.arange(tokens.shape[1]).unsqueeze(0), None)
    weights = megatron_state_dict_to_llama(model.state_dict(), spec.model)
    hf = LlamaForCausalLM(llama_config(spec.model)).eval()
    hf.load_state_dict(weights, strict=True)
    with torch.no_grad():
        assert (hf(tokens).logits - reference).abs().max() < TOLERANCE
    gate, up = "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"
    weights[gate], weights[up] = weights[up], weights[gate]
    hf.load_state_dict(weights, strict=True)
    with torch.no_grad():
        assert (hf(tokens).logits - reference).abs().max() > 100 * TOLERANCE


def test_export_errors_name_the_problem(world, tiny_job_dict, tiny_prepared, tmp_path):
    from training.export import ExportError, export_hf
    from training.model import build_model, build_optimizer, wrap_data_parallel

    spec = parse_job_spec(copy.deepcopy(tiny_job_dict))
    with pytest.raises(ExportError, match="neither a checkpoint"):
        export_hf(tmp_path / "nothing-here", tmp_path / "hf", spec)

    model = build_model(spec.model, spec.training)
    optimizer = build_optimizer(wrap_data_parallel(model, spec.training), spec.training)
    _save_checkpoint(spec, world, tmp_path / "ck", 1, model, optimizer)
    other = copy.deepcopy(tiny_job_dict)
    other["model"]["hidden_size"] = 128  # not the shape the checkpoint holds
    with pytest.raises(ExportError, match="use the job spec the checkpoint was trained with") as refused:
        export_hf(tmp_path / "ck", tmp_path / "hf", parse_job_spec(other))
    assert "model.hidden_size: checkpoint 64, spec 128" in str(refused.value)  # named from its stored config
    with pytest.raises(ExportError, match="forgeflow prepare"):
        export_hf(tmp_path / "ck", tmp_path / "hf", spec, tokenizer_dir=tmp_path / "no-tokenizer")
    assert not (tmp_path / "hf").exists()  # nothing half-written


def test_export_from_a_reference_reads_its_manifest_once_and_starts_no_writer(
        world, tiny_job_dict, tiny_prepared, tmp_path):
    """The checkpoint is located once per export (a reference is not located again) and read
    through one manifest read; reading starts no thread and no writer process."""
    import os
    import threading
    from collections import Counter

    from checkpoint.manifest import CheckpointRef, manifest_key
    from infra.storage import LocalStorage, StorageOptions
    from training.checkpoint_reader import locate_checkpoint
    from training.export import export_hf
    from training.model import build_model, build_optimizer, wrap_data_parallel

    class CountingStorage(LocalStorage):   # a real local storage that counts what it is asked
        def __init__(self, root):
            super().__init__(root, StorageOptions())
            self.reads, self.listings = Counter(), 0

        def get_bytes(self, key):
            self.reads[key] += 1
            return super().get_bytes(key)

        def list(self, prefix=""):
            self.listings += 1
            return super().list(prefix)

    def children() -> set[str]:
        return {c for t in os.listdir(f"/proc/{os.getpid()}/task")
                for c in open(f"/proc/{os.getpid()}/task/{t}/children").read().split()}

    spec = parse_job_spec(copy.deepcopy(tiny_job_dict))
    model = build_model(spec.model, spec.training)
    optimizer = build_optimizer(wrap_data_parallel(model, spec.training), spec.training)
    for step in (3, 6):
        _save_checkpoint(spec, world, tmp_path / "ck", step, model, optimizer)
    ref = locate_checkpoint(tmp_path / "ck", spec)
    assert ref == CheckpointRef(str(tmp_path / "ck"), 6)

    storage = CountingStorage(ref.url)
    threads, processes = set(threading.enumerate()), children()
    out = export_hf(ref, tmp_path / "hf", spec, storage=storage)
    assert set(threading.enumerate()) == threads and children() == processes
    assert storage.listings == 0 and storage.reads[manifest_key(6)] == 1
    assert not [k for k in storage.reads if k.startswith("step-00000003")]
    provenance = json.loads((out / "forgeflow.json").read_text())
    assert provenance["checkpoint_ref"] == ref.to_dict() and provenance["step"] == 6


@pytest.mark.slow  # two torchrun ranks: ~12 s of CPU
def test_tensor_parallel_checkpoint_merges_on_export(tiny_job_dict, tiny_prepared, tmp_path,
                                                      repo_root):
    """A TP=2 (two gloo processes) checkpoint -> an HF model with the TP logits."""
    import os
    import subprocess
    import sys

    import yaml
    from transformers import AutoModelForCausalLM

    from training.export import export_hf

    job = copy.deepcopy(tiny_job_dict)
    job["training"].update(tensor_parallel=2, global_batch_size=2, micro_batch_size=1)
    job_file = tmp_path / "tp2.yaml"
    job_file.write_text(yaml.safe_dump(job))
    env = dict(os.environ, PYTHONPATH=str(repo_root), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(Path(__file__).with_name("tp_export_worker.py")), str(job_file), str(tmp_path)],
        env=env, cwd=repo_root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    tp_logits = torch.load(tmp_path / "logits.pt")
    tokens = torch.load(tmp_path / "tokens.pt")

    spec = parse_job_spec(job)  # still says tensor_parallel=2: export merges regardless
    assert tp_logits.shape[-1] == spec.model.vocab_size
    out = export_hf(tmp_path / "ck", tmp_path / "hf", spec)
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        diff = (hf(tokens).logits - tp_logits).abs().max().item()
    assert diff < TOLERANCE, f"max |logit diff| {diff:.3g}"


def test_engine_checkpoint_on_s3_exports(world, tiny_job_dict, tiny_prepared, tmp_path, monkeypatch):
    """A checkpoint in a real S3 endpoint (moto on 127.0.0.1) -> HF folder."""
    import boto3
    from moto.server import ThreadedMotoServer
    from transformers import AutoModelForCausalLM

    from testing.local_s3 import free_ports
    from training.checkpointing import Checkpointer
    from training.export import export_hf
    from training.model import build_model, build_optimizer, wrap_data_parallel

    port = free_ports(1)[0]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        endpoint = f"http://127.0.0.1:{port}"
        for name, value in (("AWS_ACCESS_KEY_ID", "moto"), ("AWS_SECRET_ACCESS_KEY", "moto"),
                            ("AWS_DEFAULT_REGION", "us-east-1")):
            monkeypatch.setenv(name, value)
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="exports")
        job = copy.deepcopy(tiny_job_dict)
        job["checkpoint"].update(url="s3://exports/tiny/ck", endpoint_url=endpoint,
                                 region="us-east-1", async_save=False)
        spec = parse_job_spec(job)
        model = build_model(spec.model, spec.training)
        _randomise(model, seed=2)
        optimizer = build_optimizer(wrap_data_parallel(model, spec.training), spec.training)
        checkpointer = Checkpointer(spec.checkpoint, world, writer="thread")
        checkpointer.save(3, model, optimizer, {"world_size": 1})
        checkpointer.close()

        tokens = _sample_tokens(tiny_prepared, 1, spec.model.seq_length)
        model.eval()
        with torch.no_grad():
            reference = model(tokens, torch.arange(tokens.shape[1]).unsqueeze(0), None)
        out = export_hf("s3://exports/tiny/ck", tmp_path / "hf", spec)  # the root: newest step
        assert json.loads((out / "forgeflow.json").read_text())["checkpoint"] == \
            "s3://exports/tiny/ck/step-00000003"
        hf = AutoModelForCausalLM.from_pretrained(out).eval()
        with torch.no_grad():
            assert (hf(tokens).logits - reference).abs().max() < TOLERANCE
    finally:
        server.stop()
