"""CPU compatibility patches for megatron-core 0.16.1 — applied only when CUDA is absent.

megatron-core is written for GPUs; a handful of places call CUDA unconditionally.
`apply()` patches exactly those places and nothing else, and does nothing when
`torch.cuda.is_available()` (a GPU run uses megatron-core unchanged). Paths below
are relative to site-packages/megatron/core/ of megatron-core==0.16.1.

1. `torch.cuda.current_device()` returns "cpu".
   Used as a `device=` argument by:
   - utils.py:631            GlobalMemoryBuffer.get_tensor (attention/TP scratch buffers)
   - tensor_parallel/layers.py:261, 552, 597, 607, 873, 899, 1197, 1218
                             VocabParallelEmbedding / Column- / RowParallelLinear init
                             and the TP all-gather buffer
   - models/common/embeddings/rotary_pos_embedding.py:162, 297
                             RoPE moves `inv_freq` to the current CUDA device
                             (line 78 honours use_cpu_initialization, these do not)
   - models/gpt/gpt_model.py:415, transformer/attention.py:430,
     transformer/dot_product_attention.py:123, 132 (scratch/mask tensors)
   - distributed/param_and_grad_buffer.py:783, 800, 806
                             DDP grad (and distributed-optimizer param) buffers
   - optimizer/distrib_optimizer.py:791, optimizer/optimizer.py:1141
2. `torch.cuda.synchronize()` is a no-op.
   - dist_checkpointing/strategies/filesystem_async.py:230 (before writing shards)
   - distributed/distributed_data_parallel.py:588, 611 (buffer free/alloc)
   - utils.py:1596
3. Gradient norm on CPU: optimizer/clip_grads.py:90, 103, 115 allocate the norm
   accumulator with a hard-coded `device='cuda'` (not current_device()), so
   `get_grad_norm_fp32` is replaced (in clip_grads and where optimizer/optimizer.py
   imported it by name) by the same computation on the gradients' own device,
   including the all-reduce over `grad_stats_parallel_group`.
   `clip_grad_by_total_norm_fp32` (clip_grads.py:167 asserts `torch.cuda.FloatTensor`,
   :174 allocates on 'cuda') is replaced likewise by an in-place scale of the grads.
4. `FP32Optimizer.__init__` (optimizer/optimizer.py:907) creates its unit loss
   scale with `device='cuda'`; the patched __init__ makes it on the CPU.
5. Causal mask: transformer/utils.py:35 `get_default_causal_mask` builds the mask with
   `device="cuda"`; fusions/fused_softmax.py:327 (the unfused softmax the local spec
   uses) calls it by the name it imported (fused_softmax.py:8), so that name is
   replaced by a cached CPU version.
6. RNG tracker: `tensor_parallel.random.model_parallel_cuda_manual_seed` asserts CUDA
   (tensor_parallel/random.py:64, 102 read CUDA generators). `init_cpu_rng_tracker`
   installs megatron's inference tracker (tensor_parallel/random.py:321,
   `initialize_rng_tracker(inference_rng_tracker=True)`): its `fork()` is a plain
   context, so code paths that fork the "model-parallel-rng" state (dropout,
   transformer_block.py:707, dot_product_attention.py:217) run on the CPU generator.
   forgeflow's Llama-style models use no dropout, so nothing random happens under it.
7. Activation recompute: `CheckpointFunction` / `CheckpointWithoutOutput`
   (tensor_parallel/random.py:514, 552, 656, 681) save and restore "all RNG states" via
   `_get_all_rng_states` / `_set_all_rng_states` (random.py:444-460), which read the CUDA
   generator through `_get_cuda_rng_state` (random.py:41-69, `torch.cuda.random.get_rng_state`
   at :55) and `_set_cuda_rng_state` (:72). Without CUDA there is no CUDA generator: those
   two become "no state" / no-op, while the CPU generator and the tracker states are still
   saved and restored around the recomputation — so recompute=selective|full work on CPU.
8. Distributed optimizer: `MixedPrecisionOptimizer.__init__` (optimizer/optimizer.py:473,
   481, 485; the base of DistributedOptimizer) allocates its flags with `device='cuda'`
   — replaced by the same __init__ on the CPU; and DistributedOptimizer's constructor
   sorts parameters by `param.type()` against 'torch.cuda.FloatTensor' / HalfTensor /
   BFloat16Tensor names (optimizer/distrib_optimizer.py:361, 420, 582), so while that
   constructor runs, `Tensor.type()` without arguments reports a CPU tensor under its
   CUDA type name (the only thing those checks read is the dtype).

9. Pipeline schedules: pipeline_parallel/schedules.py:596, 983, 2138 (no pipelining,
   interleaved, 1F1B) allocate the token counter with `torch.zeros(..., device="cuda")`.
   The `torch` that schedules.py sees is replaced by a view of torch whose `zeros` puts
   a "cuda" request on the CPU; everything else is torch itself. (p2p_communication.py
   uses torch.cuda.current_device()/synchronize(), covered by items 1-2;
   schedules.py:418's `torch.autocast("cuda")` runs only with config.autocast_dtype.)
10. Tied embeddings across pipeline stages: models/common/language_module/
   language_module.py:244 moves the last stage's copy of the word embeddings to CUDA
   (`weight.data.cuda()`) before all-reducing it with the first stage; while
   `setup_embeddings_and_output_layer` runs, `Tensor.cuda()` returns the tensor itself.

Independent of CUDA (applied by `fix_distributed_optimizer_resume()`, GPU runs too):
without Apex/Transformer Engine, DistributedOptimizer.load_state_dict gives every Adam
state a "step" (optimizer/distrib_optimizer.py:817-823) and then copies the checkpoint's
per-parameter tensors over every state key (:938-940), but the fully-reshardable reader
leaves "step" out of what it copies (:2101-2103) -> KeyError 'step'. The patched copy
skips keys the checkpoint does not carry per parameter (the step was already restored).
Also, that restored "step" is ONE tensor shared by every parameter's state (:820-823,
and torch's Optimizer.load_state_dict keeps it shared); torch's AdamW increments it in
place once per parameter, so after a resume the bias correction is wrong. The patched
load_state_dict gives each parameter its own copy.

Not patched because forgeflow does not use it on CPU: fp16/bf16 mixed-precision
optimizers (optimizer/optimizer.py:473-485, grad_scaler.py), the persistent async
checkpoint queue (needs torch.cuda.set_device/device_count), sequence parallel.
"""

from __future__ import annotations

import functools

import torch

_APPLIED = False


def cuda_absent() -> bool:
    return not torch.cuda.is_available()


def apply() -> bool:
    """Apply every CPU patch once if CUDA is absent. Returns True when patches are active."""
    global _APPLIED
    if not cuda_absent():
        return False
    if _APPLIED:
        return True

    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]

    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mcore_optimizer

    clip_grads.get_grad_norm_fp32 = _get_grad_norm_fp32_cpu
    mcore_optimizer.get_grad_norm_fp32 = _get_grad_norm_fp32_cpu
    clip_grads.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32_cpu
    mcore_optimizer.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32_cpu
    mcore_optimizer.FP32Optimizer.__init__ = _fp32_optimizer_init_cpu

    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils as transformer_utils

    fused_softmax.get_default_causal_mask = _causal_mask_cpu
    transformer_utils.get_default_causal_mask = _causal_mask_cpu

    mcore_optimizer.MixedPrecisionOptimizer.__init__ = _mixed_precision_init_cpu
    from megatron.core.optimizer import distrib_optimizer

    distrib_optimizer.DistributedOptimizer.__init__ = _with_cuda_type_names(
        distrib_optimizer.DistributedOptimizer.__init__
    )

    from megatron.core.tensor_parallel import random as tp_random

    tp_random._get_cuda_rng_state = _no_cuda_rng_state
    tp_random._set_cuda_rng_state = _set_no_cuda_rng_state

    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.pipeline_parallel import schedules

    schedules.torch = _TorchZerosOnCpu()
    LanguageModule.setup_embeddings_and_output_layer = _with_cuda_as_identity(
        LanguageModule.setup_embeddings_and_output_layer)
    _APPLIED = True
    return True


def fix_distributed_optimizer_resume() -> None:
    """See "Independent of CUDA" in the module docstring. Idempotent."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states
    if getattr(original, "_forgeflow_fixed", False):
        return

    def set_states(self, model_param, tensors):
        if not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            destinations = {"param": main_param, **self.optimizer.state[main_param]}
            for key, tensor in tensors.items():
                if key in destinations:
                    destinations[key].copy_(tensor)
            return None
        return original(self, model_param, tensors)

    original_load = DistributedOptimizer.load_state_dict

    def load_state_dict(self, state_dict):
        result = original_load(self, state_dict)
        for state in self.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()
        return result

    set_states._forgeflow_fixed = True
    DistributedOptimizer._set_main_param_and_optimizer_states = set_states
    DistributedOptimizer.load_state_dict = load_state_dict


def init_cpu_rng_tracker() -> None:
    """Install megatron's CUDA-free RNG tracker (see item 6 of the module docstring)."""
    from megatron.core.tensor_parallel import random as tp_random

    tp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def _get_grad_norm_fp32_cpu(grads_for_norm, norm_type=2, grad_stats_parallel_group=None) -> float:
    """optimizer/clip_grads.py:get_grad_norm_fp32 without its hard-coded CUDA tensors."""
    from megatron.core.utils import get_data_parallel_group_if_dtensor, to_local_if_dtensor

    if isinstance(grads_for_norm, torch.Tensor):
        grads_for_norm = [grads_for_norm]
    data_parallel_group = None
    for grad in grads_for_norm:
        data_parallel_group = get_data_parallel_group_if_dtensor(grad, data_parallel_group)
    grads_for_norm = [to_local_if_dtensor(grad) for grad in grads_for_norm]

    norm_type = float(norm_type)
    if norm_type == torch.inf:
        total = torch.zeros(1, dtype=torch.float)
        for grad in grads_for_norm:
            total = torch.maximum(total, grad.detach().abs().max().float().reshape(1))
        op = torch.distributed.ReduceOp.MAX
    else:
        total = torch.zeros(1, dtype=torch.float)
        for grad in grads_for_norm:
            total += torch.linalg.vector_norm(grad.detach().float(), norm_type) ** norm_type
        op = torch.distributed.ReduceOp.SUM
    if data_parallel_group:
        torch.distributed.all_reduce(total, op=op, group=data_parallel_group)
    torch.distributed.all_reduce(total, op=op, group=grad_stats_parallel_group)
    if norm_type == torch.inf:
        return total.item()
    return total.item() ** (1.0 / norm_type)


def _clip_grad_by_total_norm_fp32_cpu(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """optimizer/clip_grads.py:clip_grad_by_total_norm_fp32 without the CUDA assert/buffer."""
    from megatron.core.utils import to_local_if_dtensor

    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [
        to_local_if_dtensor(getattr(p, attr)).detach()
        for p in parameters
        if getattr(p, attr, None) is not None
    ]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        for grad in grads:
            grad.mul_(clip_coeff)


@functools.lru_cache(maxsize=8)
def _causal_mask_cpu(sq: int) -> torch.Tensor:
    """transformer/utils.py:get_default_causal_mask on the CPU (True = masked out)."""
    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()


def _no_cuda_rng_state(*args, **kwargs) -> torch.Tensor:
    """tensor_parallel/random.py:_get_cuda_rng_state when there is no CUDA generator."""
    return torch.empty(0, dtype=torch.uint8)


def _set_no_cuda_rng_state(*args, **kwargs) -> None:
    """tensor_parallel/random.py:_set_cuda_rng_state when there is no CUDA generator."""


def _mixed_precision_init_cpu(self, optimizer, config, grad_scaler, init_state_fn):
    """optimizer/optimizer.py:MixedPrecisionOptimizer.__init__ with its flags on the CPU."""
    from megatron.core.optimizer.optimizer import MegatronOptimizer

    MegatronOptimizer.__init__(self, optimizer, config, init_state_fn)
    self.grad_scaler = grad_scaler
    if self.grad_scaler is None:
        assert not self.config.fp16, "fp16 expects a grad scaler."
    if self.grad_scaler:
        self.found_inf = torch.tensor([0.0], dtype=torch.float)
    self._dummy_overflow_buf = None if self.config.bf16 else torch.tensor([0], dtype=torch.int)
    if self.grad_scaler is None:
        self._scale_one = torch.tensor([1.0], dtype=torch.float)


def _with_cuda_type_names(init):
    """Run `init` while `Tensor.type()` names CPU tensors like CUDA ones (item 8)."""

    @functools.wraps(init)
    def wrapped(*args, **kwargs):
        original = torch.Tensor.type

        def cuda_named_type(tensor, dtype=None, non_blocking=False, **kw):
            if dtype is None and not kw and not tensor.is_cuda:
                name = original(tensor)
                return name.replace("torch.", "torch.cuda.", 1)
            return original(tensor, dtype, non_blocking, **kw)

        torch.Tensor.type = cuda_named_type
        try:
            return init(*args, **kwargs)
        finally:
            torch.Tensor.type = original

    return wrapped


def _fp32_optimizer_init_cpu(self, optimizer, config, init_state_fn):
    """optimizer/optimizer.py:FP32Optimizer.__init__ with its loss scale on the CPU."""
    from megatron.core.optimizer.optimizer import MegatronOptimizer

    MegatronOptimizer.__init__(self, optimizer, config, init_state_fn)
    self._scale = torch.tensor([1.0], dtype=torch.float)
    self.is_stub_optimizer = optimizer is None


class _TorchZerosOnCpu:
    """`torch` for pipeline_parallel/schedules.py: `zeros(device="cuda")` lands on the CPU (item 9)."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, **kwargs):
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return torch.zeros(*args, **kwargs)


def _with_cuda_as_identity(method):
    """Run `method` while `Tensor.cuda()` returns the tensor unchanged (item 10)."""

    @functools.wraps(method)
    def wrapped(*args, **kwargs):
        original = torch.Tensor.cuda
        torch.Tensor.cuda = lambda tensor, *a, **kw: tensor
        try:
            return method(*args, **kwargs)
        finally:
            torch.Tensor.cuda = original

    return wrapped
