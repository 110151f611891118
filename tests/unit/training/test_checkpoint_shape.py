"""A checkpoint holds its model's config; loading it into a model of another shape is one
ConfigError naming each field (checkpoint value vs spec value) and the fix, before any shard
is read. Fields that change no tensor shape may differ; an old checkpoint loads unchecked.

The comparison alone, then real saves and loads through the trainer's Checkpointer."""

from __future__ import annotations

import pytest

from training.config import CheckpointConfig, ConfigError, ModelConfig, TrainingConfig

MODEL = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                    ffn_hidden_size=128, vocab_size=256, seq_length=16)
TRAINING = TrainingConfig(global_batch_size=4, micro_batch_size=2, steps=5, lr=1e-3, min_lr=1e-4)


def _model(**changes) -> ModelConfig:
    return MODEL.model_copy(update=changes)


def test_only_fields_that_change_a_tensor_shape_count():
    from training.checkpointing import shape_differences, shape_problem

    saved = MODEL.model_dump(mode="json")
    assert shape_differences(saved, MODEL) == []
    # RoPE has no weights; norm epsilon and init scale are values, not shapes.
    assert shape_differences(saved, _model(seq_length=64, rope_theta=5e5, norm_epsilon=1e-6,
                                           init_method_std=0.01)) == []
    # An unset field equals the value it resolves to.
    full = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256, seq_length=16)
    spelled = full.model_copy(update={"num_query_groups": 4, "ffn_hidden_size": full.ffn_size})
    assert shape_differences(full.model_dump(), spelled) == []
    assert shape_differences(saved, _model(hidden_size=128, num_layers=3, num_query_groups=4)) == [
        "model.num_layers: checkpoint 2, spec 3", "model.hidden_size: checkpoint 64, spec 128",
        "model.num_query_groups: checkpoint 2, spec 4"]
    assert shape_differences(saved, _model(untie_embeddings_and_output_weights=False)) == [
        "model.untie_embeddings_and_output_weights: checkpoint True, spec False"]
    # A checkpoint from before the config was stored: nothing to compare.
    assert shape_differences(None, _model(hidden_size=128)) == []
    assert shape_problem({"trainer": {"step": 3}}, _model(hidden_size=128)) is None
    assert shape_problem({"trainer": {"model_config": saved}}, _model(vocab_size=512)) == (
        "its model has another shape than the job spec's: model.vocab_size: checkpoint 256, spec 512")


def _save(dist_env, url: str, trainer_state: dict, tmp_path) -> None:
    """Step 4 of a model trained one step (so Adam has state), saved by the trainer's Checkpointer."""
    import numpy as np
    import torch

    from training.checkpointing import Checkpointer
    from training.model import build_model, build_optimizer, wrap_data_parallel
    from training.sampler import BatchSampler, PackedTokens
    from training.train import train_step

    tokens = tmp_path / "train.bin"
    np.random.default_rng(0).integers(0, MODEL.vocab_size, 4096, dtype=np.uint16).tofile(tokens)
    model = build_model(MODEL, TRAINING)
    ddp = wrap_data_parallel(model, TRAINING)
    optimizer = build_optimizer(ddp, TRAINING)
    positions = torch.arange(MODEL.seq_length).unsqueeze(0).expand(TRAINING.micro_batch_size, -1)
    train_step([ddp], optimizer, BatchSampler(PackedTokens(tokens, MODEL.seq_length, dtype="uint16"), seed=7),
               0, dist_env, TRAINING, 2, positions)
    checkpointer = Checkpointer(CheckpointConfig(url=url, async_save=False), dist_env, writer="thread")
    checkpointer.save(4, model, optimizer, trainer_state)
    checkpointer.close()


def _load(dist_env, url: str, model_cfg: ModelConfig, training: TrainingConfig = TRAINING) -> dict:
    from training.checkpointing import Checkpointer
    from training.model import build_model, build_optimizer, wrap_data_parallel

    model = build_model(model_cfg, training)
    optimizer = build_optimizer(wrap_data_parallel(model, training), training)
    checkpointer = Checkpointer(CheckpointConfig(url=url), dist_env, writer="thread")
    try:
        return checkpointer.load(checkpointer.latest(), model, optimizer, expect_model=model_cfg)
    finally:
        checkpointer.close()


def test_loading_into_another_shape_is_one_config_error_naming_the_fields(dist_env, tmp_path):
    url = str(tmp_path / "ckpt")
    _save(dist_env, url, {"model_config": MODEL.model_dump(mode="json")}, tmp_path)

    with pytest.raises(ConfigError) as refused:
        _load(dist_env, url, _model(hidden_size=128, ffn_hidden_size=256))
    message = str(refused.value)
    assert message.startswith(f"{url}/step-00000004: unable to load the checkpoint: its model has another "
                              "shape than the job spec's: model.hidden_size: checkpoint 64, spec 128; "
                              "model.ffn_hidden_size: checkpoint 128, spec 256.")
    assert "point checkpoint.url at a folder of its own" in message and "\n" not in message
    # The refused step stays a checkpoint (nothing set aside): the right spec still resumes it.
    changed = TRAINING.model_copy(update={"lr": 5e-4, "steps": 50, "global_batch_size": 8})
    assert _load(dist_env, url, _model(seq_length=32), changed)["step"] == 4


def test_a_checkpoint_without_a_stored_model_config_loads_as_before(dist_env, tmp_path):
    from training.checkpointing import CheckpointError

    url = str(tmp_path / "old")
    _save(dist_env, url, {"world_size": 1}, tmp_path)  # what the trainer stored before the model config
    assert _load(dist_env, url, MODEL)["step"] == 4
    # Unchecked, so another shape fails as it always did: in the loader, not as a ConfigError.
    from checkpoint.engine import CheckpointError as EngineError

    with pytest.raises((EngineError, CheckpointError)) as failed:
        _load(dist_env, url, _model(hidden_size=128, ffn_hidden_size=256))
    assert not isinstance(failed.value, ConfigError)
