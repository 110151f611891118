"""Reading a trained model's whole weights out of a checkpoint, in either format.

The worker writes one of two formats (training.checkpointing.open_checkpointer):

- ``dist``: megatron `dist_checkpointing` (synchronous writer, `async_save: false`):
  ``ROOT/step_00000040/`` holding ``common.pt`` + ``*.distcp``. Read by building the
  job's GPTModel with tensor_parallel=1 in a world of one and loading through
  dist_checkpointing, which reshards a tensor-parallel checkpoint on load.
- ``engine``: the async engine's shards (checkpoint.engine, `async_save: true`, the
  default): ``ROOT/step-00000040/rank-R-of-W.bin`` + ``manifest.json``, on a local
  path or s3://. Each shard holds its rank's plain `model.state_dict()`, so the
  tensor-parallel shards of data-parallel rank 0 (global ranks 0..tp-1: megatron
  orders tensor parallel fastest) are merged here by layer type — see
  `merge_tensor_parallel`. Reading needs no torch.distributed and no megatron.

`locate_checkpoint` accepts a step directory of either format or a root holding
them (the newest committed step is taken).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from training.config import JobSpec, ModelConfig

_DIST_STEP = re.compile(r"^step_(\d{8})$")
_ENGINE_STEP = re.compile(r"^step-(\d{8,})$")


class CheckpointReadError(RuntimeError):
    """A checkpoint cannot be found or read as the job spec's model."""


@dataclass(frozen=True)
class CheckpointLocation:
    kind: Literal["dist", "engine"]
    root: str  # the checkpoint root (a path, or a URL for engine checkpoints)
    step: int
    step_url: str  # the step's own directory (path or URL)

    @property
    def name(self) -> str:  # e.g. step_00000040 / step-00000040
        return self.step_url.rstrip("/").rsplit("/", 1)[-1]


def _split_url(url: str) -> tuple[str, str]:
    parent, _, name = url.rstrip("/").rpartition("/")
    return parent, name


def _engine_steps(root: str, spec: JobSpec | None) -> list[int]:
    from checkpoint.manifest import committed_steps
    from infra.storage import StorageError, open_storage, storage_options_from_config

    options = storage_options_from_config(spec.checkpoint) if spec is not None else None
    try:
        return committed_steps(open_storage(root, options))
    except StorageError:
        return []


def locate_checkpoint(where: str | Path, spec: JobSpec | None = None) -> CheckpointLocation:
    """The checkpoint `where` names: a step directory, or the newest one under a root."""
    from training.checkpointing import complete_steps, step_dir_name

    where = str(where)
    local = not where.startswith("s3://")
    path = Path(where.removeprefix("file://")) if local else None
    if local and (path / "common.pt").is_file():
        match = _DIST_STEP.match(path.name)
        return CheckpointLocation("dist", str(path.parent), int(match[1]) if match else -1, str(path))
    parent, name = _split_url(where)
    match = _ENGINE_STEP.match(name)
    if match and int(match[1]) in _engine_steps(parent, spec):
        return CheckpointLocation("engine", parent, int(match[1]), where.rstrip("/"))
    candidates: list[CheckpointLocation] = []
    if local and path.is_dir():
        steps = complete_steps(path)
        if steps:
            candidates.append(CheckpointLocation("dist", str(path), steps[-1],
                                                 str(path / step_dir_name(steps[-1]))))
    steps = _engine_steps(where, spec) if not local or path.is_dir() else []
    if steps:
        from checkpoint.manifest import step_dir

        candidates.append(CheckpointLocation("engine", where.rstrip("/"), steps[-1],
                                             f"{where.rstrip('/')}/{step_dir(steps[-1])}"))
    if not candidates:
        raise CheckpointReadError(
            f"{where}: neither a checkpoint nor a directory holding committed checkpoints "
            "(step_NNNNNNNN/ with common.pt, or step-NNNNNNNN/ with manifest.json); "
            "give a checkpoint directory or the job's checkpoint.url")
    return max(candidates, key=lambda c: c.step)


# --- megatron dist_checkpointing --------------------------------------------------------------

def _read_dist(location: CheckpointLocation, spec: JobSpec) -> tuple[dict, dict]:
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    from training.checkpointing import read_trainer_state
    from training.model import build_model, init_distributed, shutdown_distributed

    owns_world = not torch.distributed.is_initialized()
    if not owns_world and torch.distributed.get_world_size() != 1:
        raise CheckpointReadError("reading a checkpoint runs in a single process; call it "
                                  "outside a multi-rank job")
    # The layout on disk is TP-independent; build whole matrices and let it reshard.
    training_cfg = spec.training.model_copy(update={
        "tensor_parallel": 1, "pipeline_parallel": 1, "precision": "fp32",
        "use_distributed_optimizer": False, "recompute": "none"})
    try:
        init_distributed(1)
        model = build_model(spec.model, training_cfg)
        try:
            loaded = dist_checkpointing.load({"model": model.sharded_state_dict()},
                                             location.step_url)
        # Shape/key mismatches surface as assorted megatron errors, or as torch's
        # CheckpointException, which derives from BaseException.
        except (Exception, CheckpointException) as e:
            raise CheckpointReadError(
                f"{location.step_url}: cannot load it into the model of job spec {spec.name!r} "
                f"({type(e).__name__}: {e}); use the job spec the checkpoint was trained with"
            ) from e
        model.load_state_dict(loaded["model"])
        state_dict = {k: v.detach().cpu() for k, v in model.state_dict().items()
                      if isinstance(v, torch.Tensor)}
    finally:
        if owns_world:
            shutdown_distributed()
    return state_dict, read_trainer_state(location.step_url)


# --- the async engine's shards ----------------------------------------------------------------

def merge_tensor_parallel(shards: list[dict[str, Any]], model_cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Whole tensors from the model state dicts of TP ranks 0..tp-1 (megatron local layout).

    Column-parallel layers (vocab embedding, output layer, fused QKV, SwiGLU fc1) are split
    by output rows; row-parallel layers (attention output, fc2) by input columns; norms
    are replicated. Each rank's QKV rows hold whole query groups in megatron's grouped
    order, so concatenation keeps that order. Each rank's fc1 holds [its gate rows; its
    up rows], so the gates and the ups are concatenated separately.
    """
    if len(shards) == 1:
        return {k: v for k, v in shards[0].items() if isinstance(v, torch.Tensor)}
    merged: dict[str, torch.Tensor] = {}
    for name, first in shards[0].items():
        if not isinstance(first, torch.Tensor) or name.endswith("_extra_state"):
            continue
        parts = [s[name] for s in shards]
        key = name.removeprefix("module.")
        if key.endswith(("word_embeddings.weight", "output_layer.weight", "linear_qkv.weight")):
            merged[name] = torch.cat(parts, dim=0)
        elif key.endswith("linear_fc1.weight"):
            halves = [p.chunk(2, dim=0) for p in parts]
            merged[name] = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
        elif key.endswith(("linear_proj.weight", "linear_fc2.weight")):
            merged[name] = torch.cat(parts, dim=1)
        elif "norm" in key:
            if any(not torch.equal(p, first) for p in parts[1:]):
                raise CheckpointReadError(f"{name}: replicated norm weights differ across "
                                          "tensor-parallel ranks; the checkpoint is inconsistent")
            merged[name] = first
        else:
            raise CheckpointReadError(f"{name}: no tensor-parallel merge rule for this parameter "
                                      "(only the Llama-style local layer spec is supported)")
    return merged


def _read_engine(location: CheckpointLocation, spec: JobSpec) -> tuple[dict, dict]:
    from checkpoint.manifest import lease, read_manifest
    from checkpoint.shard import ShardFormatError, read_shard
    from checkpoint.writer import checksum_bytes
    from infra.storage import StorageError, open_storage, storage_options_from_config

    storage = open_storage(location.root, storage_options_from_config(spec.checkpoint))
    try:
        manifest = read_manifest(storage, location.step)
        tp = int(manifest.layout.get("tp", 1))
        if int(manifest.layout.get("pp", 1)) != 1:
            raise CheckpointReadError(f"{location.step_url}: pipeline-parallel checkpoints "
                                      "cannot be exported yet")
        states = []
        with lease(storage, location.step, holder="export"):
            for rank in range(tp):  # data-parallel rank 0's tensor-parallel group
                record = manifest.shard_for(rank)
                data = storage.get_bytes(record.key)
                if len(data) != record.size or checksum_bytes(data) != record.checksum:
                    raise CheckpointReadError(f"{storage.url(record.key)}: size or checksum "
                                              "differs from the manifest; the shard is corrupt")
                _, state = read_shard(data)
                states.append(state)
    except (StorageError, ShardFormatError, KeyError, ValueError) as e:
        raise CheckpointReadError(f"{location.step_url}: unreadable ({e})") from e
    finally:
        storage.close()
    model_states = [{k.removeprefix("module."): v for k, v in s["model"].items()} for s in states]
    state_dict = merge_tensor_parallel(model_states, spec.model)
    _check_shapes(state_dict, spec, location)
    return state_dict, dict(states[0].get("trainer", {}))


def _check_shapes(state_dict: dict[str, torch.Tensor], spec: JobSpec,
                  location: CheckpointLocation) -> None:
    cfg = spec.model
    h, d = cfg.hidden_size, cfg.head_dim
    expected = {
        "embedding.word_embeddings.weight": (cfg.vocab_size, h),
        "decoder.layers.0.self_attention.linear_qkv.weight":
            ((cfg.num_attention_heads + 2 * cfg.kv_heads) * d, h),
        "decoder.layers.0.mlp.linear_fc1.weight": (2 * cfg.ffn_size, h),
    }
    layers = {int(m[1]) for k in state_dict if (m := re.match(r"decoder\.layers\.(\d+)\.", k))}
    problems = [f"{k}: {tuple(state_dict[k].shape) if k in state_dict else 'absent'} != {v}"
                for k, v in expected.items() if k not in state_dict or tuple(state_dict[k].shape) != v]
    if len(layers) != cfg.num_layers:
        problems.append(f"{len(layers)} layers != model.num_layers {cfg.num_layers}")
    if problems:
        raise CheckpointReadError(
            f"{location.step_url}: does not hold the model of job spec {spec.name!r} "
            f"({'; '.join(problems)}); use the job spec the checkpoint was trained with")


def read_model_state_dict(location: CheckpointLocation, spec: JobSpec) -> tuple[dict, dict]:
    """(whole megatron model state dict, trainer state) of a located checkpoint."""
    if location.kind == "dist":
        return _read_dist(location, spec)
    return _read_engine(location, spec)
