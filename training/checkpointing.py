"""The training loop's checkpointer: megatron's sharded state in checkpoint.engine's format.

One format ("sharded", `checkpoint.format` in the job spec), written by the async
engine (checkpoint.engine: host snapshot -> background persist to a path or s3:// ->
manifest last as the commit point; `async_save: false` persists before returning).
What a rank hands the engine at a checkpoint step:

    pieces   megatron's sharded state dict of the model and optimizer, flattened to
             global pieces (key, global shape, global offset: ShardedTensor metadata;
             stage-local layer numbers already global). The distributed optimizer
             gives its state in model space ('fully_reshardable', rank_state), so
             Adam moments reshard like the weights. Replicas are saved once.
    common   what megatron keeps outside the shards (optimizer param groups, Adam's
             common step) and the trainer state (step, data position, skips, spike
             detector): rank 0's copy, stored in the manifest.
    local    this rank's RNG streams; restored only when the layout that wrote them
             loads them (same-layout resume stays bit-exact). Another layout keeps
             its own seeded streams — the model has no dropout, so the loss does not
             depend on them.

Loading builds the same sharded state dict for the loading layout and asks the
engine for exactly its pieces, which it assembles from whichever shards overlap
them: any TP / PP / DP layout (and the one-process export) loads any checkpoint.
This mirrors megatron's own `dist_checkpointing.load` (load_preprocess, fill the
ShardedTensors, merge the common state, apply factory merges).

Each checkpoint's trainer state holds the job spec's `model` section (`model_config`).
A job that loads it compares the fields that decide tensor shapes (`SHAPE_FIELDS`) with its
own spec before any shard is read: a difference is one ConfigError naming each field, the
checkpoint's value and the spec's, and the fix. Everything else may differ (learning rate,
steps, batch size, the parallel layout: a layout reshards on load); a checkpoint from before
the model config was stored loads unchecked.

The interface the loop uses: latest() / load(step, model, optimizer, expect_model) / save /
before_optimizer_step / close, and save_after_failure. An async save returns before the
tensors are copied to host memory (checkpoint.engine, `overlap`): the copy runs during the
next step's forward and backward, and the loop calls `before_optimizer_step()` right before
the optimizer changes the parameters, which blocks only if the copy is still running.

A save after a peer's failure (`save_after_failure`, Just-In-Time checkpointing: Gupta et al.,
EuroSys 2024). When a rank dies mid-step (killed, its node lost, its GPU faulted), the others
learn it from their next collective, which fails. Until the optimizer's update their parameters
and optimizer state are still exactly those of the last completed step, and with data
parallelism alone (no tensor or pipeline split, no distributed optimizer) each of them holds all
of it. So one survivor (the only one when the world has two ranks; else the first to claim the
step in torchrun's store) writes that step by itself, as a checkpoint of a one-rank layout, and
commits it (manifest last, as always) before it exits: the restart resumes from the step the
job had reached, not from the last interval's. No such save (SAVE_OUTCOMES says which) after a
failure during the update (the state is neither step's), for a step whose regular save already
began, where no rank holds everything, or where the store is gone (with more than two ranks:
the agent that kept it exited with its failed rank); the restart then resumes from the last
committed checkpoint as before. It runs while the launcher waits for the failed attempt's ranks
to exit (infra.watch: `failure_grace_s`, then SIGTERM and SIGKILL): a save that does not finish
in time is never committed, so never loaded.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from training.config import ConfigError, ModelConfig
from training.rank_state import (
    OPTIMIZER_CHECKPOINT_METADATA,
    capture_rng_states,
    ensure_distributed_optimizer_state,
    restore_rng_states,
)

log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read."""


# What a collective raises when another rank is gone (gloo's TCP transport, NCCL's remote error,
# a collective's timeout): the failure is elsewhere, this rank's own state is intact.
PEER_FAILURE_TEXTS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                      "Timed out waiting", "ncclRemoteError", "NCCL communicator was aborted")
CLAIM_TIMEOUT_S = 1.0  # torchrun's store answers in milliseconds when it is there at all

# Why a save after a peer's failure did or did not happen (the rank log's `why=`, one token).
SAVE_OUTCOMES = {
    "saved": "committed the last completed step",
    "off": "checkpoint.save_on_failure is false",
    "during_update": "the failure came during the optimizer's update: the state is no step's",
    "no_whole_replica": "no rank holds the whole state (tensor or pipeline split, distributed optimizer)",
    "step_already_saving": "that step's regular save had already begun",
    "another_rank_saves": "another surviving rank claimed the step first",
    "store_unreachable": "torchrun's store is gone (its agent exited with its failed rank)",
    "not_committed": "the save failed (storage error): the restart uses the last committed step",
    "error": "the save raised (logged on stderr)",
}


def peer_failure(exc: BaseException) -> bool:
    """Whether `exc` says a peer rank failed (torch's DistNetworkError, or a collective's transport
    error), rather than that this rank itself broke."""
    import torch.distributed as dist

    if isinstance(exc, (dist.DistNetworkError, dist.DistBackendError)):
        return True
    return isinstance(exc, RuntimeError) and any(text in str(exc) for text in PEER_FAILURE_TEXTS)


# --- the model shape a checkpoint holds ------------------------------------------------------

# The model fields that decide tensor shapes (measured: each one changes a parameter's shape;
# seq_length, rope_theta, norm_epsilon and init_method_std change none: RoPE has no weights).
SHAPE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                "ffn_hidden_size", "vocab_size", "untie_embeddings_and_output_weights")


def model_shape(model: ModelConfig) -> dict[str, Any]:
    """The shape-deciding fields with their defaults resolved (no num_query_groups: one group
    per head; no ffn_hidden_size: the SwiGLU rule), so an unset field equals its value."""
    resolved = {"num_query_groups": model.kv_heads, "ffn_hidden_size": model.ffn_size}
    return {name: resolved.get(name, getattr(model, name)) for name in SHAPE_FIELDS}


def shape_differences(saved_model: dict[str, Any] | None, model: ModelConfig) -> list[str]:
    """`model.FIELD: checkpoint A, spec B` for each shape-deciding field in which a checkpoint's
    stored model config (its trainer state's `model_config`) differs from `model`; [] for
    a checkpoint that stored none (written before forgeflow stored it)."""
    if not saved_model:
        return []
    try:
        saved = model_shape(ModelConfig.model_validate(
            {k: v for k, v in saved_model.items() if k in ModelConfig.model_fields}))
    except ValueError as e:
        return [f"its stored model config does not validate ({e})"]
    wanted = model_shape(model)
    return [f"model.{name}: checkpoint {saved[name]}, spec {wanted[name]}"
            for name in SHAPE_FIELDS if saved[name] != wanted[name]]


def shape_problem(common: Any, model: ModelConfig) -> str | None:
    """The loaders' check of a checkpoint's common state (checkpoint.engine's `accept`): why its
    model does not have `model`'s shape, or None."""
    trainer = common.get("trainer", {}) if isinstance(common, dict) else {}
    differences = shape_differences(trainer.get("model_config"), model)
    if not differences:
        return None
    return "its model has another shape than the job spec's: " + "; ".join(differences)


# --- megatron's sharded state <-> the engine's global pieces ----------------------------------

def sharded_state(model, optimizer, is_loading: bool = False) -> dict[str, Any]:
    """The megatron sharded state dict of the model (and optimizer, when given)."""
    model_state = model.sharded_state_dict()
    state: dict[str, Any] = {"model": model_state}
    if optimizer is not None:
        if is_loading:
            from training.megatron_compat import fix_distributed_optimizer_resume

            fix_distributed_optimizer_resume()
            ensure_distributed_optimizer_state(optimizer)  # a fresh one has no Adam state yet
        state["optimizer"] = optimizer.sharded_state_dict(
            model_state, is_loading=is_loading, metadata=OPTIMIZER_CHECKPOINT_METADATA())
    return state


def _walk(node: Any, path: tuple = ()):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _walk(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _walk(v, path + (i,))
    else:
        yield path, node


def _piece_geometry(sh) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global offset, extent) of a ShardedTensor: prepended axes (e.g. the layer) have extent 1."""
    if sh.flattened_range is not None:
        raise CheckpointError(f"{sh.key}: flattened shards are not supported; the distributed "
                              "optimizer must use its fully_reshardable checkpoint format")
    shape = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
    return tuple(sh.global_offset), shape


def to_pieces(sharded: dict[str, Any]) -> tuple[list, Any]:
    """(global pieces, megatron's common state) of a sharded state dict, as megatron saves it."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess

    from checkpoint.sharded import GlobalPiece

    part, common = save_preprocess(sharded, validate_access_integrity=False)
    pieces = []
    for _, sh in _walk(part):
        if isinstance(sh, ShardedTensor):
            offset, _ = _piece_geometry(sh)
            data = sh.data.detach()[(None,) * sh.prepend_axis_num]  # a view, never a copy
            pieces.append(GlobalPiece(sh.key, tuple(sh.global_shape), offset, data))
        elif isinstance(sh, ShardedObject):
            pieces.append(GlobalPiece(sh.key, tuple(sh.global_shape), tuple(sh.global_offset),
                                      sh.data, is_object=True))
        else:
            raise CheckpointError(f"unsupported sharded value {type(sh).__name__} ({getattr(sh, 'key', '')})")
    return pieces, common


def load_sharded(sharded: dict[str, Any], fetch: Callable[[list], tuple[list, Any]]) -> dict[str, Any]:
    """Fill a loading sharded state dict: `fetch(requests) -> (values, saved common state)`."""
    from megatron.core.dist_checkpointing.dict_utils import merge
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factory_merges
    from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess
    from megatron.core.dist_checkpointing.utils import extract_sharded_base

    from checkpoint.sharded import PieceRequest

    part, nonpersistent, factories = load_preprocess(sharded)
    part, _ = extract_sharded_base(part)
    slots, requests = [], []
    for path, sh in _walk(part):
        if isinstance(sh, ShardedTensor):
            offset, shape = _piece_geometry(sh)
            requests.append(PieceRequest(sh.key, tuple(sh.global_shape), offset, shape, sh.dtype))
        elif isinstance(sh, ShardedObject):
            requests.append(PieceRequest(sh.key, tuple(sh.global_shape), tuple(sh.global_offset),
                                         is_object=True))
        else:
            raise CheckpointError(f"unsupported sharded value {type(sh).__name__}")
        slots.append((path, sh))
    values, common = fetch(requests)
    for (path, sh), value in zip(slots, values):
        if isinstance(sh, ShardedTensor):
            value = value.view(tuple(sh.local_shape))
            if sh.data is not None:
                value = value.to(sh.data.device)
        node = part
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    common = common if common is not None else {}
    merge(common, nonpersistent)
    merge(common, part)
    return apply_factory_merges(common, factories)


def load_model_state(model, loaded_model: dict[str, Any]) -> None:
    if isinstance(model, torch.nn.ModuleList):  # virtual pipeline stages: "model{i}" per chunk
        for i, chunk in enumerate(model):
            chunk.load_state_dict(loaded_model[f"model{i}"])
    else:
        model.load_state_dict(loaded_model)


# --- the loop's checkpointer --------------------------------------------------------------------

class Checkpointer:
    """save / latest / load / close over checkpoint.engine, for every rank of the job.

    `after_shards_written(step)` runs on every rank once its shard is persisted and
    before the commit — the fault injector's hook for `exit_mid_checkpoint`.
    """

    def __init__(self, checkpoint_cfg, env, after_shards_written: Callable[[int], None] | None = None,
                 writer: str | None = None):
        from checkpoint.engine import CheckpointEngine
        from infra.storage import storage_options_from_config

        self.env = env
        self.layout = {"dp": env.dp_size, "tp": env.tp_size, "pp": getattr(env, "pp_size", 1)}
        self.engine = CheckpointEngine(
            checkpoint_cfg.url, rank=env.rank, world_size=env.world_size, layout=self.layout,
            keep_last=checkpoint_cfg.keep_last, on_busy=checkpoint_cfg.on_busy,
            async_save=checkpoint_cfg.async_save, writer=writer,
            storage_options=storage_options_from_config(checkpoint_cfg),
            after_shard_written=after_shards_written)
        self.checkpoint_cfg = checkpoint_cfg
        self._newest_listed: int | None = None
        self._saving_from: int | None = None  # the newest step whose save() began

    def save(self, step: int, model, optimizer, trainer_state: dict[str, Any]) -> dict[str, Any]:
        self._saving_from = step
        pieces, common = to_pieces(sharded_state(model, optimizer))
        trainer = dict(trainer_state, step=step, layout=self.layout)
        self.engine.config_hash = str(trainer_state.get("config_hash", ""))
        outcome = self.engine.save(step, {"rng": capture_rng_states()}, pieces=pieces,
                                   common={"megatron": common, "trainer": trainer},
                                   overlap=self.engine.async_save)
        return {"stall_s": round(outcome.stall_s, 4), "wait_s": round(outcome.wait_s, 4),
                "skipped": outcome.skipped, "async": self.engine.async_save}

    def save_after_failure(self, failure: BaseException, step: int, model, optimizer,
                           trainer_state: dict[str, Any], full_replica: bool, updating: bool = False
                           ) -> tuple[dict[str, Any] | None, str | None]:
        """After `failure` interrupted the step after `step` (`updating`: during the optimizer's
        update), commit `step` from this rank alone if it may and should (the module's docstring).
        Returns (what the save cost, or None when there was none; why: one of SAVE_OUTCOMES, None
        when `failure` is not a peer's). No collective is used: the peers are gone."""
        if self.env.world_size == 1 or not peer_failure(failure):
            return None, None
        if not self.checkpoint_cfg.save_on_failure:
            return None, "off"
        if updating:
            return None, "during_update"
        if not full_replica:
            return None, "no_whole_replica"
        if self._saving_from is not None and step <= self._saving_from:
            return None, "step_already_saving"
        if self.env.world_size > 2:  # with a single peer, the failed one, this rank is the only survivor
            try:
                if not self._claim(step):
                    return None, "another_rank_saves"
            except (RuntimeError, OSError, ValueError):  # the store's node is gone
                return None, "store_unreachable"
        from checkpoint.engine import CheckpointEngine

        started = time.monotonic()
        layout = {"dp": 1, "tp": 1, "pp": 1}  # what wrote it: one rank, holding everything
        engine = CheckpointEngine(
            self.engine.url, rank=0, world_size=1, layout=layout, keep_last=self.engine.keep_last,
            async_save=False, writer="thread", storage_options=self.engine.options, preflight=False)
        try:
            engine.config_hash = str(trainer_state.get("config_hash", ""))
            pieces, common = to_pieces(sharded_state(model, optimizer))
            engine.save(step, {"rng": capture_rng_states()}, pieces=pieces,
                        common={"megatron": common, "trainer": dict(trainer_state, step=step, layout=layout)})
        finally:
            engine.close()
        report = engine.reports[-1] if engine.reports else None
        if report is None or not report.committed:
            log.error("checkpoint: the save of step %d after a peer's failure did not commit: %s",
                      step, report.error if report else "no persist ran")
            return None, "not_committed"
        return {"seconds": round(time.monotonic() - started, 3), "bytes": report.bytes}, "saved"

    def _claim(self, step: int) -> bool:
        """Whether this rank is the one survivor to save `step`: the first to set the step's key in
        torchrun's store (its agent on node 0 keeps it), once per restart round. A store that does
        not answer within CLAIM_TIMEOUT_S is gone (that agent exited with its failed rank)."""
        import torch.distributed as dist

        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timedelta(seconds=CLAIM_TIMEOUT_S))
        key = f"forgeflow-save-after-failure/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{step}"
        return store.compare_set(key, "", str(self.env.rank)) == str(self.env.rank).encode()

    def before_optimizer_step(self) -> float:
        """Wait for the host copy of the last checkpoint (it overlaps the forward and
        backward); call before the optimizer changes the state. Seconds blocked."""
        return self.engine.wait_snapshot()

    def latest(self) -> int | None:
        """The newest committed step (collective). `load()` of it falls back past a newest
        one that fails verification; the trainer state it returns names the step loaded."""
        steps = self.engine.committed_steps()
        self._newest_listed = steps[-1] if steps else None
        return self._newest_listed

    def load(self, step: int | None, model, optimizer, expect_model: ModelConfig | None = None
             ) -> dict[str, Any]:
        """Restore model, optimizer (any layout) and, on the same layout, RNG; the trainer state.

        `expect_model`: the job spec's model; a checkpoint that stored another shape raises
        ConfigError (on every rank) naming the fields, before any shard is read."""
        from checkpoint.engine import CheckpointError as CheckpointEngineError
        from checkpoint.manifest import step_dir

        newest = step is None or step == self._newest_listed
        box: dict[str, Any] = {}
        refused: dict[int, str] = {}

        def accept(manifest, common) -> str | None:
            problem = shape_problem(common, expect_model) if expect_model is not None else None
            if problem:
                refused[manifest.step] = problem
            return problem

        def fetch(requests):
            found = self.engine.load(None if newest else step, requests=requests, accept=accept)
            if found is None:
                raise CheckpointError(f"{self.engine.url}: no committed checkpoint verifies")
            box["found"] = found
            return found.pieces, found.common["megatron"]

        try:
            loaded = load_sharded(sharded_state(model, optimizer, is_loading=True), fetch)
        except CheckpointEngineError:
            if not refused:
                raise
            at, problem = next(iter(refused.items()))
            raise ConfigError(
                f"{self.engine.storage.url(step_dir(at))}: unable to load the checkpoint: {problem}. "
                "Resume it with the job spec it was trained with, or point checkpoint.url at a "
                "folder of its own for this model") from None
        found = box["found"]
        load_model_state(model, loaded["model"])
        optimizer.load_state_dict(loaded["optimizer"])
        trainer = dict(found.common["trainer"])
        if found.skipped_steps:
            log.warning("checkpoint: newer steps %s failed verification; resumed from %d",
                        found.skipped_steps, found.step)
        if found.same_layout:
            restore_rng_states(found.state["rng"])
        else:
            log.warning("checkpoint: step %d was written by layout %s (%d ranks); resharded onto %s",
                        found.step, found.manifest.layout, found.manifest.world_size, self.layout)
        return trainer

    def close(self, job_finished: bool = False) -> None:
        """Waits for the in-flight persist, so the last checkpoint is committed on exit; once the
        job has finished, this rank's host copies of its shards go too (no restart reads them)."""
        self.engine.close()
        if job_finished:
            self.engine.forget_host_copies()


def open_checkpointer(checkpoint_cfg, env,
                      after_shards_written: Callable[[int], None] | None = None) -> Checkpointer:
    """The checkpointer for a job spec's `checkpoint:` section (one format: "sharded")."""
    return Checkpointer(checkpoint_cfg, env, after_shards_written)
