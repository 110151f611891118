"""Evaluation trials as Slurm batch jobs: the executor's `SlurmSubmitter`.

    sbatch --job-name=forgeflow-eval-<trial> --nodes=1 --ntasks=1
           [--gpus-per-node=G | --gres=gpu:G] --cpus-per-task=C [--partition] [--account] [--time]
      └─ python -m evalsuite.trial_job run trial.json result.json   (in the job; the Kubernetes
                                                                     submitter's jobs run it too)
           └─ evalsuite.trials.run_trial → result.json (atomic), or a traceback in the job's output

One job per trial, so Slurm's queue decides where and when each trial runs; the
executor (`evalsuite.executor.execute`) still starts a slot's next trial only when
its last one ended, so a plan never holds more than one job per slot. A slot's
GPUs become the job's GPU request (Slurm picks the indices and sets
CUDA_VISIBLE_DEVICES); a CPU slot asks for its cores' count. Metric jobs stay on
this machine's CPU workers (a thread pool and the sandbox), as with the local
submitter: they are short and need no accelerator.

The jobs are watched in one batch: one `squeue` for every outstanding job per
poll, and for jobs gone from squeue `scontrol show job` (while slurmctld keeps
them, MinJobAge) then `sacct` (needs accounting). A job that ends without a
result file is reported with the tail of its Slurm output, which holds the
trial's traceback. `close()` scancels every job still queued or running: the
runner calls it on every exit, so an interrupted or failed evaluation leaves no
job behind.

Like the Slurm launcher (infra/slurm.py) this assumes the output folder is on
storage every node sees and the Python environment has the same path there.
sbatch exports the environment it is given to the job; it is given
`infra.launch.worker_environment()`, what a worker needs, never this process's
whole environment (a Slack webhook or the state database's URL stay here).
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from evalsuite.errors import EvalError, TrialError
from evalsuite.metrics import MetricJob, run_metric_job
from evalsuite.sandbox import Sandbox
from evalsuite.trials import Trial, TrialResult, cpu_cores, cuda_indices
from infra.launch import worker_environment
from infra.slurm import FINAL_STATES, SlurmError, SlurmSettings, site_args, slurm_command

OUTPUT_TAIL_CHARS = 3000   # of a failed trial's Slurm output, in its error


def job_trial(trial: Trial) -> Trial:
    """The trial as its job sees its devices: Slurm chose the GPUs (renumbered from 0 by its
    CUDA_VISIBLE_DEVICES) and the cores, so the slot's indices and pinning do not apply."""
    gpus = cuda_indices(trial.devices) or [d for d in trial.devices if d == "cuda"]
    if gpus:
        devices = ["cuda"] if len(gpus) == 1 else [f"cuda:{i}" for i in range(len(gpus))]
    elif trial.devices:
        devices = ["cpu"]
    else:
        devices = []
    return trial.model_copy(update={"devices": devices})


def sbatch_args(trial: Trial, settings: SlurmSettings, output: Path) -> list[str]:
    gpus = len(cuda_indices(trial.devices) or [d for d in trial.devices if d == "cuda"])
    args = [f"--job-name=forgeflow-eval-{trial.trial_id}", "--nodes=1", "--ntasks=1",
            f"--output={output}", "--open-mode=append", f"--chdir={os.getcwd()}",
            "--no-requeue"]   # a failed trial is reported to the executor, not silently rerun
    if gpus:
        args.append(f"--gpus-per-node={gpus}" if settings.gpu_request == "gpus-per-node" else f"--gres=gpu:{gpus}")
        args.append(f"--cpus-per-task={gpus * settings.cpus_per_gpu}")
    else:
        args.append(f"--cpus-per-task={max(1, len(cpu_cores(trial.devices)))}")
    if trial.node and settings.mode == "pin":   # a cluster forgeflow owns: the trial's slot lives there
        args.append(f"--nodelist={trial.node}")
    # Delegated (the default, a site's shared Slurm): Slurm chooses the node, as for training;
    # the plan's node was only its estimate, and a trial on another node preloads there itself.
    return args + site_args(settings)


def batch_script(trial: Trial, trial_file: Path, result_file: Path) -> str:
    root = Path(__file__).resolve().parents[1]
    run = [sys.executable, "-m", "evalsuite.trial_job", "run", str(trial_file), str(result_file)]
    lines = ["#!/bin/bash",
             f"# forgeflow evaluation trial {trial.trial_id}",
             f"export PYTHONPATH={shlex.quote(str(root))}${{PYTHONPATH:+:$PYTHONPATH}}",
             'echo "forgeflow: trial job $SLURM_JOB_ID on $(hostname), GPUs ${CUDA_VISIBLE_DEVICES:-none}"']
    if not cuda_indices(trial.devices) and "cuda" not in trial.devices and trial.devices:
        lines.append("export CUDA_VISIBLE_DEVICES=")   # a CPU slot never grabs a GPU
    return "\n".join(lines + ["exec " + shlex.join(run), ""])


def job_states(job_ids: list[str], settings: SlurmSettings) -> dict[str, tuple[str, int | None]]:
    """(state, exit code) of each job: one squeue for all, then per job gone from squeue
    `scontrol show job`, then sacct; ("UNKNOWN", None) when no source remembers it."""
    if not job_ids:
        return {}
    states: dict[str, tuple[str, int | None]] = {}
    out = slurm_command(["squeue", "-h", "-j", ",".join(job_ids), "-o", "%i|%T"], settings, check=False)
    for line in out.stdout.splitlines() if out.returncode == 0 else []:
        job_id, _, state = line.strip().partition("|")
        if job_id in job_ids and state and state.upper() not in FINAL_STATES:
            states[job_id] = (state.upper(), None)
    for job_id in job_ids:
        if job_id not in states:
            states[job_id] = _ended_state(job_id, settings)
    return states


def _ended_state(job_id: str, settings: SlurmSettings) -> tuple[str, int | None]:
    out = slurm_command(["scontrol", "show", "job", "-o", job_id], settings, check=False)
    fields = dict(item.split("=", 1) for item in out.stdout.split() if "=" in item)
    if out.returncode == 0 and fields.get("JobState"):
        state = fields["JobState"]
        code = int(fields.get("ExitCode", "1:0").split(":")[0]) if state in FINAL_STATES else None
        return state, code
    acct = slurm_command(["sacct", "-n", "-P", "-X", "-j", job_id, "-o", "State,ExitCode"], settings, check=False)
    line = acct.stdout.strip().splitlines()[0] if acct.returncode == 0 and acct.stdout.strip() else ""
    if line:
        state, code = line.split("|")
        return state.split()[0], int(code.split(":")[0])
    return "UNKNOWN", None


class SlurmTrial:
    """A trial's batch job; result() reads the result file the job wrote."""

    def __init__(self, trial_id: str, job_id: str, result_path: Path, output_path: Path) -> None:
        self.trial_id, self.job_id = trial_id, job_id
        self.result_path, self.output_path = result_path, output_path
        self.state, self.exit_code = "PENDING", None

    def final(self) -> bool:
        return self.state in FINAL_STATES or self.state == "UNKNOWN"

    def result(self) -> TrialResult:
        if self.state == "COMPLETED" and self.result_path.exists():
            return TrialResult.model_validate_json(self.result_path.read_text())
        try:
            tail = self.output_path.read_text(errors="replace")[-OUTPUT_TAIL_CHARS:].strip()
        except OSError:
            tail = "(no output file)"
        raise TrialError(f"trial {self.trial_id}: Slurm job {self.job_id} ended {self.state} "
                         f"(exit {self.exit_code}) without a result; its output ({self.output_path}):\n{tail}")


class SlurmSubmitter:
    """Trials as Slurm batch jobs, metric jobs on this machine's CPU workers."""

    def __init__(self, work_dir: str | Path, settings: SlurmSettings, metric_workers: int,
                 sandbox: Sandbox | None) -> None:   # None: a subclass submits metric jobs elsewhere
        self.work_dir = Path(work_dir).resolve()
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.settings, self.sandbox = settings, sandbox
        self._metrics = cf.ThreadPoolExecutor(max_workers=max(1, metric_workers), thread_name_prefix="metric")
        self.jobs: list[SlurmTrial] = []
        self._polled_at = -1e9

    def submit_trial(self, trial: Trial, on_progress: Callable[[str, int], None] | None) -> SlurmTrial:
        trial_file = self.work_dir / f"{trial.trial_id}.trial.json"
        result_file = self.work_dir / f"{trial.trial_id}.result.json"
        output = self.work_dir / f"{trial.trial_id}.slurm.out"
        script = self.work_dir / f"{trial.trial_id}.sbatch"
        result_file.unlink(missing_ok=True)   # a rerun must not read the last run's result
        trial_file.write_text(job_trial(trial).model_dump_json(indent=1))
        script.write_text(batch_script(trial, trial_file, result_file))
        args = ["sbatch", "--parsable", *sbatch_args(trial, self.settings, output), str(script)]
        try:
            # sbatch exports its environment to the job: only what a worker needs
            job_id = slurm_command(args, self.settings, environ=worker_environment()).stdout.strip().split(";")[0]
        except SlurmError as e:   # no Slurm reachable, a wrong partition or account: the plan cannot run
            raise EvalError(f"trial {trial.trial_id} could not be submitted to Slurm: {e}. Check SLURM_CONF "
                            "and the cluster file's slurm: section (partition, account)") from e
        (self.work_dir / f"{trial.trial_id}.job-id").write_text(job_id)
        handle = SlurmTrial(trial.trial_id, job_id, result_file, output)
        self.jobs.append(handle)
        return handle

    def submit_metric(self, job: MetricJob) -> cf.Future:
        return self._metrics.submit(run_metric_job, job, self.sandbox)

    def refresh(self, force: bool = False) -> None:
        """Ask Slurm about the jobs not yet ended: one batch, at most every poll_s."""
        pending = [j for j in self.jobs if not j.final()]
        if not pending or (not force and time.monotonic() - self._polled_at < self.settings.poll_s):
            return
        self._polled_at = time.monotonic()
        states = job_states([j.job_id for j in pending], self.settings)
        for job in pending:
            job.state, job.exit_code = states[job.job_id]

    def wait_first(self, handles: list[Any]) -> Any:
        """The first handle done: a trial's job (its Slurm state) or a metric job's future (a
        concurrent future, or one that wraps one, as a Prefect task run's does)."""
        futures = [f for h in handles if isinstance(f := getattr(h, "wrapped_future", h), cf.Future)]
        while True:
            self.refresh()
            for h in handles:   # the plan's order among those done
                if h.final() if isinstance(h, SlurmTrial) else _future_done(h):
                    return h
            # Until a metric job ends or it is time to ask Slurm again.
            wait_s = max(0.05, self.settings.poll_s - (time.monotonic() - self._polled_at))
            if futures:
                cf.wait(futures, timeout=wait_s, return_when=cf.FIRST_COMPLETED)
            else:
                time.sleep(wait_s)

    def cancel(self, timeout_s: float = 90.0) -> list[str]:
        """scancel every job not yet ended and wait until Slurm says they are (their processes
        gone, after Slurm's KillWait); returns the cancelled job ids."""
        self.refresh(force=True)
        live = [j for j in self.jobs if not j.final()]
        if not live:
            return []
        slurm_command(["scancel", *[j.job_id for j in live]], self.settings, check=False)
        deadline = time.monotonic() + timeout_s
        while any(not j.final() for j in live):
            if time.monotonic() > deadline:
                raise SlurmError(f"Slurm job(s) {[j.job_id for j in live if not j.final()]} still not ended "
                                 f"{timeout_s:.0f}s after scancel; check `squeue -j ...`")
            time.sleep(0.5)
            self.refresh(force=True)
        return [j.job_id for j in live]

    def close(self) -> None:
        try:
            self.cancel()   # nothing on a finished plan; everything outstanding on an interrupted one
        finally:
            self._metrics.shutdown(wait=True, cancel_futures=True)


def _future_done(handle: Any) -> bool:
    wrapped = getattr(handle, "wrapped_future", handle)
    return wrapped.done() if isinstance(wrapped, cf.Future) else handle.state.is_final()


# --- in the job: `python -m evalsuite.trial_job run trial.json result.json` -----------------------
# (evalsuite.trial_job, shared with the Kubernetes submitter; this module's old entry still works)


def run_job(trial_file: Path, result_file: Path) -> int:
    from evalsuite.trial_job import run_job as run

    return run(trial_file, result_file)


def main(argv: list[str] | None = None) -> int:
    from evalsuite.trial_job import main as entry

    return entry(argv, prog="python -m evalsuite.slurm_trials")


if __name__ == "__main__":
    sys.exit(main())
