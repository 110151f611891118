"""One executor for an evaluation plan, whatever runs the work.

`execute(plan, submitter)` is the only loop that runs a plan, for the command
line and for the Prefect flow alike (OpenCompass's lesson: the local path and
the distributed path are one code path). It

- prepares once: heavy backend modules are imported from this thread before any
  in-process trial starts (transformers' lazy module is not thread-safe to
  import twice at once);
- starts each slot's first trial, and whenever a trial ends, that slot's next
  one: one trial per slot at a time, in the plan's order;
- hands each finished trial's shards to metric jobs at once, so the slot moves
  on while its scores are computed on CPU (or, in the naive policy, holds the
  slot until they are done);
- records every trial's load and inference time and every metric job's time in
  the runtime history and saves it, so the next plan balances on what this run
  measured — under Prefect as on the command line.

Where the work runs is the submitter's business, a small interface of three
calls (`submit_trial`, `submit_metric`, `wait_first`):

- `LocalSubmitter` (here): a thread per slot and a CPU thread pool for metrics;
  each trial runs in that thread or in its own process with its slot's devices,
  as the trial's `isolation` says (`evalsuite.trials.execute_trial`); an in-thread
  trial reuses its slot thread's engine when that already holds the model;
- `tasks.eval_tasks.PrefectSubmitter`: the same calls as Prefect task runs
  (threads, Dask workers, or other machines), visible in the Prefect UI.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections.abc import Callable
from typing import Any, Protocol

from pydantic import BaseModel, Field

from evalsuite.coordinator import Plan
from evalsuite.history import RuntimeHistory
from evalsuite.metrics import MetricJob, ShardScore, aggregate_dataset, run_metric_job, score_path_for
from evalsuite.sandbox import Sandbox, SandboxLimits
from evalsuite.trials import EngineCache, ShardSpec, SlotProcesses, Trial, TrialResult, execute_trial

Event = Callable[[str, dict[str, Any]], None]


class TrialOutcome(BaseModel):
    trial_id: str
    slot: str
    predicted_s: float
    actual_s: float | None = None
    predicted_metric_s: float
    actual_metric_s: float = 0.0
    result: TrialResult | None = None
    error: str | None = None


class RunReport(BaseModel):
    makespan_s: float
    predicted_makespan_s: float
    outcomes: list[TrialOutcome]
    results: dict[str, dict[str, float]]       # dataset -> metric -> value
    failed_datasets: dict[str, str] = Field(default_factory=dict)
    warnings: list[str] = Field(default_factory=list)   # e.g. a sandbox without OS isolation
    history_used: list[str] = Field(default_factory=list)  # datasets whose predictions came from history

    def format(self) -> str:
        lines = [f"evaluation done in {self.makespan_s:.1f}s (predicted {self.predicted_makespan_s:.1f}s)",
                 f"  {'trial':<40} {'slot':<8} {'pred':>7} {'actual':>7} {'metric pred':>11} {'actual':>7}"]
        for o in self.outcomes:
            actual = f"{o.actual_s:7.1f}" if o.actual_s is not None else "  fail "
            lines.append(f"  {o.trial_id:<40} {o.slot:<8} {o.predicted_s:7.1f} {actual} "
                         f"{o.predicted_metric_s:11.1f} {o.actual_metric_s:7.1f}")
        for name, metrics in sorted(self.results.items()):
            shown = ", ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items()))
            lines.append(f"  {name}: {shown}")
        for name, why in sorted(self.failed_datasets.items()):
            lines.append(f"  {name}: FAILED ({why})")
        for warning in self.warnings:
            lines.append(f"  WARNING: {warning}")
        return "\n".join(lines)


class Submitter(Protocol):
    """Where trials and metric jobs run. Handles are whatever the submitter returns."""

    def submit_trial(self, trial: Trial, on_progress: Callable[[str, int], None] | None) -> Any: ...

    def submit_metric(self, job: MetricJob) -> Any: ...

    def wait_first(self, handles: list[Any]) -> Any:
        """Block until one of `handles` is done; return it (its result() then raises or returns)."""


class LocalSubmitter:
    """A thread per slot for trials (each in-thread or in its own process), a thread pool for metrics."""

    def __init__(self, slots: int, metric_workers: int, sandbox: Sandbox) -> None:
        self.sandbox = sandbox
        self._trials = cf.ThreadPoolExecutor(max_workers=max(1, slots), thread_name_prefix="slot")
        self._metrics = cf.ThreadPoolExecutor(max_workers=max(1, metric_workers), thread_name_prefix="metric")
        self.engines = EngineCache()   # in-thread trials: one engine per slot thread, reused across trials
        self.processes = SlotProcesses()   # process-isolated trials: one long-lived process per slot

    def submit_trial(self, trial: Trial, on_progress: Callable[[str, int], None] | None) -> cf.Future:
        return self._trials.submit(execute_trial, trial, on_progress, self.engines, self.processes)

    def submit_metric(self, job: MetricJob) -> cf.Future:
        return self._metrics.submit(run_metric_job, job, self.sandbox)

    def wait_first(self, handles: list[cf.Future]) -> cf.Future:
        done, _ = cf.wait(handles, return_when=cf.FIRST_COMPLETED)
        return next(h for h in handles if h in done)   # the plan's order among those done

    def close(self) -> None:
        self._trials.shutdown(wait=True)
        self._metrics.shutdown(wait=True)
        self.engines.close()
        self.processes.close()


def prepare(plan: Plan) -> None:
    """Set-up every executor shares: import in-process backends once, from this thread."""
    from evalsuite.backends import backend_class

    for name in {t.backend for t in plan.trials if t.isolation == "thread"}:
        try:
            backend_class(name).import_dependencies()
        except ImportError:
            pass  # reported per trial, where it fails


def execute(plan: Plan, submitter: Submitter, *, history: RuntimeHistory | None = None,
            sandbox_limits: SandboxLimits | None = None, on_event: Event | None = None) -> RunReport:
    """Run `plan` through `submitter`: one trial per slot at a time, metric jobs as outputs land."""
    emit = on_event or (lambda kind, info: None)
    limits = sandbox_limits or SandboxLimits()
    model_key = plan.model_key
    outcomes = {t.trial_id: TrialOutcome(trial_id=t.trial_id, slot=slot, predicted_s=t.predicted_slot_s,
                                         predicted_metric_s=t.predicted_metric_s)
                for slot, ids in plan.assignment.items() for t in map(plan.trial, ids)}
    queues = {slot: [plan.trial(t) for t in ids] for slot, ids in plan.assignment.items()}
    scores: dict[str, list[ShardScore]] = {}
    failures: dict[str, str] = {}
    warnings: set[str] = set()
    held: dict[str, int] = {}             # slot -> its metric jobs still running (naive policy)
    running: dict[Any, tuple] = {}        # handle -> ("trial", slot, trial) | ("metric", slot, trial, shard)

    def progress(trial_id: str, n: int) -> None:
        emit("progress", {"trial": trial_id, "n": n})

    def start_next(slot: str) -> None:
        if queues[slot] and not held.get(slot):
            trial = queues[slot].pop(0)
            emit("trial_started", {"trial": trial.trial_id, "slot": slot})
            running[submitter.submit_trial(trial, progress)] = ("trial", slot, trial)

    prepare(plan)
    emit("plan", {"trials": len(plan.trials), "shards": sum(len(t.shards) for t in plan.trials)})
    started = time.perf_counter()
    last_done = started
    for slot in plan.slots:
        start_next(slot)
    while running:
        handle = submitter.wait_first(list(running))
        kind, slot, trial, *rest = running.pop(handle)
        last_done = time.perf_counter()
        if kind == "trial":
            try:
                result = handle.result()
            except Exception as e:
                outcomes[trial.trial_id].error = str(e)
                for s in trial.shards:
                    failures[s.dataset.name] = f"inference: {e}"
                emit("trial_failed", {"trial": trial.trial_id, "slot": slot, "error": str(e)})
                start_next(slot)
                continue
            outcome = outcomes[trial.trial_id]
            outcome.result, outcome.actual_s = result, result.total_s
            _record_trial(history, trial, result, model_key)
            emit("trial_done", {"trial": trial.trial_id, "slot": slot, "seconds": result.total_s})
            for shard in trial.shards:
                job = metric_job_for(trial, shard, limits)
                running[submitter.submit_metric(job)] = ("metric", slot, trial, shard)
            if plan.metrics_in_slot:
                held[slot] = len(trial.shards)   # the naive way: the slot waits for its metrics
            start_next(slot)
        else:
            (shard,) = rest
            try:
                score = handle.result()
            except Exception as e:
                failures[shard.dataset.name] = f"metric: {type(e).__name__}: {e}"
                emit("metric_failed", {"trial": trial.trial_id, "dataset": shard.dataset.name, "error": str(e)})
            else:
                scores.setdefault(shard.dataset.name, []).append(score)
                outcomes[trial.trial_id].actual_metric_s += score.elapsed_s
                warnings.update(score.warnings)
                if history:
                    history.record_metric(shard.dataset.name, trial.backend, model_key, shard.samples,
                                          score.elapsed_s)
                emit("metric_done", {"trial": trial.trial_id, "dataset": shard.dataset.name, "shard": shard.shard})
            if slot in held:
                held[slot] -= 1
                if held[slot] == 0:
                    del held[slot]
                    start_next(slot)
    results = aggregate_results(plan, scores, failures)
    if history:
        history.save()
    return RunReport(makespan_s=last_done - started, predicted_makespan_s=plan.predicted_makespan,
                     outcomes=list(outcomes.values()), results=results, failed_datasets=failures,
                     warnings=sorted(warnings), history_used=list(plan.history_used))


def _record_trial(history: RuntimeHistory | None, trial: Trial, result: TrialResult, model_key: str) -> None:
    if not history:
        return
    if result.load_s:
        history.record_load(trial.backend, model_key, result.load_s, source="shm" if trial.model_path else "storage")
    for timing in result.shards:
        if not timing.skipped:
            history.record_inference(timing.dataset, trial.backend, model_key, timing.samples, timing.seconds)


def metric_job_for(trial: Trial, shard: ShardSpec, limits: SandboxLimits | None = None) -> MetricJob:
    return MetricJob(dataset=shard.dataset, shard=shard.shard, output_path=str(shard.output_path(trial.output_dir)),
                     score_path=str(score_path_for(trial.output_dir, shard.dataset.name, shard.shard)),
                     sandbox=limits or SandboxLimits())


def aggregate_results(plan: Plan, scores: dict[str, list[ShardScore]],
                      failures: dict[str, str]) -> dict[str, dict[str, float]]:
    """Dataset-level metrics from shard scores; a dataset with a failed or missing shard has none."""
    results = {}
    for name, shard_scores in scores.items():
        if name in failures:
            continue
        shards = [s for t in plan.trials for s in t.shards if s.dataset.name == name]
        if len({sc.shard for sc in shard_scores}) == len(shards):
            results[name] = aggregate_dataset(shards[0].dataset.resolve(), shard_scores)
        else:
            failures[name] = f"only {len(shard_scores)} of {len(shards)} shard(s) scored"
    return results
