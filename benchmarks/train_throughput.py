"""Training throughput of configs/tiny-cpu.yaml at world size 1 and 2 (torchrun, gloo on CPU),
and with two pipeline stages (PP=2, megatron's 1F1B schedule) on the same 2 processes.

    .venv/bin/python benchmarks/train_throughput.py [--steps 30] [--warmup 5] [--config ...]

Each world size is a real `torchrun` run of the worker for `--steps` steps. Throughput is
measured from the worker's own step log between the end of step `--warmup` and the
last step: global tokens trained / wall seconds (logging and heartbeats included,
checkpoint writing excluded — the only checkpoint is saved after the last step).
World size 1 uses every core for intra-op threads; world size 2 gets one thread per
rank (torchrun's default), so both use the whole machine. OMP_WAIT_POLICY=PASSIVE
unless set: spinning OpenMP threads collapse throughput on a shared machine.

PP=2 runs the same job on 2 ranks as two pipeline stages (2 layers each, 1F1B over the
2 micro batches of the global batch) instead of two data-parallel replicas: same
processes, threads, global batch and data, so tokens_per_s_pp2 vs tokens_per_s_ws2 is
the price of pipelining this model (point-to-point activations, the pipeline bubble:
with 2 micro batches and 2 stages a third of each stage's time is idle) on a machine
where data parallelism fits. Pipelining exists for models that do not fit one device.

`--smoke` runs one world, the PP=2 one (the same measure() path as the others, with two ranks
and the pipeline schedule), for 3 steps (1 warm-up) of a 2-layer 64-wide model
(tests/tiny_job.py's shape) on 1 MB of the corpus: seconds, not a figure. Its ws1 and ws2 keys
are null (each world costs a torchrun start and its ranks' imports, most of the smoke).

The last line is the JSON object {"tokens_per_s_ws1": ..., "tokens_per_s_ws2": ...,
"tokens_per_s_pp2": ...} (HEADLINE_KEYS).
"""

from __future__ import annotations

import json
import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.headline import checked_headline  # noqa: E402
from infra import runfiles  # noqa: E402
from training.cli import torchrun_command  # noqa: E402
from training.config import dotted_overrides, load_job_spec  # noqa: E402
from training.runlog import read_steps  # noqa: E402


HEADLINE_KEYS = ("tokens_per_s_ws1", "tokens_per_s_ws2", "tokens_per_s_pp2")
SMOKE_MODEL = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4",
               "model.num_query_groups=2", "model.ffn_hidden_size=128", "model.vocab_size=512",
               "model.seq_length=64"]


def measure(config: str, nproc: int, steps: int, warmup: int, workdir: Path,
            pipeline_parallel: int = 1, smoke: list[str] = ()) -> dict:
    run_dir = workdir / f"ws{nproc}-pp{pipeline_parallel}"
    overrides = [*smoke, f"training.steps={steps}", f"run_dir={run_dir}",
                 f"training.pipeline_parallel={pipeline_parallel}",
                 f"checkpoint.url={run_dir / 'ckpt'}", f"checkpoint.interval={steps}",
                 "checkpoint.async_save=false"]
    spec = load_job_spec(config, dotted_overrides(overrides))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("FORGEFLOW_FAULT", None)
    threads = max(1, (os.cpu_count() or 1) // nproc)
    env["OMP_NUM_THREADS"] = str(threads)
    # Idle OpenMP threads sleep instead of spinning: on a small shared machine, spinning
    # threads fight other processes for the cores (measured: 7 s/step instead of 0.7 s at
    # world size 1 with 2 threads under load).
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    cmd = torchrun_command(config, nproc, overrides)  # as `forgeflow train` starts the worker
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"world size {nproc}: the worker failed (exit {proc.returncode})")
    records = read_steps(runfiles.log_path(run_dir, 0))
    start, end = records[warmup - 1], records[-1]
    tokens = (end.step - start.step) * spec.training.global_batch_size * spec.model.seq_length
    seconds = end.elapsed_s - start.elapsed_s
    return {"world_size": nproc, "pipeline_parallel": pipeline_parallel, "threads_per_rank": threads, "steps_timed": end.step - start.step,
            "seconds": seconds, "tokens_per_s": tokens / seconds,
            "first_loss": records[0].loss, "last_loss": end.loss}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "tiny-cpu.yaml"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--smoke", action="store_true",
                        help="the PP=2 world only, 3 steps (1 warm-up), a tiny model: seconds, same keys")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.warmup = 3, 1
    if not 1 <= args.warmup < args.steps:
        parser.error("need 1 <= --warmup < --steps")

    from training.data import prepare_data

    smoke: list[str] = []  # --smoke's overrides of the config
    scratch = tempfile.TemporaryDirectory(prefix="forgeflow-throughput-data-") if args.smoke else None
    if scratch is not None:  # 1 MB of the corpus in a scratch folder: the config's prepared data may not exist yet
        smoke = [f"data.data_dir={scratch.name}", "data.max_corpus_mb=1", *SMOKE_MODEL]
    spec = load_job_spec(args.config, dotted_overrides(smoke))
    prepared = prepare_data(spec, progress=True)
    print(f"config {args.config}: {spec.model.num_parameters():,} parameters, "
          f"{spec.training.global_batch_size} x {spec.model.seq_length} tokens per step; "
          f"data {prepared.data_dir} ({prepared.train_tokens:,} train tokens); "
          f"{os.cpu_count()} CPU cores")
    results = {}
    with tempfile.TemporaryDirectory(prefix="forgeflow-throughput-") as tmp:
        worlds = (("ws1", 1, 1), ("ws2", 2, 1), ("pp2", 2, 2))
        for key, nproc, pp in (worlds[-1:] if args.smoke else worlds):
            r = measure(args.config, nproc, args.steps, args.warmup, Path(tmp), pipeline_parallel=pp, smoke=smoke)
            results[key] = r
            print(f"world size {nproc}, pp {pp} ({r['threads_per_rank']} thread(s)/rank): "
                  f"{r['tokens_per_s']:,.0f} tokens/s over {r['steps_timed']} steps "
                  f"({r['seconds']:.1f} s); loss {r['first_loss']:.3f} -> {r['last_loss']:.3f}")
    if scratch is not None:
        scratch.cleanup()
    headline = {f"tokens_per_s_{key}": None for key, _, _ in worlds}  # --smoke: the worlds not run stay null
    headline.update({f"tokens_per_s_{key}": round(r["tokens_per_s"], 1) for key, r in results.items()})
    print(json.dumps(checked_headline(headline, HEADLINE_KEYS)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
