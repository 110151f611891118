"""How close is MARP (scheduler/memory.py) to the real peak memory of a training step?

For each configuration of a grid (hidden size, layers, sequence length, micro
batch, gradient accumulation, recompute none/selective/full, GQA or not,
tensor parallel 2 and data parallel 2 under torchrun with gloo) it trains the
ACTUAL forgeflow model (training/model.py: megatron GPTModel + DDP + Adam) for
two steps under PyTorch's MemTracker (scheduler/memory_probe.py) and compares the
per-rank peak with `estimate_memory(..., CPU_MEASURED)`:

    accuracy = 1 - |predicted - measured| / measured

Frenzy's published formula is printed side by side on the same grid (with
B = micro batch x dp, the sequences resident at once, and its 2-byte mixed
precision assumptions, exactly as published). A second table runs 7B- and
13B-class shapes under FakeTensorMode (shapes without memory).

What CPU can and cannot measure: full training steps are fp32 (megatron's
mixed-precision and distributed optimizers need CUDA tensors). bf16/fp16 are
measured for forward + backward into DDP's fp32 gradient buffers without an
optimizer (a separate table, predicted with `optimizer=False`); the
distributed optimizer's sharding and the mixed-precision optimizer's 12
bytes/parameter are covered by the unit tests' hand-computed cases; sequence
parallel needs Transformer Engine. Eight seeded random shapes are held out
(they played no part in deriving the estimator) and reported apart.

    .venv/bin/python benchmarks/memory_accuracy.py [--quick] [--no-fake] [--no-torchrun]

The last line is a JSON object: configs, mean_accuracy, worst_accuracy,
frenzy_mean_accuracy, frenzy_worst_accuracy (fractions), plus the fake-mode
figures.
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

from scheduler.memory import (  # noqa: E402
    CPU_MEASURED,
    MemoryBreakdown,
    ParallelPlan,
    estimate_memory,
    frenzy_estimate,
)
from training.config import ModelConfig, TrainingConfig  # noqa: E402

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


def grid(quick: bool) -> list[Case]:
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
    if quick:
        keep = {"tiny-cpu", "h256-l4-s256-sel", "h512-l4-s512-full", "h256-l8-s1024", "tp2-h512-l4-s256"}
        cases = [c for c in cases if c.id in keep]
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
        {"id": c.id, "model": c.model, "training": c.training_cfg.model_dump(), "steps": 2} for c in cases
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
    print(f"MARP   accuracy: mean {summary['mean']:.2%}  worst {summary['worst']:.2%}  over {len(cases)} configs")
    print(f"Frenzy accuracy: mean {summary['frenzy_mean']:.2%}  worst {summary['frenzy_worst']:.2%}")
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="5 configurations (for a smoke run)")
    parser.add_argument("--no-fake", action="store_true", help="skip the FakeTensorMode 7B/13B table")
    parser.add_argument("--no-torchrun", action="store_true", help="skip the tp=2/dp=2 configurations")
    parser.add_argument("--measurements", type=Path, metavar="FILE",
                        help="development aid: reuse measured peaks from FILE if it exists, "
                             "else measure and write them there (the estimator always runs afresh)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    started = time.perf_counter()

    cases = grid(args.quick)
    if args.no_torchrun:
        cases = [c for c in cases if c.tp == 1 and c.dp == 1]
    cached = json.loads(args.measurements.read_text()) if args.measurements and args.measurements.exists() else {}
    for c in cases:
        if c.id in cached:
            c.measured, c.measured_categories = cached[c.id]["total"], cached[c.id]["by_category"]
    todo = [c for c in cases if c.measured is None]
    print(f"measuring {len(todo)} of {len(cases)} configurations (fp32, CPU, MemTracker, 2 optimizer steps each)")
    measure_in_process([c for c in todo if c.tp == 1 and c.dp == 1])
    for nproc in sorted({c.tp * c.dp for c in todo if c.tp * c.dp > 1}):
        measure_under_torchrun([c for c in todo if c.tp * c.dp == nproc], nproc)
    summary = report(cases, "Real measurement (MemTracker peak per rank, fp32)")
    held_out = [accuracy(c.predict().total, c.measured)
                for c in cases if c.id.startswith("heldout-")]
    if held_out:
        print(f"  of which held-out random shapes: mean {sum(held_out) / len(held_out):.2%}  "
              f"worst {min(held_out):.2%}  over {len(held_out)}")

    bf16_cases = [] if args.quick else BF16_CASES
    bf16_summary: dict[str, float] = {}
    if bf16_cases:
        print(f"\nHalf precision on CPU: {len(bf16_cases)} configurations, forward + backward only")
        for c in bf16_cases:
            if c.id in cached:
                c.measured, c.measured_categories = cached[c.id]["total"], cached[c.id]["by_category"]
        measure_in_process([c for c in bf16_cases if c.measured is None])
        bf16_summary = report(bf16_cases, "bf16/fp16 measurement (no optimizer: weights, fp32 grad buffers, "
                                          "activations; Frenzy column not comparable)")

    fake_summary: dict[str, float] = {}
    fake_cases: list[Case] = []
    if not args.no_fake:
        fake_cases = FAKE_CASES[:1] if args.quick else FAKE_CASES
        print(f"\nFakeTensorMode: {len(fake_cases)} large-model shapes (traced, no memory used)")
        for c in fake_cases:
            if c.id in cached:
                c.measured, c.measured_categories = cached[c.id]["total"], cached[c.id]["by_category"]
        measure_in_process([c for c in fake_cases if c.measured is None], fake=True)
        fake_summary = report(fake_cases, "FakeTensorMode measurement (fp32, shapes only)")
    if args.measurements:
        args.measurements.write_text(json.dumps(
            {c.id: {"total": c.measured, "by_category": c.measured_categories}
             for c in cases + bf16_cases + fake_cases},
            indent=1))

    print(f"\nwall time {time.perf_counter() - started:.0f} s")
    headline: dict[str, Any] = {
        "configs": len(cases),
        "mean_accuracy": round(summary["mean"], 4),
        "worst_accuracy": round(summary["worst"], 4),
        "frenzy_mean_accuracy": round(summary["frenzy_mean"], 4),
        "frenzy_worst_accuracy": round(summary["frenzy_worst"], 4),
    }
    if bf16_summary:
        headline.update(
            half_precision_configs=len(bf16_cases),
            half_precision_mean_accuracy=round(bf16_summary["mean"], 4),
            half_precision_worst_accuracy=round(bf16_summary["worst"], 4),
        )
    if fake_summary:
        headline.update(
            fake_configs=len(fake_cases),
            fake_mean_accuracy=round(fake_summary["mean"], 4),
            fake_worst_accuracy=round(fake_summary["worst"], 4),
        )
    print(json.dumps(headline))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
