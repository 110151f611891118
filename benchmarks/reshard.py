"""Resharding on resume: load time onto another layout vs the same layout, and the loss after it.

    .venv/bin/python benchmarks/reshard.py                 # ~25M-parameter GPT for load timing
    .venv/bin/python benchmarks/reshard.py --hidden 256 --layers 4 --vocab 4096   # quick

Two measurements, both with real torchrun/gloo worlds of at most 4 CPU processes:

1. Load time. A checkpoint of a GPT (model + Adam state, checkpoint.engine's one
   "sharded" format on local disk) is written at (TP1, PP1, DP2). Fresh worlds then
   build the model and optimizer at each layout and time `Checkpointer.latest()` +
   `load()` (slowest rank, median of --repeats loads per world after one warm-up
   load): the same layout
   (TP1, PP1, DP2) is the baseline, and (TP2, PP1, DP1), (TP1, PP2, DP1),
   (TP2, PP2, DP1) are resharded loads. Same model, same bytes, same storage and the
   same loader code: the only difference is which pieces each rank assembles, so the
   ratio isolates the cost of resharding. (Anchor: ByteCheckpoint, NSDI'25, reports
   loads up to 8.8x faster than DCP/Megatron; the goal here is a resharded load
   within 1.5x of a same-layout load.)
2. Loss after resharding. The worker trains the tiny test model 12 steps at
   (TP1, PP1, DP2), checkpointing every 4 (the uninterrupted curve); from its step-4
   checkpoint it resumes at each other layout, and the (TP2, PP2) run's own step-8
   checkpoint resumes back at (TP1, PP1, DP2). `max_rel_loss_delta` is the largest
   |loss - uninterrupted loss| / loss over every resumed step, from the logged
   losses (8 decimals: a delta below ~1e-8 relative reads as 0).

Layouts with pipeline parallelism are skipped while the worker does not run it.
The last line is one JSON object: layouts_resumed, max_rel_loss_delta,
reshard_load_over_same_layout (HEADLINE_KEYS), and per-layout load times. `--smoke` (seconds,
not a figure): a 64-wide model loaded once per layout, and only the first layout, (TP2, PP1, DP1);
the world that saves the checkpoint also times the same-layout load (mode `save+load`, a new
Checkpointer after the save) and then, in the same two processes on a new process group, the
(TP2, PP1, DP1) load (model, optimizer and Checkpointer built anew, as in a fresh world): three
2-process worlds, each mostly its ranks' start (the PP layouts' 4-process worlds and the way
back cost more than the whole smoke budget; tests/integration/checkpoint/test_reshard_resume.py
resumes across PP).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.headline import checked_headline  # noqa: E402

HEADLINE_KEYS = ("layouts_resumed", "max_rel_loss_delta", "reshard_load_over_same_layout", "resumed")

SAME = (1, 1, 2)  # (tp, pp, dp) that writes the checkpoints
OTHERS = [(2, 1, 1), (1, 2, 1), (2, 2, 1)]

TINY_JOB = {
    "name": "reshard-bench",
    "model": {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
              "ffn_hidden_size": 128, "vocab_size": 512, "seq_length": 32},
    "training": {"global_batch_size": 8, "micro_batch_size": 2, "steps": 12, "lr": 1.0e-3,
                 "min_lr": 1.0e-4, "warmup_steps": 2, "lr_decay_steps": 12, "seed": 1234,
                 "torch_threads": 1},
    "data": {"corpus": ["stdlib"], "max_corpus_mb": 1.0, "val_fraction": 0.05},
    "checkpoint": {"interval": 4, "keep_last": 10, "async_save": True},
}


def pp_supported() -> bool:
    from training.config import TrainingConfig

    try:
        TrainingConfig(global_batch_size=8, steps=1, pipeline_parallel=2)
    except ValueError:
        return False
    return True


def torchrun(nproc: int, args: list[str], timeout: float = 900) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    env.pop("FORGEFLOW_FAULT", None)
    proc = subprocess.run([sys.executable, "-m", "infra.torchrun", "--standalone",  # forgeflow's torchrun
                           "--nproc-per-node", str(nproc), *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"torchrun {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc


# --- 1. load time ------------------------------------------------------------------------------

def _job(args, tp: int, pp: int, url: str) -> dict:
    return {"name": "reshard-load",
            "model": {"num_layers": args.layers, "hidden_size": args.hidden,
                      "num_attention_heads": args.heads, "vocab_size": args.vocab,
                      "seq_length": args.seq},
            "training": {"global_batch_size": 2, "micro_batch_size": 1, "steps": 1,
                         "tensor_parallel": tp, "pipeline_parallel": pp, "torch_threads": 1},
            "checkpoint": {"url": url, "async_save": False, "keep_last": 1}}


def worker(mode: str, job_file: str, out_file: str, repeats: int, then: list[str] = ()) -> int:
    """Runs on every rank: `save` one checkpoint after one training step, or time `load`s; `save+load`
    (--smoke) does both in one world, the loads as a fresh `load` world would (a new Checkpointer).
    `then` (--smoke): JOB OUT pairs timed next as `load`s in the same processes, each at its own
    layout on a new process group (the model, optimizer and Checkpointer built anew, as a fresh
    world's are)."""
    import torch

    from training.checkpointing import Checkpointer
    from training.config import load_job_spec
    from training.model import (build_model, build_optimizer, init_distributed,
                                shutdown_distributed, wrap_data_parallel)

    spec = load_job_spec(job_file)
    cfg = spec.training
    torch.set_num_threads(1)
    if mode == "load" and _WORLDS_BEFORE[0]:
        _fresh_process_group()
    env = (init_distributed(cfg.tensor_parallel) if cfg.pipeline_parallel == 1
           else init_distributed(cfg.tensor_parallel, cfg.pipeline_parallel))
    try:
        model = build_model(spec.model, cfg)
        ddp = wrap_data_parallel(model, cfg)
        optimizer = build_optimizer(ddp, cfg)
        checkpointer = Checkpointer(spec.checkpoint, env, writer="thread")
        if mode in ("save", "save+load"):
            seq = spec.model.seq_length
            tokens = torch.randint(0, spec.model.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            ddp(tokens, torch.arange(seq).unsqueeze(0), None, labels=tokens).float().mean().backward()
            ddp.finish_grad_sync()
            optimizer.step()  # Adam moments exist: the checkpoint holds them
            checkpointer.save(1, model, optimizer, {"world_size": env.world_size})
            checkpointer.close()
            if mode == "save":
                return 0
            checkpointer = Checkpointer(spec.checkpoint, env, writer="thread")
        times = []
        for i in range(repeats + 1):  # the first load warms imports and allocations: not counted
            torch.distributed.barrier()
            start = time.perf_counter()
            step = checkpointer.latest()
            checkpointer.load(step, model, optimizer)
            elapsed = torch.tensor([time.perf_counter() - start])
            torch.distributed.all_reduce(elapsed, op=torch.distributed.ReduceOp.MAX)
            if i:
                times.append(elapsed.item())
        checkpointer.close()
        if env.rank == 0:
            Path(out_file).write_text(json.dumps(times))
    finally:
        shutdown_distributed()
        _WORLDS_BEFORE[0] += 1
    if then:
        return worker("load", then[0], then[1], repeats, then[2:])
    return 0


_WORLDS_BEFORE = [0]  # process groups this process has had (--smoke's `then`)


def _fresh_process_group() -> None:
    """The next process group of the same processes (--smoke's `then`) on keys of its own in
    torchrun's store: the default ones still hold the first group's gloo addresses, which a new
    group would read and fail to connect to. init_distributed then finds it started."""
    import datetime

    import torch

    from training.model import default_backend

    base = torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                      timeout=datetime.timedelta(seconds=600))
    store = torch.distributed.PrefixStore(f"reshard-world-{_WORLDS_BEFORE[0]}/", base)
    torch.distributed.init_process_group(backend=default_backend(), store=store,
                                         rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                                         timeout=datetime.timedelta(seconds=600))


def measure_loads(args, work: Path, layouts: list[tuple[int, int, int]], one_world_same: bool = False
                  ) -> dict[str, float]:
    """`one_world_same` (--smoke): the world that saves also times the same-layout loads, then the
    other layouts of as many processes (`then`; torchrun worlds fewer: the full run times each
    layout in a fresh world)."""
    import yaml

    url = str(work / "load-ckpt")
    save_job = work / "save.yaml"
    save_job.write_text(yaml.safe_dump(_job(args, SAME[0], SAME[1], url)))
    same_out = work / f"load-{SAME[0]}{SAME[1]}{SAME[2]}.json"
    if one_world_same:  # and the other layouts of as many processes, next in the same processes
        then = []
        for tp, pp, dp in layouts:
            if tp * pp * dp == SAME[0] * SAME[1] * SAME[2]:
                job = work / f"load-{tp}{pp}{dp}.yaml"
                job.write_text(yaml.safe_dump(_job(args, tp, pp, url)))
                then += ["--then", str(job), str(work / f"load-{tp}{pp}{dp}.json")]
        torchrun(SAME[0] * SAME[1] * SAME[2], [__file__, "--worker", "save+load", str(save_job), str(same_out),
                                               "--repeats", str(args.repeats), *then])
    else:
        torchrun(SAME[0] * SAME[1] * SAME[2], [__file__, "--worker", "save", str(save_job), "-"])
    from checkpoint.manifest import committed_checkpoints

    record = committed_checkpoints(url)[-1]
    print(f"load timing: checkpoint of {record.total_bytes / 1e6:.0f} MB written at "
          f"(TP{SAME[0]}, PP{SAME[1]}, DP{SAME[2]})")
    medians: dict[str, float] = {}
    for tp, pp, dp in [SAME] + layouts:
        job = work / f"load-{tp}{pp}{dp}.yaml"
        job.write_text(yaml.safe_dump(_job(args, tp, pp, url)))
        out = work / f"load-{tp}{pp}{dp}.json"
        if not (one_world_same and tp * pp * dp == SAME[0] * SAME[1] * SAME[2]):
            torchrun(tp * pp * dp, [__file__, "--worker", "load", str(job), str(out),
                                    "--repeats", str(args.repeats)])
        times = json.loads(out.read_text())
        medians[f"tp{tp}_pp{pp}_dp{dp}"] = statistics.median(times)
        print(f"  load at (TP{tp}, PP{pp}, DP{dp}): median {statistics.median(times):.3f}s "
              f"over {len(times)} ({', '.join(f'{t:.3f}' for t in times)})")
    return medians


# --- 2. loss after resharding --------------------------------------------------------------------

def _losses(run_dir: Path) -> dict[int, float]:
    from infra import runfiles

    out: dict[int, float] = {}
    for step, loss in re.findall(r" step=(\d+) loss=(\S+) ", runfiles.log_path(run_dir, 0).read_text()):
        out[int(step)] = float(loss)
    return out


def resume_curves(work: Path, layouts: list[tuple[int, int, int]]) -> tuple[list[str], float]:
    import yaml

    from checkpoint.manifest import step_dir
    from training.config import parse_job_spec
    from training.data import prepare_data

    job = copy.deepcopy(TINY_JOB)
    job["data"]["data_dir"] = str(work / "data")
    job["checkpoint"]["url"] = str(work / "unused")
    prepare_data(parse_job_spec(copy.deepcopy(job)), progress=False)

    def run(name: str, tp: int, pp: int, dp: int, steps: int, ckpt: Path) -> dict[int, float]:
        spec = copy.deepcopy(job)
        spec.update(name=name, run_dir=str(work / name))
        spec["training"].update(tensor_parallel=tp, pipeline_parallel=pp, steps=steps)
        spec["checkpoint"]["url"] = str(ckpt)
        path = work / f"{name}.yaml"
        path.write_text(yaml.safe_dump(spec))
        torchrun(tp * pp * dp, ["-m", "training.train", str(path)])
        return _losses(work / name)

    u_ckpt = work / "u" / "ckpt"
    reference = run("u", *SAME, 12, u_ckpt)
    resumed: list[str] = []
    deltas: list[float] = []

    def compare(name: str, losses: dict[int, float], first: int, last: int) -> None:
        worst = max(abs(losses[s] - reference[s]) / abs(reference[s]) for s in range(first, last + 1))
        deltas.append(worst)
        resumed.append(name)
        print(f"  resumed {name}: steps {first}-{last}, max rel loss delta {worst:.2e}")

    for tp, pp, dp in layouts:
        name = f"tp{tp}_pp{pp}_dp{dp}"
        ckpt = work / name / "ckpt"
        shutil.copytree(u_ckpt / step_dir(4), ckpt / step_dir(4))
        steps = 8 if (tp, pp) == (2, 2) else 12
        compare(name, run(name, tp, pp, dp, steps, ckpt), 5, steps)
        if (tp, pp) == (2, 2):  # and back to the layout that wrote the first checkpoint
            back = f"back_to_tp{SAME[0]}_pp{SAME[1]}_dp{SAME[2]}"
            compare(back, run(back, *SAME, 12, ckpt), 9, 12)
    return resumed, max(deltas)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", nargs=3, metavar=("MODE", "JOB", "OUT"), help=argparse.SUPPRESS)
    p.add_argument("--then", nargs=2, action="append", default=[], metavar=("JOB", "OUT"), help=argparse.SUPPRESS)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workdir", default=None)
    p.add_argument("--smoke", action="store_true",
                   help="a 64-wide model, one load per layout, only (TP2, PP1, DP1), both loads timed in the "
                        "saving world's processes: seconds, same keys")
    args = p.parse_args()
    if args.worker:
        return worker(*args.worker, repeats=args.repeats, then=[x for pair in args.then for x in pair])
    if args.smoke:
        args.hidden, args.layers, args.heads, args.vocab, args.seq, args.repeats = 64, 4, 4, 512, 32, 1

    work = Path(args.workdir or tempfile.mkdtemp(prefix="reshard-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    layouts = [l for l in OTHERS if l[1] == 1 or pp_supported()]
    if len(layouts) < len(OTHERS):
        print("pipeline parallelism is not supported by the worker yet: PP layouts skipped")
    if args.smoke:
        layouts = layouts[:1]
    loads = measure_loads(args, work, layouts, one_world_same=args.smoke)
    same = loads[f"tp{SAME[0]}_pp{SAME[1]}_dp{SAME[2]}"]
    ratio = max(v for k, v in loads.items() if k != f"tp{SAME[0]}_pp{SAME[1]}_dp{SAME[2]}") / same
    print(f"slowest resharded load / same-layout load: {ratio:.2f}x (goal <= 1.5x)")
    print("loss after resharding (uninterrupted run at (TP1, PP1, DP2), resumed from its step 4):")
    resumed, worst = resume_curves(work, layouts)
    out = {"layouts_resumed": len(resumed), "max_rel_loss_delta": worst,
           "reshard_load_over_same_layout": round(ratio, 3),
           **{f"load_s_{k}": round(v, 4) for k, v in loads.items()},
           "resumed": resumed}
    print(json.dumps(checked_headline(out, HEADLINE_KEYS)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
