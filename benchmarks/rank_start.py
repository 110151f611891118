"""What starting a world's ranks costs: forked from torchrun's agent (infra.torchrun's default)
against a new interpreter per rank (torchrun's own start, FORGEFLOW_RANK_START=exec).

    .venv/bin/python benchmarks/rank_start.py [--repeats 5] [--nproc 2] [--steps 5]

What runs: the worker as every launcher starts it (`python -m infra.torchrun`, static
rendezvous, `-m training.train JOB`) trains configs/tiny-cpu.yaml for `--steps` steps on `--nproc`
ranks (gloo), once per start method per repeat, the two methods alternating so that the machine's
load falls on both alike; one launch of each first, unmeasured, so that both read the same warm
page cache. A launch is measured from the benchmark's Popen to the agent's exit.

Baseline and why it is fair: torchrun's own start, a new `python -u -m training.train` per rank,
is what every torchrun user runs; the same agent, job, data, steps, environment and machine, only
FORGEFLOW_RANK_START differs. Neither side is given anything the other lacks: the fork inherits
only what the agent had imported to be an agent (torch and torchrun), nothing imported for it.

Keys (last line):
- `first_step_s_exec` / `first_step_s_fork`: median seconds from the launch to rank 0's first
  step in its run log (what a start or a restart waits for before training resumes);
- `launch_cpu_s_exec` / `launch_cpu_s_fork`: median CPU seconds (user + system) of the whole
  launch: the agent and its ranks (resource.getrusage of waited-for children);
- `cpu_saved_per_rank_s`: (launch_cpu_s_exec - launch_cpu_s_fork) / nproc;
- `nproc`, `repeats`.

`--smoke`: one rank, two steps of a 2-layer 64-wide model on 1 MB of the corpus, one repeat and no
warm-up launch: the same launches and keys, seconds, not a figure.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.headline import checked_headline  # noqa: E402
from benchmarks.train_throughput import SMOKE_MODEL  # noqa: E402
from infra import runfiles  # noqa: E402
from infra.launch import LaunchRequest, local_node_launches, torchrun_command  # noqa: E402
from infra.torchrun import RANK_START_ENV  # noqa: E402
from testing.prefect_server import free_port  # noqa: E402
from training.config import dotted_overrides, load_job_spec  # noqa: E402
from training.runlog import epoch_seconds, read_steps  # noqa: E402

HEADLINE_KEYS = ("first_step_s_exec", "first_step_s_fork", "launch_cpu_s_exec", "launch_cpu_s_fork",
                 "cpu_saved_per_rank_s", "nproc", "repeats")
METHODS = ("exec", "fork")


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def launch(method: str, config: str, overrides: list[str], run_dir: Path, nproc: int) -> dict:
    """One launch of the worker on `nproc` ranks started by `method`: seconds to rank 0's first
    step, and the CPU seconds of the agent and its ranks."""
    overrides = [*overrides, f"run_dir={run_dir}", f"checkpoint.url={run_dir / 'ckpt'}"]
    env = dict(os.environ, PYTHONUNBUFFERED="1", **{RANK_START_ENV: method})
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as infra.launch.node_env sets it for every node
    worker_args = ["-m", "training.train", config, *(arg for item in overrides for arg in ("--set", item))]
    request = LaunchRequest(job_name="rank-start", nodes=local_node_launches(["local"], nproc, free_port()),
                            worker_args=worker_args, run_dir=run_dir)
    command = torchrun_command(request.nodes[0], request)  # as every launcher starts a node's torchrun
    cpu_before = _children_cpu_s()
    started = time.time()
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    cpu = _children_cpu_s() - cpu_before
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-4000:])
        raise SystemExit(f"{method}: the launch failed (exit {done.returncode})")
    first = read_steps(runfiles.log_path(run_dir, 0))[0]
    first_at = epoch_seconds(first.time)
    return {"method": method, "first_step_s": round(first_at - started, 3), "cpu_s": round(cpu, 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "tiny-cpu.yaml"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="one rank, two steps, one repeat: seconds, same keys")
    args = parser.parse_args()
    if args.smoke:
        args.repeats, args.nproc, args.steps = 1, 1, 2

    from training.data import prepare_data

    work = Path(tempfile.mkdtemp(prefix="forgeflow-rank-start-"))
    overrides = [f"training.steps={args.steps}", f"checkpoint.interval={args.steps}", "checkpoint.async_save=false"]
    if args.smoke:  # 1 MB of the corpus in the scratch folder: the config's prepared data may not exist yet
        overrides += [f"data.data_dir={work / 'data'}", "data.max_corpus_mb=1", *SMOKE_MODEL]
    prepare_data(load_job_spec(args.config, dotted_overrides(overrides)), progress=False)

    if not args.smoke:  # both read a warm page cache
        for method in METHODS:
            launch(method, args.config, overrides, work / f"warm-{method}", args.nproc)
    runs: dict[str, list[dict]] = {method: [] for method in METHODS}
    for repeat in range(args.repeats):
        for method in METHODS if repeat % 2 == 0 else reversed(METHODS):
            result = launch(method, args.config, overrides, work / f"{method}-{repeat}", args.nproc)
            runs[method].append(result)
            print(json.dumps(result), flush=True)

    def median(method: str, key: str) -> float:
        return round(statistics.median(r[key] for r in runs[method]), 3)

    headline = {
        "first_step_s_exec": median("exec", "first_step_s"), "first_step_s_fork": median("fork", "first_step_s"),
        "launch_cpu_s_exec": median("exec", "cpu_s"), "launch_cpu_s_fork": median("fork", "cpu_s"),
        "cpu_saved_per_rank_s": round((median("exec", "cpu_s") - median("fork", "cpu_s")) / args.nproc, 3),
        "nproc": args.nproc, "repeats": args.repeats,
    }
    print(json.dumps(checked_headline(headline, HEADLINE_KEYS)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
