"""The model, its data-parallel wrapper and its optimizer — megatron-core, Llama-style.

    dist = init_distributed(training_cfg.tensor_parallel,   # torch.distributed + megatron groups
                            training_cfg.pipeline_parallel, training_cfg.virtual_pipeline_stages)
    model = build_model(spec.model, spec.training)          # GPTModel (RoPE, RMSNorm, SwiGLU, GQA;
                                                            # core attention per training.attention)
    ddp_model = wrap_data_parallel(model, spec.training)     # megatron DDP: grad buffers + all-reduce
    optimizer = build_optimizer(ddp_model, spec.training)    # megatron Adam(W) + grad clipping

Works in one process with world size 1 (memory benchmark, export parity) and under
torchrun with any world size: gloo on CPU, NCCL on GPU, nothing else differs.

Pipeline parallelism: with `pipeline_parallel` > 1 each rank builds only its stage's
layers (the first stage holds the embedding, the last the output layer and loss);
the cut is `pipeline_stage_layers` or an even split whose first stages take any
remainder (the planner's memory model, scheduler.memory_model.stage_layers), handed to
megatron as a `pipeline_model_parallel_layout`. With `virtual_pipeline_stages` V > 1
a rank holds V model chunks (interleaved 1F1B); `build_model` then returns a
`ModelChunks` and `wrap_data_parallel` a list of DDP chunks. Initial weights depend
only on the seed and each parameter's global name (`init_weights_by_global_name`),
so every TP/PP/VPP layout starts from the same model.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from training import megatron_compat
from training.config import ModelConfig, TrainingConfig, resolve_attention


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
    pp_rank: int = 0
    pp_size: int = 1


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(tensor_parallel: int = 1, pipeline_parallel: int = 1,
                     virtual_pipeline_stages: int = 1, timeout_s: float = 600.0) -> DistEnv:
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
    model_parallel = tensor_parallel * pipeline_parallel
    if world_size % model_parallel:
        raise ValueError(
            f"world size {world_size} is not divisible by tensor_parallel x pipeline_parallel = "
            f"{tensor_parallel} x {pipeline_parallel}; start a multiple of {model_parallel} "
            "processes (torchrun --nproc-per-node)"
        )
    if not parallel_state.model_parallel_is_initialized():
        # Megatron's rank order: tensor-parallel ranks fastest, then data, then pipeline.
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tensor_parallel,
            pipeline_model_parallel_size=pipeline_parallel,
            virtual_pipeline_model_parallel_size=(
                virtual_pipeline_stages if virtual_pipeline_stages > 1 else None),
        )
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
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        pp_size=parallel_state.get_pipeline_model_parallel_world_size(),
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


def stage_layer_counts(model_cfg: ModelConfig, training_cfg: TrainingConfig) -> list[int]:
    """Decoder layers of each model chunk in layer order (pp x vpp entries).

    `training.pipeline_stage_layers` when given; else an even split whose first chunks
    take any remainder — the cut the planner's memory model prices
    (scheduler.memory_model.stage_layers), so a plan runs with the memory it was sized for.
    """
    chunks = training_cfg.pipeline_parallel * training_cfg.virtual_pipeline_stages
    if training_cfg.pipeline_stage_layers is not None:
        return list(training_cfg.pipeline_stage_layers)
    base, extra = divmod(model_cfg.num_layers, chunks)
    return [base + (1 if i < extra else 0) for i in range(chunks)]


def pipeline_layout(model_cfg: ModelConfig, training_cfg: TrainingConfig) -> list[list[str]] | None:
    """megatron's `pipeline_model_parallel_layout` (embedding, decoders, loss per chunk)."""
    if training_cfg.pipeline_parallel == 1:
        return None
    counts = stage_layer_counts(model_cfg, training_cfg)
    layout = [["decoder"] * n for n in counts]
    layout[0].insert(0, "embedding")
    layout[-1].append("loss")
    return layout


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
        virtual_pipeline_model_parallel_size=(
            training_cfg.virtual_pipeline_stages if training_cfg.virtual_pipeline_stages > 1
            else None),
        pipeline_model_parallel_layout=pipeline_layout(model_cfg, training_cfg),
        pipeline_dtype=params_dtype,
        # megatron's own defaults (megatron/training/arguments.py): interleaved stages overlap
        # their point-to-point transfers (isend/irecv ordered even/odd), 1F1B batches them.
        # Batched transfers with virtual stages and pp=2 pair an activation with a gradient
        # when both go to the same peer (measured on gloo: wrong activations from the
        # third micro batch on).
        overlap_p2p_comm=training_cfg.virtual_pipeline_stages > 1,
        batch_p2p_comm=training_cfg.virtual_pipeline_stages == 1,
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


class ModelChunks(torch.nn.ModuleList):
    """A rank's model chunks under interleaved pipeline parallelism (one GPTModel per
    virtual stage). state_dict()/load_state_dict() are ModuleList's; the sharded state
    dict nests each chunk under "model{i}" as megatron's own checkpoints do (the tensor
    keys inside are global, so any layout can load them)."""

    @property
    def config(self):
        return self[0].config

    def sharded_state_dict(self, *args, **kwargs) -> dict:
        return {f"model{i}": chunk.sharded_state_dict(*args, **kwargs)
                for i, chunk in enumerate(self)}


def model_chunks(model) -> list:
    """The GPTModels a rank holds: [model], or the chunks of a ModelChunks."""
    return list(model) if isinstance(model, ModelChunks) else [model]


def attention_kernel(training_cfg: TrainingConfig) -> str:
    """The core attention this process builds: `training.attention`, auto resolved for this
    process's device (torch's flash SDPA kernels need compute capability 8.0)."""
    flash_device = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)
    return resolve_attention(training_cfg.attention, training_cfg.precision, flash_device)


def build_model(model_cfg: ModelConfig, training_cfg: TrainingConfig):
    """A megatron-core GPTModel shaped Llama-style. Needs `init_distributed()` first.

    With `virtual_pipeline_stages` > 1 a `ModelChunks` of this rank's GPTModels. Initial
    weights depend only on `training_cfg.seed` and each parameter's global name
    (`init_weights_by_global_name`), so every data-parallel rank starts identical and
    every tensor/pipeline layout starts from the same model.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    from training.attention import gpt_layer_spec

    config = transformer_config(model_cfg, training_cfg)
    layer_spec = gpt_layer_spec(attention_kernel(training_cfg))
    torch.manual_seed(training_cfg.seed)
    if not megatron_compat.cuda_absent():
        # On GPUs megatron initialises weights (and forks dropout RNG) through its CUDA RNG
        # tracker, which must be seeded per model-parallel rank (found on an H100: without
        # it GPTModel fails with "cuda rng state model-parallel-rng is not added").
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(training_cfg.seed)
    virtual = training_cfg.virtual_pipeline_stages
    chunks = []
    for vp_stage in range(virtual):
        vp = vp_stage if virtual > 1 else None
        chunk = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec,
            vocab_size=model_cfg.vocab_size,
            max_sequence_length=model_cfg.seq_length,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            position_embedding_type="rope",
            rotary_base=int(model_cfg.rope_theta),
            share_embeddings_and_output_weights=not model_cfg.untie_embeddings_and_output_weights,
            parallel_output=True,
            vp_stage=vp,
        )
        if torch.cuda.is_available():
            chunk = chunk.cuda(torch.cuda.current_device())
        chunks.append(chunk)
    for chunk in chunks:
        init_weights_by_global_name(chunk, training_cfg.seed)
    return ModelChunks(chunks) if virtual > 1 else chunks[0]


# Which init each weight gets (megatron's choices: GPTModel, LanguageModelEmbedding,
# the local layer spec): the output projections of attention and MLP use the depth-
# scaled normal, everything else the plain normal; 1-D weights (RMSNorm) stay as built.
_SCALED_INIT_SUFFIXES = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
_PLAIN_INIT_SUFFIXES = ("self_attention.linear_qkv.weight", "mlp.linear_fc1.weight",
                        "embedding.word_embeddings.weight", "output_layer.weight")


def global_parameter_name(chunk, local_name: str) -> str:
    """`decoder.layers.{i}.` of a pipeline stage renamed with the layer's global index."""
    prefix = "decoder.layers."
    if not local_name.startswith(prefix):
        if local_name == "output_layer.weight" and getattr(chunk, "share_embeddings_and_output_weights", False):
            return "embedding.word_embeddings.weight"  # the last stage's copy of tied weights
        return local_name
    index, _, rest = local_name[len(prefix):].partition(".")
    layer_number = chunk.decoder.layers[int(index)].layer_number  # global, 1-based
    return f"{prefix}{layer_number - 1}.{rest}"


@torch.no_grad()
def init_weights_by_global_name(chunk, seed: int) -> None:
    """Re-draw every matrix from a generator seeded by (seed, global parameter name).

    Megatron draws its initial weights from one generator in construction order, so a
    pipeline stage that starts at layer 3 would draw layer 3 from where layer 0 draws
    in a one-stage model: the same seed would give a different model on every layout.
    Here each parameter gets its own stream. Tensor-parallel shards are cut from the
    full ("master") matrix exactly as megatron's CPU initialisation cuts them
    (tensor_parallel/layers.py `_initialize_affine_weight_cpu`: split by
    partition_dim and stride, every tp_size-th piece), so TP does not change it either.
    """
    import hashlib

    from megatron.core import parallel_state

    config = chunk.config
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    for local_name, param in chunk.named_parameters():
        if param.dim() < 2:
            continue
        name = global_parameter_name(chunk, local_name)
        if name.endswith(_SCALED_INIT_SUFFIXES):
            init = config.output_layer_init_method
        elif name.endswith(_PLAIN_INIT_SUFFIXES):
            init = config.embedding_init_method if name.startswith("embedding.") else config.init_method
        else:
            raise RuntimeError(f"no initialisation rule for parameter {name!r}; add it to "
                               "training.model._SCALED_INIT_SUFFIXES or _PLAIN_INIT_SUFFIXES")
        digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
        generator = torch.Generator(device=param.device).manual_seed(
            int.from_bytes(digest[:8], "little") & (2**63 - 1))
        shape = list(param.shape)
        split = getattr(param, "tensor_model_parallel", False) and tp_size > 1
        dim = getattr(param, "partition_dim", 0)
        if split:
            shape[dim] *= tp_size
        master = torch.empty(shape, dtype=torch.float32, device=param.device)
        init(master, generator=generator)
        if split:
            stride = getattr(param, "partition_stride", 1)
            pieces = torch.split(master, param.shape[dim] // stride, dim=dim)
            master = torch.cat(pieces[tp_rank::tp_size], dim=dim)
        param.copy_(master.to(param.dtype))


def wrap_data_parallel(model, training_cfg: TrainingConfig):
    """megatron DDP: contiguous fp32 grad buffers, averaged across data-parallel ranks.

    A GPTModel gives one DDP module; a ModelChunks gives a list, one per chunk (only the
    first bucketed, as megatron's training loop does).
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=training_cfg.use_distributed_optimizer,
    )
    wrapped = [DistributedDataParallel(config=chunk.config, ddp_config=ddp_config, module=chunk,
                                       disable_bucketing=i > 0)
               for i, chunk in enumerate(model_chunks(model))]
    return wrapped if isinstance(model, ModelChunks) else wrapped[0]


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
    chunks = ddp_model if isinstance(ddp_model, list) else [ddp_model]
    optimizer = get_megatron_optimizer(
        config, chunks, config_overrides=get_standard_config_overrides(config)
    )
    from training.schedule import apply_schedule

    apply_schedule(optimizer, 0, training_cfg)
    return optimizer


def count_parameters(model) -> int:
    """Parameters held by this rank (a TP shard holds a slice, a pipeline stage its layers)."""
    return sum(p.numel() for p in model.parameters())
