"""Prefect tasks of the evaluate-checkpoint flow: thin wrappers over evalsuite/.

Every argument and result is a serialisable value (strings, pydantic models), so
the same tasks run in threads (ThreadPoolTaskRunner), in Dask worker processes
(prefect-dask's DaskTaskRunner) or on other machines.

`PrefectSubmitter` is how the flow runs a plan: evalsuite's one executor
(`evalsuite.executor.execute`) calls it to submit trials and metric jobs as task
runs, so the flow records runtime history and shares its set-up with the CLI.
A trial task runs its trial the way the suite's isolation says: in the task's
thread, or in its own process that sees only its slot's devices.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.futures import PrefectFuture, as_completed

from evalsuite.coordinator import Plan, format_plan
from evalsuite.suite import SuiteConfig
from evalsuite.metrics import MetricJob, ShardScore, run_metric_job
from evalsuite.sandbox import Sandbox, SandboxLimits
from evalsuite.trials import Trial, TrialResult, execute_trial
from training.config import JobSpec

_sandboxes: dict[str, Sandbox] = {}
_sandbox_lock = threading.Lock()


def _shared_sandbox(limits: SandboxLimits) -> Sandbox:
    # Metric tasks in one worker process share one sandbox: one program per reserved core.
    key = limits.model_dump_json()
    with _sandbox_lock:
        if key not in _sandboxes:
            _sandboxes[key] = Sandbox(limits)
        return _sandboxes[key]


@task(name="export-checkpoint", cache_policy=NO_CACHE, retries=1)
def export_checkpoint(checkpoint: str, spec: JobSpec | None, work_dir: str) -> str:
    """An HF folder for the checkpoint (exported once if it is a training checkpoint)."""
    from evalsuite.checkpoints import model_source_for

    return model_source_for(checkpoint, spec, work_dir)


@task(name="preload-model", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5)
def preload_model(source: str, root: str | None) -> str:
    """Precursor job: storage → node-local shared memory, once per node."""
    from evalsuite.preload import preload

    return str(preload(source, root))


@task(name="remove-preload", cache_policy=NO_CACHE)
def remove_preloaded(source: str, root: str | None) -> None:
    from evalsuite.preload import remove_preload

    remove_preload(source, root)


@task(name="plan-trials", cache_policy=NO_CACHE)
def plan_trials(suite: SuiteConfig, model_path: str, model_source: str, output_dir: str,
                history_path: str | None = None) -> Plan:
    """Decompose and balance the suite with the runtime history's predictions; log the plan."""
    from evalsuite.history import RuntimeHistory
    from evalsuite.runner import build_plan

    plan = build_plan(suite, model_path=model_path, output_dir=output_dir, history=RuntimeHistory(history_path),
                      model_source=model_source, preloaded_path=model_path)
    get_run_logger().info("%s", format_plan(plan))
    return plan


@task(name="inference-trial", cache_policy=NO_CACHE, task_run_name="trial {trial.trial_id}")
def inference_trial(trial: Trial) -> TrialResult:
    """Model load + inference over the trial's shards (in this thread or its own process with
    its slot's devices); complete shards are skipped (resume)."""
    return execute_trial(trial)


@task(name="metric-job", cache_policy=NO_CACHE, task_run_name="metric {job.dataset.name}#{job.shard}")
def metric_job(job: MetricJob) -> ShardScore:
    return run_metric_job(job, _shared_sandbox(job.sandbox))


# ----------------------------------------------------------------------------- jobs to evaluate

EVAL_JOBS_VARIABLE = "forgeflow_eval_jobs"   # a Prefect Variable: job name -> {suite, spec}


def register_for_evaluation(spec: JobSpec, suite: str) -> None:
    """Remember that `spec`'s checkpoints are evaluated with `suite`: the catch-up's list of jobs.

    A Prefect Variable, so every worker of the deployment sees it; the spec is stored
    whole (not a path, which another machine may not have)."""
    from prefect.variables import Variable

    jobs = dict(Variable.get(EVAL_JOBS_VARIABLE, default={}) or {})
    entry = {"suite": suite, "spec": spec.model_dump(mode="json")}
    if jobs.get(spec.name) != entry:
        jobs[spec.name] = entry
        Variable.set(EVAL_JOBS_VARIABLE, jobs, overwrite=True)


def jobs_for_evaluation() -> tuple[list[tuple[JobSpec, str]], dict[str, str]]:
    """(spec, suite) of every registered job, and the entries that are not valid (name -> why)."""
    from prefect.variables import Variable

    from training.config import ConfigError, parse_job_spec

    jobs, bad = [], {}
    for name, entry in sorted((Variable.get(EVAL_JOBS_VARIABLE, default={}) or {}).items()):
        try:
            jobs.append((parse_job_spec(entry["spec"], source=f"Variable {EVAL_JOBS_VARIABLE}[{name}]"),
                         str(entry.get("suite") or "quick")))
        except (ConfigError, KeyError, TypeError) as e:
            bad[name] = (f"{type(e).__name__}: {e}; re-register it by evaluating one of its checkpoints "
                         f"with job_spec set, or delete the entry from the Variable {EVAL_JOBS_VARIABLE!r}")
    return jobs, bad


# ----------------------------------------------------------------------------- executor

class PrefectSubmitter:
    """The executor's trials and metric jobs as task runs of the flow's task runner."""

    def submit_trial(self, trial: Trial, on_progress: Callable[[str, int], None] | None) -> PrefectFuture:
        return inference_trial.submit(trial)

    def submit_metric(self, job: MetricJob) -> PrefectFuture:
        return metric_job.submit(job)

    def wait_first(self, handles: list[PrefectFuture]) -> PrefectFuture:
        return next(as_completed(handles))


@task(name="publish-results", cache_policy=NO_CACHE)
def publish_results(checkpoint: str, suite_name: str, payload: dict[str, Any], output_dir: str,
                    job: str | None = None) -> dict[str, str]:
    """Results JSON next to the checkpoint; the job's scores per step (JSONL beside its checkpoints);
    artifacts: this checkpoint's table, and the trend (chart inline + table) over every step so far."""
    from prefect.artifacts import create_markdown_artifact

    from evalsuite.reporting import (results_table, split_checkpoint_url, trend_chart_png, trend_markdown,
                                     write_results_next_to, write_score_history)

    url = write_results_next_to(checkpoint, suite_name, payload)
    root, name = split_checkpoint_url(checkpoint)
    job = job or _job_of(root)
    create_table_artifact(key=_artifact_key(f"eval-{name}-{suite_name}"), table=results_table(payload["results"]),
                          description=f"{suite_name} on {checkpoint} (makespan {payload['makespan_s']:.1f}s)")
    scores_url, rows = write_score_history(root, suite_name)
    title = f"{job}: {suite_name} scores over training steps"
    create_markdown_artifact(key=_artifact_key(f"eval-trend-{job}-{suite_name}"), markdown=trend_markdown(rows, title),
                             description=f"{title} ({len({r['step'] for r in rows})} checkpoint(s); {scores_url})")
    png = trend_chart_png(rows, title)
    plot = Path(output_dir) / f"trend-{suite_name}.png"
    if png:
        plot.write_bytes(png)
    return {"results_url": url, "scores_url": scores_url, "plot": str(plot) if png else ""}


def _job_of(root: str) -> str:
    # Without a job spec, name the job after its checkpoint folder (".../JOB/checkpoints" -> JOB).
    parts = [p for p in root.rstrip("/").split("/") if p and p != "."]
    if parts and parts[-1] == "checkpoints" and len(parts) > 1:
        return parts[-2]
    return parts[-1] if parts else "job"


def _artifact_key(text: str) -> str:
    # Artifact keys: lowercase letters, digits and dashes.
    return "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-")[:100]
