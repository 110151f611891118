"""From `forgeflow submit` returning to the job's first training step, on an idle cluster with the
embedded defaults (no Prefect server: the detached runner starts a temporary one).

    .venv/bin/python benchmarks/submit_latency.py [--repeats 5] [--config configs/tiny-cpu.yaml]
        [--prefect-home DIR]

Each repeat submits the job (3 steps, its data prepared beforehand and shared, so data
preparation is not timed), notes the wall time `forgeflow submit` returned, and reads the
first step line of rank 0's log (its timestamp is written when the step ends); the job then
finishes before the next repeat, so the cluster is idle each time. `submit_to_running_s_p50`
is the median of (first step's time - submit's return). The runners' Prefect home is a fresh one in
the run's folder (the first repeat's temporary server migrates its database, the later ones find it
done), or `--prefect-home`'s (the benchmark smoke test passes its session's: after another smoke
has started a Prefect server there, the runner's finds the migrations done).

The floor beside it, measured in the same run: `torchrun_to_first_step_s_p50`, the same job
started directly with `torchrun -m training.train` (what a user without forgeflow runs on a
machine they own: no queue, no flow, no Prefect) from its start to its first step. The
difference is what submitting costs: the runner's start, Prefect's temporary server, planning,
queueing, placement and the launch. `submit_overhead_s_p50` is that difference of medians.

`--smoke`: one repeat of each, on tests/tiny_job.py's model shape and 1 MB of the corpus (SMOKE_SETS:
less tokenizer to train and model to build), one rank instead of two (`--gpus 1`, `--nproc_per_node 1`),
and the direct torchrun started beside the submitted job instead of after it (its figures are not
a measurement): the same submit and torchrun paths, same keys. The last line is the JSON object of
HEADLINE_KEYS.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.headline import checked_headline  # noqa: E402
from infra import runfiles  # noqa: E402
from training.config import dotted_overrides, load_job_spec  # noqa: E402
from training.runlog import epoch_seconds, read_steps  # noqa: E402

HEADLINE_KEYS = ("submit_to_running_s_p50", "torchrun_to_first_step_s_p50", "submit_overhead_s_p50", "repeats")
STEPS = 3
# --smoke's overrides, after the others: tests/tiny_job.py's model shape on 1 MB of the corpus
SMOKE_SETS = ["data.max_corpus_mb=1", "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4",
              "model.num_query_groups=2", "model.ffn_hidden_size=128", "model.vocab_size=512",
              "model.seq_length=64"]
EXTRA_SETS: list[str] = []  # SMOKE_SETS under --smoke
NPROC = ["2"]  # the direct torchrun's --nproc_per_node (what MARP gives the submitted job here); 1 under --smoke
SUBMIT_OPTIONS: list[str] = []  # ["--gpus", "1"] under --smoke (otherwise MARP sizes the job)


def _step_time(record) -> float:
    return epoch_seconds(record.time)


def _first_step_at(run_dir: Path, timeout_s: float) -> float:
    deadline = time.monotonic() + timeout_s
    log = runfiles.log_path(run_dir, 0)
    while time.monotonic() < deadline:
        steps = read_steps(log) if log.exists() else []
        if steps:
            return _step_time(steps[0])
        time.sleep(0.1)
    raise SystemExit(f"no training step in {log} after {timeout_s:.0f} s")


def _sets(work: Path, data_dir: Path) -> list[str]:
    return [f"training.steps={STEPS}", "training.log_interval=1", f"data.data_dir={data_dir}",
            "data.max_corpus_mb=2", f"run_dir={work}/runs/{{name}}/{{job}}", "checkpoint.url={run_dir}/checkpoints",
            f"checkpoint.interval={STEPS}", *EXTRA_SETS]


def submit_once(config: str, work: Path, env: dict, data_dir: Path) -> float:
    from scheduler.orchestrator.seat import cluster_orchestrator

    argv = [sys.executable, "-m", "flows.cli", "submit", config, "--json", *SUBMIT_OPTIONS]
    for item in _sets(work, data_dir):
        argv += ["--set", item]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    returned = time.time()
    if done.returncode != 0:
        raise SystemExit(f"forgeflow submit failed: {done.stderr[-2000:]}")
    out = json.loads(done.stdout)
    first = _first_step_at(Path(out["run_dir"]), 600)
    orch = cluster_orchestrator()
    deadline = time.monotonic() + 600
    while orch.job(out["job_id"])["state"] in ("queued", "running"):  # idle again before the next repeat
        if time.monotonic() > deadline:
            raise SystemExit(f"job {out['job_id']} did not end")
        time.sleep(0.5)
    return first - returned


def torchrun_once(config: str, work: Path, env: dict, data_dir: Path, i: int) -> float:
    run_dir = work / f"direct-{i}"
    sets = [s for s in _sets(work, data_dir) if not s.startswith(("run_dir=", "checkpoint.url="))]
    sets += [f"run_dir={run_dir}", f"checkpoint.url={run_dir}/checkpoints"]
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", NPROC[0],
            "-m", "training.train", config]
    for item in sets:
        argv += ["--set", item]
    started = time.time()
    subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600, cwd=REPO, check=True)
    return _first_step_at(run_dir, 10) - started


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--config", default="configs/tiny-cpu.yaml")
    p.add_argument("--prefect-home", default=None,
                   help="PREFECT_HOME of the submitted jobs' runners (default: a fresh one in this run's folder, "
                        "whose migrations the first repeat's temporary server runs)")
    p.add_argument("--smoke", action="store_true", help="one repeat of each (same keys)")
    args = p.parse_args()
    repeats = 1 if args.smoke else args.repeats
    if args.smoke:
        EXTRA_SETS.extend(SMOKE_SETS)
        NPROC[0] = "1"
        SUBMIT_OPTIONS.extend(["--gpus", "1"])
    work = Path(tempfile.mkdtemp(prefix="forgeflow-submit-latency-"))
    data_dir = work / "data"
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "FORGEFLOW_DB_URL", "FORGEFLOW_FAULT")}
    env.update(FORGEFLOW_STATE_DIR=str(work / "state"), PREFECT_HOME=args.prefect_home or str(work / "prefect-home"),
               PREFECT_SERVER_ANALYTICS_ENABLED="false", PYTHONUNBUFFERED="1")
    if args.smoke:  # what torchrun sets for each rank when it starts more than one (the full run's two)
        env.setdefault("OMP_NUM_THREADS", "1")
    os.environ.update(FORGEFLOW_STATE_DIR=env["FORGEFLOW_STATE_DIR"])
    os.environ.pop("FORGEFLOW_DB_URL", None)

    from training.data import prepare_data

    prepare_data(load_job_spec(args.config, dotted_overrides(_sets(work, data_dir))), progress=False)
    submitted, direct = [], []
    for i in range(repeats):  # side by side: the machine's load affects both alike
        if args.smoke:  # both at once: a harness check, not a figure
            with ThreadPoolExecutor(1) as beside:
                started = beside.submit(torchrun_once, args.config, work, env, data_dir, i)
                submitted.append(submit_once(args.config, work, env, data_dir))
                direct.append(started.result())
        else:
            submitted.append(submit_once(args.config, work, env, data_dir))
            direct.append(torchrun_once(args.config, work, env, data_dir, i))
        print(f"repeat {i}: submit -> first step {submitted[-1]:.1f} s; torchrun -> first step {direct[-1]:.1f} s",
              file=sys.stderr, flush=True)
    values = {"submit_to_running_s_p50": round(statistics.median(submitted), 2),
              "torchrun_to_first_step_s_p50": round(statistics.median(direct), 2),
              "submit_overhead_s_p50": round(statistics.median(submitted) - statistics.median(direct), 2),
              "repeats": repeats}
    print(json.dumps(checked_headline(values, HEADLINE_KEYS)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
