"""Recovery of the pretrain flow: time to resume, lost work, goodput (local or Slurm launcher).

    .venv/bin/python benchmarks/recovery.py [--config configs/tiny-cpu.yaml] [--faults 2]
        [--fault-every-s 300] [--interval 25] [--launcher local|slurm]

With `--launcher slurm` every attempt (and node check) is a Slurm batch job: on the
cluster SLURM_CONF names, or on a single-host Slurm this script starts (root,
Debian's slurm-wlm + munge); the restart phase then includes sbatch, Slurm's
scheduling and srun.

Two real runs of the `pretrain` flow (Prefect's ephemeral API, torchrun on CPU),
one after the other on the same job and data:

1. fault-free: wall time W0 of the flow for S steps;
2. with faults: a crash-type fault (the worker's `cuda_error` drill: PyTorch's
   illegal-memory-access text and exit code) `--fault-every-s` seconds of training
   after each (re)start, `--faults` times; S is chosen so that the fault-free run
   lasts (faults + 1) × fault-every-s. Each fault is diagnosed (rules), acted on
   (node check, restart from the newest committed checkpoint) and recovered.

Per fault, from the flow's failure records and rank 0's run log (UTC timestamps):
  detect   = flow saw the failure          − the last step logged before it
  diagnose = diagnosis done                − detected
  act      = next attempt launched         − diagnosis done (node check, backoff)
  restart  = first step after resume       − launched (torchrun, imports, checkpoint load)
  seconds_to_resume = first step after resume − last step before the fault
  lost steps = last step before the fault − the checkpoint step resumed from
Goodput of a run = useful step time / wall time, with useful step time the S
steps at the fault-free run's median step time; the headline is the ratio of
the faulty run's goodput to the fault-free run's (= W0 / W_faults).

The last line is the JSON object {"seconds_to_resume_p50", "lost_steps_max",
"checkpoint_interval_steps", "goodput_with_faults_over_fault_free"}.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.chdir(REPO)


def _ts(text: str) -> float:
    return dt.datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=dt.timezone.utc).timestamp()


def _lines(path: Path):
    from training.runlog import LogFormatError, parse_line

    for raw in path.read_text(errors="replace").splitlines():
        try:
            yield parse_line(raw)
        except LogFormatError:
            continue


def write_job(config: str, work: Path, name: str, steps: int, interval: int) -> Path:
    import yaml

    from training.config import load_job_spec

    spec = load_job_spec(config)
    job = spec.model_dump(mode="json", exclude_none=True)
    job.pop("base", None)
    job["name"] = name
    job["run_dir"] = str(work / name / "run")
    job["checkpoint"].update({"url": str(work / name / "checkpoints"), "interval": interval,
                              "keep_last": 1000, "async_save": True})
    job["training"].update({"steps": steps, "lr_decay_steps": steps, "log_interval": 1})
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


LAUNCH = {"launcher": "local", "cluster": "local"}  # --launcher slurm: a local Slurm's cluster file


def slurm_cluster_file(work: Path) -> Path:
    """A cluster file for Slurm (`--launcher slurm`): the one of SLURM_CONF if set, else a
    single-host Slurm started here (infra.slurm_local; needs root and slurm-wlm + munge)."""
    import atexit

    import yaml

    from infra.slurm_local import LocalSlurm, node_name

    conf = os.environ.get("SLURM_CONF")
    if not conf:
        slurm = LocalSlurm(work / "slurm").start()
        atexit.register(slurm.stop)
        conf = str(slurm.conf)
        os.environ["SLURM_CONF"] = conf
    cpus = max(1, min(2, os.cpu_count() or 1))
    path = work / "cluster-slurm.yaml"
    path.write_text(yaml.safe_dump({
        "name": "recovery-slurm",
        "nodes": [{"name": node_name(), "gpu_type": "cpu", "gpu_count": cpus, "gpu_memory_gib": 8,
                   "peak_tflops": 0.05, "address": node_name()}],
        "slurm": {"slurm_conf": conf, "poll_s": 1.0},
    }, sort_keys=False))
    return path


def run_flow(job: Path, drills: list[str]) -> tuple[object, float]:
    from flows.pretrain import pretrain

    started = time.time()
    result = pretrain(str(job), cluster=LAUNCH["cluster"], launcher=LAUNCH["launcher"], backoff_s=1.0,
                      hang_timeout_s=300, drill_faults=drills or None, max_restarts=len(drills) + 2)
    return result, time.time() - started


def step_times(log: Path) -> list[tuple[int, float]]:
    return [(int(l.fields["step"]), _ts(l.time)) for l in _lines(log) if "loss" in l.fields]


def phases(result, log: Path) -> list[dict]:
    """Per failure: phase durations from the flow's records and rank 0's run log."""
    lines = list(_lines(log))
    out = []
    for failure in result.failures:
        detected, diagnosed, relaunched = failure.detected_at, failure.diagnosed_at, failure.relaunched_at
        before = [l for l in lines if "loss" in l.fields and _ts(l.time) <= detected]
        last_step_line = before[-1]
        resumed = next(l for l in lines if l.event == "resumed" and _ts(l.time) > detected)
        first_after = next(l for l in lines if "loss" in l.fields and _ts(l.time) > _ts(resumed.time))
        fault_at = _ts(last_step_line.time)
        out.append({
            "fault_step": int(last_step_line.fields["step"]) + 1,
            "resumed_from_step": int(resumed.fields["step"]),
            "lost_steps": int(last_step_line.fields["step"]) - int(resumed.fields["step"]),
            "detect_s": round(detected - fault_at, 2),
            "diagnose_s": round(diagnosed - detected, 2),
            "act_s": round(relaunched - diagnosed, 2),
            "restart_s": round(_ts(first_after.time) - relaunched, 2),
            "seconds_to_resume": round(_ts(first_after.time) - fault_at, 2),
        })
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tiny-cpu.yaml")
    parser.add_argument("--faults", type=int, default=2)
    parser.add_argument("--fault-every-s", type=float, default=300.0)
    parser.add_argument("--interval", type=int, default=25, help="checkpoint interval in steps")
    parser.add_argument("--calibrate-steps", type=int, default=30)
    parser.add_argument("--launcher", choices=["local", "slurm"], default="local",
                        help="slurm: every attempt is a Slurm batch job (SLURM_CONF's cluster, else a local one)")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="forgeflow-recovery-"))
    os.environ.setdefault("PREFECT_HOME", str(work / "prefect-home"))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # A fresh home's migrations can outlast the ephemeral server's default 20 s on a busy machine.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.pop("SLACK_WEBHOOK_URL", None)
    if args.launcher == "slurm":
        LAUNCH.update(launcher="slurm", cluster=str(slurm_cluster_file(work)))

    from infra import runfiles
    from training.config import load_job_spec
    from training.data import prepare_data

    prepare_data(load_job_spec(args.config), progress=False)

    # Calibrate: the step time under the flow (also warms Prefect's ephemeral API).
    calib = write_job(args.config, work, "calibrate", args.calibrate_steps, args.interval)
    result, _ = run_flow(calib, [])
    assert result.finished, result
    times = step_times(runfiles.log_path(load_job_spec(calib).resolved_run_dir, 0))
    step_s = statistics.median(b - a for (_, a), (_, b) in zip(times[5:], times[6:]))
    steps_per_fault = max(args.interval + 1, round(args.fault_every_s / step_s))
    steps = steps_per_fault * (args.faults + 1)
    print(f"step time {step_s:.3f} s: a fault every {steps_per_fault} steps of training, {steps} steps in all")

    free_job = write_job(args.config, work, "fault-free", steps, args.interval)
    free, wall_free = run_flow(free_job, [])
    assert free.finished, free
    free_times = step_times(runfiles.log_path(load_job_spec(free_job).resolved_run_dir, 0))
    median_step = statistics.median(b - a for (_, a), (_, b) in zip(free_times, free_times[1:]))

    # Fault k fires steps_per_fault steps of training after restart k-1 resumed.
    drills, resume = [], 0
    for _ in range(args.faults):
        at = resume + steps_per_fault
        drills.append(f"cuda_error@{at}:0")
        resume = (at - 1) // args.interval * args.interval  # newest checkpoint before it (if committed)
    faulty_job = write_job(args.config, work, "with-faults", steps, args.interval)
    faulty, wall_faults = run_flow(faulty_job, drills)
    assert faulty.finished, faulty
    per_fault = phases(faulty, runfiles.log_path(load_job_spec(faulty_job).resolved_run_dir, 0))

    useful = steps * median_step
    print(f"\n{'fault':>5} {'step':>5} {'from':>5} {'lost':>5} {'detect':>7} {'diagnose':>8} {'act':>6} "
          f"{'restart':>8} {'to resume':>9}")
    for i, p in enumerate(per_fault):
        print(f"{i:>5} {p['fault_step']:>5} {p['resumed_from_step']:>5} {p['lost_steps']:>5} {p['detect_s']:>7.2f} "
              f"{p['diagnose_s']:>8.2f} {p['act_s']:>6.2f} {p['restart_s']:>8.2f} {p['seconds_to_resume']:>9.2f}")
    print(f"\nfault-free: {wall_free:.1f} s wall for {steps} steps (goodput {useful / wall_free:.3f})")
    print(f"with {len(per_fault)} faults: {wall_faults:.1f} s wall (goodput {useful / wall_faults:.3f})")
    print(f"(hang detection is the heartbeat timeout itself, {300:.0f} s by default in the flow; not included)")
    headline = {
        "launcher": args.launcher,
        "seconds_to_resume_p50": round(statistics.median(p["seconds_to_resume"] for p in per_fault), 2),
        "lost_steps_max": max(p["lost_steps"] for p in per_fault),
        "checkpoint_interval_steps": args.interval,
        "goodput_with_faults_over_fault_free": round(wall_free / wall_faults, 3),
        "phases_p50_s": {k: round(statistics.median(p[k] for p in per_fault), 2)
                         for k in ("detect_s", "diagnose_s", "act_s", "restart_s")},
        "fault_every_s": args.fault_every_s, "faults": len(per_fault),
    }
    print(json.dumps(headline))


if __name__ == "__main__":
    main()
