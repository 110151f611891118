"""The trial coordinator: decompose a suite into trials, balance them over slots, run them.

Acme's three ideas, in order:

1. **Decompose with priors.** Every dataset's inference and metric cost is
   estimated from the runtime history (or sample count × a per-dataset factor).
   Datasets much shorter than a target trial length are batched into one trial
   (one model load serves them all); long ones are split into equal shards so
   no single dataset sets the makespan.
2. **Balance.** Trials are sorted longest first — by inference plus metric
   time, so trials whose CPU metric phase is long start early and that phase
   overlaps the remaining inference — and dealt round-robin over the sorted
   queue to the slot that frees up first (longest-processing-time list
   scheduling).
3. **Decouple.** A slot runs only model load + inference; as soon as a trial's
   shard files are complete its metric jobs go to a CPU pool and the slot moves
   on. The model comes from the node's preload in shared memory.

`Policy` switches each idea off, which gives the naive baseline the benchmark
compares against (one trial per dataset, model loaded from storage per trial,
metrics in the slot, first in first out).

The plan is printed before running (slots × trials with predicted times) and
the report after (predicted vs actual); the history is updated from the actuals.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from evalsuite.datasets import DatasetRef, EvalDataset
from evalsuite.history import RuntimeHistory
from evalsuite.metrics import MetricJob, ShardScore, aggregate_dataset, run_metric_job, score_path_for
from evalsuite.sandbox import Sandbox, SandboxLimits
from evalsuite.trials import ShardSpec, Trial, TrialResult, run_trial, run_trial_in_process


class Policy(BaseModel):
    batch_small: bool = True
    split_large: bool = True
    preload: bool = True
    metrics_in_slot: bool = False
    order: Literal["lpt", "fifo"] = "lpt"

    @classmethod
    def naive(cls) -> "Policy":
        return cls(batch_small=False, split_large=False, preload=False, metrics_in_slot=True, order="fifo")


@dataclass(frozen=True)
class DatasetCost:
    """What decomposition needs to know about one dataset."""

    ref: DatasetRef
    samples: int
    gpu_s: float        # predicted inference seconds for all samples
    metric_s: float     # predicted CPU metric seconds for all samples


def estimate_costs(datasets: list[tuple[DatasetRef, EvalDataset]], history: RuntimeHistory,
                   backend: str, model_key: str) -> list[DatasetCost]:
    out = []
    for ref, ds in datasets:
        n = ds.num_samples()
        out.append(DatasetCost(ref, n, history.gpu_s(ds, backend, model_key, n),
                               history.metric_s(ds, backend, model_key, n)))
    return out


def decompose(costs: list[DatasetCost], *, slots: int, backend: str, output_dir: str, load_s: float,
              policy: Policy | None = None, target_trial_s: float | None = None,
              backend_options: dict | None = None, trials_per_slot: int = 3) -> list[Trial]:
    """Datasets → trials: split the long, batch the short (each as the policy allows)."""
    policy = policy or Policy()
    total = sum(c.gpu_s for c in costs)
    # A few trials per slot leave the balancer room to even slots out; never aim below the
    # load time, or loads would dominate.
    target = target_trial_s or max(total / (trials_per_slot * slots), load_s, 1e-9)
    pieces: list[list[ShardSpec]] = []
    small: list[ShardSpec] = []
    for c in costs:
        k = 1
        # A long metric phase is split too: its shards are scored in parallel on the CPU pool.
        longest = max(c.gpu_s, c.metric_s)
        if policy.split_large and longest > target:
            k = min(c.samples, math.ceil(longest / target))
        bounds = [round(i * c.samples / k) for i in range(k + 1)]
        shards = [ShardSpec(dataset=c.ref, shard=i, start=bounds[i], stop=bounds[i + 1],
                            predicted_gpu_s=c.gpu_s * (bounds[i + 1] - bounds[i]) / max(1, c.samples),
                            predicted_metric_s=c.metric_s * (bounds[i + 1] - bounds[i]) / max(1, c.samples))
                  for i in range(k)]
        if policy.batch_small and k == 1 and longest < target / 2:
            small.extend(shards)
        else:
            pieces.extend([s] for s in shards)
    # First-fit decreasing of the short datasets into trials of about `target`.
    bins: list[list[ShardSpec]] = []
    for s in sorted(small, key=lambda s: -s.predicted_gpu_s):
        for b in bins:
            if sum(x.predicted_gpu_s for x in b) + s.predicted_gpu_s <= target:
                b.append(s)
                break
        else:
            bins.append([s])
    samples_of = {c.ref.name: c.samples for c in costs}
    trials = []
    for i, shards in enumerate(pieces + bins):
        label = "+".join(sorted({s.dataset.name for s in shards}))[:48]
        if len(shards) == 1 and shards[0].samples < samples_of[shards[0].dataset.name]:
            label += f"#{shards[0].shard}"  # one shard of a split dataset
        trials.append(Trial(
            trial_id=f"t{i:03d}-{label}", shards=shards, backend=backend,
            backend_options=dict(backend_options or {}), output_dir=output_dir, predicted_load_s=load_s,
            predicted_gpu_s=sum(s.predicted_gpu_s for s in shards),
            predicted_metric_s=sum(s.predicted_metric_s for s in shards)))
    return trials


class Plan(BaseModel):
    slots: list[str]
    trials: list[Trial]
    assignment: dict[str, list[str]]          # slot -> trial ids, in run order
    predicted_start: dict[str, float]
    predicted_end: dict[str, float]           # end of inference (the slot is free again)
    metrics_in_slot: bool = False

    def trial(self, trial_id: str) -> Trial:
        return next(t for t in self.trials if t.trial_id == trial_id)

    @property
    def predicted_makespan(self) -> float:
        ends = [self.predicted_end[t.trial_id] + (0 if self.metrics_in_slot else t.predicted_metric_s)
                for t in self.trials]
        return max(ends, default=0.0)


def assign(trials: list[Trial], slots: list[str], policy: Policy | None = None) -> Plan:
    """Deal trials to slots: sorted queue (LPT) or arrival order (FIFO), next free slot takes next."""
    policy = policy or Policy()
    inline = policy.metrics_in_slot

    def slot_time(t: Trial) -> float:
        return t.predicted_slot_s + (t.predicted_metric_s if inline else 0.0)

    queue = list(trials)
    if policy.order == "lpt":
        # Long metric phases first (they overlap later inference), then longest inference.
        queue.sort(key=lambda t: (-(t.predicted_slot_s + t.predicted_metric_s), t.trial_id))
    free_at = {s: 0.0 for s in slots}
    assignment: dict[str, list[str]] = {s: [] for s in slots}
    start, end = {}, {}
    for t in queue:
        slot = min(slots, key=lambda s: (free_at[s], slots.index(s)))
        start[t.trial_id] = free_at[slot]
        free_at[slot] += slot_time(t)
        end[t.trial_id] = free_at[slot]
        assignment[slot].append(t.trial_id)
    return Plan(slots=list(slots), trials=queue, assignment=assignment, predicted_start=start,
                predicted_end=end, metrics_in_slot=inline)


def format_plan(plan: Plan) -> str:
    lines = [f"evaluation plan: {len(plan.trials)} trial(s) on {len(plan.slots)} slot(s), "
             f"predicted makespan {plan.predicted_makespan:.1f}s"]
    for slot in plan.slots:
        lines.append(f"  {slot}:")
        for tid in plan.assignment[slot]:
            t = plan.trial(tid)
            shards = ", ".join(f"{s.dataset.name}[{s.start}:{s.stop}]" for s in t.shards)
            lines.append(f"    {tid:<40} load {t.predicted_load_s:6.1f}s  infer {t.predicted_gpu_s:7.1f}s  "
                         f"metric {t.predicted_metric_s:6.1f}s  ({shards})")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- running

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
        return "\n".join(lines)


Event = Callable[[str, dict[str, Any]], None]


def execute(plan: Plan, *, history: RuntimeHistory | None = None, model_key: str = "unknown",
            isolation: Literal["thread", "process"] = "thread", metric_workers: int | None = None,
            sandbox: Sandbox | None = None, sandbox_limits: SandboxLimits | None = None,
            on_event: Event | None = None) -> RunReport:
    """Run a plan: one thread per slot runs its trials in order; metric jobs go to a CPU pool."""
    emit = on_event or (lambda kind, info: None)
    sandbox = sandbox or Sandbox(sandbox_limits)
    workers = metric_workers or sandbox.concurrency
    outcomes = {t.trial_id: TrialOutcome(trial_id=t.trial_id, slot=slot, predicted_s=t.predicted_slot_s,
                                         predicted_metric_s=t.predicted_metric_s)
                for slot, ids in plan.assignment.items() for t in map(plan.trial, ids)}
    scores: dict[str, list[ShardScore]] = {}
    failures: dict[str, str] = {}
    lock = threading.Lock()
    started = time.perf_counter()
    last_done = [started]

    def score(trial: Trial, shard: ShardSpec) -> None:
        job = metric_job_for(trial, shard, sandbox.limits)
        try:
            result = run_metric_job(job, sandbox)
        except Exception as e:
            with lock:
                failures[shard.dataset.name] = f"metric: {type(e).__name__}: {e}"
            emit("metric_failed", {"trial": trial.trial_id, "dataset": shard.dataset.name, "error": str(e)})
            return
        with lock:
            scores.setdefault(shard.dataset.name, []).append(result)
            outcomes[trial.trial_id].actual_metric_s += result.elapsed_s
            last_done[0] = max(last_done[0], time.perf_counter())
            if history:
                history.record_metric(shard.dataset.name, trial.backend, model_key, shard.samples, result.elapsed_s)
        emit("metric_done", {"trial": trial.trial_id, "dataset": shard.dataset.name, "shard": shard.shard})

    if isolation == "thread":
        from evalsuite.backends import backend_class

        for name in {t.backend for t in plan.trials}:
            try:
                backend_class(name).import_dependencies()
            except ImportError:
                pass  # reported per trial, where it fails
    emit("plan", {"trials": len(plan.trials), "shards": sum(len(t.shards) for t in plan.trials)})
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="metric")
    pending: list[Future] = []

    def run_slot(slot: str) -> None:
        for trial_id in plan.assignment[slot]:
            trial = plan.trial(trial_id)
            emit("trial_started", {"trial": trial_id, "slot": slot})
            t0 = time.perf_counter()
            try:
                if isolation == "process":
                    result = run_trial_in_process(trial)
                else:
                    result = run_trial(trial, on_progress=lambda tid, n: emit("progress", {"trial": tid, "n": n}))
            except Exception as e:
                with lock:
                    outcomes[trial_id].error = str(e)
                    for s in trial.shards:
                        failures[s.dataset.name] = f"inference: {e}"
                emit("trial_failed", {"trial": trial_id, "error": str(e)})
                continue
            outcome = outcomes[trial_id]
            outcome.result, outcome.actual_s = result, time.perf_counter() - t0
            with lock:
                last_done[0] = max(last_done[0], time.perf_counter())
            if history:
                if result.load_s:
                    history.record_load(trial.backend, model_key, result.load_s,
                                        source="shm" if trial.model_path else "storage")
                for timing in result.shards:
                    if not timing.skipped:
                        history.record_inference(timing.dataset, trial.backend, model_key,
                                                 timing.samples, timing.seconds)
            emit("trial_done", {"trial": trial_id, "slot": slot, "seconds": outcome.actual_s})
            for shard in trial.shards:
                if plan.metrics_in_slot:
                    score(trial, shard)       # the naive way: the slot waits for its metrics
                else:
                    pending.append(pool.submit(score, trial, shard))

    threads = [threading.Thread(target=run_slot, args=(s,), name=f"slot-{s}") for s in plan.slots]
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        for f in pending:
            f.result()
    finally:
        pool.shutdown(wait=True)
    results = aggregate_results(plan, scores, failures)
    if history:
        history.save()
    return RunReport(makespan_s=last_done[0] - started, predicted_makespan_s=plan.predicted_makespan,
                     outcomes=list(outcomes.values()), results=results, failed_datasets=failures)


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


def slot_names(count: int, devices: list[str] | None = None) -> list[str]:
    if devices and len(devices) != count:
        raise ValueError(f"{len(devices)} devices given for {count} slots; give one per slot")
    return [f"slot{i}" for i in range(count)]
