"""Mobius (ASPLOS'23) in forgeflow: partition MIP, cross mapping, pipeline simulation, offload executor.

Prints a table per part and, last, one JSON line:

  mip_matches_bruteforce      fraction of 200 random small profiles (<= 12 layers, <= 4 GPUs) where the
                              MIP's step time equals brute force over every contiguous partition (goal 1.0)
  mip_solve_s_p99             solve time, 48-layer models x 8 GPUs (8 shapes; goal < 10 s). HiGHS does
                              not prove optimality there: it stops at the budget (MIP_TIME_LIMIT_S) with
                              its best incumbent. `mip_gap_max` is the honest price: the incumbent is at
                              most that fraction slower than the optimum (from the least lower bound over
                              all stage counts); `mip_optimal_fraction` says how often it proved optimality
  sim_speedup_vs_offload_pipeline   step time of the DeepSpeed-style offload baseline / Mobius with cross
                              mapping, on the paper's server (8x RTX 3090-Ti, 2 root complexes of 4 GPUs,
                              PCIe 3.0 x8 per GPU, x16 uplink per root complex), 3B..15B; min and per size
  sim_traffic_ratio           PCIe parameter bytes host->GPU per step, Mobius / baseline (goal ~1/N)
  cross_mapping_gain          simulated step time, sequential mapping / cross mapping (geometric mean)
  offload_loss_max_abs_diff   CPU executor, 2 workers x 4 stages, device budget < model: max |loss
                              difference| over 20 steps against the same fine-tuning without offload

Baselines, and why they are fair: all systems run the same model profile (same FLOPs per layer at the
same efficiency, the same bytes), the same global batch (8 micro batches of 1 x 1024 tokens), the same
PCIe model (per-GPU link and per-root-complex uplink, shared by priority). The offload baseline is the
DeepSpeed ZeRO-3-offload-style design the Mobius paper compares with: every GPU streams every layer's
weights from DRAM (one layer ahead, overlapped with compute) and processes 1/N of the batch — its
parameters cross PCIe once per GPU. Its collectives are modelled as they run on GeForce cards, which
have no GPU peer-to-peer: NCCL stages them in host memory, so the parameter all-gather also sends
(N-1)/N of every layer GPU->host and the gradient reduce-scatter moves (N-1)/N of the gradients each
way (until 2026-11-23 the baseline had neither: speedups 3.08-3.26x, now 4.4-4.6x). Mobius's own
stage-to-stage activations go through host memory the same way. GPipe keeps everything on the GPUs
and is reported only where it fits (3B, as in the paper). The optimizer step (the same CPU Adam for
all offload systems) is left out of every row: a common term, so the ratios are upper bounds of what
the same runs with the optimizer would show. Simulated, not measured: no 3090-Ti server was available; the CPU executor checks the
schedule and numerics for real.

Run: .venv/bin/python benchmarks/mobius.py [--quick]
     .venv/bin/python benchmarks/mobius.py --smoke   # seconds: 5 brute-force instances, one timing
     shape and the 3B simulation with a 0.3 s MIP budget, the executor for 3 steps (not a figure)
The last line's keys: HEADLINE_KEYS (`offload_loss_max_abs_diff` is null with --quick).
"""

from __future__ import annotations

import json
import argparse
import math
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scheduler.offload.mapping import contention, cross_map, sequential_map  # noqa: E402
from scheduler.offload.partition import brute_force, solve_partition  # noqa: E402
from scheduler.offload.profile import (  # noqa: E402
    PCIE3_X8_BYTES_PER_S, PCIE3_X16_BYTES_PER_S, LayerProfile, ModelProfile, OffloadHardware, analytic_profile,
)
from scheduler.offload.simulate import (  # noqa: E402
    simulate_gpipe, simulate_mobius, simulate_offload_data_parallel,
)
from training.config import ModelConfig  # noqa: E402
from benchmarks.headline import checked_headline  # noqa: E402

GIB = 1024**3
MB = 10**6
ROOT_COMPLEXES = (0, 0, 0, 0, 1, 1, 1, 1)
RTX_3090TI_TFLOPS = 80.0  # dense fp16 tensor with fp32 accumulate (GeForce: half the fp16-accumulate rate)
MODELS = {"3B": (32, 2560), "7B": (32, 4096), "13B": (40, 5120), "15B": (48, 5120)}
# The partition's time budget. 48 layers x 8 GPUs never prove optimal within 10 s; the incumbent
# after 5 s equalled the one after 10 s in 6 of 8 shapes (at most 1.8% slower), and a busy
# machine overshoots HiGHS's limit by up to ~0.5 s: 8 s, with the gap reported.
MIP_TIME_LIMIT_S = 8.0
SMOKE_TIME_LIMIT_S = 0.3  # --smoke: enough for an incumbent (gap ~10-20 %), not a figure
HEADLINE_KEYS = ("mip_matches_bruteforce", "mip_solve_s_p99", "mip_optimal_fraction", "mip_gap_max", "mip_time_limit_s",
                 "sim_speedup_vs_offload_pipeline", "sim_speedup_vs_offload_pipeline_by_model", "sim_traffic_ratio",
                 "sim_traffic_ratio_goal", "cross_mapping_gain", "sim_step_time_s", "offload_loss_max_abs_diff",
                 "wall_s")


def paper_server() -> OffloadHardware:
    return OffloadHardware(8, int(24 * GIB * 0.9), PCIE3_X8_BYTES_PER_S, root_complex=ROOT_COMPLEXES,
                           root_complex_bytes_per_s=PCIE3_X16_BYTES_PER_S, name="8x RTX 3090-Ti")


def model_profile(layers: int, hidden: int, seq: int = 1024, microbatches: int = 8) -> ModelProfile:
    mc = ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=hidden // 128, vocab_size=32000,
                     seq_length=seq)
    return analytic_profile(mc, micro_batch=1, microbatches=microbatches, peak_tflops=RTX_3090TI_TFLOPS)


def mip_vs_bruteforce(count: int) -> float:
    rng = random.Random(7)
    matched = total = 0
    for i in range(count):
        L, n = rng.randint(3, 12), rng.randint(1, 4)

        def layer(j):
            return LayerProfile(f"l{j}", rng.uniform(0.01, 0.1), rng.uniform(0.02, 0.3), rng.randint(1, 100) * MB,
                                rng.randint(1, 100) * MB, 0, rng.randint(1, 50) * MB, rng.randint(1, 10) * MB)
        profile = ModelProfile(tuple(layer(j) for j in range(L)), microbatches=rng.randint(1, 4))
        hw = OffloadHardware(n, rng.randint(150, 600) * MB, rng.uniform(1e8, 2e9))
        ref = brute_force(profile, hw)
        if ref is None:
            continue
        total += 1
        mip = solve_partition(profile, hw, max_stages=L, mip_rel_gap=1e-9)
        matched += mip.step.total_s <= ref.step.total_s * (1 + 1e-7)
    print(f"MIP vs brute force: {matched}/{total} feasible instances optimal")
    return matched / total


def mip_timing(shapes, time_limit_s: float = MIP_TIME_LIMIT_S) -> tuple[list[float], list[bool], list[float]]:
    hw = paper_server()
    times, optimal, gaps = [], [], []
    for layers, hidden, seq, mb in shapes:
        part = solve_partition(model_profile(layers, hidden, seq, mb), hw, time_limit_s=time_limit_s)
        times.append(part.solve_s)
        optimal.append(part.optimal)
        gaps.append(part.gap)
        print(f"  MIP 48 layers h={hidden} seq={seq} m={mb}: {part.num_stages} stages, "
              f"{part.solve_s:.2f} s, optimal={part.optimal}, gap <= {100 * part.gap:.1f}%")
    return times, optimal, gaps


def simulate_all(models: dict[str, tuple[int, int]] = MODELS, time_limit_s: float = MIP_TIME_LIMIT_S) -> dict:
    hw = paper_server()
    rows = {}
    print(f"{'model':>5} {'params':>7} {'stages':>6} {'cross':>7} {'seq':>7} {'offload-DP':>10} {'gpipe':>7} "
          f"{'speedup':>7} {'param traffic':>13}")
    for name, (layers, hidden) in models.items():
        profile = model_profile(layers, hidden)
        part = solve_partition(profile, hw, time_limit_s=time_limit_s)
        mapping = cross_map(list(range(8)), ROOT_COMPLEXES, num_stages=part.num_stages)
        cross = simulate_mobius(profile, hw, part.stages, mapping.gpus, "mobius_cross")
        seq = simulate_mobius(profile, hw, part.stages, sequential_map(range(8)), "mobius_sequential")
        base = simulate_offload_data_parallel(profile, hw)
        gpipe = simulate_gpipe(profile, hw)
        params = sum(l.param_bytes for l in profile.layers) / 2 / 1e9
        rows[name] = dict(
            params_b=round(params, 2), stages=part.num_stages, mobius_cross_s=cross.step_time_s,
            mobius_sequential_s=seq.step_time_s, offload_pipeline_s=base.step_time_s,
            gpipe_s=gpipe.step_time_s if gpipe else None, speedup=base.step_time_s / cross.step_time_s,
            traffic_ratio=cross.param_h2d_bytes / base.param_h2d_bytes,
            pcie_gb={"mobius": cross.pcie_bytes / 1e9, "offload_pipeline": base.pcie_bytes / 1e9},
            cross_gain=seq.step_time_s / cross.step_time_s,
            contention={"cross": mapping.contention,
                        "sequential": contention(sequential_map(range(8)), ROOT_COMPLEXES, part.num_stages)},
        )
        g = f"{gpipe.step_time_s:7.2f}" if gpipe else "    n/a"
        print(f"{name:>5} {params:6.1f}B {part.num_stages:>6} {cross.step_time_s:7.2f} {seq.step_time_s:7.2f} "
              f"{base.step_time_s:10.2f} {g} {rows[name]['speedup']:6.2f}x {rows[name]['traffic_ratio']:13.3f}")
    return rows


def offload_loss_diff(steps: int = 20) -> float:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from training.offload.executor import DataSource, OffloadRunConfig, train_without_offload
    from training.offload.launch import run_local

    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256,
                                             num_hidden_layers=10, num_attention_heads=4, num_key_value_heads=2,
                                             tie_word_embeddings=False))
        model.save_pretrained(Path(tmp) / "model")
        model_bytes = sum(p.numel() * 4 for p in model.parameters())
        cfg = OffloadRunConfig(model_dir=str(Path(tmp) / "model"), stages=[(0, 3), (3, 6), (6, 9), (9, 12)],
                               steps=steps, microbatches=4, seq_length=8, lr=1e-3, data=DataSource(distinct_batches=2),
                               device_budget_bytes=int(0.9 * model_bytes), out_dir=str(Path(tmp) / "run"),
                               save_model=False)
        reports = run_local(cfg, workers=2)
        reference = train_without_offload(cfg)
        diff = max(abs(a - b) for a, b in zip(reports[0]["losses"], reference))
        peak = max(r["device_peak_bytes"] for r in reports)
        print(f"executor: 2 workers x 4 stages, budget {cfg.device_budget_bytes / 2**20:.2f} MiB < model "
              f"{model_bytes / 2**20:.2f} MiB, peak {peak / 2**20:.2f} MiB, max |loss diff| {diff:.2e}")
        return diff


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="40 brute-force instances, 3 timing shapes, no executor")
    ap.add_argument("--smoke", action="store_true",
                    help="5 brute-force instances, 1 timing shape and the 3B simulation with a 0.3 s MIP budget, "
                         "the executor for 3 steps: seconds, same keys")
    args = ap.parse_args()
    if args.smoke:  # idle OpenMP threads sleep (torch is not imported yet): spinning ones stall a busy machine
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    started = time.time()
    limit = SMOKE_TIME_LIMIT_S if args.smoke else MIP_TIME_LIMIT_S
    matches = mip_vs_bruteforce(5 if args.smoke else 40 if args.quick else 200)
    shapes = [(48, h, s, m) for h in (4096, 5120) for s in (512, 1024) for m in (4, 8)]
    times, optimal, gaps = mip_timing(shapes[:1] if args.smoke else shapes[:3] if args.quick else shapes, limit)
    rows = simulate_all({"3B": MODELS["3B"]} if args.smoke else MODELS, limit)
    loss_diff = None if args.quick else offload_loss_diff(3 if args.smoke else 20)
    p99 = sorted(times)[max(0, math.ceil(0.99 * len(times)) - 1)]
    result = {
        "mip_matches_bruteforce": matches,
        "mip_solve_s_p99": round(p99, 3),
        "mip_optimal_fraction": sum(optimal) / len(optimal),
        "mip_gap_max": round(max(gaps), 4),
        "mip_time_limit_s": limit,
        "sim_speedup_vs_offload_pipeline": round(min(r["speedup"] for r in rows.values()), 3),
        "sim_speedup_vs_offload_pipeline_by_model": {k: round(r["speedup"], 3) for k, r in rows.items()},
        "sim_traffic_ratio": round(max(r["traffic_ratio"] for r in rows.values()), 4),
        "sim_traffic_ratio_goal": 1 / 8,
        "cross_mapping_gain": round(statistics.geometric_mean([r["cross_gain"] for r in rows.values()]), 4),
        "sim_step_time_s": {k: {kk: (round(v, 3) if isinstance(v, float) else v) for kk, v in r.items()
                                if kk.endswith("_s")} for k, r in rows.items()},
        "offload_loss_max_abs_diff": loss_diff,
        "wall_s": round(time.time() - started, 1),
    }
    print(json.dumps(checked_headline(result, HEADLINE_KEYS)), flush=True)


if __name__ == "__main__":
    main()
