"""training.attention: the fused SDPA core attention computes megatron's attention exactly."""

from __future__ import annotations

import pytest
import torch

from training.config import ModelConfig, TrainingConfig, resolve_attention

GQA = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=2,
                  ffn_hidden_size=128, vocab_size=256, seq_length=32)
MHA = GQA.model_copy(update={"num_query_groups": None})


@pytest.mark.parametrize("choice, precision, flash_device, kernel", [
    ("auto", "bf16", True, "sdpa"),
    ("auto", "fp16", True, "sdpa"),
    ("auto", "fp32", True, "local"),   # no flash kernel in fp32
    ("auto", "bf16", False, "local"),  # CPU or a pre-Ampere GPU
    ("auto", "fp32", False, "local"),
    ("local", "bf16", True, "local"),
    ("sdpa", "fp32", False, "sdpa"),   # explicit choices are kept
])
def test_auto_resolves_to_sdpa_only_where_flash_kernels_run(choice, precision, flash_device, kernel):
    assert resolve_attention(choice, precision, flash_device) == kernel


def test_an_unknown_kernel_is_one_clear_config_error():
    with pytest.raises(ValueError, match="attention") as err:
        TrainingConfig(global_batch_size=2, steps=1, attention="flash")
    assert "'auto', 'local' or 'sdpa'" in str(err.value)


def _loss_and_grads(model_cfg, attention, recompute="none"):
    from training.model import build_model

    training_cfg = TrainingConfig(global_batch_size=2, micro_batch_size=2, steps=1, seed=3,
                                  attention=attention, recompute=recompute)
    model = build_model(model_cfg, training_cfg)
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, model_cfg.vocab_size, (2, model_cfg.seq_length + 1), generator=g)
    positions = torch.arange(model_cfg.seq_length).unsqueeze(0).expand(2, -1)
    loss = model(batch[:, :-1], positions, None, labels=batch[:, 1:]).float().mean()
    loss.backward()
    return model, loss.item(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("model_cfg", [GQA, MHA], ids=["gqa", "mha"])
@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_sdpa_gives_megatrons_loss_and_gradients(dist_env, model_cfg, recompute):
    local, local_loss, local_grads = _loss_and_grads(model_cfg, "local", recompute)
    fused, fused_loss, fused_grads = _loss_and_grads(model_cfg, "sdpa", recompute)
    core = fused.decoder.layers[0].self_attention.core_attention
    assert type(core).__name__ == "SDPAttention"
    assert type(local.decoder.layers[0].self_attention.core_attention).__name__ == "DotProductAttention"
    assert fused_loss == pytest.approx(local_loss, rel=1e-6)
    assert local_grads.keys() == fused_grads.keys()
    for name, grad in local_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_both_kernels_build_the_same_parameters_so_checkpoints_move_between_them(dist_env):
    from training.model import build_model

    cfg = TrainingConfig(global_batch_size=2, steps=1, seed=3)
    local = build_model(GQA, cfg.model_copy(update={"attention": "local"}))
    fused = build_model(GQA, cfg.model_copy(update={"attention": "sdpa"}))
    state = local.state_dict()
    assert state.keys() == fused.state_dict().keys()
    fused.load_state_dict(state, strict=True)


def test_an_explicit_mask_is_applied_as_megatron_applies_it(dist_env):
    """megatron's masks are True where attention is masked out; SDPA's are True where allowed."""
    from training.model import build_model

    cfg = TrainingConfig(global_batch_size=2, steps=1, seed=3)
    cores = [build_model(GQA, cfg.model_copy(update={"attention": a})).decoder.layers[0]
             .self_attention.core_attention for a in ("local", "sdpa")]
    s, b, heads, groups, d = GQA.seq_length, 2, 8, 2, 8
    g = torch.Generator().manual_seed(1)
    q = torch.randn(s, b, heads, d, generator=g)
    k, v = (torch.randn(s, b, groups, d, generator=g) for _ in range(2))
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)
    padded = causal.clone()
    padded[:, -5:] = True  # the last 5 keys are padding
    padded[-5:, -5:] = ~torch.eye(5, dtype=torch.bool)  # a padding query still sees itself
    mask = padded.expand(b, 1, s, s)
    want, got = (core(q, k, v, mask) for core in cores)
    assert got.shape == (s, b, heads * d)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
