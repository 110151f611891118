"""Checkpoint and exact resume with megatron-core `dist_checkpointing`.

What a checkpoint holds (one `dist_checkpointing` directory):

    model       the GPTModel's sharded state dict (TP shards reassemble on load)
    optimizer   megatron optimizer state (Adam moments, step) sharded like the model
    rng         per-rank RNG states (python, numpy, torch CPU, torch CUDA, megatron's
                tracker), a ShardedObject indexed by global rank
    trainer     plain values from rank 0: step, data position, skipped batches, world
                size, config hash — whatever the training loop passes as `trainer_state`

Layout under the checkpoint root (`spec.checkpoint.url`, a local path or file:// URL)::

    step_00000020/            a COMPLETE checkpoint (only complete ones have this name)
    step_00000040.partial/    being written, or left by a crash; ignored and replaced

The writer fills `step_N.partial/`, all ranks meet at a barrier, then rank 0 renames
it to `step_N/` (atomic on one filesystem): a checkpoint exists only once renamed,
so `latest()` never returns a half-written one. Older complete checkpoints beyond
`keep_last` are deleted after each save.

The interface (`Checkpointer`: save / latest / load / close) is what the training loop
uses; the async/S3 engine (checkpoint/engine.py) implements the same methods and can
reuse `sharded_state()` / `restore_rng_states()` so only the writer differs.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from training.model import DistEnv
from training.rank_state import (
    OPTIMIZER_CHECKPOINT_METADATA,
    capture_rng_states,
    ensure_distributed_optimizer_state,
    restore_rng_states,
)

_STEP_DIR = re.compile(r"^step_(\d{8})$")
PARTIAL_SUFFIX = ".partial"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read."""


class Checkpointer(Protocol):
    def save(self, step: int, model, optimizer, trainer_state: dict[str, Any]) -> dict[str, Any] | None: ...
    def latest(self) -> int | None: ...
    def load(self, step: int, model, optimizer) -> dict[str, Any]: ...
    def close(self) -> None: ...


def local_root(url: str) -> Path:
    """The directory a `file://` URL or bare path names; s3:// belongs to checkpoint.engine."""
    if url.startswith("file://"):
        return Path(url[len("file://"):])
    if "://" in url:
        raise CheckpointError(
            f"checkpoint url {url!r}: the local checkpointer handles file:// URLs and paths; "
            "s3:// needs the async engine (checkpoint.engine)"
        )
    return Path(url)


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def complete_steps(root: str | Path) -> list[int]:
    """Steps of the complete checkpoints under `root`, ascending."""
    root = Path(root)
    if not root.is_dir():
        return []
    steps = []
    for entry in root.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and entry.is_dir():
            steps.append(int(match.group(1)))
    return sorted(steps)


# --- what goes into a checkpoint --------------------------------------------------------------

def sharded_state(model, optimizer, env: DistEnv, trainer_state: dict[str, Any] | None,
                  is_loading: bool = False) -> dict[str, Any]:
    """The sharded state dict that `dist_checkpointing.save/load` take (see module doc)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    model_state = model.sharded_state_dict()
    if is_loading:
        from training.megatron_compat import fix_distributed_optimizer_resume

        fix_distributed_optimizer_resume()
        ensure_distributed_optimizer_state(optimizer)
    state = {
        "model": model_state,
        "optimizer": optimizer.sharded_state_dict(
            model_state, is_loading=is_loading, metadata=OPTIMIZER_CHECKPOINT_METADATA(),
        ),
        "rng": ShardedObject(
            "rng_state", None if is_loading else capture_rng_states(),
            (env.world_size,), (env.rank,), replica_id=0,
        ),
    }
    if trainer_state is not None:
        state["trainer"] = trainer_state
    return state


# --- process hygiene ---------------------------------------------------------------------------

def _die_with_parent() -> None:
    """Runs in megatron's queue-manager process: SIGKILL it when its parent dies (Linux)."""
    import ctypes
    import signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the manager then lingers after a SIGKILLed worker, as upstream


def install_write_results_queue() -> None:
    """Give dist_checkpointing a results queue whose manager process dies with this worker.

    megatron-core's FileSystemWriterAsync (dist_checkpointing/strategies/filesystem_async.py:51-56,
    used by synchronous saves too, :185) lazily starts a spawn-context multiprocessing
    Manager to collect write results. If the worker is SIGKILLed (OOM killer, a fault) or
    `os._exit`s, that Manager is orphaned and lives on, holding the worker's stdout/stderr
    open, so the launcher waiting for EOF hangs. The same Manager started with a
    parent-death signal disappears with the worker.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from torch import multiprocessing as mp
    from multiprocessing.managers import SyncManager

    if filesystem_async._results_queue is not None:
        return
    manager = SyncManager(ctx=mp.get_context("spawn"))
    manager.start(initializer=_die_with_parent)
    filesystem_async._results_queue = manager.Queue()
    filesystem_async._forgeflow_manager = manager  # keep it referenced for the process lifetime


# --- the synchronous local writer -------------------------------------------------------------

class LocalCheckpointer:
    """Synchronous `dist_checkpointing` save/load to a local (or shared) directory.

    `after_shards_written(step)` is called on every rank after its shards are on disk
    and before the checkpoint is committed — the fault injector's hook for
    `exit_mid_checkpoint`; None in normal runs.
    """

    def __init__(self, root: str | Path, env: DistEnv, keep_last: int = 3,
                 after_shards_written: Callable[[int], None] | None = None):
        self.root = Path(root)
        self.env = env
        self.keep_last = keep_last
        self.after_shards_written = after_shards_written
        install_write_results_queue()
        if env.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
        torch.distributed.barrier()

    def save(self, step: int, model, optimizer, trainer_state: dict[str, Any]) -> None:
        from megatron.core import dist_checkpointing

        final = self.root / step_dir_name(step)
        partial = self.root / (step_dir_name(step) + PARTIAL_SUFFIX)
        if self.env.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)  # a crashed earlier attempt
            partial.mkdir(parents=True)
        torch.distributed.barrier()
        state = sharded_state(model, optimizer, self.env, dict(trainer_state, step=step))
        dist_checkpointing.save(state, str(partial))
        if self.after_shards_written is not None:
            self.after_shards_written(step)
        torch.distributed.barrier()  # every rank's shards are written
        if self.env.rank == 0:
            if final.exists():  # re-saving a step after a restart: replace it whole
                shutil.rmtree(final)
            os.replace(partial, final)
            self._prune()
        torch.distributed.barrier()

    def latest(self) -> int | None:
        steps = complete_steps(self.root)
        return steps[-1] if steps else None

    def load(self, step: int, model, optimizer) -> dict[str, Any]:
        """Restore model, optimizer and this rank's RNG states; returns the trainer state."""
        from megatron.core import dist_checkpointing

        path = self.root / step_dir_name(step)
        if not path.is_dir():
            raise CheckpointError(f"{path}: no complete checkpoint for step {step}")
        common = dist_checkpointing.load_common_state_dict(str(path))
        trainer_state = common.get("trainer", {})
        saved_world = trainer_state.get("world_size")
        template = sharded_state(model, optimizer, self.env, None, is_loading=True)
        if saved_world != self.env.world_size:
            # RNG states are per rank; with another world size they cannot map 1:1. The
            # model and optimizer reshard; training randomness does not depend on them.
            del template["rng"]
        loaded = dist_checkpointing.load(template, str(path))
        model.load_state_dict(loaded["model"])
        optimizer.load_state_dict(loaded["optimizer"])
        if "rng" in loaded:
            restore_rng_states(loaded["rng"])
        return trainer_state

    def close(self) -> None:
        pass

    def _prune(self) -> None:
        for old in complete_steps(self.root)[: -self.keep_last]:
            shutil.rmtree(self.root / step_dir_name(old), ignore_errors=True)


def open_checkpointer(checkpoint_cfg, env: DistEnv,
                      after_shards_written: Callable[[int], None] | None = None) -> Checkpointer:
    """The checkpointer for a job spec's `checkpoint:` section.

    `async_save: true` (the default) or an s3:// URL: the async engine (checkpoint.engine,
    via training.async_checkpointer). `async_save: false` on a local path: this module's
    synchronous dist_checkpointing writer (reshardable, what `forgeflow export` reads).
    """
    if checkpoint_cfg.async_save or checkpoint_cfg.url.startswith("s3://"):
        from training.async_checkpointer import AsyncCheckpointer

        return AsyncCheckpointer(checkpoint_cfg, env, after_shards_written)
    return LocalCheckpointer(local_root(checkpoint_cfg.url), env, checkpoint_cfg.keep_last,
                             after_shards_written)


def read_trainer_state(checkpoint_dir: str | Path) -> dict[str, Any]:
    """The plain trainer values of a complete checkpoint (no torch.distributed needed)."""
    path = Path(checkpoint_dir) / "common.pt"
    if not path.is_file():
        raise CheckpointError(f"{checkpoint_dir}: not a dist_checkpointing directory (no common.pt)")
    try:
        common = torch.load(path, map_location="cpu", weights_only=False)
    except (pickle.UnpicklingError, RuntimeError) as e:
        raise CheckpointError(f"{path}: unreadable ({e})") from None
    return common.get("trainer", {})
