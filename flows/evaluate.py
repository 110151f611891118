"""Evaluate checkpoints as they are committed: the decoupled evaluation runbook.

    checkpoint committed (event: a CheckpointRef) ─┐
    every 15 min: catch up ────────────────────────┴→ evaluate-checkpoint:
        export to Hugging Face format (once), into the evaluation's folder under the
          job's run directory: <run_dir>/eval/step-N-SUITE/
        across nodes: the nodes given, or an allocation from the cluster orchestrator (held to the end)
        preload it into this node's shared memory (once per node)
        plan: split/batch datasets into trials, balance them over the slots
        run inference trials, one chain per slot; as each trial's outputs land,
          its metric jobs start on CPU workers while the slot moves on
        remove the preload (also when something failed)
        publish: results JSON next to the checkpoint, the job's scores per step (JSONL),
          a table artifact and a trend artifact (score vs step per dataset, inline chart)

The deployments (on-commit: event-triggered; catch-up: every 15 minutes) are
defined once, in prefect.yaml, and created by `forgeflow deploy`. A run created
through the API (from a deployment) evaluates one job's own checkpoints with its
recorded spec, writes only in its run directory and takes suites by name
(evalsuite.job_scope); a node session is told only its session folder and reads
what to serve from the record the evaluating flow wrote there.

The runtime history the plans balance on is one file in the state directory
($FORGEFLOW_STATE_DIR, default ~/.forgeflow/state: the orchestrator's folder; workers that
share it share the history).

Evaluate one checkpoint now:                  python flows/evaluate.py CHECKPOINT [SUITE] [JOB.yaml]
"""

from __future__ import annotations

import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner

from checkpoint.manifest import CheckpointRef, committed_checkpoints
from evalsuite.checkpoints import checkpoint_name, checkpoint_to_evaluate, checkpoint_url, eval_output_dir
from evalsuite.executor import execute
from evalsuite.node_session import serve_node
from evalsuite.history import RuntimeHistory
from evalsuite.reporting import has_results
from evalsuite.runner import results_payload
from evalsuite.suite import load_suite
from infra.atomic_write import atomic_write
from tasks.eval_tasks import (NodeSubmitter, PrefectSubmitter, ProgressArtifact, SlurmTaskSubmitter, eval_allocation,
                              export_checkpoint, jobs_for_evaluation, node_result_path, node_sessions, plan_trials,
                              preload_model, publish_results, read_session_record, register_for_evaluation,
                              remove_preloaded, slot_processes)
from training.config import JobSpec, as_job_spec


def _slurm_settings(submitter: str, cluster_file: str | None, nodes: Any) -> Any:
    """The Slurm settings for submitter='slurm' (None for 'prefect'); a wrong combination fails
    before anything runs, naming the fix."""
    from infra.slurm import SlurmSettings

    if submitter not in ("prefect", "slurm"):
        raise ValueError(f"submitter must be 'prefect' or 'slurm' (got {submitter!r})")
    if submitter == "prefect":
        if cluster_file:
            raise ValueError("slurm_cluster_file is only used with submitter='slurm'; set it or drop the file")
        return None
    if nodes:
        raise ValueError("submitter='slurm' lets Slurm place the trials: drop nodes/node_count")
    if not cluster_file:
        return SlurmSettings()
    from scheduler.cluster import load_cluster

    settings = load_cluster(cluster_file).slurm
    if settings is None:
        raise ValueError(f"{cluster_file} has no slurm: section; add one (partition, account, ...) "
                         "or leave slurm_cluster_file unset for the environment's Slurm")
    return settings


def _spec(job_spec: str | dict | JobSpec | None) -> JobSpec | None:
    return as_job_spec(job_spec) if job_spec else None


def created_through_the_api() -> bool:
    """Whether this flow run was created from a deployment (its parameters are whoever could
    create a flow run's), not by a Python call of the flow (whose caller already runs code here)."""
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    return bool(context and context.flow_run and context.flow_run.deployment_id)


def _orchestrator_engine():
    from scheduler.orchestrator.seat import cluster_orchestrator

    return cluster_orchestrator().engine


def _confined_to_its_job(checkpoint, suite, job_spec, output_dir, preload_root, history_path,
                         slurm_cluster_file) -> JobSpec:
    """An evaluation through the API touches one job's files only (evalsuite.job_scope): the
    job's recorded spec, which the run uses instead of the content it was given."""
    from evalsuite import job_scope

    engine = _orchestrator_engine()
    job_scope.check_not_given(preload_root=preload_root, history_path=history_path)
    job_scope.check_suite(suite)
    scope = job_scope.recorded_job(engine, job_spec, checkpoint)
    job_scope.check_output_dir(scope, output_dir)
    job_scope.check_cluster_file(engine, slurm_cluster_file)
    return scope.spec


@flow(name="evaluate-checkpoint", log_prints=True, task_runner=ThreadPoolTaskRunner(max_workers=16))
def evaluate_checkpoint(checkpoint: CheckpointRef | dict | str, suite: str = "quick",
                        job_spec: str | dict | JobSpec | None = None,
                        output_dir: str | None = None, preload_root: str | None = None,
                        history_path: str | None = None, nodes: list[str] | None = None,
                        node_count: int | None = None, cluster: str | None = None,
                        submitter: str = "prefect", slurm_cluster_file: str | None = None) -> dict[str, Any]:
    """Evaluate one checkpoint: a committed training checkpoint (a CheckpointRef, as the
    checkpoint event carries it, or a step folder / checkpoint root, located once here) or
    an exported Hugging Face folder. With `nodes` (work queues of node workers), on every node's slots;
    with `node_count` instead, on that many nodes the cluster orchestrator allocates (`cluster`:
    a registered cluster, default the only one), held until the evaluation ends.
    `submitter="slurm"`: each trial is a Slurm batch job instead (Slurm places it; the slurm:
    section of `slurm_cluster_file`, default the environment's Slurm); metric jobs stay task runs."""
    if created_through_the_api():   # parameters that name files must be its job's (evalsuite.job_scope)
        job_spec = _confined_to_its_job(checkpoint, suite, job_spec, output_dir, preload_root, history_path,
                                        slurm_cluster_file)
    slurm = _slurm_settings(submitter, slurm_cluster_file, nodes or node_count)
    spec = _spec(job_spec)
    suite_config = load_suite(suite, spec, {"preload_root": preload_root} if preload_root else None)
    if spec is not None:
        register_for_evaluation(spec, suite)   # the catch-up keeps evaluating this job's checkpoints
    target = checkpoint_to_evaluate(checkpoint, spec)
    name, where = checkpoint_name(target), checkpoint_url(target)
    out = Path(output_dir or eval_output_dir(target, suite_config.name, spec))
    out.mkdir(parents=True, exist_ok=True)

    with ExitStack() as held:
        # 0. Across nodes from the cluster: queue for node_count nodes' worth of the suite's GPUs,
        #    hold them (lease renewed) until the end, give them back on every exit.
        if node_count and not nodes:
            nodes = held.enter_context(eval_allocation(suite_config, node_count, cluster,
                                                       f"evaluate {name} ({suite_config.name})"))
        # 1. One HF folder per checkpoint, then one copy of it in this node's shared memory.
        source = export_checkpoint(target, spec, str(out))
        local = preload_model(source, suite_config.preload_root)
        try:
            # 1b. Across nodes: one session per node (a run on its own work queue): it preloads the
            #     model there (the precursor), runs the trials handed to it on its slots' long-lived
            #     processes, and removes its preload when told to stop or when this flow stops beating.
            sessions = held.enter_context(node_sessions(nodes, source, suite_config.preload_root,
                                                        out / "node-sessions", suite_config.slots)) if nodes else None
            # 2. Trials balanced over slots with predicted times from the runtime history.
            plan = plan_trials(suite_config, local, source, str(out), history_path, nodes)
            # 3. One chain of trials per slot, each trial a task run (or handed to its node's session);
            #    metric jobs start as soon as a trial's outputs exist. The executor is the CLI's: it
            #    records the runtimes this run measures, so the next plan balances on them.
            progress = ProgressArtifact(f"eval-progress-{name}-{suite_config.name}",
                                        f"{suite_config.name} on {where}: trials and metric jobs done")
            if slurm is not None:
                runs: Any = SlurmTaskSubmitter(out / "slurm", slurm, 1, None)
            else:
                runs = NodeSubmitter(sessions) if sessions else PrefectSubmitter()
            try:
                with slot_processes():
                    report = execute(plan, runs, history=RuntimeHistory(history_path),
                                     sandbox_limits=suite_config.sandbox, on_event=progress)
            finally:
                if slurm is not None:
                    runs.close()   # scancels the trial jobs a failed or cancelled run left behind
        finally:
            # 4. This node's preload goes, also when something failed (each node's session removes
            #    its own when `held` closes: told to stop, waited for).
            remove_preloaded(source, suite_config.preload_root)

    print(report.format())
    payload = results_payload(report, suite_config, source)
    # 5. Publish: results beside the checkpoint, the job's scores per step, table + trend artifacts.
    published = publish_results(where, suite_config.name, payload, str(out), spec.name if spec else None,
                                spec=spec)
    return {**payload, **published}


@flow(name="evaluate-node-work", log_prints=True)
def evaluate_node_work(action: str, node: str, session_dir: str) -> str:
    """One node's part of a multi-node evaluation, run on that node's work queue. `serve`: the
    node's session (evalsuite.node_session): preload the model here, run the trials the
    evaluating flow hands it on its slots, remove the preload at the end. What to serve (the
    model, the preload root, the slots) is the session's record, which the evaluating flow wrote
    in `session_dir`; the result goes to that folder too (tasks.eval_tasks.node_result_path):
    no parameter names a model or a file to write."""
    if action != "serve":
        raise ValueError(f"unknown action {action!r}; expected serve")
    folder, record = read_session_record(session_dir)
    result_path = node_result_path(folder, action, node)
    done = serve_node(folder, node, record["source"], record["preload_root"], record["slots"])
    atomic_write(result_path, done)   # the evaluating flow reads it: whole or absent
    print(done)
    return str(result_path)


def pending_checkpoints(checkpoints: list[CheckpointRef | str], suite_name: str) -> list[CheckpointRef | str]:
    return [c for c in checkpoints if not has_results(checkpoint_url(c), suite_name)]


@flow(name="evaluate-catch-up", log_prints=True)
def evaluate_catch_up(job_spec: str | JobSpec | None = None, suite: str | None = None,
                      limit: int | None = None) -> list[str]:
    """Evaluate committed checkpoints that have no results yet (missed events, downtime).

    With no job_spec: every job registered for evaluation (each on-commit run registers
    its job), with the suite it registered. With one: that job (and it is registered).
    Run from its deployment, the registered jobs (a Prefect Variable) and the parameters
    are checked like evaluate-checkpoint's: each is a job the orchestrator knows, evaluated
    with its recorded spec and a suite name (evalsuite.job_scope)."""
    through_api = created_through_the_api()
    if job_spec is not None:
        spec = _recorded_spec(job_spec, suite or "quick") if through_api else _spec(job_spec)
        register_for_evaluation(spec, suite or "quick")
        jobs, bad = [(spec, suite or "quick")], {}
    else:
        jobs, bad = jobs_for_evaluation()
        jobs = [(spec, suite or job_suite) for spec, job_suite in jobs]
        if through_api:
            jobs, refused = _recorded_jobs(jobs)
            bad.update(refused)
    for name, why in bad.items():
        print(f"skipping job {name!r}: its registration is not valid: {why}")
    print(f"catching up on {len(jobs)} job(s): {', '.join(spec.name for spec, _ in jobs) or 'none registered'}")
    evaluated = []
    for spec, job_suite in jobs:
        suite_name = load_suite(job_suite, spec).name
        todo = pending_checkpoints([r.ref for r in committed_checkpoints(spec.checkpoint)], suite_name)
        todo = todo[: None if limit is None else max(0, limit - len(evaluated))]
        print(f"{len(todo)} checkpoint(s) of {spec.name} not yet evaluated with {suite_name}")
        for ref in todo:
            evaluate_checkpoint(ref, suite=job_suite, job_spec=spec)
        evaluated += [ref.step_url for ref in todo]
    return evaluated


def _recorded_spec(job_spec: str | dict | JobSpec, suite: str) -> JobSpec:
    from evalsuite import job_scope

    job_scope.check_suite(suite)
    return job_scope.job_named(_orchestrator_engine(), job_spec).spec


def _recorded_jobs(jobs: list[tuple[JobSpec, str]]) -> tuple[list[tuple[JobSpec, str]], dict[str, Exception]]:
    """Each (spec, suite) as its job's recorded spec with a suite name; the others, name -> why."""
    from evalsuite import job_scope

    engine = _orchestrator_engine()
    kept, refused = [], {}
    for spec, suite in jobs:
        try:
            job_scope.check_suite(suite)
            kept.append((job_scope.recorded_job(engine, spec, spec.checkpoint.url).spec, suite))
        except job_scope.EvalScopeError as e:
            refused[spec.name] = e
    return kept, refused


def evaluate_committed(spec: JobSpec, suite: str = "demo") -> list[str]:
    """`make demo`: evaluate the demo job's checkpoints at the end."""
    return evaluate_catch_up(spec, suite=suite)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        print(evaluate_checkpoint(sys.argv[1], *(sys.argv[2:4])))
    else:
        print(__doc__)
