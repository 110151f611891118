"""Reading a trained model's whole weights out of a checkpoint (for export and evaluation).

A checkpoint (checkpoint.engine's "sharded" format, on a local path or s3://) stores
every tensor with its global shape and offset, so reading whole weights is one more
layout to load onto: the job's GPTModel built with tensor_parallel=1 and one pipeline
stage in a world of one process, filled through the same loader a resuming job uses
(training.checkpointing.load_sharded). No per-layer merge rules: the offsets say
where every piece goes, whatever TP/PP layout wrote it.

`locate_checkpoint` accepts a step directory (`ROOT/step-00000040`) or a root holding
committed steps (the newest is taken), both through checkpoint.committed_checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from training.config import JobSpec


class CheckpointReadError(RuntimeError):
    """A checkpoint cannot be found or read as the job spec's model."""


@dataclass(frozen=True)
class CheckpointLocation:
    root: str  # the checkpoint root (a path or URL)
    step: int
    step_url: str  # the step's own directory (path or URL)
    kind: str = "sharded"  # the on-storage format (checkpoint.format)

    @property
    def name(self) -> str:  # e.g. step-00000040
        return self.step_url.rstrip("/").rsplit("/", 1)[-1]


def _committed(root: str, spec: JobSpec | None) -> list:
    from checkpoint.manifest import committed_checkpoints
    from infra.storage import StorageError, storage_options_from_config

    options = storage_options_from_config(spec.checkpoint) if spec is not None else None
    try:
        return committed_checkpoints(root, options)
    except StorageError:
        return []


def locate_checkpoint(where: str | Path, spec: JobSpec | None = None) -> CheckpointLocation:
    """The checkpoint `where` names: a step directory, or the newest one under a root."""
    from checkpoint.manifest import parse_step_dir

    where = str(where).rstrip("/")
    parent, _, name = where.rpartition("/")
    step = parse_step_dir(name)
    if step is not None and parent:
        if any(r.step == step for r in _committed(parent, spec)):
            return CheckpointLocation(parent, step, where)
    records = _committed(where, spec)
    if not records:
        raise CheckpointReadError(
            f"{where}: neither a checkpoint nor a directory holding committed "
            "checkpoints (step-NNNNNNNN/ with manifest.json); give a checkpoint directory or "
            "the job's checkpoint.url")
    newest = records[-1]
    return CheckpointLocation(where, newest.step, newest.url)


def read_model_state_dict(location: CheckpointLocation, spec: JobSpec) -> tuple[dict, dict[str, Any]]:
    """(whole megatron model state dict, trainer state) of a located checkpoint."""
    from checkpoint.engine import CheckpointEngine, CheckpointError
    from infra.storage import StorageError, storage_options_from_config
    from training.checkpointing import load_model_state, load_sharded, sharded_state
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
    try:
        init_distributed(1)
        model = build_model(spec.model, training_cfg)
        engine = CheckpointEngine(location.root, layout={"dp": 1, "tp": 1, "pp": 1}, writer="thread",
                                  preflight=False,
                                  storage_options=storage_options_from_config(spec.checkpoint))

        def fetch(requests):
            found = engine.load(location.step, requests=requests, set_aside=False)
            if found is None:
                raise CheckpointReadError(f"{location.step_url}: failed verification (see the "
                                          "warning above); the checkpoint is damaged")
            box["trainer"] = dict(found.common["trainer"])
            return found.pieces, found.common["megatron"]

        try:
            loaded = load_sharded(sharded_state(model, None), fetch)
        except (CheckpointError, StorageError) as e:
            raise CheckpointReadError(
                f"{location.step_url}: cannot load it into the model of job spec {spec.name!r} "
                f"({e}); use the job spec the checkpoint was trained with") from e
        finally:
            engine.close()
        load_model_state(model, loaded["model"])
        state_dict = {k: v.detach().cpu() for k, v in model.state_dict().items()
                      if isinstance(v, torch.Tensor)}
    finally:
        if owns_world:
            shutdown_distributed()
    return state_dict, box["trainer"]
