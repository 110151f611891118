"""How close is MARP (scheduler/memory_model.py) to the real peak memory of a training step?

Headline, and where it is measured. The figure that counts is MARP against the
CUDA allocator's peak on a GPU (benchmarks/gpu_check.py: bf16 + megatron's
mixed-precision optimizer, distributed optimizer, recompute) — the headline wherever
a GPU exists. The first GPU figures (one H200, 2026-11-28) are in gpu_check.py's docstring
(part 5; `gpu_check.py --score-recorded benchmarks/data/gpu_h200_2026-11-28` reprints them):
they added what a CPU cannot show (torch's foreach Adam on CUDA, the allocator's workspaces
and fragmentation, the CUDA context). This script reports what a CPU can say, in three parts:

1. **Held-out set (the CPU headline).** `HELDOUT_CASES`, decided and written down
   (2026-11-23, before any further tuning of scheduler/memory_model.py; see the block
   comment there) so that they cannot have shaped the estimator: bf16/fp16, tensor
   and data parallel 2 under torchrun, selective/full recompute, sequences of
   2,048-4,096 tokens — none of them in the grid the estimator's terms were read
   from. Reported: mean and worst accuracy, mean signed error
   ((predicted - measured) / measured; negative = under-prediction) and the
   under-prediction rate (an under-predicted plan is one that may OOM; an
   over-prediction only wastes memory) and the largest under-prediction, as a fraction
   of the measured peak, against the planner's memory margin
   (`PlannerConfig.memory_margin`, 10 %: the share of GPU memory a plan leaves free, so an
   under-prediction up to that still fits). `FRESH_HELDOUT_CASES`, a second set written
   down 2026-11-28 (issue 26) before the estimator was changed for what the first set
   revealed, is reported the same way: once the first set has steered a change it is no
   longer held out, so the fresh set is the one that says whether the change generalises.
   Second issue-26 change (4c36ab2, 2026-11-28): four terms read off the CALIBRATION grid
   only (MemTracker's peak operator and live tensors on its 5 under-predicted rows), committed
   before either held-out set was re-measured; neither held-out set was used to find or tune
   them (no constant was fitted: each term is an itemised tensor). Same measurements, old ->
   new estimator: calibration 40 rows under 12.5 % -> 0 %; held-out 2026-11-23 mean 0.9954
   -> 0.9954, worst 0.9892 -> 0.9892, under 22 % -> 11 % (1 of 9), largest under 0.37 % ->
   0.37 %; fresh 2026-11-28 mean 0.9955 -> 0.9955, worst 0.9837 -> 0.9837, under 20 % -> 20 %
   (2 of 10, both bf16 with full recompute), largest under 0.11 % -> 0.11 %; every
   under-prediction far inside the planner's 10 % margin. The rate goal (<= 10 %) is met on
   neither set yet.
   Third issue-26 change (c6618ee, 2026-11-29), again from calibration shapes only and
   committed before either held-out set was re-measured: MemTracker's live tensors at the
   peak (creating operator, shape, dtype) on the half-precision rows `BF16_CASES` and four new
   ones, `BF16_CASES_2026_11_29` (GQA and MHA, micro batch 2-3, full recompute, long sequences;
   none a held-out shape; which kind to build was steered by the note above that the fresh
   shortfalls were bf16 + full recompute). Found, each an itemised tensor, no constant fitted:
   under full recompute the last layer's softmax is replayed inside the backward, where the
   loss's per-token bookkeeping is alive (12 B/token + 8 short); the key after RoPE is alive at
   the unfused softmax (GQA); in the first forward the token ids and the last layer's input
   (its residual) are alive there; RoPE's cos/sin are stored in the activations' dtype (counted
   at 4 bytes, an excess that had hidden the others on the older rows); the final norm's x·rstd
   is fp32 in half precision; the output layer's backward holds the half logits gradient, not
   the fp32 logits. Measured 2026-11-29 (`--heldout-only`, 1,016 s on this loaded 2-core box;
   every peak byte-identical to the 2026-11-28 run's): held-out 2026-11-23 mean 0.9983, worst
   0.9914, mean signed +0.17 %, under-predicted 0 of 9; fresh 2026-11-28 mean 0.9981, worst
   0.9911, mean signed +0.19 %, under-predicted 0 of 10; largest under-prediction 0 on both.
   The goal (rate <= 10 %, none beyond the margin, mean >= 0.95) is met on both sets; the worst
   rows are over-predictions (fp16/fp32 rows, +0.7..0.9 %).
2. **Frenzy's formula where its own assumptions hold** (`FRENZY_CASES`): fp16,
   GPT-style parameter count (tied embedding, multi-head attention, a SwiGLU
   width of 8h/3 so a block holds 12h² weights like GPT's 4h MLP), no gradient
   accumulation (B = micro batch x dp). On CPU megatron's mixed-precision optimizer
   cannot run, so these are measured forward + backward only; Frenzy's formula is
   scored with its static term set to what that run holds (6 bytes/parameter:
   fp16 weights + the fp32 gradient buffer, instead of its 20 for weights,
   gradients and Adam) and its activation term unchanged. MARP is scored on the
   same cases. Baseline and why it is fair: Frenzy's MARP is the published
   estimator forgeflow's replaces; scored only where its assumptions hold, it is
   not penalised for shapes it never claimed to cover, and the one change (the
   static bytes) removes a term the CPU run cannot contain rather than one it
   gets wrong. (The old `frenzy_*` keys apply the formula as published to the
   fp32 grid, outside its assumptions.)
3. **Regression check (old keys, not a headline).** The original grid (hidden
   size, layers, sequence, micro batch, accumulation, recompute, GQA, tp=2 and
   dp=2 under torchrun with gloo): MARP's terms were read off MemTracker's
   timeline on these very shapes, so agreement here is circular — it only guards
   against the estimator or the model code drifting apart. Same for the 8 seeded
   random fp32 shapes (added after calibration, same small family), the bf16
   forward+backward table and the FakeTensorMode 7B/13B shapes.

Each configuration trains the ACTUAL forgeflow model (training/model.py:
megatron GPTModel + DDP + Adam) for two steps under PyTorch's MemTracker
(scheduler/memory_probe.py) and compares the per-rank peak with
`estimate_memory(..., CPU_MEASURED)`:  accuracy = 1 - |predicted - measured| / measured.
fp32 cases run full steps with Adam; bf16/fp16 run forward + backward into DDP's
fp32 gradient buffers (megatron's mixed-precision optimizer needs CUDA).

    .venv/bin/python benchmarks/memory_accuracy.py [--smoke] [--no-fake] [--no-torchrun] [--heldout-only]

Last line: one JSON object — planner_memory_margin; for each held-out set (heldout_*,
fresh_heldout_*): _configs, _mean_accuracy, _worst_accuracy, _mean_signed_error,
_underprediction_rate, _largest_underprediction; frenzy_mean_accuracy_own_assumptions,
marp_mean_accuracy_on_frenzy_cases, and the regression keys (configs, mean_accuracy,
worst_accuracy, underprediction_rate, largest_underprediction, frenzy_mean_accuracy,
frenzy_worst_accuracy, half_precision_*, fake_*). `--smoke` prints the same keys from one
tiny configuration per table (seconds; the figures mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scheduler.memory_model import (  # noqa: E402
    CPU_MEASURED,
    MemoryBreakdown,
    ParallelPlan,
    estimate_memory,
    frenzy_estimate,
)
from scheduler.planner import PlannerConfig  # noqa: E402
from training.config import ModelConfig, TrainingConfig  # noqa: E402
from benchmarks.headline import checked_headline  # noqa: E402

HEADLINE_KEYS = (
    "headline_where_gpu",
    "planner_memory_margin",
    "heldout_configs",
    "heldout_mean_accuracy",
    "heldout_worst_accuracy",
    "heldout_mean_signed_error",
    "heldout_underprediction_rate",
    "heldout_largest_underprediction",
    "fresh_heldout_configs",
    "fresh_heldout_mean_accuracy",
    "fresh_heldout_worst_accuracy",
    "fresh_heldout_mean_signed_error",
    "fresh_heldout_underprediction_rate",
    "fresh_heldout_largest_underprediction",
    "frenzy_own_assumptions_configs",
    "frenzy_mean_accuracy_own_assumptions",
    "frenzy_signed_error_own_assumptions",
    "frenzy_underprediction_rate_own_assumptions",
    "marp_mean_accuracy_on_frenzy_cases",
    "configs",
    "mean_accuracy",
    "worst_accuracy",
    "frenzy_mean_accuracy",
    "frenzy_worst_accuracy",
    "underprediction_rate",
    "largest_underprediction",
    "half_precision_configs",
    "half_precision_mean_accuracy",
    "half_precision_worst_accuracy",
    "half_precision_underprediction_rate",
    "half_precision_largest_underprediction",
    "fake_configs",
    "fake_mean_accuracy",
    "fake_worst_accuracy",
)  # the last line, full run and --smoke alike (benchmarks.headline)
# The regression grid's keys (absent from a --heldout-only run, like half_precision_* and fake_*).
REGRESSION_KEYS = ("configs", "mean_accuracy", "worst_accuracy", "frenzy_mean_accuracy", "frenzy_worst_accuracy",
                   "underprediction_rate", "largest_underprediction")

# The fraction of GPU memory the planner keeps free (`PlannerConfig.memory_margin`): a plan is
# kept when predicted <= (1 - margin) x capacity, so an under-prediction of up to `margin` of
# the measured peak still fits the GPU; a larger one can run out of memory.
PLANNER_MEMORY_MARGIN = PlannerConfig().memory_margin

MIB = 1024**2


@dataclass
class Case:
    id: str
    model: dict[str, Any]
    micro: int
    global_batch: int
    recompute: str = "none"
    tp: int = 1
    dp: int = 1
    precision: str = "fp32"
    measured: int | None = None
    measured_categories: dict[str, int] = field(default_factory=dict)

    @property
    def model_cfg(self) -> ModelConfig:
        return ModelConfig(**self.model)

    @property
    def training_cfg(self) -> TrainingConfig:
        return TrainingConfig(
            global_batch_size=self.global_batch, micro_batch_size=self.micro, steps=2,
            recompute=self.recompute, tensor_parallel=self.tp, precision=self.precision,
        )

    @property
    def plan(self) -> ParallelPlan:
        return ParallelPlan(
            global_batch_size=self.global_batch, micro_batch_size=self.micro, dp=self.dp,
            tp=self.tp, recompute=self.recompute, precision=self.precision,
        )

    @property
    def with_optimizer(self) -> bool:
        # megatron's mixed-precision optimizer needs CUDA: half precision is measured
        # (and predicted) for forward + backward into the fp32 gradient buffers only.
        return self.precision == "fp32"

    def predict(self) -> MemoryBreakdown:
        return estimate_memory(self.model_cfg, self.plan, CPU_MEASURED, optimizer=self.with_optimizer)


def _m(h: int, l: int, a: int, kv: int, s: int, v: int = 4096, f: int | None = None, tied: bool = False) -> dict[str, Any]:
    return dict(num_layers=l, hidden_size=h, num_attention_heads=a, num_query_groups=kv,
                ffn_hidden_size=f, vocab_size=v, seq_length=s,
                untie_embeddings_and_output_weights=not tied)


def grid() -> list[Case]:
    cases = [
        Case("tiny-cpu", _m(256, 4, 8, 4, 128, f=688), micro=8, global_batch=16),
        Case("h256-l2-s128", _m(256, 2, 8, 4, 128), micro=2, global_batch=2),
        Case("h256-l4-s256", _m(256, 4, 8, 4, 256), micro=2, global_batch=4),
        Case("h256-l4-s256-sel", _m(256, 4, 8, 4, 256), micro=2, global_batch=4, recompute="selective"),
        Case("h256-l4-s256-full", _m(256, 4, 8, 4, 256), micro=2, global_batch=4, recompute="full"),
        Case("h512-l4-s256-mha", _m(512, 4, 8, 8, 256), micro=1, global_batch=1),
        Case("h512-l4-s512-gqa", _m(512, 4, 8, 2, 512), micro=1, global_batch=1),
        Case("h512-l4-s512-sel", _m(512, 4, 8, 2, 512), micro=1, global_batch=1, recompute="selective"),
        Case("h512-l4-s512-full", _m(512, 4, 8, 2, 512), micro=1, global_batch=1, recompute="full"),
        Case("h384-l6-s256-b4", _m(384, 6, 6, 2, 256), micro=4, global_batch=4),
        Case("h384-l6-s128-b4-accum-sel", _m(384, 6, 6, 2, 128), micro=4, global_batch=8, recompute="selective"),
        Case("h768-l2-s128-b8", _m(768, 2, 12, 4, 128), micro=8, global_batch=8),
        Case("h768-l2-s128-b8-full", _m(768, 2, 12, 4, 128), micro=8, global_batch=8, recompute="full"),
        Case("h256-l8-s1024", _m(256, 8, 4, 1, 1024), micro=1, global_batch=1),
        Case("h256-l8-s1024-sel", _m(256, 8, 4, 1, 1024), micro=1, global_batch=1, recompute="selective"),
        Case("h256-l8-s1024-full", _m(256, 8, 4, 1, 1024), micro=1, global_batch=1, recompute="full"),
        Case("h128-l2-s64-b16-v8k", _m(128, 2, 4, 4, 64, v=8192), micro=16, global_batch=32),
        Case("h1024-l2-s128", _m(1024, 2, 16, 4, 128), micro=1, global_batch=2),
        Case("h1024-l2-s128-full", _m(1024, 2, 16, 4, 128), micro=1, global_batch=2, recompute="full"),
        Case("h640-l3-s384-v16k", _m(640, 3, 10, 5, 384, v=16000), micro=2, global_batch=2),
        Case("h640-l3-s384-v16k-sel", _m(640, 3, 10, 5, 384, v=16000), micro=2, global_batch=2, recompute="selective"),
        Case("h256-l2-s256-tied", _m(256, 2, 8, 4, 256, tied=True), micro=2, global_batch=2),
        # Under torchrun (2 gloo processes): tensor parallel 2, data parallel 2.
        Case("tp2-h512-l4-s256", _m(512, 4, 8, 4, 256), micro=2, global_batch=2, tp=2),
        Case("tp2-h512-l4-s256-sel", _m(512, 4, 8, 4, 256), micro=2, global_batch=2, tp=2, recompute="selective"),
        Case("tp2-h768-l2-s512", _m(768, 2, 12, 4, 512), micro=1, global_batch=1, tp=2),
        Case("tp2-h768-l2-s512-full", _m(768, 2, 12, 4, 512), micro=1, global_batch=1, tp=2, recompute="full"),
        Case("dp2-h256-l4-s256", _m(256, 4, 8, 4, 256), micro=2, global_batch=8, dp=2),
    ]
    cases += held_out_cases(8)
    return cases


def held_out_cases(count: int, seed: int = 20261122) -> list[Case]:
    """Random shapes (fixed seed) that played no part in deriving the estimator's terms."""
    import random

    rng = random.Random(seed)
    cases = []
    for i in range(count):
        head_dim = rng.choice([16, 32, 64])
        heads = rng.choice([2, 4, 6, 8, 12])
        kv = rng.choice([d for d in range(1, heads + 1) if heads % d == 0])
        micro = rng.choice([1, 2, 4])
        model = _m(head_dim * heads, rng.randint(1, 5), heads, kv, rng.choice([64, 128, 192, 256, 384, 512]),
                   v=rng.choice([1000, 3000, 5000, 8192]), f=rng.choice([None, 256, 1000]),
                   tied=rng.random() < 0.2)
        cases.append(Case(f"heldout-{i}", model, micro=micro, global_batch=micro * rng.choice([1, 2]),
                          recompute=rng.choice(["none", "selective", "full"])))
    return cases


BF16_CASES = [
    Case("bf16-h256-l2-s128", _m(256, 2, 8, 4, 128), micro=2, global_batch=2, precision="bf16"),
    Case("bf16-h512-l4-s512", _m(512, 4, 8, 2, 512), micro=1, global_batch=1, precision="bf16"),
    Case("bf16-h512-l4-s512-sel", _m(512, 4, 8, 2, 512), micro=1, global_batch=1, precision="bf16",
         recompute="selective"),
    Case("bf16-h384-l4-s256-full", _m(384, 4, 6, 6, 256), micro=2, global_batch=4, precision="bf16",
         recompute="full"),
    Case("fp16-h256-l2-s256-v16k", _m(256, 2, 4, 2, 256, v=16000), micro=2, global_batch=2, precision="fp16"),
]

# Calibration shapes added 2026-11-29 (issue 26, third change), after both held-out sets were
# written down (so a list of their own: the fresh set's "only new shapes" check is against what
# existed before it): half precision with GQA and MHA, micro batches 2-3, full recompute and
# long sequences without recompute; none of them a held-out shape. scheduler/memory_model.py
# names the tensors each one showed at its peak.
BF16_CASES_2026_11_29 = [
    Case("bf16-h256-l2-s768-b2-gqa-full", _m(256, 2, 8, 2, 768, v=4000), micro=2, global_batch=2,
         precision="bf16", recompute="full"),
    Case("bf16-h384-l2-s896-b3-gqa-full", _m(384, 2, 6, 2, 896, v=5000), micro=3, global_batch=3,
         precision="bf16", recompute="full"),
    Case("bf16-h320-l2-s1024-b2-gqa", _m(320, 2, 10, 2, 1024, v=3000), micro=2, global_batch=2, precision="bf16"),
    Case("bf16-h256-l3-s1536-mha", _m(256, 3, 4, 4, 1536, v=3000), micro=1, global_batch=1, precision="bf16"),
]


# ---------------------------------------------------------------------------------------
# HELD-OUT SET — decided 2026-11-23 before any further tuning of scheduler/memory_model.py, and
# committed before it was first measured. Do not tune the estimator against these and do
# not edit this list to improve the figure; add a new, dated set instead. What each
# covers that the calibration grid does not: half precision together with tp/dp > 1,
# recompute in half precision and under parallelism, and 2k-4k-token sequences.
# ---------------------------------------------------------------------------------------
HELDOUT_CASES = [
    # long sequences, one process
    Case("ho-bf16-h256-l4-s2048-sel", _m(256, 4, 4, 2, 2048, v=8000), micro=1, global_batch=1,
         precision="bf16", recompute="selective"),
    Case("ho-bf16-h256-l2-s4096-sel", _m(256, 2, 4, 1, 4096, v=8000), micro=1, global_batch=1,
         precision="bf16", recompute="selective"),
    Case("ho-fp16-h512-l2-s2048-full", _m(512, 2, 8, 8, 2048, v=8000), micro=1, global_batch=2,
         precision="fp16", recompute="full"),
    Case("ho-fp32-h128-l2-s3072", _m(128, 2, 2, 2, 3072, v=4000), micro=1, global_batch=1),
    # tensor / data parallel 2 under torchrun (gloo)
    Case("ho-bf16-tp2-h512-l2-s512", _m(512, 2, 8, 4, 512, v=8000), micro=2, global_batch=2, tp=2,
         precision="bf16"),
    Case("ho-bf16-tp2-h384-l3-s1024-full", _m(384, 3, 6, 6, 1024, v=8000), micro=1, global_batch=1, tp=2,
         precision="bf16", recompute="full"),
    Case("ho-fp32-tp2-h256-l2-s2048-sel", _m(256, 2, 4, 2, 2048, v=8000), micro=1, global_batch=1, tp=2,
         recompute="selective"),
    Case("ho-bf16-dp2-h256-l4-s512-sel", _m(256, 4, 8, 4, 512, v=8000), micro=2, global_batch=8, dp=2,
         precision="bf16", recompute="selective"),
    Case("ho-fp32-dp2-h384-l4-s1024-full", _m(384, 4, 6, 2, 1024, v=8000), micro=2, global_batch=4, dp=2,
         recompute="full"),
]

# ---------------------------------------------------------------------------------------
# FRESH HELD-OUT SET — written down 2026-11-28 (issue 26) before the estimator was changed for
# the half-precision under-prediction the set above revealed, and committed on its own before
# any tuning. Do not tune against it and do not edit it; add a new, dated set instead. Every
# shape is new: hidden sizes 192/320/448/576/832/896, 1/3/5/7/9 layers (1, 5, 7 and 9 nowhere
# else), sequences of 768-3,584 tokens (none used before), micro batch 3 (never used before),
# heads 3/5/7/9/10/13/14, vocabularies 2,500/6,000/10,240/12,000; bf16 without recompute on
# long sequences (absent above), every recompute mode in bf16, tp and dp 2. The fp16 cases are
# small: this CPU has no fp16 matrix units (about 2 GFLOP/s), bf16 runs on AVX512-BF16.
# ---------------------------------------------------------------------------------------
FRESH_HELDOUT_CASES = [
    # one process
    Case("fresh-bf16-h320-l5-s2560", _m(320, 5, 5, 5, 2560, v=6000), micro=1, global_batch=1, precision="bf16"),
    Case("fresh-bf16-h192-l7-s3584-sel", _m(192, 7, 3, 3, 3584, v=10240), micro=1, global_batch=1,
         precision="bf16", recompute="selective"),
    Case("fresh-fp16-h448-l1-s1536-sel", _m(448, 1, 7, 1, 1536, v=2500), micro=1, global_batch=1,
         precision="fp16", recompute="selective"),
    Case("fresh-bf16-h576-l3-s1280-b3-full", _m(576, 3, 9, 3, 1280, v=6000), micro=3, global_batch=6,
         precision="bf16", recompute="full"),
    Case("fresh-fp32-h192-l9-s1792", _m(192, 9, 3, 1, 1792, v=6000), micro=1, global_batch=1),
    Case("fresh-fp16-h832-l1-s768-b3", _m(832, 1, 13, 1, 768, v=2500), micro=3, global_batch=3,
         precision="fp16"),
    # tensor / data parallel 2 under torchrun (gloo)
    Case("fresh-bf16-tp2-h448-l5-s1792", _m(448, 5, 14, 2, 1792, v=10240), micro=1, global_batch=1, tp=2,
         precision="bf16"),
    Case("fresh-fp32-tp2-h896-l3-s768-b3-sel", _m(896, 3, 14, 14, 768, v=6000), micro=3, global_batch=3, tp=2,
         recompute="selective"),
    Case("fresh-bf16-dp2-h320-l7-s1280-b3-full", _m(320, 7, 10, 5, 1280, v=10240), micro=3, global_batch=12,
         dp=2, precision="bf16", recompute="full"),
    Case("fresh-bf16-dp2-h576-l1-s2560-sel", _m(576, 1, 9, 9, 2560, v=12000), micro=1, global_batch=2, dp=2,
         precision="bf16", recompute="selective"),
]

# Frenzy's own assumptions: fp16, GPT-style parameter count (tied embedding, MHA, SwiGLU
# width 8h/3 -> 12h² per block), no gradient accumulation.
FRENZY_CASES = [
    Case("fz-fp16-h384-l4-s512-b2", _m(384, 4, 6, 6, 512, v=8192, f=1024, tied=True), micro=2, global_batch=2,
         precision="fp16"),
    Case("fz-fp16-h768-l2-s256-b4", _m(768, 2, 12, 12, 256, v=8192, f=2048, tied=True), micro=4, global_batch=4,
         precision="fp16"),
    Case("fz-fp16-h384-l6-s1024-b1", _m(384, 6, 6, 6, 1024, v=8192, f=1024, tied=True), micro=1, global_batch=1,
         precision="fp16"),
    Case("fz-fp16-tp2-h768-l2-s512-b2", _m(768, 2, 12, 12, 512, v=8192, f=2048, tied=True), micro=2,
         global_batch=2, tp=2, precision="fp16"),
    Case("fz-fp16-dp2-h384-l4-s512-b4", _m(384, 4, 6, 6, 512, v=8192, f=1024, tied=True), micro=2,
         global_batch=4, dp=2, precision="fp16"),
]
# What the forward+backward-only CPU run holds per parameter: fp16 weights + fp32 gradient buffer.
FRENZY_STATIC_BYTES_MEASURED = 2 + 4


def frenzy_own_assumptions(c: Case) -> float:
    """Frenzy's formula with its static term for what the measured run holds (see the docstring)."""
    from scheduler.memory_model import frenzy_parameters

    published = frenzy_estimate(c.model_cfg, global_batch=c.micro * c.dp, dp=c.dp, tp=c.tp)
    w = frenzy_parameters(c.model_cfg)
    return published - 20 * w / c.tp + FRENZY_STATIC_BYTES_MEASURED * w / c.tp


def score(pairs: list[tuple[float, float]]) -> dict[str, float]:
    """(predicted, measured) pairs -> mean/worst accuracy, mean signed error, under-prediction
    rate and the largest under-prediction as a fraction of the measured peak (0 if none)."""
    accs = [accuracy(p, m) for p, m in pairs]
    signed = [(p - m) / m for p, m in pairs]
    return {"mean": sum(accs) / len(accs), "worst": min(accs), "signed": sum(signed) / len(signed),
            "under": sum(1 for p, m in pairs if p < m) / len(pairs),
            "largest_under": max([(m - p) / m for p, m in pairs if p < m], default=0.0)}


def report_heldout(cases: list[Case], title: str) -> dict[str, float]:
    """Print one held-out set row by row; return its `score`."""
    print(f"\n{title}")
    print(f"{'config':36s} {'tp':>2s} {'dp':>2s} {'prec':>5s} {'measured':>10s} {'MARP':>10s} {'signed':>8s}")
    for c in cases:
        pred = c.predict().total
        print(f"{c.id:36s} {c.tp:2d} {c.dp:2d} {c.precision:>5s} {c.measured / MIB:10.1f} {pred / MIB:10.1f} "
              f"{(pred - c.measured) / c.measured:+8.2%}")
    h = score([(c.predict().total, c.measured) for c in cases])
    print(f"MARP: mean {h['mean']:.2%}  worst {h['worst']:.2%}  mean signed {h['signed']:+.2%}  "
          f"under-predicted {h['under']:.0%} of {len(cases)}  largest under-prediction {h['largest_under']:.2%} "
          f"(planner memory margin {PLANNER_MEMORY_MARGIN:.0%})")
    return h


def report_frenzy(frenzy_cases: list[Case]) -> dict[str, dict[str, float]]:
    print("\nFrenzy's formula where its assumptions hold (fp16, GPT-style count, no accumulation; "
          f"static {FRENZY_STATIC_BYTES_MEASURED} B/param for the forward+backward-only run)")
    print(f"{'config':34s} {'tp':>2s} {'dp':>2s} {'measured':>10s} {'Frenzy':>10s} {'signed':>8s} "
          f"{'MARP':>10s} {'signed':>8s}")
    for c in frenzy_cases:
        fz, pred = frenzy_own_assumptions(c), c.predict().total
        print(f"{c.id:34s} {c.tp:2d} {c.dp:2d} {c.measured / MIB:10.1f} {fz / MIB:10.1f} "
              f"{(fz - c.measured) / c.measured:+8.2%} {pred / MIB:10.1f} {(pred - c.measured) / c.measured:+8.2%}")
    out = {"frenzy": score([(frenzy_own_assumptions(c), c.measured) for c in frenzy_cases]),
           "marp_on_frenzy": score([(c.predict().total, c.measured) for c in frenzy_cases])}
    f, m = out["frenzy"], out["marp_on_frenzy"]
    print(f"Frenzy: mean {f['mean']:.2%}  worst {f['worst']:.2%}  signed {f['signed']:+.2%}  under {f['under']:.0%}")
    print(f"MARP:   mean {m['mean']:.2%}  worst {m['worst']:.2%}  signed {m['signed']:+.2%}  under {m['under']:.0%}")
    return out


FAKE_CASES = [
    # Llama-2-7B / 13B shapes with 4k sequences; a Llama-3-8B-like GQA shape (128k vocabulary).
    Case("7B-s4096", _m(4096, 32, 32, 32, 4096, v=32000, f=11008), micro=1, global_batch=1),
    Case("7B-s4096-b2-sel", _m(4096, 32, 32, 32, 4096, v=32000, f=11008), micro=2, global_batch=2,
         recompute="selective"),
    Case("7B-s2048-full-accum", _m(4096, 32, 32, 32, 2048, v=32000, f=11008), micro=4, global_batch=8,
         recompute="full"),
    Case("8B-gqa-s8192-sel", _m(4096, 32, 32, 8, 8192, v=128256, f=14336), micro=1, global_batch=1,
         recompute="selective"),
    Case("13B-s4096", _m(5120, 40, 40, 40, 4096, v=32000, f=13824), micro=1, global_batch=1),
    Case("13B-s4096-full", _m(5120, 40, 40, 40, 4096, v=32000, f=13824), micro=1, global_batch=1,
         recompute="full"),
]


def smoke_cases() -> dict[str, list[Case]]:
    """One tiny configuration per table for `--smoke`: seconds, in this process, same code
    path and the same last-line keys as the full run (the figures mean nothing)."""
    tiny = _m(64, 1, 2, 1, 64, v=256)
    return {
        "heldout": [Case("smoke-bf16-sel", tiny, micro=1, global_batch=1, precision="bf16", recompute="selective")],
        "fresh": [Case("smoke-bf16", _m(64, 2, 4, 2, 96, v=256), micro=1, global_batch=1, precision="bf16")],
        "frenzy": [Case("smoke-fz-fp16", _m(48, 1, 2, 2, 64, v=256, f=128, tied=True), micro=1, global_batch=1,
                        precision="fp16")],
        "grid": [Case("smoke-fp32-accum", tiny, micro=2, global_batch=4)],
        "half": [Case("smoke-fp16-full", tiny, micro=1, global_batch=1, precision="fp16", recompute="full")],
        "fake": [Case("smoke-fake", _m(128, 2, 4, 4, 128, v=512), micro=1, global_batch=1)],
    }


def measure_in_process(cases: list[Case], fake: bool = False) -> None:
    from scheduler.memory_probe import measure_training_peak

    for case in cases:
        started = time.perf_counter()
        peak = measure_training_peak(case.model_cfg, case.training_cfg, fake=fake,
                                     with_optimizer=case.with_optimizer)
        case.measured, case.measured_categories = peak.total, peak.by_category
        print(f"  measured {case.id:24s} {peak.total / MIB:12.1f} MiB  ({time.perf_counter() - started:.1f} s)",
              flush=True)


def measure_under_torchrun(cases: list[Case], nproc: int) -> None:
    """One torchrun of `nproc` gloo processes measures every case of the list, in order."""
    payload = [
        {"id": c.id, "model": c.model, "training": c.training_cfg.model_dump(), "steps": 2,
         "with_optimizer": c.with_optimizer} for c in cases
    ]
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "configs.json"
        spec.write_text(json.dumps(payload))
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "scheduler.memory_probe", str(spec)]
        started = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    by_id = {c.id: c for c in cases}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            case = by_id[row["id"]]
            case.measured, case.measured_categories = row["total"], row["by_category"]
            print(f"  measured {case.id:24s} {case.measured / MIB:12.1f} MiB  (max of {row['world_size']} ranks)")
    print(f"  torchrun x{nproc}: {time.perf_counter() - started:.1f} s", flush=True)
    missing = [c.id for c in cases if c.measured is None]
    if missing:
        raise RuntimeError(f"torchrun printed no result for {missing}:\n{proc.stdout[-2000:]}")


def accuracy(predicted: float, measured: float) -> float:
    return 1.0 - abs(predicted - measured) / measured


def report(cases: list[Case], title: str) -> dict[str, float]:
    print(f"\n{title}")
    header = (f"{'config':24s} {'tp':>2s} {'dp':>2s} {'measured':>10s} {'MARP':>10s} {'acc':>7s} "
              f"{'Frenzy':>10s} {'acc':>7s}  MARP breakdown (MiB) / peak moment")
    print(header)
    print("-" * len(header))
    ours, theirs = [], []
    for c in cases:
        assert c.measured is not None
        bd: MemoryBreakdown = c.predict()
        frenzy = frenzy_estimate(c.model_cfg, global_batch=c.micro * c.dp, dp=c.dp, tp=c.tp)
        a_ours, a_frenzy = accuracy(bd.total, c.measured), accuracy(frenzy, c.measured)
        ours.append(a_ours)
        theirs.append(a_frenzy)
        parts = " ".join(
            f"{name[:5]}={getattr(bd, name) / MIB:.1f}"
            for name in ("weights", "gradients", "optimizer_states", "activations", "logits",
                         "transient", "persistent_buffers") if getattr(bd, name)
        )
        print(f"{c.id:24s} {c.tp:2d} {c.dp:2d} {c.measured / MIB:10.1f} {bd.total / MIB:10.1f} {a_ours:7.2%} "
              f"{frenzy / MIB:10.1f} {a_frenzy:7.2%}  {parts} @ {bd.peak_event}")
        meas = c.measured_categories
        print(f"{'':24s} measured categories (MiB): "
              + " ".join(f"{k[:5]}={v / MIB:.1f}" for k, v in meas.items() if v))
    summary = {
        "mean": sum(ours) / len(ours), "worst": min(ours),
        "frenzy_mean": sum(theirs) / len(theirs), "frenzy_worst": min(theirs),
    }
    marp = score([(c.predict().total, c.measured) for c in cases])
    summary.update(under=marp["under"], largest_under=marp["largest_under"])
    print(f"MARP   accuracy: mean {summary['mean']:.2%}  worst {summary['worst']:.2%}  over {len(cases)} configs")
    print(f"MARP   under-predicted {summary['under']:.0%} of {len(cases)}, "
          f"largest under-prediction {summary['largest_under']:.2%}")
    print(f"Frenzy accuracy: mean {summary['frenzy_mean']:.2%}  worst {summary['frenzy_worst']:.2%}")
    return summary


def measure(cases: list[Case], cached: dict[str, Any]) -> None:
    """Fill `measured` for every case: from `cached`, in this process (tp = dp = 1) or one torchrun per size."""
    for c in cases:
        if c.id in cached:
            c.measured, c.measured_categories = cached[c.id]["total"], cached[c.id]["by_category"]
    todo = [c for c in cases if c.measured is None]
    measure_in_process([c for c in todo if c.tp == 1 and c.dp == 1])
    for nproc in sorted({c.tp * c.dp for c in todo if c.tp * c.dp > 1}):
        measure_under_torchrun([c for c in todo if c.tp * c.dp == nproc], nproc)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true",
                        help="one tiny configuration per table, in this process (seconds; same code and keys)")
    parser.add_argument("--no-fake", action="store_true", help="skip the FakeTensorMode 7B/13B table")
    parser.add_argument("--no-torchrun", action="store_true", help="skip every tp=2/dp=2 configuration")
    parser.add_argument("--heldout-only", action="store_true",
                        help="only the held-out set and Frenzy's own-assumption cases (no regression grid)")
    parser.add_argument("--measurements", type=Path, metavar="FILE",
                        help="development aid: reuse measured peaks from FILE if it exists, "
                             "else measure and write them there (the estimator always runs afresh)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    started = time.perf_counter()
    cached = json.loads(args.measurements.read_text()) if args.measurements and args.measurements.exists() else {}

    def keep(cases: list[Case]) -> list[Case]:
        return [c for c in cases if c.tp == 1 and c.dp == 1] if args.no_torchrun else list(cases)

    sets = smoke_cases() if args.smoke else {
        "heldout": HELDOUT_CASES, "fresh": FRESH_HELDOUT_CASES, "frenzy": FRENZY_CASES,
        "grid": [] if args.heldout_only else grid(),
        "half": [] if args.heldout_only else BF16_CASES + BF16_CASES_2026_11_29,
        "fake": [] if args.no_fake or args.heldout_only else FAKE_CASES,
    }
    heldout, fresh, frenzy_cases = keep(sets["heldout"]), keep(sets["fresh"]), keep(sets["frenzy"])
    print(f"measuring {len(heldout)} + {len(fresh)} held-out and {len(frenzy_cases)} Frenzy-assumption "
          "configurations (CPU, MemTracker, 2 steps each)")
    measure(heldout + fresh + frenzy_cases, cached)
    held: dict[str, dict[str, float]] = {}
    if heldout:
        held["heldout"] = report_heldout(heldout, "HELD-OUT set of 2026-11-23 (decided before tuning)")
    if fresh:
        held["fresh_heldout"] = report_heldout(
            fresh, "FRESH HELD-OUT set of 2026-11-28 (written down before the issue-26 change)")
    if frenzy_cases:
        held.update(report_frenzy(frenzy_cases))

    cases = keep(sets["grid"])
    summary: dict[str, float] = {}
    if cases:
        print(f"\nREGRESSION CHECK (not a headline: the estimator's terms were read off these shapes): "
              f"{len(cases)} configurations (fp32, full steps)")
        measure(cases, cached)
        summary = report(cases, "Real measurement (MemTracker peak per rank, fp32)")
        random_shapes = [accuracy(c.predict().total, c.measured) for c in cases if c.id.startswith("heldout-")]
        if random_shapes:
            print(f"  of which seeded random shapes (added after calibration; not a held-out set): "
                  f"mean {sum(random_shapes) / len(random_shapes):.2%}  worst {min(random_shapes):.2%}  "
                  f"over {len(random_shapes)}")

    bf16_cases = sets["half"]
    bf16_summary: dict[str, float] = {}
    if bf16_cases:
        print(f"\nHalf precision on CPU: {len(bf16_cases)} configurations, forward + backward only")
        measure(bf16_cases, cached)
        bf16_summary = report(bf16_cases, "bf16/fp16 measurement (no optimizer: weights, fp32 grad buffers, "
                                          "activations; Frenzy column not comparable)")

    fake_summary: dict[str, float] = {}
    fake_cases: list[Case] = sets["fake"]
    if fake_cases:
        print(f"\nFakeTensorMode: {len(fake_cases)} large-model shapes (traced, no memory used)")
        for c in fake_cases:
            if c.id in cached:
                c.measured, c.measured_categories = cached[c.id]["total"], cached[c.id]["by_category"]
        measure_in_process([c for c in fake_cases if c.measured is None], fake=True)
        fake_summary = report(fake_cases, "FakeTensorMode measurement (fp32, shapes only)")
    if args.measurements:
        cached.update({c.id: {"total": c.measured, "by_category": c.measured_categories}
                       for c in heldout + fresh + frenzy_cases + cases + bf16_cases + fake_cases})
        args.measurements.write_text(json.dumps(cached, indent=1))

    print(f"\nwall time {time.perf_counter() - started:.0f} s")
    headline: dict[str, Any] = {"headline_where_gpu": "benchmarks/gpu_check.py (memory_mean_accuracy)"}
    headline["planner_memory_margin"] = PLANNER_MEMORY_MARGIN
    for key, cases_of_set in (("heldout", heldout), ("fresh_heldout", fresh)):
        if key in held:
            h = held[key]
            headline.update({
                f"{key}_configs": len(cases_of_set),
                f"{key}_mean_accuracy": round(h["mean"], 4),
                f"{key}_worst_accuracy": round(h["worst"], 4),
                f"{key}_mean_signed_error": round(h["signed"], 4),
                f"{key}_underprediction_rate": round(h["under"], 4),
                f"{key}_largest_underprediction": round(h["largest_under"], 4),
            })
    if "frenzy" in held:
        headline.update(
            frenzy_own_assumptions_configs=len(frenzy_cases),
            frenzy_mean_accuracy_own_assumptions=round(held["frenzy"]["mean"], 4),
            frenzy_signed_error_own_assumptions=round(held["frenzy"]["signed"], 4),
            frenzy_underprediction_rate_own_assumptions=round(held["frenzy"]["under"], 4),
            marp_mean_accuracy_on_frenzy_cases=round(held["marp_on_frenzy"]["mean"], 4),
        )
    if summary:
        headline.update(
            configs=len(cases),
            mean_accuracy=round(summary["mean"], 4),
            worst_accuracy=round(summary["worst"], 4),
            frenzy_mean_accuracy=round(summary["frenzy_mean"], 4),
            frenzy_worst_accuracy=round(summary["frenzy_worst"], 4),
            underprediction_rate=round(summary["under"], 4),
            largest_underprediction=round(summary["largest_under"], 4),
        )
    if bf16_summary:
        headline.update(
            half_precision_configs=len(bf16_cases),
            half_precision_mean_accuracy=round(bf16_summary["mean"], 4),
            half_precision_worst_accuracy=round(bf16_summary["worst"], 4),
            half_precision_underprediction_rate=round(bf16_summary["under"], 4),
            half_precision_largest_underprediction=round(bf16_summary["largest_under"], 4),
        )
    if fake_summary:
        headline.update(
            fake_configs=len(fake_cases),
            fake_mean_accuracy=round(fake_summary["mean"], 4),
            fake_worst_accuracy=round(fake_summary["worst"], 4),
        )
    # A partial run checks the keys of the tables it ran: --heldout-only skips the regression
    # grid, the half-precision table and FakeTensorMode, --no-fake the last (without this the
    # partial runs ended in checked_headline's error instead of their JSON line).
    skipped: tuple[str, ...] = ()
    if args.heldout_only and not args.smoke:
        skipped = REGRESSION_KEYS + tuple(k for k in HEADLINE_KEYS if k.startswith(("half_precision_", "fake_")))
    elif args.no_fake and not args.smoke:
        skipped = tuple(k for k in HEADLINE_KEYS if k.startswith("fake_"))
    required = tuple(k for k in HEADLINE_KEYS if k not in skipped)
    print(json.dumps(checked_headline(headline, required)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
