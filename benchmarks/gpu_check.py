"""On a CUDA machine: the training worker on NCCL, and MARP against the CUDA allocator's peak.

    python benchmarks/gpu_check.py [--steps 40] [--no-train] [--no-memory]

1. Train: `forgeflow prepare` the tiny-cpu data, then the unchanged worker under
   torchrun (NCCL, one process per visible GPU) in bf16 with megatron's
   distributed optimizer; reports the first/last loss and tokens/s.
2. Memory: for a grid of shapes and plans (bf16 + megatron's mixed-precision
   optimizer, distributed optimizer on/off, recompute none/selective/full), two
   training steps of the ACTUAL model (training/model.py) on this GPU, measured
   with torch.cuda.max_memory_allocated(), against MARP's
   estimate_memory(..., MEGATRON_GPU) minus its fixed context/NCCL term and its
   fragmentation margin (the allocator's counter sees neither).

The last line is the JSON object {"gpu", "train_loss_first", "train_loss_last",
"train_tokens_per_s", "memory_configs", "memory_mean_accuracy",
"memory_worst_accuracy"}.
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

    from scheduler.memory import MEGATRON_GPU, ParallelPlan, estimate_memory
    from training import model as tm
    from training.config import ModelConfig, TrainingConfig

    layers, hidden, heads, kv, ffn, seq, micro, gbs, recompute, dist_opt = row
    model_cfg = ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_query_groups=kv,
                            ffn_hidden_size=ffn, vocab_size=32000, seq_length=seq)
    training_cfg = TrainingConfig(global_batch_size=gbs, micro_batch_size=micro, steps=2, precision="bf16",
                                  recompute=recompute, use_distributed_optimizer=dist_opt)
    env = tm.init_distributed(1)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()  # what init left (nothing model-sized)
    model = tm.build_model(model_cfg, training_cfg)
    ddp = tm.wrap_data_parallel(model, training_cfg)
    optimizer = tm.build_optimizer(ddp, training_cfg)
    tokens = torch.randint(0, model_cfg.vocab_size, (micro, seq), device=env.device)
    positions = torch.arange(seq, device=env.device).unsqueeze(0).expand(micro, seq)
    for _ in range(2):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        for _ in range(gbs // micro):
            loss = model(tokens, positions, None, labels=tokens).float().mean() / (gbs // micro)
            loss.backward()
            del loss
        ddp.finish_grad_sync()
        optimizer.step()
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - base
    plan = ParallelPlan(global_batch_size=gbs, micro_batch_size=micro, dp=1, tp=1, pp=1, recompute=recompute,
                        distributed_optimizer=dist_opt, precision="bf16")
    bd = estimate_memory(model_cfg, plan, MEGATRON_GPU)
    dynamic = bd.total - MEGATRON_GPU.fixed_overhead_bytes
    predicted = int(dynamic / (1 + MEGATRON_GPU.dynamic_overhead_fraction))
    return predicted, measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--no-train", action="store_true")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--measure-one", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()

    import torch

    if args.measure_one is not None:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        print(json.dumps(measure(GRID[args.measure_one])))
        return

    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this check is for GPU machines (the CPU paths are in the test suite)")
    headline: dict = {"gpu": torch.cuda.get_device_name(0)}
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
    print(json.dumps(headline))


if __name__ == "__main__":
    main()
