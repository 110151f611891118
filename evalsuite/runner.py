"""Evaluate one exported checkpoint with a suite: preload → plan → trials → metrics → results.

This is the whole pipeline in one call for the command line and plain Python;
the Prefect flow (flows/evaluate.py) runs the same steps as separate tasks, with
the same `build_plan` and the same executor (`evalsuite.executor.execute`), only
a different submitter.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Literal

from evalsuite.coordinator import Plan, Policy, assign, decompose, estimate_costs, format_plan, slot_names
from evalsuite.executor import LocalSubmitter, RunReport, execute
from evalsuite.history import RuntimeHistory, model_size_key
from evalsuite.preload import preloaded
from evalsuite.sandbox import Sandbox
from evalsuite.suite import SuiteConfig
from infra.slurm import SlurmSettings


def build_plan(suite: SuiteConfig, *, model_path: str, output_dir: str | Path, history: RuntimeHistory,
               policy: Policy | None = None, model_source: str = "", preloaded_path: str = "",
               nodes: list[str] | None = None) -> Plan:
    """Trials for `suite`, balanced over its slots with predicted times from `history`.

    With `nodes`, every node contributes the suite's slots (same device sets on each):
    slot "NODE/slotK", and each trial carries the node that runs it."""
    policy = policy or Policy()
    model_key = model_size_key(model_path)
    datasets = [(ref, ref.resolve()) for ref in suite.refs()]
    costs = estimate_costs(datasets, history, suite.backend, model_key)
    per_node = slot_names(suite.slots)
    slots = [f"{n}/{s}" for n in nodes for s in per_node] if nodes else per_node
    trials = decompose(costs, slots=len(slots), backend=suite.backend, output_dir=str(output_dir),
                       load_s=history.load_s(suite.backend, model_key, source="shm" if policy.preload else "storage"),
                       policy=policy,
                       target_trial_s=suite.target_trial_s, backend_options=suite.backend_options,
                       batch_size=_batch_granularity(suite))
    plan = assign(trials, slots, policy)
    plan.devices = {slot: devices for slot, devices in zip(slots, suite.slot_devices() * max(1, len(nodes or [])))}
    plan.model_key = model_key
    plan.history_used = sorted({ds.name for _, ds in datasets if history.knows(ds.name, suite.backend, model_key)})
    slot_of = {tid: s for s, ids in plan.assignment.items() for tid in ids}
    for t in plan.trials:
        t.model_path = preloaded_path if policy.preload else ""
        t.model_source = model_source
        t.devices = list(plan.devices[slot_of[t.trial_id]])
        t.isolation = suite.isolation
        t.node = slot_of[t.trial_id].split("/", 1)[0] if nodes else ""
    return plan


def _batch_granularity(suite: SuiteConfig) -> int:
    from evalsuite.backends import backend_class, parse_backend_options
    from evalsuite.errors import EvalError

    try:
        return backend_class(suite.backend).batch_granularity(parse_backend_options(suite.backend_options))
    except EvalError:
        return 1   # an unknown backend or bad options: reported where the trial loads it


def evaluate(model_source: str, suite: SuiteConfig, output_dir: str | Path, *, policy: Policy | None = None,
             history: RuntimeHistory | None = None, on_event: Callable[[str, dict[str, Any]], None] | None = None,
             echo: Callable[[str], None] = print, submitter: Literal["local", "slurm", "kubernetes"] = "local",
             slurm: SlurmSettings | None = None, kubernetes: Any = None, gpu_type: str = "cpu") -> RunReport:
    """Evaluate the Hugging Face folder at `model_source` (a path, file:// or s3:// URL).

    `submitter="slurm"`: each trial is a Slurm batch job (evalsuite.slurm_trials; `slurm` is the
    cluster file's slurm: section, default: the environment's Slurm); `submitter="kubernetes"`:
    each trial is a Job (evalsuite.kubernetes_trials; `kubernetes` is the cluster file's
    kubernetes: section, `gpu_type` the GPU type its Jobs pin), and nothing is preloaded on this
    machine: with the policy's preload each trial's pod copies the model into its own /dev/shm.
    Metrics stay on this machine."""
    policy = policy or Policy()
    history = history or RuntimeHistory()
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    in_pods = submitter == "kubernetes"
    preload_ctx = preloaded(model_source, suite.preload_root) if policy.preload and not in_pods else nullcontext(None)
    t0 = time.perf_counter()
    with preload_ctx as local:
        preload_s = time.perf_counter() - t0
        model_path, preloaded_path = (str(local) if local else _local_path(model_source)), str(local or "")
        if in_pods and policy.preload:
            from evalsuite.kubernetes_trials import pod_preload_path

            preloaded_path = str(pod_preload_path(model_source, suite))
        plan = build_plan(suite, model_path=model_path, output_dir=output_dir, history=history, policy=policy,
                          model_source=model_source, preloaded_path=preloaded_path)
        echo(format_plan(plan))
        sandbox = Sandbox(suite.sandbox, cores=_metric_cores(suite.metric_workers))
        metric_workers = suite.metric_workers or sandbox.concurrency
        if submitter == "slurm":
            from evalsuite.slurm_trials import SlurmSubmitter

            runs: Any = SlurmSubmitter(output_dir / "slurm", slurm or SlurmSettings(), metric_workers, sandbox)
        elif in_pods:
            from evalsuite.kubernetes_trials import KubernetesSubmitter

            if kubernetes is None:
                raise ValueError("submitter='kubernetes' needs the cluster file's kubernetes: settings")
            runs = KubernetesSubmitter(output_dir / "kubernetes", kubernetes, metric_workers, sandbox,
                                       gpu_type=gpu_type,
                                       on_waiting=lambda trial, why: echo(f"trial {trial}: {why}") if why else None)
        else:
            runs = LocalSubmitter(len(plan.slots), metric_workers, sandbox)
        try:
            report = execute(plan, runs, history=history, sandbox_limits=suite.sandbox, on_event=on_event)
        finally:
            runs.close()   # Slurm's scancels, Kubernetes' deletes what an interrupted plan left queued or running
    echo(report.format())
    write_results(output_dir / "results.json", report, suite, model_source, preload_s)
    return report


def _local_path(source: str) -> str:
    return source[len("file://"):] if source.startswith("file://") else source


def _metric_cores(workers: int | None) -> list[int] | None:
    import os

    cores = sorted(os.sched_getaffinity(0))
    if workers is None:
        return None
    # More workers than cores would make programs share a core; reuse cores round-robin then.
    return [cores[i % len(cores)] for i in range(workers)]


def results_payload(report: RunReport, suite: SuiteConfig, model_source: str, preload_s: float = 0.0) -> dict:
    return {"model": model_source, "suite": suite.name, "backend": suite.backend, "time": time.time(),
            "results": report.results, "failed": report.failed_datasets, "makespan_s": report.makespan_s,
            "predicted_makespan_s": report.predicted_makespan_s, "preload_s": preload_s,
            "warnings": report.warnings, "history_used": report.history_used}


def write_results(path: str | Path, report: RunReport, suite: SuiteConfig, model_source: str,
                  preload_s: float = 0.0) -> Path:
    path = Path(path)
    path.write_text(json.dumps(results_payload(report, suite, model_source, preload_s), indent=2, sort_keys=True))
    return path
