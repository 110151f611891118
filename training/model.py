"""The model, its data-parallel wrapper and its optimizer — megatron-core, Llama-style.

    dist = init_distributed(training_cfg.tensor_parallel)   # torch.distributed + megatron groups
    model = build_model(spec.model, spec.training)          # GPTModel (RoPE, RMSNorm, SwiGLU, GQA)
    ddp_model = wrap_data_parallel(model, spec.training)     # megatron DDP: grad buffers + all-reduce
    optimizer = build_optimizer(ddp_model, spec.training)    # megatron Adam(W) + grad clipping

Works in one process with world size 1 (memory benchmark, export parity) and under
torchrun with any world size: gloo on CPU, NCCL on GPU, nothing else differs.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from training import megatron_compat
from training.config import ModelConfig, TrainingConfig


class UnsupportedOnCPU(RuntimeError):
    """A setting megatron-core 0.16.1 cannot run without CUDA."""


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits: global rank/world and its data/tensor-parallel coordinates."""

    rank: int
    world_size: int
    local_rank: int
    tp_rank: int
    tp_size: int
    dp_rank: int
    dp_size: int
    device: torch.device
    backend: str


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(tensor_parallel: int = 1, timeout_s: float = 600.0) -> DistEnv:
    """Start torch.distributed (if not started) and megatron's parallel groups.

    Under torchrun the usual RANK/WORLD_SIZE/MASTER_* variables are used. Without them
    (a plain `python` process: tests, the memory benchmark) it starts a world of one
    on an in-memory store, so no port is needed.
    """
    megatron_compat.apply()
    from megatron.core import parallel_state

    backend = default_backend()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    if not torch.distributed.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            torch.distributed.init_process_group(backend=backend, timeout=timeout)
        else:
            torch.distributed.init_process_group(
                backend=backend, store=torch.distributed.HashStore(), rank=0, world_size=1,
                timeout=timeout,
            )
    world_size = torch.distributed.get_world_size()
    if world_size % tensor_parallel:
        raise ValueError(
            f"world size {world_size} is not divisible by tensor_parallel={tensor_parallel}; "
            "start a multiple of tensor_parallel processes (torchrun --nproc-per-node)"
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel)
    if megatron_compat.cuda_absent():
        megatron_compat.init_cpu_rng_tracker()
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    return DistEnv(
        rank=torch.distributed.get_rank(),
        world_size=world_size,
        local_rank=local_rank,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        tp_size=parallel_state.get_tensor_model_parallel_world_size(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        dp_size=parallel_state.get_data_parallel_world_size(),
        device=device,
        backend=backend,
    )


def shutdown_distributed() -> None:
    """Tear down megatron's groups and the process group (tests start several worlds)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _check_cpu_support(training_cfg: TrainingConfig) -> None:
    if not megatron_compat.cuda_absent():
        return
    if training_cfg.precision != "fp32":
        raise UnsupportedOnCPU(
            f"training.precision={training_cfg.precision} needs CUDA: megatron-core's "
            "mixed-precision optimizer only accepts torch.cuda tensors "
            "(optimizer/optimizer.py:671); use precision: fp32 on CPU"
        )


def transformer_config(model_cfg: ModelConfig, training_cfg: TrainingConfig):
    """The megatron TransformerConfig of a Llama-style decoder."""
    from megatron.core.transformer import TransformerConfig

    _check_cpu_support(training_cfg)
    params_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[
        training_cfg.precision
    ]
    recompute = {}
    if training_cfg.recompute == "selective":
        recompute = dict(recompute_granularity="selective")
    elif training_cfg.recompute == "full":
        recompute = dict(
            recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
        )
    return TransformerConfig(
        num_layers=model_cfg.num_layers,
        hidden_size=model_cfg.hidden_size,
        num_attention_heads=model_cfg.num_attention_heads,
        num_query_groups=model_cfg.kv_heads,
        ffn_hidden_size=model_cfg.ffn_size,
        kv_channels=model_cfg.head_dim,
        init_method_std=model_cfg.init_method_std,
        layernorm_epsilon=model_cfg.norm_epsilon,
        # Llama: RMSNorm, SwiGLU (gated SiLU), no biases, no dropout.
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=training_cfg.tensor_parallel,
        pipeline_model_parallel_size=training_cfg.pipeline_parallel,
        params_dtype=params_dtype,
        bf16=training_cfg.precision == "bf16",
        fp16=training_cfg.precision == "fp16",
        # CPU: build weights on the host (also makes init independent of the TP degree).
        use_cpu_initialization=megatron_compat.cuda_absent(),
        # The fused kernels need Apex/TE/CUDA; the unfused paths are exact and portable.
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        **recompute,
    )


def build_model(model_cfg: ModelConfig, training_cfg: TrainingConfig):
    """A megatron-core GPTModel shaped Llama-style. Needs `init_distributed()` first.

    Initial weights depend only on `training_cfg.seed` (the torch CPU generator is
    seeded here), so every data-parallel rank starts identical.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = transformer_config(model_cfg, training_cfg)
    torch.manual_seed(training_cfg.seed)
    if not megatron_compat.cuda_absent():
        # On GPUs megatron initialises weights (and forks dropout RNG) through its CUDA RNG
        # tracker, which must be seeded per model-parallel rank (found on an H100: without
        # it GPTModel fails with "cuda rng state model-parallel-rng is not added").
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(training_cfg.seed)
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=model_cfg.vocab_size,
        max_sequence_length=model_cfg.seq_length,
        position_embedding_type="rope",
        rotary_base=int(model_cfg.rope_theta),
        share_embeddings_and_output_weights=not model_cfg.untie_embeddings_and_output_weights,
        parallel_output=True,
    )
    if torch.cuda.is_available():
        model = model.cuda(torch.cuda.current_device())
    return model


def wrap_data_parallel(model, training_cfg: TrainingConfig):
    """megatron DDP: contiguous fp32 grad buffers, averaged across data-parallel ranks."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=training_cfg.use_distributed_optimizer,
    )
    return DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)


def build_optimizer(ddp_model, training_cfg: TrainingConfig):
    """megatron-core's optimizer: AdamW (decoupled weight decay) with global-norm clipping.

    Returned with step 0's learning rate and weight decay applied; the training loop
    calls `training.schedule.apply_schedule` before every step. Norm weights get no
    weight decay (megatron's standard parameter-group overrides).
    """
    from megatron.core.optimizer import (
        OptimizerConfig,
        get_megatron_optimizer,
        get_standard_config_overrides,
    )

    _check_cpu_support(training_cfg)
    config = OptimizerConfig(
        optimizer="adam",
        lr=training_cfg.lr,
        min_lr=training_cfg.min_lr,
        weight_decay=training_cfg.weight_decay,
        adam_beta1=training_cfg.adam_beta1,
        adam_beta2=training_cfg.adam_beta2,
        adam_eps=1e-8,
        clip_grad=training_cfg.grad_clip,
        bf16=training_cfg.precision == "bf16",
        fp16=training_cfg.precision == "fp16",
        params_dtype={"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[
            training_cfg.precision
        ],
        use_distributed_optimizer=training_cfg.use_distributed_optimizer,
    )
    if training_cfg.use_distributed_optimizer:
        # upstream's no-Apex resume bugs, fixed for any loader (see megatron_compat)
        megatron_compat.fix_distributed_optimizer_resume()
    # The standard overrides mark 1-D params (norm weights) wd_mult=0; the per-step
    # schedule (training.schedule.apply_schedule) turns wd_mult into each group's decay.
    optimizer = get_megatron_optimizer(
        config, [ddp_model], config_overrides=get_standard_config_overrides(config)
    )
    from training.schedule import apply_schedule

    apply_schedule(optimizer, 0, training_cfg)
    return optimizer


def count_parameters(model) -> int:
    """Parameters held by this rank (a TP shard holds a slice)."""
    return sum(p.numel() for p in model.parameters())
