"""On a CUDA machine: the training worker on NCCL, and MARP against the CUDA allocator's peak.

    python benchmarks/gpu_check.py [--steps 40] [--no-train] [--no-memory] [--no-heldout]
    python benchmarks/gpu_check.py --predict-only      # the held-out grid's predictions, no GPU
    python benchmarks/gpu_check.py --mfu-only [--mfu-model tiny]   # item 8 alone (tiny: CPU check)
    python benchmarks/gpu_check.py --smoke             # the CPU paths: predictions + tiny MFU

1. Train: `forgeflow prepare` the tiny-cpu data, then the unchanged worker under
   torchrun (NCCL, one process per visible GPU) in bf16 with megatron's
   distributed optimizer; reports the first/last loss and tokens/s.
2. Memory: for a grid of shapes and plans (bf16 + megatron's mixed-precision
   optimizer, distributed optimizer on/off, recompute none/selective/full), two
   training steps of the ACTUAL model (training/model.py) on this GPU, measured
   with torch.cuda.max_memory_allocated(), against MARP's
   estimate_memory(..., gpu_profile()) minus its fixed context/NCCL term and its
   fragmentation margin (the allocator's counter sees neither).

3. Held-out memory (issue 13 item 7): HELDOUT_GRID, frozen before MARP was ever scored on it,
   one fresh process per row: MARP's whole prediction (fixed and runtime overhead terms
   included, nothing subtracted) and Frenzy's published formula (only on the rows where its
   assumptions hold: full attention, no recompute, no accumulation, replicated optimizer)
   against the process's peak device memory (max_memory_reserved plus what the allocator does
   not hold: CUDA context, workspaces, NCCL; from NVML). Written 2026-11-25 without a GPU: the
   prediction path was run on CPU (--predict-only), the measurement path not yet. MARP is
   sized with the profile of the attention kernel the model builds there
   (scheduler.memory_model.profile_for_device: on an Ampere-or-newer GPU in bf16, the fused SDPA).
4. Training speed (issue 13 item 8): model-FLOPs utilisation of a Llama-3.2-1B-shaped model
   (16 layers, hidden 2048, 32 heads / 8 KV groups, SwiGLU 8192, vocab 128256, tied
   embeddings; seq 2048, micro batch 2, global batch 32, bf16, megatron DDP + Adam) on one
   GPU, once per core-attention kernel, each in a fresh process: megatron-core's local spec
   (unfused attention) and the local spec with torch's fused SDPA (training/attention.py;
   megatron-core 0.16 has no fused training attention without Transformer Engine, and TE's
   spec would rename parameters: fused norms inside linear_qkv). MFU = model FLOPs per step
   (scheduler.cost_model.step_flops without recompute: 6 N per token plus 12 L h s for
   attention, the PaLM/Megatron convention that counts the causal mask's skipped half) over
   step time x the GPU's dense bf16 peak (scheduler.gpus: H100 SXM 989 TFLOP/s); 3 warm-up
   steps, the median of the timed ones. Both kernels run the same micro batch, so the figure
   compares kernels, not batch sizes. Also reports what `training.attention: auto` picks on
   this GPU and whether that is the faster. Anchor: Megatron-LM's ~47 % MFU at scale on A100s;
   goal >= 40 % on one H100. `--mfu-only --mfu-model tiny` runs the same path on CPU (fp32, a
   small model, no MFU: a CPU has no catalogue peak) to check the harness without a GPU.

The last line is the JSON object {"gpu", "train_loss_first", "train_loss_last",
"train_tokens_per_s", "memory_configs", "memory_mean_accuracy", "memory_worst_accuracy",
"marp_heldout_configs", "marp_mean_accuracy_heldout", "marp_worst_accuracy_heldout",
"marp_mean_signed_error_heldout", "marp_underpredictions_heldout",
"marp_underpredictions_beyond_margin_heldout", "frenzy_heldout_configs",
"frenzy_mean_accuracy_heldout", "mfu_local_spec", "mfu_fused", "attention_auto",
"auto_chose_faster", ...}: the MFU keys come with their step times and tokens/s (HEADLINE_KEYS;
a part left out with --no-* keeps its keys, null). `--smoke` runs what needs no GPU, in seconds:
the held-out grid's predictions (as --predict-only) and the MFU harness on the tiny model on
CPU (as --mfu-only --mfu-model tiny, 1 timed step); the keys that need CUDA are null.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.chdir(REPO)

from benchmarks.headline import checked_headline  # noqa: E402

TRAIN_KEYS = ("train_loss_first", "train_loss_last", "train_tokens_per_s")
MEMORY_KEYS = ("memory_configs", "memory_mean_accuracy", "memory_worst_accuracy")
HELDOUT_KEYS = ("marp_heldout_configs", "marp_mean_accuracy_heldout", "marp_worst_accuracy_heldout",
                "marp_mean_signed_error_heldout", "marp_underpredictions_heldout",
                "marp_underpredictions_beyond_margin_heldout", "frenzy_heldout_configs",
                "frenzy_mean_accuracy_heldout", "marp_mean_accuracy_heldout_frenzy_rows")
MFU_KEYS = ("mfu_model", "mfu_local_spec", "mfu_fused", "tokens_per_s_local_spec", "tokens_per_s_fused",
            "speedup_fused_vs_local", "attention_auto", "auto_chose_faster", "transformer_engine_installed")
HEADLINE_KEYS = ("gpu", *TRAIN_KEYS, *MEMORY_KEYS, *HELDOUT_KEYS, *MFU_KEYS)

# (layers, hidden, heads, kv heads, ffn, seq, micro batch, global batch, recompute, distributed optimizer)
GRID = [
    (4, 1024, 16, 16, 2816, 1024, 2, 4, "none", False),
    (4, 1024, 16, 16, 2816, 1024, 2, 4, "none", True),
    (4, 1024, 16, 4, 2816, 2048, 1, 2, "none", True),
    (4, 1024, 16, 4, 2816, 2048, 2, 4, "selective", True),
    (4, 1024, 16, 4, 2816, 2048, 2, 4, "full", True),
    (8, 2048, 16, 8, 5632, 1024, 2, 4, "none", False),
    (8, 2048, 16, 8, 5632, 1024, 4, 8, "selective", True),
    (8, 2048, 16, 8, 5632, 2048, 2, 2, "full", False),
    (12, 2560, 20, 20, 6912, 2048, 1, 2, "none", True),
    (16, 4096, 32, 8, 11008, 2048, 1, 1, "selective", True),
    (24, 2048, 16, 16, 5632, 4096, 1, 2, "full", True),
    (2, 4096, 32, 32, 11008, 4096, 2, 2, "none", False),
]

# Issue 13 item 7: the held-out grid, frozen on 2026-11-25 before MARP was ever scored on it and
# never to be tuned on (GRID above is the grid MARP's GPU profile was checked against). Shapes not
# in GRID: bf16, every recompute mode, 4k-8k sequences, GQA and full attention, 3 to 32 layers,
# with and without the distributed optimizer and gradient accumulation. One GPU allows no dp/tp > 1
# (a multi-GPU machine would add rows here, frozen the same way before their first run).
HELDOUT_GRID = [
    (6, 1536, 12, 12, 4096, 2048, 2, 2, "none", False),
    (10, 2048, 16, 16, 5504, 1024, 4, 4, "none", False),
    (4, 3072, 24, 24, 8192, 2048, 1, 1, "none", False),
    (8, 1024, 8, 8, 2752, 8192, 1, 1, "none", False),
    (6, 2048, 16, 4, 5632, 8192, 1, 2, "selective", True),
    (12, 1536, 12, 4, 4096, 4096, 2, 4, "full", True),
    (20, 1024, 16, 8, 2816, 4096, 2, 8, "selective", False),
    (6, 4096, 32, 8, 11008, 1024, 2, 4, "none", True),
    (3, 5120, 40, 8, 13824, 2048, 1, 2, "full", False),
    (16, 2560, 20, 20, 6912, 1024, 4, 4, "none", False),
    (32, 1024, 16, 16, 2752, 2048, 4, 8, "full", True),
    (8, 2048, 16, 16, 5504, 4096, 2, 2, "selective", False),
]


def frenzy_applies(row) -> bool:
    """Frenzy's formula assumes a GPT-style block (full attention), every activation kept (no
    recompute), the whole batch resident (no gradient accumulation) and a replicated optimizer."""
    _, _, heads, kv, _, _, micro, gbs, recompute, dist_opt = row
    return heads == kv and recompute == "none" and micro == gbs and not dist_opt


def configs(row, attention: str = "auto"):
    from training.config import ModelConfig, TrainingConfig

    layers, hidden, heads, kv, ffn, seq, micro, gbs, recompute, dist_opt = row
    model_cfg = ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_query_groups=kv,
                            ffn_hidden_size=ffn, vocab_size=32000, seq_length=seq)
    training_cfg = TrainingConfig(global_batch_size=gbs, micro_batch_size=micro, steps=2, precision="bf16",
                                  recompute=recompute, use_distributed_optimizer=dist_opt, attention=attention)
    return model_cfg, training_cfg


def gpu_profile(training_cfg):
    """MARP's profile for this machine's GPU (an H100 where there is none: --predict-only) and
    the attention kernel the model builds there, as the planner would size the job."""
    import torch

    from scheduler.gpus import match_device_name
    from scheduler.memory_model import profile_for_device

    gpu_type = "H100-80G"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        spec = match_device_name(props.name, props.total_memory / 2**30)
        gpu_type = spec.name if spec is not None else props.name
    return profile_for_device(gpu_type, training_cfg.precision, training_cfg.attention)


def predict_full(row, attention: str = "auto") -> dict:
    """MARP's whole prediction for a row (fixed and runtime overhead terms included) and Frenzy's
    published formula (bf16 mixed-precision Adam is its setting; scored only where it applies)."""
    from scheduler.memory_model import ParallelPlan, estimate_memory, frenzy_estimate

    model_cfg, training_cfg = configs(row, attention)
    plan = ParallelPlan(global_batch_size=training_cfg.global_batch_size, micro_batch_size=training_cfg.micro_batch_size,
                        dp=1, tp=1, pp=1, recompute=training_cfg.recompute,
                        distributed_optimizer=training_cfg.use_distributed_optimizer, precision="bf16")
    return {"marp": estimate_memory(model_cfg, plan, gpu_profile(training_cfg)).total,
            "frenzy": frenzy_estimate(model_cfg, global_batch=training_cfg.micro_batch_size)}


def measure_full(row, attention: str = "auto") -> dict:
    """The process's whole device memory at its peak: the caching allocator's reserved peak plus
    what is outside it (CUDA context, cuBLAS workspaces, NCCL buffers): this process's used memory
    from NVML (pynvml, when installed) or else the device's (cudaMemGetInfo; run it alone on the
    GPU), less the allocator's own reservation, at the end."""
    import torch

    from training import model as tm

    env = tm.init_distributed(1)
    torch.cuda.reset_peak_memory_stats()
    two_steps(*configs(row, attention), env.device)
    used, source = _process_device_memory()
    outside_allocator = used - torch.cuda.memory_reserved()
    return {"attention": tm.attention_kernel(configs(row, attention)[1]),
            "reserved_peak": torch.cuda.max_memory_reserved(), "outside_allocator": outside_allocator,
            "measured": torch.cuda.max_memory_reserved() + outside_allocator, "used_from": source}


def _process_device_memory() -> tuple[int, str]:
    import torch

    try:
        import pynvml

        pynvml.nvmlInit()
        index = torch.cuda.current_device()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible:
            index = int(visible.split(",")[index])
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == os.getpid() and proc.usedGpuMemory:
                return int(proc.usedGpuMemory), "nvml"
    except Exception:   # no pynvml, or a container that hides the pids: the device's used memory
        pass
    free, total = torch.cuda.mem_get_info()
    return total - free, "device"


def two_steps(model_cfg, training_cfg, device) -> None:
    """Two optimizer steps of the actual model (training/model.py) with gradient accumulation."""
    train_steps(model_cfg, training_cfg, device, steps=2)


def train_steps(model_cfg, training_cfg, device, steps: int) -> list[float]:
    """`steps` optimizer steps of the actual model (training/model.py: megatron DDP, megatron's
    optimizer, gradient accumulation over micro batches); the seconds of each step."""
    import time

    import torch

    from training import model as tm

    micro, gbs, seq = training_cfg.micro_batch_size, training_cfg.global_batch_size, model_cfg.seq_length
    model = tm.build_model(model_cfg, training_cfg)
    ddp = tm.wrap_data_parallel(model, training_cfg)
    optimizer = tm.build_optimizer(ddp, training_cfg)
    tokens = torch.randint(0, model_cfg.vocab_size, (micro, seq), device=device)
    positions = torch.arange(seq, device=device).unsqueeze(0).expand(micro, seq)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        for _ in range(gbs // micro):
            loss = model(tokens, positions, None, labels=tokens).float().mean() / (gbs // micro)
            loss.backward()
            del loss
        ddp.finish_grad_sync()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


# Issue 13 item 8: a Llama-3.2-1B-shaped model (tied embeddings), bf16, one GPU.
MFU_MODELS = {
    "1b": (dict(num_layers=16, hidden_size=2048, num_attention_heads=32, num_query_groups=8,
                ffn_hidden_size=8192, vocab_size=128256, seq_length=2048,
                untie_embeddings_and_output_weights=False),
           dict(global_batch_size=32, micro_batch_size=2, precision="bf16")),
    # the harness's CPU check: same code path, fp32, a model a laptop steps in seconds
    "tiny": (dict(num_layers=2, hidden_size=256, num_attention_heads=8, num_query_groups=2,
                  ffn_hidden_size=688, vocab_size=2048, seq_length=256,
                  untie_embeddings_and_output_weights=False),
             dict(global_batch_size=4, micro_batch_size=2, precision="fp32")),
}
MFU_WARMUP_STEPS = 3
MFU_KERNELS = ("local", "sdpa")


def measure_mfu(model_name: str, attention: str, steps: int) -> dict:
    """One kernel in this (fresh) process: median step time, tokens/s, model TFLOP/s, MFU."""
    import statistics

    import torch

    from scheduler.cost_model import step_flops
    from scheduler.gpus import match_device_name
    from training import model as tm
    from training.config import ModelConfig, TrainingConfig

    model_kw, training_kw = MFU_MODELS[model_name]
    model_cfg = ModelConfig(**model_kw)
    training_cfg = TrainingConfig(**training_kw, steps=steps, attention=attention)
    env = tm.init_distributed(1)
    times = train_steps(model_cfg, training_cfg, env.device, MFU_WARMUP_STEPS + steps)[MFU_WARMUP_STEPS:]
    step_s = statistics.median(times)
    flops = step_flops(model_cfg, training_cfg.global_batch_size, "none")  # MFU counts no recompute
    tflops = flops / step_s / 1e12
    peak = None
    if env.device.type == "cuda":
        props = torch.cuda.get_device_properties(env.device)
        spec = match_device_name(props.name, props.total_memory / 2**30)
        peak = spec.peak_tflops if spec is not None else None
    return {"attention": tm.attention_kernel(training_cfg), "step_s": round(step_s, 4),
            "tokens_per_s": round(training_cfg.global_batch_size * model_cfg.seq_length / step_s, 1),
            "model_tflops": round(tflops, 2), "peak_tflops": peak,
            "mfu": round(tflops / peak, 4) if peak else None,
            "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2)
            if env.device.type == "cuda" else None}


def mfu(model_name: str, steps: int) -> dict:
    """Item 8: each kernel in its own process (megatron's globals and the allocator start clean)."""
    import importlib.util

    from training.config import TrainingConfig
    from training.model import attention_kernel

    results = {}
    for kernel in MFU_KERNELS:
        proc = subprocess.run([sys.executable, __file__, "--measure-mfu", kernel, "--mfu-model", model_name,
                               "--mfu-steps", str(steps)], capture_output=True, text=True)
        if proc.returncode != 0:
            reason = "out of memory" if "OutOfMemoryError" in proc.stderr else proc.stderr[-1500:]
            print(f"mfu {kernel}: not measured ({reason})")
            continue
        results[kernel] = json.loads(proc.stdout.strip().splitlines()[-1])
        r = results[kernel]
        print(f"mfu {kernel:>5}: step {r['step_s']:.3f} s, {r['tokens_per_s']:,.0f} tokens/s, "
              f"{r['model_tflops']:.1f} model TFLOP/s, MFU {r['mfu']}, peak reserved {r['peak_reserved_gib']} GiB")
    training_kw = MFU_MODELS[model_name][1]
    auto = attention_kernel(TrainingConfig(**training_kw, steps=1, attention="auto"))
    timed = {k: r["step_s"] for k, r in results.items()}
    faster = min(timed, key=timed.get) if len(timed) == len(MFU_KERNELS) else None
    out = {"mfu_model": model_name, "mfu_local_spec": results.get("local", {}).get("mfu"),
           "mfu_fused": results.get("sdpa", {}).get("mfu"),
           "tokens_per_s_local_spec": results.get("local", {}).get("tokens_per_s"),
           "tokens_per_s_fused": results.get("sdpa", {}).get("tokens_per_s"),
           "speedup_fused_vs_local": round(timed["local"] / timed["sdpa"], 3) if faster else None,
           "attention_auto": auto, "auto_chose_faster": (auto == faster) if faster else None,
           "transformer_engine_installed": importlib.util.find_spec("transformer_engine") is not None}
    return out


def heldout_memory() -> dict:
    """Item 7: MARP's full prediction against the measured peak on the held-out grid, with the
    attention the worker builds there (auto); on the rows where Frenzy's assumptions hold, also
    both formulas against a run with megatron's unfused attention, which Frenzy's s² term assumes."""
    from scheduler.planner import PlannerConfig

    margin = PlannerConfig().memory_margin
    marp, marp_local, frenzy, rows = [], [], [], []
    print(f"{'L':>3} {'h':>5} {'s':>5} {'mb':>3} {'gbs':>3} {'recompute':>9} {'distopt':>7} {'attention':>9} "
          f"{'meas GiB':>9} {'MARP GiB':>9} {'acc':>6} {'Frenzy GiB':>10} {'acc':>6}")
    runs = [(index, "auto") for index in range(len(HELDOUT_GRID))]
    runs += [(index, "local") for index, row in enumerate(HELDOUT_GRID) if frenzy_applies(row)]
    for index, attention in runs:
        row = HELDOUT_GRID[index]
        proc = subprocess.run([sys.executable, __file__, "--measure-full", str(index), "--attention", attention],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            reason = "out of memory" if "OutOfMemoryError" in proc.stderr else proc.stderr[-1500:]
            print(f"{row} {attention}: not measured ({reason})")
            continue
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        pred, measured = predict_full(row, attention), got["measured"]
        (marp if attention == "auto" else marp_local).append((pred["marp"], measured))
        scored = attention == "local"  # Frenzy assumes the unfused kernel's saved scores
        if scored:
            frenzy.append((pred["frenzy"], measured))
        layers, hidden, _, _, _, seq, micro, gbs, recompute, dist_opt = row
        print(f"{layers:>3} {hidden:>5} {seq:>5} {micro:>3} {gbs:>3} {recompute:>9} {str(dist_opt):>7} "
              f"{got['attention']:>9} {measured / 2**30:>9.2f} {pred['marp'] / 2**30:>9.2f} "
              f"{accuracy(pred['marp'], measured):>6.3f} {pred['frenzy'] / 2**30:>10.2f} "
              f"{accuracy(pred['frenzy'], measured) if scored else float('nan'):>6.3f}")
        rows.append({"row": list(row), **got, **pred})

    def mean(pairs):
        return round(sum(accuracy(p, m) for p, m in pairs) / len(pairs), 4) if pairs else None

    return {"marp_heldout_configs": len(marp),
            "marp_mean_accuracy_heldout": mean(marp),
            "marp_worst_accuracy_heldout": round(min(accuracy(p, m) for p, m in marp), 4) if marp else None,
            "marp_mean_signed_error_heldout": round(sum((p - m) / m for p, m in marp) / len(marp), 4) if marp else None,
            "marp_underpredictions_heldout": sum(1 for p, m in marp if p < m),
            # the planner keeps memory_margin of the GPU free: an under-prediction inside it still fits
            "marp_underpredictions_beyond_margin_heldout": sum(1 for p, m in marp if m > p / (1 - margin)),
            "frenzy_heldout_configs": len(frenzy),
            "frenzy_mean_accuracy_heldout": mean(frenzy),
            "marp_mean_accuracy_heldout_frenzy_rows": mean(marp_local)}


def accuracy(predicted: float, measured: float) -> float:
    return 1 - abs(predicted - measured) / measured


def train(steps: int) -> dict:
    import torch

    from infra import runfiles
    from training.config import dotted_overrides, load_job_spec
    from training.runlog import read_steps

    work = Path(tempfile.mkdtemp(prefix="forgeflow-gpu-"))
    sets = [f"training.steps={steps}", f"run_dir={work / 'run'}", f"checkpoint.url={work / 'ckpt'}",
            f"checkpoint.interval={steps}", "training.precision=bf16", "training.use_distributed_optimizer=true",
            "training.global_batch_size=64", "training.micro_batch_size=16"]
    from training.data import prepare_data

    prepare_data(load_job_spec("configs/tiny-cpu.yaml"), progress=False)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={torch.cuda.device_count()}", "-m", "training.train", "configs/tiny-cpu.yaml"]
    for item in sets:
        cmd += ["--set", item]
    run = subprocess.run(cmd, capture_output=True, text=True)
    print(run.stdout[-3000:])
    if run.returncode != 0:
        raise SystemExit(f"training on GPU failed ({run.returncode}):\n{run.stderr[-6000:]}")
    spec = load_job_spec("configs/tiny-cpu.yaml", dotted_overrides(sets))
    records = read_steps(runfiles.log_path(spec.resolved_run_dir, 0))
    start, end = records[4], records[-1]
    tokens = (end.step - start.step) * spec.training.global_batch_size * spec.model.seq_length
    return {"train_loss_first": records[0].loss, "train_loss_last": end.loss,
            "train_tokens_per_s": round(tokens / (end.elapsed_s - start.elapsed_s), 1)}


def measure(row) -> tuple[int, int]:
    import torch

    from scheduler.memory_model import ParallelPlan, estimate_memory
    from training import model as tm

    *_, micro, gbs, recompute, dist_opt = row
    model_cfg, training_cfg = configs(row)
    env = tm.init_distributed(1)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()  # what init left (nothing model-sized)
    two_steps(model_cfg, training_cfg, env.device)
    measured = torch.cuda.max_memory_allocated() - base
    plan = ParallelPlan(global_batch_size=gbs, micro_batch_size=micro, dp=1, tp=1, pp=1, recompute=recompute,
                        distributed_optimizer=dist_opt, precision="bf16")
    profile = gpu_profile(training_cfg)
    bd = estimate_memory(model_cfg, plan, profile)
    dynamic = bd.total - profile.fixed_overhead_bytes
    predicted = int(dynamic / (1 + profile.dynamic_overhead_fraction))
    return predicted, measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--no-train", action="store_true")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--no-heldout", action="store_true", help="skip the held-out grid (item 7)")
    parser.add_argument("--predict-only", action="store_true",
                        help="print MARP's and Frenzy's predictions for the held-out grid (no GPU needed)")
    parser.add_argument("--no-mfu", action="store_true", help="skip the MFU measurement (item 8)")
    parser.add_argument("--mfu-only", action="store_true", help="only the MFU measurement (item 8)")
    parser.add_argument("--mfu-model", choices=sorted(MFU_MODELS), default="1b",
                        help="1b: the item-8 model (GPU); tiny: the harness check on CPU")
    parser.add_argument("--mfu-steps", type=int, default=8, help="timed steps per kernel (after 3 warm-up)")
    parser.add_argument("--measure-mfu", choices=MFU_KERNELS, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--measure-one", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--measure-full", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--attention", choices=("auto", "local", "sdpa"), default="auto", help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true",
                        help="no GPU needed, seconds: the held-out predictions and the tiny MFU harness on CPU")
    args = parser.parse_args()

    if args.predict_only or args.smoke:
        for row in HELDOUT_GRID:
            pred = predict_full(row)
            local = predict_full(row, "local")["marp"]
            print(f"{row}: MARP {pred['marp'] / 2**30:.2f} GiB (unfused attention {local / 2**30:.2f}), "
                  f"Frenzy {pred['frenzy'] / 2**30:.2f} GiB "
                  f"({'applies, unfused' if frenzy_applies(row) else 'outside its assumptions'})")
        if not args.smoke:
            return

    import torch

    if args.measure_mfu is not None:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        print(json.dumps(measure_mfu(args.mfu_model, args.measure_mfu, args.mfu_steps)))
        return
    if args.mfu_only:
        headline = {"gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
        if not torch.cuda.is_available() and args.mfu_model != "tiny":
            raise SystemExit("no CUDA device: the 1B MFU run needs a GPU; --mfu-model tiny checks the harness on CPU")
        headline.update(mfu(args.mfu_model, args.mfu_steps))
        print(json.dumps(headline))
        return
    if args.measure_one is not None or args.measure_full is not None:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        if args.measure_one is not None:
            print(json.dumps(measure(GRID[args.measure_one])))
        else:
            print(json.dumps(measure_full(HELDOUT_GRID[args.measure_full], args.attention)))
        return

    if args.smoke:
        headline = {**dict.fromkeys(HEADLINE_KEYS), "gpu": "cpu", **mfu("tiny", 1)}
        print(json.dumps(checked_headline(headline, HEADLINE_KEYS)), flush=True)
        return
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this check is for GPU machines (the CPU paths are in the test suite "
                         "and --smoke)")
    headline: dict = {**dict.fromkeys(HEADLINE_KEYS), "gpu": torch.cuda.get_device_name(0)}
    if not args.no_train:
        headline.update(train(args.steps))
        print(f"train: loss {headline['train_loss_first']:.3f} -> {headline['train_loss_last']:.3f}, "
              f"{headline['train_tokens_per_s']:.0f} tokens/s")
    if not args.no_memory:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        accuracies = []
        print(f"{'L':>3} {'h':>5} {'s':>5} {'mb':>3} {'gbs':>3} {'recompute':>9} {'distopt':>7} "
              f"{'pred GiB':>9} {'meas GiB':>9} {'acc':>6}")
        for index, row in enumerate(GRID):
            # One fresh process per configuration: megatron's globals and the caching
            # allocator would otherwise carry one configuration's memory into the next.
            proc = subprocess.run([sys.executable, __file__, "--measure-one", str(index)],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                reason = "out of memory" if "OutOfMemoryError" in proc.stderr else proc.stderr[-1500:]
                print(f"{row}: not measured ({reason})")
                continue
            predicted, measured = json.loads(proc.stdout.strip().splitlines()[-1])
            acc = 1 - abs(predicted - measured) / measured
            accuracies.append(acc)
            layers, hidden, _, _, _, seq, micro, gbs, recompute, dist_opt = row
            print(f"{layers:>3} {hidden:>5} {seq:>5} {micro:>3} {gbs:>3} {recompute:>9} {str(dist_opt):>7} "
                  f"{predicted / 2**30:>9.2f} {measured / 2**30:>9.2f} {acc:>6.3f}")
        headline.update({"memory_configs": len(accuracies),
                         "memory_mean_accuracy": round(sum(accuracies) / len(accuracies), 4),
                         "memory_worst_accuracy": round(min(accuracies), 4)})
    if not args.no_heldout:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        headline.update(heldout_memory())
    if not args.no_mfu:
        headline.update(mfu(args.mfu_model, args.mfu_steps))
    print(json.dumps(checked_headline(headline, HEADLINE_KEYS)), flush=True)


if __name__ == "__main__":
    main()
