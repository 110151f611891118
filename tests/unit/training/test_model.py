"""The megatron model builder and the CPU compatibility patches, in one process (world of 1)."""

from __future__ import annotations

import pytest
import torch

from training.config import ModelConfig, TrainingConfig

MODEL = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                    ffn_hidden_size=128, vocab_size=256, seq_length=16)
TRAINING = TrainingConfig(global_batch_size=4, micro_batch_size=2, steps=5, lr=1e-3,
                          min_lr=1e-4, grad_clip=0.5, seed=7)


def test_world_of_one_without_torchrun(dist_env):
    assert (dist_env.rank, dist_env.world_size, dist_env.dp_size, dist_env.tp_size) == (0, 1, 1, 1)
    assert dist_env.backend == ("nccl" if torch.cuda.is_available() else "gloo")


def test_parameter_count_matches_the_config_formula(dist_env):
    from training.model import build_model, count_parameters

    model = build_model(MODEL, TRAINING)
    assert count_parameters(model) == MODEL.num_parameters()
    names = [n for n, _ in model.named_parameters()]
    assert not any(n.endswith(".bias") for n in names)  # Llama: no biases
    assert "output_layer.weight" in names  # untied embeddings


def test_initial_weights_depend_only_on_the_seed(dist_env):
    from training.model import build_model

    a, b = build_model(MODEL, TRAINING), build_model(MODEL, TRAINING)
    c = build_model(MODEL, TRAINING.model_copy(update={"seed": 8}))
    wa, wb, wc = (m.embedding.word_embeddings.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)


def test_one_optimizer_step_clips_to_the_global_norm_and_lowers_the_loss(dist_env):
    from training.model import build_model, build_optimizer, wrap_data_parallel

    model = build_model(MODEL, TRAINING)
    ddp = wrap_data_parallel(model, TRAINING)
    optimizer = build_optimizer(ddp, TRAINING)
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, MODEL.vocab_size, (2, MODEL.seq_length + 1), generator=g)
    tokens, labels = batch[:, :-1], batch[:, 1:]
    positions = torch.arange(MODEL.seq_length).unsqueeze(0).expand(2, -1)

    def loss_and_grads() -> tuple[float, float]:
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        loss = ddp(tokens, positions, None, labels=labels).float().mean()
        loss.backward()
        ddp.finish_grad_sync()
        grads = [p.main_grad for p in model.parameters()]
        return loss.item(), torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(x) for x in grads])).item()

    losses = []
    for _ in range(3):
        loss, reference_norm = loss_and_grads()
        ok, grad_norm, _ = optimizer.step()
        assert ok and grad_norm == pytest.approx(reference_norm, rel=1e-5)
        losses.append(loss)
    assert losses[-1] < losses[0]
    # norm weights get no weight decay (megatron's standard overrides, applied by the schedule)
    decays = {g["wd_mult"]: g["weight_decay"] for g in optimizer.param_groups}
    assert decays == {0.0: 0.0, 1.0: TRAINING.weight_decay}


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only settings check")
def test_settings_that_need_cuda_are_refused_clearly(dist_env):
    from training.model import UnsupportedOnCPU, build_model

    with pytest.raises(UnsupportedOnCPU, match="precision: fp32"):
        build_model(MODEL, TRAINING.model_copy(update={"precision": "bf16"}))


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_activation_recompute_gives_the_same_loss_and_gradients(dist_env, recompute):
    from training.model import build_model

    g = torch.Generator().manual_seed(1)
    batch = torch.randint(0, MODEL.vocab_size, (2, MODEL.seq_length + 1), generator=g)
    positions = torch.arange(MODEL.seq_length).unsqueeze(0).expand(2, -1)

    def loss_and_grads(cfg):
        model = build_model(MODEL, cfg)
        model.train()
        loss = model(batch[:, :-1], positions, None, labels=batch[:, 1:]).float().mean()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    ref_loss, ref_grads = loss_and_grads(TRAINING)
    loss, grads = loss_and_grads(TRAINING.model_copy(update={"recompute": recompute}))
    assert torch.equal(loss, ref_loss)
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(grads, ref_grads))
