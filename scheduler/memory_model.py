"""MARP: per-GPU peak memory of one training plan, itemised.

    plan = ParallelPlan(global_batch_size=512, micro_batch_size=1, dp=8, tp=4, pp=2,
                        recompute="selective", distributed_optimizer=True, precision="bf16")
    breakdown = estimate_memory(model_cfg, plan)          # MemoryBreakdown, bytes
    breakdown.total, breakdown.gib("activations"), breakdown.peak_event

What is counted, for the busiest GPU (the first or the last pipeline stage,
whichever is larger):

* **Static state** under the sharding used. megatron-core's mixed precision
  keeps bf16/fp16 weights, fp32 gradient buffers (`grad_reduce_in_fp32`), fp32
  master weights and Adam's m and v: 2 + 4 + 4 + 8 = 18 bytes per parameter; the
  distributed optimizer shards the 12 bytes of fp32 optimizer state over dp.
  fp32 training keeps fp32 weights, fp32 grads and m, v: 16 bytes/parameter
  (the distributed optimizer shards m, v). Parameters are split over tp (all
  but norms) and pp (layers; embedding on the first stage, output layer on
  the last).
* **Activations** that autograd saves, per transformer layer and microbatch,
  derived op by op from the megatron-core GPTModel forgeflow trains
  (training/model.py: local spec, RMSNorm, SwiGLU, GQA, RoPE, no dropout) and
  checked tensor by tensor against MemTracker (benchmarks/memory_accuracy.py).
  Korthikanti et al.'s 34·s·b·h + 5·a·s²·b bytes per layer is the GPT-3-block
  form of the same bookkeeping; the Llama block differs (no dropout masks, a
  gated MLP of width f, GQA's K = kv·head_dim, RMSNorm saving its normalised
  input). See `layer_activation_terms` for the itemised terms. Tensor
  parallelism divides the attention and MLP terms by t; sequence parallelism
  also divides the norm/residual terms; selective recompute drops the
  attention-score terms (a·s² per token); full recompute keeps only each
  layer's input. Under 1F1B the first stage holds min(pp, microbatches)
  microbatches in flight.
* **Logits**: the fp32 softmax megatron's vocab-parallel cross entropy saves
  for backward (s·b·V/t·4 bytes, fp32 whatever the training precision).
* **Transient**: what exists only around the peak moment. The estimator
  evaluates the candidate moments — the cross-entropy forward (half-precision
  logits next to their fp32 upcast), the output layer's backward (its weight
  gradient and the input gradient), the last layer's MLP backward (with full
  recompute: right after replaying the layer; at fc2's backward, its weight gradient
  while fc2's input is still saved, and at the SwiGLU multiply's), its attention backward
  (score-sized gradients; in half precision the softmax's backward holds three
  fp32 score-sized tensors), the last layer's unfused softmax in the forward
  (raw scores, their fp32 upcast and the probabilities), the optimizer step
  (Adam temporaries, visiting parameters in registration order, with the cached RoPE
  table and the token ids still alive) — and reports the largest as `peak_event`. Which tensors exist at each moment was
  read off MemTracker's per-operator timeline of the real model.
* **Persistent buffers**: megatron's global memory buffer for attention
  scores (b·a/t·s² elements, allocated once, kept), on CPU the cached
  boolean causal mask (s² bytes), on CUDA the cuBLAS workspaces the caching
  allocator hands out.
* **Overhead**: the runtime's own memory — outside the caching allocator the
  CUDA context, cuBLAS handles and NCCL buffers (a fixed term), inside it the
  reservation beyond the allocated bytes (fragmentation, a fraction of every
  allocated byte) — zero in the CPU measurement profile (MemTracker counts tensors only).

How the stack stores things differs between the CPU measurement setting and
a GPU run (precision, softmax in fp32, optimizer kernels, runtime overhead);
`RuntimeProfile` names those choices. `CPU_MEASURED` is what the benchmark
measures (fp32 full steps, bf16/fp16 forward+backward). The 2026-11-23 held-out set of
benchmarks/memory_accuracy.py showed a half-precision term growing with a·s² missing
(mean signed error -4.4 %, 8 of 9 under-predicted, worst -12 %); issue 26 found it on the
calibration grid (the softmax backward's fp32 tensors, see `_attention_backward`) together
with the unfused softmax's forward moment and the small per-token and per-tensor terms that
left 95 % of the calibration rows a few bytes short. After the change: calibration 40 rows
mean 0.9993, under-predicted 12.5 %, largest -0.53 %; the old held-out set mean 0.9954,
2 of 9 under (largest -0.37 %); a fresh held-out set frozen before the change, mean 0.9955,
2 of 10 under (largest -0.11 %, both bf16 with full recompute). Third change (2026-11-29),
read off MemTracker's live tensors (creating op, shape, dtype) at the peak of calibration
shapes only — the bf16/fp16 rows of the benchmark's BF16_CASES, four of them added for this
(GQA and MHA, micro batch 1-3, full recompute, long sequences), none a held-out shape:
under full recompute the last layer's softmax runs in its replay inside the backward, so the
loss's per-token bookkeeping is alive there; the key after RoPE is alive at the unfused softmax
(GQA); in the first forward the token ids and the last layer's input (its residual) are alive
there; RoPE's cos/sin are stored in the activations' dtype (4 bytes were counted); the final
norm's x·rstd is fp32 in half precision; the output layer's backward sees the half logits
gradient, not the fp32 logits. Every one of those calibration shapes then matched MemTracker
to the byte or over-predicted (at most a few bytes per token, or two h-wide tensors at the MHA
full-recompute attention backward); the fp32 grid's predictions are unchanged.
`MEGATRON_GPU` (and `MEGATRON_SDPA_GPU`, the fused-SDPA variant `training.attention: auto`
builds on a GPU) is the default for GPUs: the same model code in bf16 on the stack
forgeflow's worker image installs (megatron-core without TE/apex, so torch's foreach AdamW),
cuBLAS workspaces inside the caching allocator, its fragmentation, and the CUDA context and
NCCL outside it. First checked on a GPU on 2026-11-28 (one H200, torch 2.11+cu130,
benchmarks/data/gpu_h200_2026-11-28): with fused Adam assumed and the overhead constants
read, not measured (1.5 GiB + 8 %), the estimate was short on all 11 calibration rows
(allocated part 0.5-14 % short, most where the foreach Adam temporaries decide the peak) and
all 12 held-out rows (mean accuracy 0.889, 6 beyond the planner's 10 % margin). The foreach
term, the workspace bytes, the fixed bytes outside the allocator and the fragmentation
fraction were then taken from the 11 calibration rows only (benchmarks/gpu_check.py `GRID`):
allocated part mean accuracy 0.9968 (worst 0.9906). The held-out rows, measured before and
not used, scored once after: mean 0.9716, worst 0.9357, 6 of 12 under-predicted, none beyond
the margin (`benchmarks/gpu_check.py --score-recorded benchmarks/data/gpu_h200_2026-11-28`).
With the 2026-11-29 CPU-found terms (same recorded rows, nothing refitted): calibration
allocated mean 0.9972, held-out mean 0.9719, worst 0.9377, 7 of 12 under-predicted, none
beyond the margin.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from scheduler.gpus import lookup_gpu
from training.config import (Attention, ModelConfig, Precision, Recompute, TrainingConfig,
                             resolve_attention)

GIB = 1024**3

AttentionKernel = Literal["unfused", "flash"]
AdamKernel = Literal["single-tensor", "foreach", "fused"]


class MemoryModelError(ValueError):
    """A plan that cannot exist for this model (indivisible sizes, bad degrees)."""


@dataclass(frozen=True, kw_only=True)
class RuntimeProfile:
    """How the training stack stores tensors, and what it uses beyond them."""

    name: str
    attention: AttentionKernel = "unfused"
    # megatron's local MLP computes act(x_glu) * (x_linear + glu_linear_offset): the add
    # produces (and the multiply saves) one more f-wide tensor.
    glu_offset_copy: bool = True
    # torch's composite RMSNorm saves the normalised input (x·rstd) besides its output;
    # for half precision it also keeps the fp32 upcast of its input.
    rmsnorm_composite: bool = True
    # With half-precision activations, megatron's unfused softmax runs in fp32 and keeps
    # the fp32 probabilities as well as the half copy the next matmul saves.
    softmax_in_fp32: bool = True
    # Which Adam megatron steps with. Without TE/apex it falls back to torch.optim.AdamW with
    # torch's default kernel choice (foreach=None): the single-tensor loop on CPU (parameter-
    # sized temporaries, one parameter at a time) and the multi-tensor `foreach` kernel on
    # CUDA (one fp32 sqrt(v) per parameter of a parameter group, all alive at once). With TE
    # or apex installed it is their FusedAdam, which allocates nothing. See `_adam_temporaries`.
    adam_kernel: AdamKernel = "single-tensor"
    # training/megatron_compat.py caches the s×s boolean causal mask on CPU (upstream
    # megatron rebuilds it per call on GPU, a short-lived tensor).
    cached_causal_mask: bool = True
    # Bytes the caching allocator hands out besides tensors (cuBLAS workspaces on CUDA).
    allocator_workspace_bytes: int = 0
    fixed_overhead_bytes: int = 0
    # The allocator's reserved bytes beyond its allocated ones, as a fraction of the latter.
    fragmentation_fraction: float = 0.0


CPU_MEASURED = RuntimeProfile(name="megatron-local-cpu")
"""What MemTracker measures on CPU: tensors only, no allocator or context."""

MEGATRON_GPU = RuntimeProfile(
    name="megatron-local-gpu",
    # torch sends F.rms_norm on CUDA tensors to `_fused_rms_norm` only when input and
    # weight dtypes match. forgeflow keeps RMSNorm weights in fp32 in bf16/fp16 models, so
    # on a real GPU (H100, torch 2.11: "Mismatch dtype between input and weight ... Cannot
    # dispatch to fused implementation") the composite path runs and saves its
    # intermediates; counting them raised the H100 accuracy of benchmarks/gpu_check.py
    # from 0.863 to 0.887 mean.
    rmsnorm_composite=True,
    # The stack forgeflow's worker image installs (megatron-core without Transformer Engine
    # or apex): megatron falls back to torch.optim.AdamW, which picks `foreach` on CUDA.
    # A worker with TE or apex gets their FusedAdam: `profile_for_device(fused_adam=True)`.
    adam_kernel="foreach",
    cached_causal_mask=False,
    # torch's cuBLAS/cuBLASLt workspaces come from the caching allocator (so they are inside
    # max_memory_allocated): 32 MiB each on Hopper. Inferred, not itemised on the GPU: with
    # the foreach term the H200 calibration rows whose peak is otherwise accounted for
    # (grid rows 5, 9, 10 of benchmarks/gpu_check.py) were 58-64 MiB short, the others
    # 64-173 MiB.
    allocator_workspace_bytes=64 * 2**20,
    # Outside the caching allocator: CUDA context, cuBLAS handles, NCCL communicators. The
    # process's NVML memory less the allocator's reservation was 2,606,759,936 B (2.43 GiB)
    # in every one of the 12 rows measured on an H200 (driver 580.159.04, CUDA 13.0, torch
    # 2.11; benchmarks/data/gpu_h200_2026-11-28/grid.jsonl). It depends on the driver, CUDA
    # and torch versions and the GPU (the context's kernel images, NCCL's buffers); it was
    # 1.5 GiB by reading before that measurement.
    fixed_overhead_bytes=2_606_759_936,
    # The caching allocator's reservation beyond its allocated peak (fragmentation, 2 MiB
    # rounding of large segments): max_memory_reserved / max_memory_allocated - 1 on the 11
    # H200 calibration rows (grid rows 0-10) was 0.017-0.139, mean 0.062. The held-out rows
    # were not used. Applied to every allocated byte, static state included.
    fragmentation_fraction=0.062,
)
"""A GPU run of the same model code without TE/apex: torch's foreach AdamW, the allocator's
workspaces and fragmentation, and the CUDA context/NCCL outside it (measured on an H200)."""

MEGATRON_TE_FLASH_GPU = replace(
    MEGATRON_GPU, name="megatron-te-flash-gpu", attention="flash", glu_offset_copy=False,
    rmsnorm_composite=False, softmax_in_fp32=False, adam_kernel="fused",
)
"""Transformer Engine layers: flash attention (no s² terms), fused norms and SwiGLU, and TE's
FusedAdam (no temporaries). Not measured on a GPU; its overhead constants are the local stack's."""


CPU_SDPA_MEASURED = replace(CPU_MEASURED, name="megatron-local-sdpa-cpu", attention="flash")
"""`training.attention: sdpa` on CPU: torch's fused CPU kernel keeps no s x s tensor (checked
against MemTracker by tests/integration/scheduler/test_memory_measured.py)."""

MEGATRON_SDPA_GPU = replace(MEGATRON_GPU, name="megatron-local-sdpa-gpu", attention="flash")
"""The local layer spec with torch's fused SDPA (`training.attention` auto on a GPU in
bf16/fp16): no s x s terms; norms, SwiGLU and softmax bookkeeping as the local spec."""


def profile_for_device(gpu_type: str, precision: Precision = "bf16",
                       attention: Attention = "auto", *, fused_adam: bool = False) -> RuntimeProfile:
    """The profile a plan on this device type should be sized with: the attention kernel
    the worker will build there (`training.config.resolve_attention`) decides the s x s terms.
    Flash kernels need an Ampere-or-newer GPU, the GPUs with bf16; a GPU type the catalogue
    does not know is sized unfused (the larger estimate).

    `fused_adam` says whether the worker's Python environment has Transformer Engine or apex
    (megatron then steps with their FusedAdam, no temporaries). The planner runs elsewhere
    than the worker, so it cannot import-check it: the default is the stack forgeflow's worker
    image installs (no TE/apex: torch's foreach AdamW, 4 bytes per matrix parameter at the
    step), the larger estimate; a deployment whose workers ship TE or apex passes True."""
    spec = None if gpu_type == "cpu" else lookup_gpu(gpu_type)
    kernel = resolve_attention(attention, precision, flash_device=spec is not None and spec.supports_bf16)
    if gpu_type == "cpu":
        return CPU_SDPA_MEASURED if kernel == "sdpa" else CPU_MEASURED
    profile = MEGATRON_SDPA_GPU if kernel == "sdpa" else MEGATRON_GPU
    if fused_adam:
        return replace(profile, name=f"{profile.name}-fused-adam", adam_kernel="fused")
    return profile


@dataclass(frozen=True, kw_only=True)
class ParallelPlan:
    """One way to run a job: parallel degrees, batch split, recompute, sharding, precision."""

    global_batch_size: int
    micro_batch_size: int = 1
    dp: int = 1
    tp: int = 1
    pp: int = 1
    recompute: Recompute = "none"
    distributed_optimizer: bool = False
    sequence_parallel: bool = False
    precision: Precision = "bf16"

    def __post_init__(self) -> None:
        for name in ("global_batch_size", "micro_batch_size", "dp", "tp", "pp"):
            if getattr(self, name) < 1:
                raise MemoryModelError(f"{name} must be >= 1 (got {getattr(self, name)})")
        if self.global_batch_size % (self.micro_batch_size * self.dp):
            raise MemoryModelError(
                f"global_batch_size ({self.global_batch_size}) must be a multiple of "
                f"micro_batch_size × dp ({self.micro_batch_size} × {self.dp})"
            )
        if self.sequence_parallel and self.tp == 1:
            raise MemoryModelError("sequence_parallel needs tp > 1")

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    @classmethod
    def from_training(cls, training: TrainingConfig, dp: int = 1) -> "ParallelPlan":
        return cls(
            global_batch_size=training.global_batch_size,
            micro_batch_size=training.micro_batch_size,
            dp=dp,
            tp=training.tensor_parallel,
            pp=training.pipeline_parallel,
            recompute=training.recompute,
            distributed_optimizer=training.use_distributed_optimizer,
            precision=training.precision,
        )


@dataclass(frozen=True, kw_only=True)
class MemoryBreakdown:
    """Per-GPU bytes at the peak moment, by category; `total` is their sum."""

    weights: int
    gradients: int
    optimizer_states: int
    activations: int
    logits: int
    transient: int
    persistent_buffers: int
    overhead: int
    peak_event: str = ""
    stage: int = 0
    notes: tuple[str, ...] = field(default=())

    CATEGORIES = (
        "weights", "gradients", "optimizer_states", "activations", "logits",
        "transient", "persistent_buffers", "overhead",
    )

    @property
    def static(self) -> int:
        return self.weights + self.gradients + self.optimizer_states

    @property
    def total(self) -> int:
        return sum(getattr(self, c) for c in self.CATEGORIES)

    def gib(self, category: str = "total") -> float:
        return getattr(self, category) / GIB

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {c: getattr(self, c) for c in self.CATEGORIES}
        out.update(total=self.total, peak_event=self.peak_event, stage=self.stage)
        return out

    def fits(self, capacity_bytes: float, safety_margin: float = 0.0) -> bool:
        """True if total × (1 + margin) fits into the capacity."""
        return self.total * (1.0 + safety_margin) <= capacity_bytes


# --- parameters ---------------------------------------------------------------


def _bytes_per_element(precision: Precision) -> int:
    return 4 if precision == "fp32" else 2


def _layer_params(m: ModelConfig) -> tuple[int, int]:
    """(parameters split by tp, parameters replicated over tp) of one transformer layer."""
    h, f, k = m.hidden_size, m.ffn_size, m.kv_heads * m.head_dim
    split = h * (h + 2 * k) + h * h + 2 * h * f + f * h  # qkv, proj, fc1 (gate+up), fc2
    replicated = 2 * h  # two RMSNorm weights
    return split, replicated


def stage_layers(num_layers: int, pp: int, stage: int) -> int:
    """Layers on a pipeline stage: an even split, the first stages taking any remainder."""
    base, extra = divmod(num_layers, pp)
    return base + (1 if stage < extra else 0)


def stage_parameters(m: ModelConfig, tp: int, pp: int, stage: int) -> tuple[int, int]:
    """(parameters held by one GPU of this stage, its largest single parameter tensor)."""
    split, replicated = _layer_params(m)
    layers = stage_layers(m.num_layers, pp, stage)
    h, v, f, k = m.hidden_size, m.vocab_size, m.ffn_size, m.kv_heads * m.head_dim
    params = layers * (split // tp + replicated)
    largest = max(2 * h * f, h * (h + 2 * k)) // tp if layers else 0
    vocab_shard = -(-v // tp) * h  # megatron pads the vocabulary to a multiple of tp
    if stage == 0:
        params += vocab_shard
        largest = max(largest, vocab_shard)
    if stage == pp - 1:
        params += h  # final norm
        if m.untie_embeddings_and_output_weights or pp > 1:
            # untied output layer; with tied weights and pp > 1 megatron keeps a copy too
            params += vocab_shard
            largest = max(largest, vocab_shard)
    return params, largest


def static_bytes(params: int, plan: ParallelPlan) -> tuple[int, int, int]:
    """(weights, gradients, optimizer states) in bytes for `params` parameters on one GPU."""
    if plan.precision == "fp32":
        weights = 4 * params
        grads = 4 * params
        opt_state = 8 * params  # Adam m, v; fp32 weights are their own master copy
    else:
        weights = 2 * params
        grads = 4 * params  # fp32 main_grad buffer (grad_reduce_in_fp32)
        opt_state = 12 * params  # fp32 master weights + m + v
    if plan.distributed_optimizer:
        opt_state = -(-opt_state // plan.dp)
    return weights, grads, opt_state


# --- activations -------------------------------------------------------------


def layer_activation_terms(
    m: ModelConfig, plan: ParallelPlan, profile: RuntimeProfile, recompute: Recompute | None = None
) -> dict[str, int]:
    """Bytes autograd saves in one transformer layer for one microbatch, itemised.

    Derived from the forward of megatron-core's TransformerLayer with the local
    spec (see the module docstring); names say which tensor each term is.
    """
    recompute = plan.recompute if recompute is None else recompute
    s, b, t = m.seq_length, plan.micro_batch_size, plan.tp
    h, f, a = m.hidden_size, m.ffn_size, m.num_attention_heads
    k = m.kv_heads * m.head_dim
    e = _bytes_per_element(plan.precision)
    tokens = s * b
    sp = t if plan.sequence_parallel else 1  # norms/residuals are split by SP only
    if recompute == "full":
        return {"layer_output": tokens * h * e // sp}
    terms: dict[str, int] = {}

    def norm(prefix: str) -> None:
        terms[f"{prefix}_rstd"] = tokens * 4 // sp
        terms[f"{prefix}_out"] = tokens * h * e // sp  # saved by the next linear
        if profile.rmsnorm_composite:
            terms[f"{prefix}_normalized"] = tokens * h * e // sp
            if e < 4:
                terms[f"{prefix}_fp32_input"] = tokens * h * 4 // sp

    norm("input_norm")
    gqa = m.kv_heads < m.num_attention_heads
    scores = b * (a // t) * s * s
    if profile.attention == "flash" or recompute == "selective":
        # q after RoPE, k after RoPE, the fused qkv output (v is a view of it), context
        terms["qkv_out"] = tokens * (h + 2 * k) * e // t
        terms["q_rope"] = tokens * h * e // t
        terms["k_rope"] = tokens * k * e // t
        terms["context"] = tokens * h * e // t
        if profile.attention == "flash" and recompute != "selective":
            terms["softmax_lse"] = b * (a // t) * s * 4
    else:
        if gqa:  # GQA repeats k and v to all heads; the repeats are what the matmuls save
            terms["q_rope"] = tokens * h * e // t
            terms["k_repeated"] = tokens * h * e // t
            terms["v_repeated"] = tokens * h * e // t
        else:  # v stays a view of the qkv output, so all of it is kept
            terms["qkv_out"] = tokens * (h + 2 * k) * e // t
            terms["q_rope"] = tokens * h * e // t
            terms["k_rope"] = tokens * k * e // t
        terms["attention_probs"] = scores * e
        if profile.softmax_in_fp32 and e < 4:
            terms["attention_probs_fp32"] = scores * 4
        terms["context"] = tokens * h * e // t
    # RoPE's cos and sin for q and for k: megatron's _apply_rotary_pos_emb_bshd computes them in
    # fp32 from the fp32 frequencies and casts them to the activations' dtype
    # (`(torch.cos(freqs) * mscale).to(t.dtype)`), and the multiplies save the cast copies:
    # 4 x s x head_dim elements of e bytes (counted at 4 bytes before; MemTracker's live
    # tensors on the bf16 calibration row bf16-h384-l2-s896-b3-gqa-full hold four
    # s x head_dim bf16 tensors, 114,688 B each, per layer).
    terms["rope_cos_sin"] = 4 * s * m.head_dim * e
    terms["attention_residual"] = tokens * h * e // sp
    norm("mlp_norm")
    terms["fc1_out"] = tokens * 2 * f * e // t
    terms["swiglu_act"] = tokens * f * e // t
    if profile.glu_offset_copy:
        terms["swiglu_linear"] = tokens * f * e // t
    terms["swiglu_out"] = tokens * f * e // t
    terms["layer_output"] = tokens * h * e // sp
    return terms


def _score_bytes(m: ModelConfig, plan: ParallelPlan) -> int:
    return plan.micro_batch_size * (m.num_attention_heads // plan.tp) * m.seq_length**2 * (
        _bytes_per_element(plan.precision)
    )


def _check(m: ModelConfig, plan: ParallelPlan) -> None:
    if m.num_attention_heads % plan.tp or m.kv_heads % plan.tp:
        raise MemoryModelError(
            f"tp={plan.tp} must divide num_attention_heads ({m.num_attention_heads}) and "
            f"the key/value heads ({m.kv_heads})"
        )
    if m.ffn_size % plan.tp:
        raise MemoryModelError(f"tp={plan.tp} must divide ffn_hidden_size ({m.ffn_size})")
    if plan.pp > m.num_layers:
        raise MemoryModelError(f"pp={plan.pp} exceeds num_layers ({m.num_layers})")
    if plan.sequence_parallel and m.seq_length % plan.tp:
        raise MemoryModelError(f"sequence_parallel needs tp={plan.tp} to divide seq_length")


def estimate_memory(
    model: ModelConfig, plan: ParallelPlan, profile: RuntimeProfile = MEGATRON_GPU, *, optimizer: bool = True
) -> MemoryBreakdown:
    """Peak bytes on the busiest GPU of the plan, itemised (see the module docstring).

    `optimizer=False` sizes forward and backward alone (no optimizer state, no step),
    as measured for bf16 on CPU where megatron's mixed-precision optimizer cannot run.
    """
    _check(model, plan)
    stages = {0, plan.pp - 1}
    candidates = [_estimate_stage(model, plan, profile, st, optimizer) for st in sorted(stages)]
    return max(candidates, key=lambda bd: bd.total)


def _estimate_stage(
    m: ModelConfig, plan: ParallelPlan, profile: RuntimeProfile, stage: int, optimizer: bool = True
) -> MemoryBreakdown:
    s, b, t = m.seq_length, plan.micro_batch_size, plan.tp
    h, v = m.hidden_size, m.vocab_size
    e = _bytes_per_element(plan.precision)
    tokens = s * b
    sp = t if plan.sequence_parallel else 1
    last = stage == plan.pp - 1
    layers = stage_layers(m.num_layers, plan.pp, stage)
    params, _ = stage_parameters(m, t, plan.pp, stage)
    weights, grads, opt_state = static_bytes(params, plan)
    if e < 4:
        # The local spec's RMSNorm weights (torch.nn.RMSNorm) stay fp32 in bf16/fp16 models.
        norm_params = layers * 2 * h + (h if last else 0)
        weights += 2 * norm_params
    if not optimizer:
        opt_state = 0
    elif profile.adam_kernel == "single-tensor":
        # torch's AdamW keeps each parameter's `step` as its own 0-dim fp32 tensor on the host
        # (not capturable): counted where the parameters are host tensors too, the CPU case
        # whose kernel is single-tensor (a CPU run forced to foreach holds the same bytes; on
        # a GPU they are not device memory): 6 parameter tensors per layer, the embedding,
        # the final norm and output layer.
        tensors = 6 * layers + (1 if stage == 0 else 0)
        if last:
            tensors += 2 if (m.untie_embeddings_and_output_weights or plan.pp > 1) else 1
        opt_state += 4 * tensors

    # 1F1B: stage i holds (pp - i) microbatches in flight, at most the microbatch count.
    in_flight = min(plan.pp - stage, plan.num_microbatches)
    layer_terms = layer_activation_terms(m, plan, profile)
    # Each microbatch also keeps the stage's input (the embedding output on stage 0) and, if
    # the stage has layers, the RoPE table GPTModel computes once per forward for all of them
    # (s x head_dim, fp32; each layer's RoPE backward keeps it).
    rope_table = s * m.head_dim * 4 if layers else 0
    per_microbatch = layers * sum(layer_terms.values()) + tokens * h * e // sp + rope_table
    if plan.recompute == "selective":
        per_microbatch += 4 * layers  # one 0-dim fp32 kept per checkpointed core attention
    final_norm = 0
    loss_per_token = 0
    if last:
        final_norm = tokens * 4 // sp + tokens * h * e // sp  # rstd, the output the output layer saves
        if profile.rmsnorm_composite:
            # The composite RMSNorm's normalised input x·rstd, computed on the fp32 upcast, so
            # fp32 in half precision too (counted at e bytes before: in the layers the
            # residual-stream terms balance that, see `_half_norm_shortfall`, but after the final
            # norm there is no residual). MemTracker's live tensors at the cross-entropy forward
            # of the bf16 calibration row bf16-h256-l2-s128 hold final_layernorm's fp32 mul
            # output, (128, 2, 256); the estimate was one tokens x h x 2 B short there.
            final_norm += tokens * h * (4 if e < 4 else e) // sp
            if e < 4:
                final_norm += tokens * h * 4 // sp  # and the fp32 upcast of its input
        # The loss's per-token bookkeeping, alive from the loss through the whole backward:
        # the labels' contiguous int64 copy the vocab-parallel cross entropy is given and the
        # fp32 per-token loss the training loop holds until backward returns (12 bytes/token).
        loss_per_token = tokens * (8 + 4)
        if t > 1:
            # With t > 1 the vocab-parallel cross entropy's all-reduced per-token tensors (max,
            # predicted logit, target mask: 9 bytes/token) outlive it; the tp=2 calibration
            # rows held exactly that (4,608 B at 512 tokens).
            loss_per_token += tokens * 9
        # The loss and its gradient: 0-dim fp32 tensors.
        loss_per_token += 2 * 4
    stored = in_flight * per_microbatch + final_norm + loss_per_token
    vocab_shard = -(-v // t)
    logits = tokens * vocab_shard * 4 if last else 0
    persistent = 0
    if profile.attention == "unfused" and layers:
        persistent = _score_bytes(m, plan)  # megatron's global buffer for attention scores
        if profile.cached_causal_mask:
            persistent += s * s  # one byte per boolean

    events: dict[str, tuple[int, int, int]] = {}  # moment -> (activations, logits, transient)
    if last:
        # Cross entropy shifts and exponentiates fp32 logits in place; half-precision
        # training briefly holds the half logits next to their fp32 upcast.
        # Its per-token intermediates are alive too: the masked int64 targets, the int64 row
        # index (arange) its predicted-logit gather uses, the target mask and the fp32 max,
        # predicted logit and sum of exponentials, besides the input token ids the training
        # loop holds (8 bytes/token) — 37 bytes/token; the fp32 per-token loss counted in
        # `stored` does not exist yet (4 bytes/token). The calibration row
        # fp16-h256-l2-s256-v16k peaked here 12 bytes/token above the 21 counted before.
        ce_per_token = tokens * (8 + 8 + 1 + 3 * 4 + 8)
        events["cross-entropy forward"] = (stored - tokens * 4, logits,
                                           ce_per_token + (tokens * vocab_shard * e if e < 4 else 0))
        # Output layer backward: its weight gradient (before DDP's hook moves it into the
        # grad buffer) and the gradient of its input. In half precision the logits' gradient
        # reaching it is the half copy the fp32 upcast's backward makes; the fp32 logits (turned
        # in place into the softmax and then into their gradient) are freed by then. On the
        # bf16 calibration row bf16-h256-l2-s128 MemTracker held, at the output layer's
        # backward mm, a (128, 2, 4096) bf16 gradient and no fp32 logits-sized tensor.
        events["output-layer backward"] = (stored, tokens * vocab_shard * e if last else 0,
                                           vocab_shard * h * e + tokens * h * e)
    else:
        # Inner stages start their backward with the gradient received from the next stage.
        events["stage backward start"] = (stored, 0, tokens * h * e // sp)
    if layers:
        # Backward of the stage's last layer: the logits and final norm are gone; with
        # full recompute the layer's forward has just been replayed.
        base = stored - final_norm
        replayed = layer_terms
        if plan.recompute == "full":
            replayed = layer_activation_terms(m, plan, profile, recompute="none")
            base += sum(replayed.values())
        mlp_acts = base - _mlp_freed_early(replayed)
        events["MLP backward"] = (mlp_acts, 0, _mlp_backward_transient(m, plan, profile))
        events["MLP output-projection backward"] = (
            mlp_acts + replayed.get("swiglu_out", 0), 0, _fc2_backward_transient(m, plan, profile))
        attn_acts, attn_transient = _attention_backward(m, plan, profile, replayed, base)
        events["attention backward"] = (attn_acts, 0, attn_transient)
        if profile.attention == "unfused":
            # The last layer's softmax in the forward (or in its replay under full recompute):
            # everything before this layer, the layer's saved inputs to the core attention
            # and the score-sized tensors of the unfused softmax.
            before_layer = base - sum(replayed.values())
            if plan.recompute != "full":
                # In the first forward the loss's bookkeeping does not exist yet, except the
                # micro-batch's int64 token ids (8 B/token), the model's input, which the training
                # loop holds throughout (MemTracker counts them once it has seen them, from the
                # first loss on). The bf16 calibration shape LONG of
                # tests/unit/scheduler/test_memory_estimator.py (no recompute) peaked at this
                # softmax 256 x 8 B above the event without them.
                before_layer -= loss_per_token - tokens * 8
                if layers > 1:
                    # The last layer's input, the previous layer's output: no node saves it (the
                    # norm saves its fp32 upcast), but TransformerLayer.forward holds it as the
                    # residual until the attention's output is added, so it is alive at this
                    # softmax. The completed layers' terms do not contain it, and with one layer it
                    # is the stage input, counted already. (Under full recompute each layer's
                    # input is a saved term.) MemTracker on the bf16 calibration rows
                    # bf16-h320-l2-s1024-b2-gqa and bf16-h256-l3-s1536-mha (no recompute, peak at
                    # the last layer's softmax) held exactly one tokens x h x 2 B tensor more than
                    # the event: layer L-2's output (the residual add's result).
                    before_layer += tokens * h * e // sp
            # Under full recompute that softmax runs in the layer's replay, which is part of the
            # backward: all of the loss's per-token bookkeeping (the int64 token ids, the fp32
            # per-token loss the training loop holds until backward returns, with tp > 1 the
            # cross entropy's all-reduced per-token tensors, the 0-dim loss and its gradient)
            # exists then. The calibration row bf16-h256-l2-s768-b2-gqa-full peaked at this
            # replay's fp32 upcast (aten._to_copy in the last layer's scale_mask_softmax, in the
            # backward) exactly 12 B/token + 8 B (18,440 B at 1,536 tokens) above the event
            # when it was counted as absent.
            events["attention forward"] = _attention_forward(m, plan, profile, replayed, before_layer)
    if optimizer:
        # Alive through the step besides Adam's temporaries: the RoPE table (megatron's
        # RotaryEmbedding.forward is lru_cached, so the table outlives the step) and the
        # micro-batch's int64 token ids the training loop holds (8 bytes/token); the
        # calibration row h1024-l2-s128 held exactly these 33,792 B at its Adam peak.
        events["optimizer step"] = (rope_table + tokens * 8, 0, _adam_temporaries(m, plan, profile, stage))

    persistent += profile.allocator_workspace_bytes
    name, (acts, logit_bytes, transient) = max(events.items(), key=lambda kv: sum(kv[1]))
    allocated = weights + grads + opt_state + acts + logit_bytes + transient + persistent
    overhead = profile.fixed_overhead_bytes + int(profile.fragmentation_fraction * allocated)
    return MemoryBreakdown(
        weights=weights, gradients=grads, optimizer_states=opt_state, activations=acts,
        logits=logit_bytes, transient=transient, persistent_buffers=persistent,
        overhead=overhead, peak_event=name, stage=stage,
    )


def _mlp_freed_early(terms: dict[str, int]) -> int:
    # By the SwiGLU multiply's backward the layer output and the fc2 input are freed.
    return terms.get("layer_output", 0) + terms.get("swiglu_out", 0)


def _mlp_backward_transient(m: ModelConfig, plan: ParallelPlan, profile: RuntimeProfile) -> int:
    """Gradients alive at the SwiGLU multiply's backward: the incoming h-wide gradient,
    the fc2 input gradient (f) and the multiply's two f-wide input gradients."""
    tokens = m.seq_length * plan.micro_batch_size
    e = _bytes_per_element(plan.precision)
    sp = plan.tp if plan.sequence_parallel else 1
    return (tokens * m.hidden_size * e // sp + 3 * tokens * m.ffn_size * e // plan.tp
            + _half_norm_shortfall(m, plan, profile))


def _fc2_backward_transient(m: ModelConfig, plan: ParallelPlan, profile: RuntimeProfile) -> int:
    """Gradients alive at the MLP's output projection (fc2) backward, one moment before the
    SwiGLU multiply's: the incoming h-wide gradient, fc2's input gradient (f) and fc2's
    weight gradient (h x f, in the weights' dtype, before DDP's hook adds it to the fp32
    grad buffer), while fc2's saved input (the SwiGLU output) is still alive. It beats the
    multiply's moment when h·f > tokens·f + the SwiGLU output, i.e. few tokens per
    micro-batch: the calibration row tp2-h768-l2-s512-full peaked here (aten.mm in the
    backward), 1 MiB above the multiply's moment the model had."""
    tokens = m.seq_length * plan.micro_batch_size
    e = _bytes_per_element(plan.precision)
    sp = plan.tp if plan.sequence_parallel else 1
    f = m.ffn_size // plan.tp
    return (tokens * m.hidden_size * e // sp + tokens * f * e + m.hidden_size * f * e
            + _half_norm_shortfall(m, plan, profile))


def _half_norm_shortfall(m: ModelConfig, plan: ParallelPlan, profile: RuntimeProfile) -> int:
    """In half precision the composite RMSNorm's saved x·rstd is fp32, not the e bytes its
    `*_normalized` term counts. Over a whole layer the residual-stream terms balance that
    (the norms save fp32 upcasts, not the half residuals), but once the layer's output is
    freed (the MLP's backward) the pre-MLP norm's extra 4 - e bytes per element are not
    covered: tokens x h x (4 - e). The bf16 full-recompute calibration row
    bf16-h384-l4-s256-full was one bf16 h-wide tensor short at its SwiGLU backward."""
    e = _bytes_per_element(plan.precision)
    if e == 4 or not profile.rmsnorm_composite:
        return 0
    sp = plan.tp if plan.sequence_parallel else 1
    return m.seq_length * plan.micro_batch_size * m.hidden_size * (4 - e) // sp


_FREED_BEFORE_ATTENTION_BWD = (
    "mlp_norm", "fc1_out", "swiglu", "layer_output", "attention_residual", "context",
    "v_repeated", "attention_probs",
)


def _attention_backward(
    m: ModelConfig, plan: ParallelPlan, profile: RuntimeProfile, terms: dict[str, int], base: int
) -> tuple[int, int]:
    """(activations alive, transient) at the worst moment of the last layer's attention backward.

    Unfused attention: the masked_fill_ megatron applies to a view of its global score
    buffer makes autograd materialise, at the peak, four score-sized tensors (softmax
    gradient, a zero-filled copy of the buffer, its clone and the masked result)
    besides a few h-wide gradients; by then the MLP half, the context, the repeated
    values and the probabilities of that layer are freed. Selective recompute replays
    the core attention first, with the same peak. Checked against the op timeline.
    """
    tokens = m.seq_length * plan.micro_batch_size
    e = _bytes_per_element(plan.precision)
    hidden_grads = tokens * m.hidden_size * e // plan.tp
    if profile.attention == "flash":
        freed = sum(v for k, v in terms.items() if k.startswith(("mlp_norm", "fc1", "swiglu", "layer_output")))
        return base - freed, 3 * hidden_grads  # q, k, v gradients
    scores = _score_bytes(m, plan)
    half_softmax_in_fp32 = e < 4 and profile.softmax_in_fp32
    if half_softmax_in_fp32:
        # The mask is applied to a fresh fp32 upcast (not the buffer view). The worst moment
        # is the softmax's own backward: three fp32 score-sized tensors are alive, the fp32
        # probabilities it saved (released only once that node has run), the incoming
        # gradient upcast to fp32 and the softmax gradient; the half gradient of the
        # probabilities is already freed by the upcast. The saved fp32 probabilities are
        # kept in `base` (no recompute) or were just recomputed (selective: a transient).
        # This was sized as half gradient + 2 fp32 with the fp32 probabilities counted as
        # freed, 2 bytes per score short: on the calibration rows bf16-h512-l4-s512 and its
        # selective twin MemTracker's peak inside the last layer's softmax backward was
        # 3.1 MiB above the event (200.05 vs 196.92 MiB, 165.55 vs 162.42 MiB), and the
        # shortfall grows with a·s², hence the half-precision long-sequence under-predictions
        # (issue 26). Not measured on a GPU here.
        scores_fp32 = scores * 4 // e
        transient = 2 * scores_fp32
    else:
        transient = 4 * scores
    if plan.recompute == "selective":
        freed = sum(v for k, v in terms.items() if k.startswith(("mlp_norm", "fc1", "swiglu", "layer_output")))
        recomputed_probs = scores_fp32 if half_softmax_in_fp32 else 0
        return base - freed, transient + recomputed_probs + 3 * hidden_grads
    kept = {"attention_probs_fp32"} if half_softmax_in_fp32 else set()
    if plan.recompute == "full":
        # The replayed layer's output is held by the recompute until the layer's backward is
        # done (calibration rows with full recompute were one tokens x h tensor short here).
        kept.add("layer_output")
    freed = sum(v for k, v in terms.items() if k.startswith(_FREED_BEFORE_ATTENTION_BWD) and k not in kept)
    return base - freed, transient + 2 * hidden_grads


_SAVED_BEFORE_CORE_ATTENTION = (
    "input_norm", "qkv_out", "q_rope", "k_rope", "k_repeated", "v_repeated", "rope_cos_sin", "attention_probs",
)


def _attention_forward(
    m: ModelConfig, plan: ParallelPlan, profile: RuntimeProfile, terms: dict[str, int], before_layer: int
) -> tuple[int, int, int]:
    """(activations, logits, transient) at the last layer's unfused softmax in the forward.

    Read off MemTracker's timeline of the calibration row bf16-h512-l4-s512: at the cast of
    the probabilities to half precision, besides what the layer saves up to there, the raw
    scores (baddbmm's output, referenced by the attention's locals until it returns), the
    fp32 upcast they were masked in (half precision) and, for GQA, the fused qkv projection
    output and a contiguous copy of the query split off it (the repeated k and v are further
    copies) are alive. Under selective recompute nothing of the core attention is saved, so
    its probabilities are transient too.
    """
    tokens = m.seq_length * plan.micro_batch_size
    e = _bytes_per_element(plan.precision)
    t = plan.tp
    scores = _score_bytes(m, plan)
    scores_fp32 = scores * 4 // e
    half_softmax_in_fp32 = e < 4 and profile.softmax_in_fp32
    saved = sum(v for k, v in terms.items() if k.startswith(_SAVED_BEFORE_CORE_ATTENTION))
    transient = scores + (scores_fp32 if half_softmax_in_fp32 else 0)
    if e < 4 and profile.rmsnorm_composite and "input_norm_normalized" in terms:
        # In half precision the composite RMSNorm's x·rstd is fp32, not the e bytes its term
        # counts: over a whole layer that is balanced by the residual-stream terms (the norms
        # save their fp32 upcasts, not the half residuals), but the layer's own residual does
        # not exist yet at this moment.
        sp = plan.tp if plan.sequence_parallel else 1
        transient += tokens * m.hidden_size * (4 - e) // sp
    if plan.recompute == "selective":
        transient += scores + (scores_fp32 if half_softmax_in_fp32 else 0)
    if m.kv_heads < m.num_attention_heads:
        transient += tokens * m.hidden_size * e // t  # the query's contiguous copy
        if "k_rope" not in terms:
            # The key after RoPE (tokens x kv_heads x head_dim): the core attention's matmul
            # saves its repeated copy (`k_repeated`), but SelfAttention.forward's `key` still
            # references it until the core attention returns. Missing before: the bf16
            # calibration row bf16-h384-l2-s896-b3-gqa-full held one 688,128 B tensor
            # (2,688 tokens x 128 x 2 B) at this moment that no term named.
            transient += tokens * m.kv_heads * m.head_dim * e // t
        if "qkv_out" not in terms:  # saved under selective recompute, alive in any case
            transient += tokens * (m.hidden_size + 2 * m.kv_heads * m.head_dim) * e // t
        if plan.recompute == "selective":
            transient += 2 * tokens * m.hidden_size * e // t  # the repeated k and v, not saved
    return before_layer + saved, 0, transient


def _adam_temporaries(m: ModelConfig, plan: ParallelPlan, profile: RuntimeProfile, stage: int) -> int:
    """Bytes of Adam's temporaries at its worst parameter.

    torch's single-tensor AdamW (megatron's fallback without TE/apex) computes
    sqrt(v) / bias_correction for each parameter: two parameter-sized temporaries,
    while the previous parameter's quotient is still referenced; parameters are
    visited in registration order (embedding, per layer proj, qkv, fc1, fc2, output layer:
    megatron's SelfAttention registers linear_proj before linear_qkv, so fc1's predecessor
    is the larger qkv; the model said proj, 2 MiB short on the calibration row
    h1024-l2-s128). The norms are another parameter group, stepped on their own.
    Fused Adam kernels allocate nothing.

    torch's multi-tensor AdamW (`foreach`, torch's default on CUDA, so megatron's fallback on
    a GPU without TE/apex) steps each parameter group with list ops (torch/optim/adam.py
    `_multi_tensor_adam`, torch 2.11 and 2.13 alike): with decoupled weight decay, a float
    beta2 and no amsgrad every op is in place except `exp_avg_sq_sqrt =
    torch._foreach_sqrt(exp_avg_sqs)`, one fp32 tensor per parameter of the group, all alive
    until the group's update is done. megatron hands AdamW its fp32 main parameters (the
    mixed-precision optimizer's copies, or with the distributed optimizer this rank's shards
    of them) in two groups: with weight decay (every matrix) and without (the 1-D norm
    weights, wd_mult 0), so the larger group's 4 bytes per parameter (per shard) are the
    temporaries. The H200 calibration rows whose peak is the step (grid rows 7-10 of
    benchmarks/gpu_check.py) were 1.0-4.2 GiB above the fused-Adam prediction; 4 bytes per
    matrix parameter accounts for all but 0.1-0.7 % of their allocated peaks.
    """
    if profile.adam_kernel == "fused":
        return 0
    shard = plan.dp if plan.distributed_optimizer else 1
    if profile.adam_kernel == "foreach":
        params, _ = stage_parameters(m, plan.tp, plan.pp, stage)
        layers = stage_layers(m.num_layers, plan.pp, stage)
        norms = layers * 2 * m.hidden_size + (m.hidden_size if stage == plan.pp - 1 else 0)
        return 4 * -(-(params - norms) // shard)
    t = plan.tp
    h, f, v = m.hidden_size, m.ffn_size, m.vocab_size
    k = m.kv_heads * m.head_dim
    vocab_shard = -(-v // t) * h
    order: list[int] = []
    if stage == 0:
        order.append(vocab_shard)
    for _ in range(stage_layers(m.num_layers, plan.pp, stage)):
        order += [h * h // t, h * (h + 2 * k) // t, 2 * h * f // t, f * h // t]
    if stage == plan.pp - 1 and (m.untie_embeddings_and_output_weights or plan.pp > 1):
        order.append(vocab_shard)
    worst = max((2 * size + (order[i - 1] if i else 0) for i, size in enumerate(order)), default=0)
    state_bytes = 4  # Adam runs on fp32 (master) parameters
    return worst * state_bytes // shard


# --- Frenzy's published formula (the baseline) ------------------------------


def frenzy_parameters(m: ModelConfig) -> int:
    """Frenzy's parameter count W ≈ V·h + l·(12h² + 13h) (GPT-style block)."""
    h = m.hidden_size
    return m.vocab_size * h + m.num_layers * (12 * h * h + 13 * h)


def frenzy_estimate(m: ModelConfig, global_batch: int, dp: int = 1, tp: int = 1) -> int:
    """Frenzy's MARP: 20W/t + s·B·h·l·(10/d + 24/(d·t) + 5·a·s/(d·h·t)) bytes per GPU.

    B is the global batch split over d data-parallel ranks with no gradient
    accumulation (Frenzy's setting), so pass the sequences resident at once
    (micro batch × dp) to compare with a run that accumulates gradients.
    """
    s, h, l, a = m.seq_length, m.hidden_size, m.num_layers, m.num_attention_heads
    w = frenzy_parameters(m)
    act = s * global_batch * h * l * (10 / dp + 24 / (dp * tp) + 5 * a * s / (dp * h * tp))
    return int(20 * w / tp + act)


def breakdown_table(bd: MemoryBreakdown) -> list[tuple[str, float]]:
    """(category, GiB) rows plus the total, for printing."""
    rows = [(c, bd.gib(c)) for c in MemoryBreakdown.CATEGORIES]
    rows.append(("total", bd.gib()))
    return rows


__all__ = [
    "CPU_MEASURED", "CPU_SDPA_MEASURED", "MEGATRON_GPU", "MEGATRON_SDPA_GPU", "MEGATRON_TE_FLASH_GPU",
    "MemoryBreakdown", "MemoryModelError",
    "ParallelPlan", "RuntimeProfile", "breakdown_table", "estimate_memory", "frenzy_estimate",
    "frenzy_parameters", "layer_activation_terms", "profile_for_device", "stage_layers",
    "stage_parameters", "static_bytes",
]
