"""Evaluate checkpoints as they are committed: the decoupled evaluation runbook.

    checkpoint committed (event) ─┐
    every 15 min: catch up ───────┴→ evaluate-checkpoint:
        export to Hugging Face format (once)
        preload it into this node's shared memory (once per node)
        plan: split/batch datasets into trials, balance them over the slots
        run inference trials, one chain per slot; as each trial's outputs land,
          its metric jobs start on CPU workers while the slot moves on
        remove the preload (also when something failed)
        publish: results JSON next to the checkpoint, table artifact, progress plot

Serve both deployments without a work pool:   python flows/evaluate.py serve
Evaluate one checkpoint now:                  python flows/evaluate.py CHECKPOINT [SUITE] [JOB.yaml]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.futures import as_completed
from prefect.task_runners import ThreadPoolTaskRunner

from evalsuite.coordinator import RunReport, TrialOutcome, aggregate_results, metric_job_for
from evalsuite.reporting import has_results
from evalsuite.runner import results_payload
from evalsuite.suite import load_suite
from tasks.eval_tasks import (export_checkpoint, inference_trial, metric_job, plan_trials, preload_model,
                              publish_results, remove_preloaded)
from checkpoint.manifest import committed_checkpoints
from tasks.checkpoint_events import CHECKPOINT_COMMITTED
from training.config import JobSpec, load_job_spec

def _spec(job_spec: str | JobSpec | None) -> JobSpec | None:
    return load_job_spec(job_spec) if isinstance(job_spec, str) and job_spec else (job_spec or None)


@flow(name="evaluate-checkpoint", log_prints=True, task_runner=ThreadPoolTaskRunner(max_workers=16))
def evaluate_checkpoint(checkpoint: str, suite: str = "quick", job_spec: str | JobSpec | None = None,
                        output_dir: str | None = None, preload_root: str | None = None) -> dict[str, Any]:
    spec = _spec(job_spec)
    suite_config = load_suite(suite, spec, {"preload_root": preload_root} if preload_root else None)
    name = checkpoint.rstrip("/").rsplit("/", 1)[-1]
    out = Path(output_dir or Path("runs") / "eval" / f"{name}-{suite_config.name}")
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    # 1. One HF folder per checkpoint, then one copy of it in this node's shared memory.
    source = export_checkpoint(checkpoint, spec, str(out))
    local = preload_model(source, suite_config.preload_root)
    try:
        # 2. Trials balanced over slots with predicted times from the runtime history.
        plan = plan_trials(suite_config, local, source, str(out))
        # 3. One chain of trials per slot; metric jobs start as soon as a trial's outputs exist.
        queues = {slot: [plan.trial(t) for t in ids] for slot, ids in plan.assignment.items()}
        running = {}  # future -> (slot, trial)

        def start_next(slot: str) -> None:
            if queues[slot]:
                trial = queues[slot].pop(0)
                running[inference_trial.submit(trial)] = (slot, trial)

        for slot in queues:
            start_next(slot)
        metric_futures, outcomes = [], {}
        while running:
            done = next(as_completed(list(running)))
            slot, trial = running.pop(done)
            outcome = TrialOutcome(trial_id=trial.trial_id, slot=slot, predicted_s=trial.predicted_slot_s,
                                   predicted_metric_s=trial.predicted_metric_s)
            try:
                outcome.result = done.result()
                outcome.actual_s = outcome.result.total_s
                for shard in trial.shards:
                    metric_futures.append(
                        (shard, metric_job.submit(metric_job_for(trial, shard, suite_config.sandbox))))
            except Exception as e:  # the slot moves on; the dataset is reported failed
                outcome.error = str(e)
            outcomes[trial.trial_id] = outcome
            start_next(slot)
        # 4. Gather scores (metric jobs of failed trials never started).
        scores, failures = {}, {}
        for shard, future in metric_futures:
            try:
                scores.setdefault(shard.dataset.name, []).append(future.result())
            except Exception as e:
                failures[shard.dataset.name] = f"metric: {e}"
        for o in outcomes.values():
            if o.error:
                for s in plan.trial(o.trial_id).shards:
                    failures[s.dataset.name] = f"inference: {o.error}"
        results = aggregate_results(plan, scores, failures)
    finally:
        remove_preloaded(source, suite_config.preload_root)

    report = RunReport(makespan_s=time.perf_counter() - started, predicted_makespan_s=plan.predicted_makespan,
                       outcomes=list(outcomes.values()), results=results, failed_datasets=failures)
    print(report.format())
    payload = results_payload(report, suite_config, source)
    published = publish_results(checkpoint, suite_config.name, payload, str(out))
    return {**payload, **published}


def pending_checkpoints(checkpoints: list[str], suite_name: str) -> list[str]:
    return [c for c in checkpoints if not has_results(c, suite_name)]


@flow(name="evaluate-catch-up", log_prints=True)
def evaluate_catch_up(job_spec: str | JobSpec, suite: str = "quick", limit: int | None = None) -> list[str]:
    """Evaluate committed checkpoints that have no results yet (missed events, downtime)."""
    spec = _spec(job_spec)
    suite_name = load_suite(suite, spec).name
    todo = pending_checkpoints([r.url for r in committed_checkpoints(spec.checkpoint)], suite_name)[:limit]
    print(f"{len(todo)} checkpoint(s) of {spec.name} not yet evaluated with {suite_name}")
    for checkpoint in todo:
        evaluate_checkpoint(checkpoint, suite=suite, job_spec=spec)
    return todo


def evaluate_committed(spec: JobSpec, suite: str = "demo") -> list[str]:
    """`make demo`: evaluate the demo job's checkpoints at the end."""
    return evaluate_catch_up(spec, suite=suite)


def build_deployments(job_spec: str = "configs/tiny-cpu.yaml", suite: str = "quick") -> list:
    """The two deployments: on each checkpoint-committed event, and a catch-up every 15 minutes."""
    from prefect.events import DeploymentEventTrigger

    triggered = evaluate_checkpoint.to_deployment(
        name="on-commit", parameters={"suite": suite},
        triggers=[DeploymentEventTrigger(
            expect={CHECKPOINT_COMMITTED}, match={"prefect.resource.id": "forgeflow.checkpoint.*"},
            parameters={"checkpoint": "{{ event.resource['forgeflow.checkpoint.url'] }}",
                        "job_spec": "{{ event.resource['forgeflow.job_spec'] }}"})])
    catch_up = evaluate_catch_up.to_deployment(
        name="catch-up", interval=900, parameters={"job_spec": job_spec, "suite": suite})
    return [triggered, catch_up]


def serve_deployments() -> None:
    """Serve both deployments from this process (no work pool needed)."""
    from prefect import serve

    serve(*build_deployments())


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        serve_deployments()
    elif len(sys.argv) > 1:
        print(evaluate_checkpoint(sys.argv[1], *(sys.argv[2:4])))
    else:
        print(__doc__)
