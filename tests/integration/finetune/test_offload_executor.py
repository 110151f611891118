"""Offloaded fine-tuning on CPU: 2 worker processes x 4 stages under torchrun, device budget smaller than
the model; the loss trajectory equals the same fine-tuning without offload, peak device memory within budget.

Tolerance: 1e-5 absolute on each step's loss (fp32, fixed seed). The two runs do the same arithmetic
except the global gradient norm for clipping, summed per worker then all-reduced here and by
clip_grad_norm_'s fused per-tensor norms there; observed differences are ~1e-7.
"""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest
import torch

from training.offload.executor import DataSource, OffloadRunConfig, train_without_offload
from training.offload.launch import run_local

LOSS_TOLERANCE = 1e-5


def make_tiny_llama(folder: Path, layers: int = 10, hidden: int = 128, tie: bool = False) -> int:
    """A random-init HF Llama saved offline; returns its parameter bytes (fp32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=tie)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(folder)
    return sum(p.numel() * 4 for p in model.parameters())


@pytest.mark.slow
def test_two_workers_four_stages_match_no_offload_within_budget(tmp_path):
    model_bytes = make_tiny_llama(tmp_path / "model")
    budget = int(0.9 * model_bytes)
    cfg = OffloadRunConfig(
        model_dir=str(tmp_path / "model"), stages=[(0, 3), (3, 6), (6, 9), (9, 12)], steps=20,
        micro_batch_size=1, microbatches=4, seq_length=8, lr=1e-3, grad_clip=1.0,
        device_budget_bytes=budget, out_dir=str(tmp_path / "run"), data=DataSource(distinct_batches=2),
    )
    reports = run_local(cfg, workers=2)
    reference = train_without_offload(cfg)

    assert [r["stages"] for r in reports] == [[0, 2], [1, 3]]  # stage s on worker s mod 2
    assert reports[0]["losses"] == reports[1]["losses"]
    diffs = [abs(a - b) for a, b in zip(reports[0]["losses"], reference)]
    assert len(diffs) == 20 and max(diffs) < LOSS_TOLERANCE, diffs
    assert reference[-1] < reference[0]  # it learns (it memorises the two batches it cycles through)
    for r in reports:
        assert 0 < r["device_peak_bytes"] <= budget < model_bytes
        # forward: own first stage, prefetch the next; the last two stages stay for backward;
        # backward: prefetch the earlier stage. Per step on worker 0: 0, 2, 0.
        first, second = r["stages"]
        assert r["prefetch_order"] == [first, second, first] * 20
    # the fine-tuned model is written as one HF folder that loads
    from transformers import LlamaForCausalLM

    tuned = LlamaForCausalLM.from_pretrained(tmp_path / "run" / "model")
    assert tuned.config.num_hidden_layers == 10


def test_budget_below_one_stage_fails_with_a_clear_error(tmp_path):
    make_tiny_llama(tmp_path / "model", layers=2, hidden=64)
    cfg = OffloadRunConfig(model_dir=str(tmp_path / "model"), stages=[(0, 2), (2, 4)], steps=1, seq_length=8,
                           device_budget_bytes=10_000, out_dir=str(tmp_path / "run"), save_model=False)
    from training.offload.device import DeviceBudgetExceeded
    from training.offload.executor import run_worker

    with pytest.raises(DeviceBudgetExceeded, match="re-plan the partition"):
        run_worker(cfg)
    torch.distributed.destroy_process_group()


def test_world_of_one_with_tied_embeddings_matches_reference(tmp_path):
    make_tiny_llama(tmp_path / "model", layers=3, hidden=64, tie=True)
    cfg = OffloadRunConfig(model_dir=str(tmp_path / "model"), stages=[(0, 2), (2, 3), (3, 5)], steps=4,
                           microbatches=2, seq_length=8, lr=1e-3, out_dir=str(tmp_path / "run"), save_model=False)
    # Both sides in fresh interpreters (the executor in a torchrun worker, as in production; the
    # reference in a spawned process): run in the pytest process, the reference shared the
    # interpreter with whatever ran there before and differed by exactly 0.057 in some full runs
    # (never alone, nor after its folder's tests or the Megatron export's; the state it picked up
    # is not found yet).
    (report,) = run_local(cfg, workers=1)
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        reference = pool.apply(train_without_offload, (cfg,))
    assert max(abs(a - b) for a, b in zip(report["losses"], reference)) < LOSS_TOLERANCE


def test_a_tied_checkpoint_that_also_stores_a_head_loads_the_embedding_as_its_head(tmp_path):
    """A tied model's file may carry an lm_head.weight of its own (saved untied by another tool,
    or by a process where the tie was broken): the config says the head is the input embedding,
    so the executor loads that, as the reference run (train_without_offload) unties it; using the
    stored head trained another model (a full test run once saved such a file: 0.057 apart)."""
    from safetensors.torch import load_file, save_file

    from training.offload.units import load_llama_config, load_units, unit_count

    make_tiny_llama(tmp_path / "model", layers=2, hidden=64, tie=True)
    path = next((tmp_path / "model").glob("*.safetensors"))
    tensors = load_file(str(path))
    tensors["lm_head.weight"] = torch.randn_like(tensors["model.embed_tokens.weight"])  # not the embedding
    save_file(tensors, str(path), metadata={"format": "pt"})

    config = load_llama_config(tmp_path / "model")
    assert config.tie_word_embeddings
    (head,) = load_units(tmp_path / "model", config, [unit_count(config) - 1]).values()  # the head is last
    assert torch.equal(head.lm_head.weight, tensors["model.embed_tokens.weight"])
