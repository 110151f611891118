"""Measure the real per-rank peak memory of training steps, to check `scheduler.memory_model`.

    peak = measure_training_peak(model_cfg, training_cfg)     # MeasuredPeak, bytes
    peak.total, peak.by_category["activations"]

It builds the model exactly as the training worker does (`training.model`:
megatron GPTModel, megatron DDP with fp32 grad buffers, megatron's Adam), runs
`steps` optimizer steps (the first step creates Adam's state, so the peak of a
steady-state step appears from step two) under PyTorch's
`torch.distributed._tools.mem_tracker.MemTracker`, and reads the tracker's
peak snapshot. MemTracker counts every tensor storage created through the
dispatcher (CPU tensors included) plus what `track_external` registers (the
model's parameters, DDP's gradient buffers and the optimizer state), so the
figure is "bytes of live tensors at the worst moment" — no allocator slack,
no runtime context.

`fake=True` builds and runs everything under `FakeTensorMode`: tensors have
shapes but no storage, so 7B/13B-class models are traced on a laptop. The
gradient clipping is switched off there (its norm is data, which fake tensors
do not have); clipping allocates nothing large.

Run as a module under torchrun to measure tensor-parallel configurations
(one JSON line per configuration on rank 0, the maximum over ranks):

    torchrun --nproc-per-node 2 -m scheduler.memory_probe CONFIGS.json
"""

from __future__ import annotations

import contextlib
import json
import sys
from dataclasses import dataclass
from typing import Any, Iterator

from training.config import ModelConfig, TrainingConfig

_CATEGORY_NAMES = {  # MemTracker's reference types -> our words
    "parameter": "weights",
    "buffer": "buffers",
    "gradient": "gradients",
    "other": "grad_buffers",  # DDP's main_grad buffers, registered via track_external
    "optstate": "optimizer_states",
    "activation": "activations",
    "temp": "temporaries",
}


@dataclass(frozen=True)
class MeasuredPeak:
    """The tracker's peak snapshot: total bytes and bytes per MemTracker category."""

    total: int
    by_category: dict[str, int]
    rank: int = 0


@contextlib.contextmanager
def cpu_recompute_support(allow_half_precision: bool = False) -> Iterator[None]:
    """Let megatron's activation recompute run on CPU for the duration of a measurement.

    megatron's CheckpointFunction saves and restores the CUDA RNG state
    (tensor_parallel/random.py:_get_all_rng_states/_set_all_rng_states), which asserts
    without CUDA. forgeflow's models have no dropout, so there is no CUDA random state
    to keep: the two CUDA-state helpers become no-ops, and `training.model`'s refusal
    of recompute on CPU is lifted (its other CPU checks — fp32 only, no distributed
    optimizer — stay). A GPU run never enters this: it is a no-op with CUDA present.

    `allow_half_precision` also lifts the fp32-only check, for measurements that build
    no optimizer (megatron's mixed-precision optimizer is what needs CUDA; the bf16
    model, DDP's fp32 gradient buffers, forward and backward run on CPU).
    """
    import torch

    if torch.cuda.is_available():
        yield
        return
    from megatron.core.tensor_parallel import random as tp_random

    from training import model as training_model

    saved = (tp_random._get_cuda_rng_state, tp_random._set_cuda_rng_state, training_model._check_cpu_support)
    original_check = saved[2]

    def check_without_recompute(training_cfg: TrainingConfig) -> None:
        relaxed: dict[str, Any] = {"recompute": "none"}
        if allow_half_precision:
            relaxed["precision"] = "fp32"
        original_check(training_cfg.model_copy(update=relaxed))

    tp_random._get_cuda_rng_state = lambda *a, **k: None
    tp_random._set_cuda_rng_state = lambda *a, **k: None
    training_model._check_cpu_support = check_without_recompute
    try:
        yield
    finally:
        tp_random._get_cuda_rng_state, tp_random._set_cuda_rng_state, training_model._check_cpu_support = saved


def _global_peak_tracker() -> Any:
    """A MemTracker that keeps only the global peak.

    The stock tracker also records a per-module peak after every operator, looping
    over every tracked module and deep-copying snapshots; on a 40-layer model that
    is most of the run time. The global peak (`get_tracker_snapshot("peak")`) is
    computed exactly as upstream does (torch 2.13, mem_tracker.py:_update_peak_stats).
    """
    from torch.distributed._tools.mem_tracker import MemTracker

    class GlobalPeakTracker(MemTracker):
        def _update_peak_stats(self, peak_state: Any) -> None:
            for dev, dev_snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < dev_snap["Total"]:
                    self._peak_mem[dev] = dev_snap["Total"]
                    self._peak_mem_snap[dev] = dict(dev_snap)

    tracker = GlobalPeakTracker()
    if not all(hasattr(tracker, a) for a in ("_curr_mem_snap", "_peak_mem", "_peak_mem_snap")):
        return MemTracker()  # a torch whose internals moved: the slow, stock path
    return tracker


def _snapshot_bytes(snapshot: dict[Any, dict[Any, int]]) -> tuple[int, dict[str, int]]:
    total = 0
    by_category: dict[str, int] = {}
    for device_snapshot in snapshot.values():
        for key, value in device_snapshot.items():
            name = str(getattr(key, "value", key))
            if name == "Total":
                total += value
            else:
                label = _CATEGORY_NAMES.get(name.lower(), name.lower())
                by_category[label] = by_category.get(label, 0) + value
    return total, by_category


def measure_training_peak(
    model_cfg: ModelConfig,
    training_cfg: TrainingConfig,
    *,
    steps: int = 2,
    fake: bool = False,
    with_optimizer: bool = True,
    adam_foreach: bool = False,
) -> MeasuredPeak:
    """Peak bytes of `steps` training steps on this rank (see the module docstring).

    Needs torch.distributed to be set up by `training.model.init_distributed` (a world of
    one is started when not under torchrun); the global batch is split into
    micro batches over this process's data-parallel group as the trainer does.

    `with_optimizer=False` runs forward and backward (into DDP's gradient buffers)
    only; that is how bf16/fp16 is measured on CPU, where megatron's mixed-precision
    optimizer cannot be built. `adam_foreach=True` makes torch's AdamW take its multi-tensor
    (foreach) path, its default on CUDA, instead of the single-tensor loop it picks on CPU.
    """
    import torch

    from training import model as tm

    if steps < 2:
        raise ValueError("steps must be >= 2: Adam's state exists only from the second step")
    if training_cfg.precision != "fp32" and with_optimizer and not torch.cuda.is_available():
        raise ValueError(
            f"precision {training_cfg.precision} on CPU can only be measured with_optimizer=False "
            "(megatron's mixed-precision optimizer needs CUDA tensors)"
        )
    from megatron.core import parallel_state

    if (
        parallel_state.model_parallel_is_initialized()
        and parallel_state.get_tensor_model_parallel_world_size() != training_cfg.tensor_parallel
    ):
        parallel_state.destroy_model_parallel()  # the previous measurement used another tp
    with cpu_recompute_support(allow_half_precision=not with_optimizer):
        dist = tm.init_distributed(training_cfg.tensor_parallel)
        _clear_cached_masks()
        if fake:
            training_cfg = training_cfg.model_copy(update={"grad_clip": 0.0})
        dp = dist.dp_size
        micro = training_cfg.micro_batch_size
        if training_cfg.global_batch_size % (micro * dp):
            raise ValueError(
                f"global batch {training_cfg.global_batch_size} is not a multiple of "
                f"micro batch {micro} × data-parallel size {dp}"
            )
        num_micro = training_cfg.global_batch_size // (micro * dp)
        with contextlib.ExitStack() as stack:
            if fake:
                stack.enter_context(_fake_mode())
            model = tm.build_model(model_cfg, training_cfg)
            ddp = tm.wrap_data_parallel(model, training_cfg)
            optimizer = tm.build_optimizer(ddp, training_cfg) if with_optimizer else None
            s = model_cfg.seq_length
            tokens = torch.randint(0, model_cfg.vocab_size, (micro, s))
            positions = torch.arange(s).unsqueeze(0).expand(micro, s)
            tracker = _global_peak_tracker()
            # megatron's DDP keeps gradients in contiguous buffers outside autograd; the
            # tracker would not see them otherwise. (megatron's DDP also shadows
            # nn.Module.buffers, so the inner GPTModel is what gets tracked and called.)
            grad_buffers = [buffer.grad_data for buffer in ddp.buffers]
            inner_optimizers = getattr(optimizer, "chained_optimizers", [optimizer]) if optimizer else []
            for inner in inner_optimizers if adam_foreach else []:
                for group in inner.optimizer.param_groups:
                    group["foreach"] = True
            tracker.track_external(model, *[o.optimizer for o in inner_optimizers], *grad_buffers)
            with tracker:
                for _ in range(steps):
                    ddp.zero_grad_buffer()
                    if optimizer is not None:
                        optimizer.zero_grad()
                    for _ in range(num_micro):
                        per_token_loss = model(tokens, positions, None, labels=tokens)
                        loss = per_token_loss.float().mean() / num_micro
                        loss.backward()
                        del per_token_loss, loss
                        # The tracker refuses a second call of a module unless its
                        # per-module stats are cleared; the global peak is kept.
                        tracker.reset_mod_stats()
                    if optimizer is None:
                        continue
                    if fake:
                        # The chained optimizer always computes the global gradient norm,
                        # a data-dependent scalar; the inner optimizers step without it.
                        for inner in inner_optimizers:
                            inner.step()
                    else:
                        ddp.finish_grad_sync()
                        optimizer.step()
            total, by_category = _snapshot_bytes(tracker.get_tracker_snapshot("peak"))
            del model, ddp, optimizer, tracker
    _reset_megatron_state()
    return MeasuredPeak(total=total, by_category=by_category, rank=dist.rank)


@contextlib.contextmanager
def _fake_mode() -> Iterator[None]:
    """FakeTensorMode, with megatron's object all-gathers (optimizer setup) run for real.

    `all_gather_object` pickles Python objects into byte tensors and reads them back,
    which a fake tensor cannot do; those tensors are tiny and not model memory.
    """
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

    original = torch.distributed.all_gather_object

    def all_gather_object_real(*args: Any, **kwargs: Any) -> Any:
        with unset_fake_temporarily():
            return original(*args, **kwargs)

    torch.distributed.all_gather_object = all_gather_object_real
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            yield
    finally:
        torch.distributed.all_gather_object = original


def _clear_cached_masks() -> None:
    """Forget the causal mask a previous measurement cached (the CPU compat layer keeps one
    per sequence length), so each measurement counts it, as a fresh training run would."""
    from megatron.core.fusions import fused_softmax

    cache_clear = getattr(fused_softmax.get_default_causal_mask, "cache_clear", None)
    if cache_clear is not None:
        cache_clear()


def _reset_megatron_state() -> None:
    """Drop megatron's global scratch buffer so the next measurement starts clean."""
    from megatron.core import parallel_state

    if hasattr(parallel_state, "destroy_global_memory_buffer"):
        parallel_state.destroy_global_memory_buffer()
        parallel_state._set_global_memory_buffer()


def _main(argv: list[str]) -> int:
    """torchrun entry: measure each configuration of a JSON list; rank 0 prints max over ranks."""
    import torch

    from training import model as tm

    if len(argv) != 1:
        print("usage: torchrun --nproc-per-node N -m scheduler.memory_probe CONFIGS.json", file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as fh:
        configs = json.load(fh)
    for item in configs:
        model_cfg = ModelConfig(**item["model"])
        training_cfg = TrainingConfig(**item["training"])
        peak = measure_training_peak(model_cfg, training_cfg, steps=item.get("steps", 2),
                                     with_optimizer=item.get("with_optimizer", True),
                                     adam_foreach=item.get("adam_foreach", False))
        gathered: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, (peak.total, peak.by_category))
        if torch.distributed.get_rank() == 0:
            worst_total, worst_categories = max(gathered, key=lambda g: g[0])
            print(json.dumps({"id": item.get("id"), "total": worst_total, "by_category": worst_categories,
                              "world_size": len(gathered)}), flush=True)
    tm.shutdown_distributed()
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
