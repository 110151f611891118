"""Reading a trained model's whole weights out of a checkpoint (for export and evaluation).

A checkpoint (checkpoint.engine's "sharded" format, on a local path or s3://) stores
every tensor with its global shape and offset, so reading whole weights is one more
layout to load onto: the job's GPTModel built with tensor_parallel=1 and one pipeline
stage in a world of one process, filled through the same loader a resuming job uses
(training.checkpointing.load_sharded). No per-layer merge rules: the offsets say
where every piece goes, whatever TP/PP layout wrote it.

The checkpoint is a `checkpoint.manifest.CheckpointRef` (root URL, step, format), located
once: `locate_checkpoint` turns a step directory (`ROOT/step-00000040`) or a root (its
newest committed step) into one with a single listing. `read_model_state_dict(ref, spec)`
then reads that step's manifest once and the shards (checkpoint.engine.read_checkpoint:
no engine, so no writer process, thread or host buffers), after checking that the
checkpoint's model has the spec's shape (training.checkpointing.shape_problem).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from checkpoint.manifest import CheckpointRef
from infra.storage import Storage
from training.config import JobSpec


class CheckpointReadError(RuntimeError):
    """A checkpoint cannot be found or read as the job spec's model."""


def locate_checkpoint(where: str | Path | CheckpointRef, spec: JobSpec | None = None) -> CheckpointRef:
    """The committed checkpoint `where` names: a step directory, or the newest one under a root
    (a CheckpointRef is returned as it is). One listing; the job spec's S3 settings apply."""
    from checkpoint.manifest import locate
    from infra.storage import StorageError, storage_options_from_config

    if isinstance(where, CheckpointRef):
        return where
    where = str(where).rstrip("/")
    options = storage_options_from_config(spec.checkpoint) if spec is not None else None
    try:
        ref = locate(where, options)
    except StorageError as e:
        raise CheckpointReadError(f"{where}: cannot list the checkpoints there: {e}") from e
    if ref is None:
        raise CheckpointReadError(
            f"{where}: neither a checkpoint nor a directory holding committed "
            "checkpoints (step-NNNNNNNN/ with manifest.json); give a checkpoint directory or "
            "the job's checkpoint.url")
    return ref


def read_model_state_dict(ref: CheckpointRef, spec: JobSpec, *,
                          storage: Storage | None = None) -> tuple[dict, dict[str, Any]]:
    """(whole megatron model state dict, trainer state) of a located checkpoint.

    `storage`: an open storage at `ref.url` to read through (default: opened here with the
    job spec's S3 settings, and closed again)."""
    from checkpoint.engine import CheckpointError, CheckpointStorageUnavailable, read_checkpoint
    from infra.storage import StorageError, open_storage, storage_options_from_config
    from training.checkpointing import load_model_state, load_sharded, shape_problem, sharded_state
    from training.model import build_model, init_distributed, shutdown_distributed

    owns_world = not torch.distributed.is_initialized()
    if not owns_world and torch.distributed.get_world_size() != 1:
        raise CheckpointReadError("reading a checkpoint runs in a single process; call it "
                                  "outside a multi-rank job")
    # Whole matrices, one stage: the checkpoint reshards onto this layout.
    whole = {"tensor_parallel": 1, "pipeline_parallel": 1, "virtual_pipeline_stages": 1,
             "pipeline_stage_layers": None, "precision": "fp32",
             "use_distributed_optimizer": False, "recompute": "none"}
    fields = type(spec.training).model_fields
    training_cfg = spec.training.model_copy(update={k: v for k, v in whole.items() if k in fields})
    box: dict[str, Any] = {}
    opened = storage is None
    if opened:
        storage = open_storage(ref.url, storage_options_from_config(spec.checkpoint))
    try:
        init_distributed(1)
        model = build_model(spec.model, training_cfg)

        def fetch(requests):
            found = read_checkpoint(storage, ref.step, requests,
                                    accept=lambda _manifest, common: shape_problem(common, spec.model))
            box["trainer"] = dict(found.common["trainer"])
            return found.pieces, found.common["megatron"]

        try:
            loaded = load_sharded(sharded_state(model, None), fetch)
        except (CheckpointStorageUnavailable, StorageError) as e:
            raise CheckpointReadError(f"{ref.step_url}: cannot read it: {e}") from e
        except CheckpointError as e:
            raise CheckpointReadError(
                f"{ref.step_url}: cannot load it into the model of job spec {spec.name!r} "
                f"({e}); use the job spec the checkpoint was trained with") from e
        load_model_state(model, loaded["model"])
        state_dict = {k: v.detach().cpu() for k, v in model.state_dict().items()
                      if isinstance(v, torch.Tensor)}
    finally:
        if opened:
            storage.close()
        if owns_world:
            shutdown_distributed()
    return state_dict, box["trainer"]
