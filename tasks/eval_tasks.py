"""Prefect tasks of the evaluate-checkpoint flow: thin wrappers over evalsuite/.

Every argument and result is a serialisable value (strings, pydantic models), so
the same tasks run in threads (ThreadPoolTaskRunner), in Dask worker processes
(prefect-dask's DaskTaskRunner) or on other machines.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from evalsuite.coordinator import Plan, format_plan
from evalsuite.suite import SuiteConfig
from evalsuite.metrics import MetricJob, ShardScore, run_metric_job
from evalsuite.sandbox import Sandbox, SandboxLimits
from evalsuite.trials import Trial, TrialResult, run_trial
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
def plan_trials(suite: SuiteConfig, model_path: str, model_source: str, output_dir: str) -> Plan:
    """Decompose and balance the suite with the runtime history's predictions; log the plan."""
    from evalsuite.history import RuntimeHistory
    from evalsuite.runner import build_plan

    plan = build_plan(suite, model_path=model_path, output_dir=output_dir, history=RuntimeHistory(),
                      model_source=model_source, preloaded_path=model_path)
    get_run_logger().info("%s", format_plan(plan))
    return plan


@task(name="inference-trial", cache_policy=NO_CACHE, task_run_name="trial {trial.trial_id}")
def inference_trial(trial: Trial) -> TrialResult:
    """Model load + inference over the trial's shards; complete shards are skipped (resume)."""
    return run_trial(trial)


@task(name="metric-job", cache_policy=NO_CACHE, task_run_name="metric {job.dataset.name}#{job.shard}")
def metric_job(job: MetricJob) -> ShardScore:
    return run_metric_job(job, _shared_sandbox(job.sandbox))


@task(name="publish-results", cache_policy=NO_CACHE)
def publish_results(checkpoint: str, suite_name: str, payload: dict[str, Any], output_dir: str) -> dict[str, str]:
    """Results JSON next to the checkpoint, a table artifact, and the progress plot."""
    from evalsuite.reporting import (load_all_results, plot_progress, results_table, split_checkpoint_url,
                                     write_results_next_to)

    url = write_results_next_to(checkpoint, suite_name, payload)
    root, name = split_checkpoint_url(checkpoint)
    slug = "".join(c if c.isalnum() else "-" for c in f"eval-{name}-{suite_name}".lower()).strip("-")
    create_table_artifact(key=slug[:100], table=results_table(payload["results"]),
                          description=f"{suite_name} on {checkpoint} (makespan {payload['makespan_s']:.1f}s)")
    png = plot_progress(load_all_results(root, suite_name), Path(output_dir) / f"progress-{suite_name}.png")
    return {"results_url": url, "plot": str(png) if png else ""}
