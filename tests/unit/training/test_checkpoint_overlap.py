"""The trainer's overlapped checkpoint copy: the host copy of step N runs during step N+1's
forward and backward, and train_step waits for it before its optimizer step; the shard
written is byte for byte the one a synchronous save of step N writes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from checkpoint.manifest import committed_steps, shard_key
from infra.storage import open_storage
from training.config import CheckpointConfig, ModelConfig, TrainingConfig

MODEL = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                    ffn_hidden_size=128, vocab_size=256, seq_length=16)
TRAINING = TrainingConfig(global_batch_size=4, micro_batch_size=2, steps=5, lr=1e-3,
                          min_lr=1e-4, grad_clip=0.5, seed=7)


@pytest.mark.parametrize("writer", ["process", "thread"])
def test_overlapped_checkpoint_equals_a_synchronous_one_of_the_same_step(dist_env, tmp_path, writer):
    from training.checkpointing import Checkpointer
    from training.model import build_model, build_optimizer, wrap_data_parallel
    from training.sampler import BatchSampler, PackedTokens
    from training.train import train_step

    tokens = tmp_path / "train.bin"
    np.random.default_rng(0).integers(0, MODEL.vocab_size, 4096, dtype=np.uint16).tofile(tokens)
    sampler = BatchSampler(PackedTokens(tokens, MODEL.seq_length, dtype="uint16"), seed=7)
    model = build_model(MODEL, TRAINING)
    ddp = wrap_data_parallel(model, TRAINING)
    optimizer = build_optimizer(ddp, TRAINING)
    positions = torch.arange(MODEL.seq_length).unsqueeze(0).expand(TRAINING.micro_batch_size, -1)

    def run_step(step: int, before_update=None) -> None:
        train_step([ddp], optimizer, sampler, step, dist_env, TRAINING, 2, positions,
                   before_update=before_update)

    sync = Checkpointer(CheckpointConfig(url=str(tmp_path / "sync"), async_save=False), dist_env,
                        writer="thread")
    overlapped = Checkpointer(CheckpointConfig(url=str(tmp_path / "overlap")), dist_env, writer=writer)
    try:
        for step in range(2):  # Adam state exists and is not all zeros
            run_step(step)
        sync.save(2, model, optimizer, {"step": 2})  # the reference: copied before it returns
        saved_weight = model.embedding.word_embeddings.weight.detach().clone()
        info = overlapped.save(2, model, optimizer, {"step": 2})
        assert info["async"] and overlapped.engine.outcomes[-1].overlap
        at_update: list[bool] = []

        def before_update() -> None:  # what train() passes: the checkpointer's wait, recorded
            overlapped.before_optimizer_step()
            at_update.append(not overlapped.engine.copying
                             and torch.equal(model.embedding.word_embeddings.weight, saved_weight))

        run_step(2, before_update=before_update)  # the copy overlaps this step's forward/backward
        assert at_update == [True]  # waited once, before the update changed anything
        assert not torch.equal(model.embedding.word_embeddings.weight, saved_weight)  # it updated
        assert overlapped.engine.wait().committed
    finally:
        sync.close()
        overlapped.close()
    a, b = open_storage(str(tmp_path / "sync")), open_storage(str(tmp_path / "overlap"))
    assert committed_steps(a) == committed_steps(b) == [2]
    assert b.get_bytes(shard_key(2, 0, 1)) == a.get_bytes(shard_key(2, 0, 1))
