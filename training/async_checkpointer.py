"""The training loop's `Checkpointer` over the async engine (checkpoint.engine).

Same four methods as `training.checkpointing.LocalCheckpointer` — save / latest /
load / close — so the loop does not know which writer it has. What a rank saves is
its own local state, exactly what it needs to continue bit-for-bit:

    model      this rank's model.state_dict() (its tensor-parallel shard)
    optimizer  optimizer.state_dict() (Adam moments, step counts, param groups), plus
               the local parameter-state shard when the distributed optimizer is used
    rng        python / numpy / torch (CPU, CUDA) / megatron tracker states of this rank
    trainer    step, data position, skipped batches, spike-detector state, ...

Resuming needs the same world size and parallel layout as the run that wrote it
(resharding is what the dist_checkpointing writer is for).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from training.rank_state import capture_rng_states, ensure_distributed_optimizer_state, restore_rng_states

log = logging.getLogger(__name__)


class AsyncCheckpointer:
    def __init__(self, checkpoint_cfg, env, after_shards_written: Callable[[int], None] | None = None,
                 writer: str | None = None):
        from checkpoint.engine import CheckpointEngine
        from infra.storage import storage_options_from_config

        self.env = env
        self.engine = CheckpointEngine(
            checkpoint_cfg.url, rank=env.rank, world_size=env.world_size,
            layout={"dp": env.dp_size, "tp": env.tp_size, "pp": 1},
            keep_last=checkpoint_cfg.keep_last, on_busy=checkpoint_cfg.on_busy,
            async_save=checkpoint_cfg.async_save, writer=writer,
            storage_options=storage_options_from_config(checkpoint_cfg),
            after_shard_written=after_shards_written)
        self._found = None  # what latest() verified, kept for the load() that follows

    def save(self, step: int, model, optimizer, trainer_state: dict[str, Any]) -> dict[str, Any]:
        state: dict[str, Any] = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "rng": capture_rng_states(),
            "trainer": dict(trainer_state, step=step),
        }
        subs = _sub_optimizers(optimizer)
        if any(_is_distributed(sub) for sub in subs):
            # The DistributedOptimizer keeps its Adam moments and fp32 main params out of
            # state_dict(); this rank's shard of them, as views (the snapshot copies them).
            state["optimizer_param_state"] = [
                sub.get_parameter_state_dp_reshardable() if _is_distributed(sub) else None
                for sub in subs]
        self.engine.config_hash = str(trainer_state.get("config_hash", ""))
        outcome = self.engine.save(step, state)
        return {"stall_s": round(outcome.stall_s, 4), "wait_s": round(outcome.wait_s, 4),
                "skipped": outcome.skipped, "async": self.engine.async_save}

    def latest(self) -> int | None:
        """The newest committed step whose shards verify on every rank (collective)."""
        self._found = self.engine.load()
        if self._found is not None and self._found.skipped_steps:
            log.warning("checkpoint: newer steps %s failed verification; resuming from %d",
                        self._found.skipped_steps, self._found.step)
        return None if self._found is None else self._found.step

    def load(self, step: int, model, optimizer) -> dict[str, Any]:
        found = self._found if self._found is not None and self._found.step == step else None
        if found is None:
            found = self.engine.load(step)
        self._found = None
        state = found.state
        model.load_state_dict(state["model"])
        if "optimizer_param_state" in state:
            from training.megatron_compat import fix_distributed_optimizer_resume

            fix_distributed_optimizer_resume()
            ensure_distributed_optimizer_state(optimizer)  # a fresh one has no Adam state yet
        optimizer.load_state_dict(state["optimizer"])
        for sub, param_state in zip(_sub_optimizers(optimizer), state.get("optimizer_param_state", [])):
            if param_state is not None:
                _mark_unpadded(param_state)
                with torch.no_grad():  # it copies into fp32 main params that require grad
                    sub.load_parameter_state_from_dp_reshardable(param_state)
        restore_rng_states(state["rng"])
        return state["trainer"]

    def close(self) -> None:
        """Waits for the in-flight persist, so the last checkpoint is committed on exit."""
        self.engine.close()


def _sub_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _is_distributed(optimizer) -> bool:
    return hasattr(optimizer, "get_parameter_state_dp_reshardable")


def _mark_unpadded(param_state: dict) -> None:
    """megatron 0.16.1's loader (distrib_optimizer.py:1793) reads a 'padding' flag that its
    own get_parameter_state_dp_reshardable() (:942) never writes; every entry it wrote is a
    real parameter, so mark them as such."""
    for key, by_dtype in param_state.items():
        if not isinstance(key, int):
            continue
        for buckets in by_dtype.values():
            for bucket in buckets:
                for entry in bucket:
                    entry.setdefault("padding", False)
