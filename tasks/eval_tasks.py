"""Prefect tasks of the evaluate-checkpoint flow: thin wrappers over evalsuite/.

Every argument and result is a serialisable value (strings, pydantic models), so
the same tasks run in threads (ThreadPoolTaskRunner), in Dask worker processes
(prefect-dask's DaskTaskRunner) or on other machines.

`PrefectSubmitter` is how the flow runs a plan: evalsuite's one executor
(`evalsuite.executor.execute`) calls it to submit trials and metric jobs as task
runs, so the flow records runtime history and shares its set-up with the CLI.
A trial task runs its trial the way the suite's isolation says: in the task's
thread, or in its slot's own process that sees only the slot's devices (one
long-lived process per slot while the flow runs its plan: `slot_processes`).

Across nodes, `NodeSubmitter` hands trials to one session per node (the protocol,
both halves, is evalsuite.node_session's; here a session is a run of the node-work
deployment on the node's work queue: `node_sessions`, `FlowRunSessions`); the nodes
are given, or allocated by the cluster orchestrator (`eval_allocation`: queued, held
with a renewed lease, released).
`SlurmTaskSubmitter` runs each trial as a Slurm batch job (evalsuite.slurm_trials)
and its metric jobs as task runs of the flow.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.futures import PrefectFuture, as_completed

from checkpoint.manifest import CheckpointRef
from evalsuite.coordinator import Plan, format_plan
from evalsuite.suite import SuiteConfig
from evalsuite.metrics import MetricJob, ShardScore, run_metric_job
from evalsuite.sandbox import Sandbox, SandboxLimits
from evalsuite.slurm_trials import SlurmSubmitter
from evalsuite.trials import SlotProcesses, Trial, TrialResult, execute_trial
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
def export_checkpoint(checkpoint: CheckpointRef | str, spec: JobSpec | None, work_dir: str) -> str:
    """An HF folder for the checkpoint: a located training checkpoint is exported once (the
    reference is read as it is, not located again); an HF folder's URL is used as it is."""
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
                history_path: str | None = None, nodes: list[str] | None = None) -> Plan:
    """Decompose and balance the suite with the runtime history's predictions; log the plan."""
    from evalsuite.history import RuntimeHistory
    from evalsuite.runner import build_plan

    plan = build_plan(suite, model_path=model_path, output_dir=output_dir, history=RuntimeHistory(history_path),
                      model_source=model_source, preloaded_path=model_path, nodes=nodes)
    get_run_logger().info("%s", format_plan(plan))
    return plan


_slot_processes: dict[str, SlotProcesses] = {}   # flow run id -> the worker processes of its slots


@contextmanager
def slot_processes() -> Iterator[None]:
    """While the evaluating flow runs its plan, its process-isolated trials run on long-lived slot
    processes (one per slot, the engine kept between the slot's trials); closed at the end. A trial
    task in another process (a Dask worker) finds none and starts a fresh process per trial."""
    from prefect.context import get_run_context

    key = str(get_run_context().flow_run.id)
    _slot_processes[key] = processes = SlotProcesses()
    try:
        yield
    finally:
        _slot_processes.pop(key, None)
        processes.close()


def _processes_of_this_flow() -> SlotProcesses | None:
    from prefect.context import TaskRunContext

    context = TaskRunContext.get()
    return _slot_processes.get(str(context.task_run.flow_run_id)) if context else None


@task(name="inference-trial", cache_policy=NO_CACHE, task_run_name="trial {trial.trial_id}")
def inference_trial(trial: Trial) -> TrialResult:
    """Model load + inference over the trial's shards (in this thread, or in its slot's own process
    with its devices); complete shards are skipped (resume)."""
    return execute_trial(trial, processes=_processes_of_this_flow())


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


EVAL_NODE_DEPLOYMENT = "evaluate-node-work/eval-node-work"


def gpus_per_node(suite: SuiteConfig) -> int:
    """GPUs one node's slots use (each slot's device set); a CPU suite counts one unit per node."""
    gpus = {d for devices in suite.slot_devices() for d in devices if d.startswith("cuda")}
    return max(1, len(gpus))


@contextmanager
def eval_allocation(suite: SuiteConfig, node_count: int, cluster: str | None, what: str) -> Iterator[list[str]]:
    """`node_count` nodes' worth of the suite's GPUs from the cluster orchestrator: queue like any
    job (the policy places it), wait, hold the allocation (lease renewed in the background) while
    the evaluation runs, release it on every exit. Yields the allocated nodes (their work queues)."""
    from scheduler.orchestrator import demand_options
    from scheduler.orchestrator.lease import HeldJob
    from scheduler.orchestrator.seat import cluster_orchestrator, withdraw
    from tasks.cluster_tasks import flow_db_retry

    if node_count < 1:
        raise ValueError(f"node_count must be at least 1 (got {node_count}); or give nodes=[...] instead")
    logger = get_run_logger()
    db = flow_db_retry(what)  # every call below waits out a database outage (logged, alerted once it lasts)
    orch = db.call(cluster_orchestrator, "opening the state database")
    inventory = db.call(lambda: orch.cluster(cluster), f"{what}: reading the cluster")
    gpus = node_count * gpus_per_node(suite)
    job_id = db.call(lambda: orch.submit(what, demand_options(inventory, gpus), cluster=inventory.name),
                     f"{what}: asking for GPUs")
    logger.info("%s: asked the orchestrator for %d GPU(s) on %s (job %d)", what, gpus, inventory.name, job_id)
    try:
        admission = db.call(lambda: orch.wait_admitted(job_id, poll_s=2.0, on_wait=lambda pos, n: logger.info(
            "%s: waiting for GPUs, position %d of %d", what, pos, n)), f"{what}: waiting for GPUs")
    except BaseException:
        withdraw(orch, job_id, db)   # a cancelled or failed wait leaves the queue
        raise
    nodes = admission.placement.nodes
    logger.info("%s: evaluating on %s (orchestrator job %d)", what, ", ".join(nodes), job_id)
    with HeldJob(orch, job_id, db=db):
        yield nodes


class _NodeRun:
    """A run of the node-work deployment; result() is what the run left in its result file."""

    def __init__(self, flow_run_id: Any, result_path: str, what: str) -> None:
        self.flow_run_id, self.result_path, self.what = flow_run_id, result_path, what
        self.state: Any = None

    def done(self) -> bool:
        if not self.final():
            refresh_states([self])
        return self.final()

    def final(self) -> bool:
        return bool(self.state and self.state.is_final())

    def result(self) -> Any:
        from evalsuite.errors import TrialError

        if not (self.state and self.state.is_completed()):
            name = self.state.name if self.state else "unknown"
            raise TrialError(f"{self.what}: node flow run {self.flow_run_id} ended {name}: "
                             f"{getattr(self.state, 'message', '')}")
        return Path(self.result_path).read_text()


def refresh_states(runs: list[_NodeRun]) -> None:
    """One API call for the states of the node runs not yet final (flow-run states are set by
    the node's worker through the API, so the server's answer is authoritative)."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    pending = {r.flow_run_id: r for r in runs if not r.final()}
    if not pending:
        return
    with get_client(sync_client=True) as client:
        for flow_run in client.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=list(pending)))):
            pending[flow_run.id].state = flow_run.state


SESSION_RECORD = "session.json"   # in a session folder: what its node sessions serve (written by the evaluator)


def write_session_record(session_dir: Path, source: str, preload_root: str | None, slots: int) -> None:
    """What the node sessions of this evaluation serve: the node-work runs read it here, so their
    parameters name no model, folder or file (a flow-run parameter is anyone's who can reach the API)."""
    from infra.atomic_write import atomic_write_json

    session_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(session_dir / SESSION_RECORD, {"source": source, "preload_root": preload_root,
                                                      "slots": int(slots)})


def read_session_record(session_dir: str) -> tuple[Path, dict[str, Any]]:
    """The session folder (resolved) and its record; EvalConfigError when the folder holds none
    (it is no evaluation's session folder) or the node name could leave it."""
    import json

    from evalsuite.errors import EvalConfigError

    folder = Path(session_dir).resolve()
    try:
        record = json.loads((folder / SESSION_RECORD).read_text())
        source, preload_root, slots = record["source"], record["preload_root"], int(record["slots"])
    except (OSError, ValueError, KeyError, TypeError):
        raise EvalConfigError(f"{session_dir} holds no evaluation session ({SESSION_RECORD} written by the "
                              "evaluate-checkpoint flow); a node session serves only one of those") from None
    if not isinstance(source, str) or not (preload_root is None or isinstance(preload_root, str)) or slots < 1:
        raise EvalConfigError(f"{folder / SESSION_RECORD} is not a session record; it was not written by forgeflow")
    return folder, {"source": source, "preload_root": preload_root, "slots": slots}


def node_result_path(session_dir: Path, action: str, node: str) -> Path:
    """Where a node run of `action` leaves its result: in the session folder, named by the node."""
    import re

    from evalsuite.errors import EvalConfigError

    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}", node) or not re.fullmatch(r"[a-z]+", action):
        raise EvalConfigError(f"node {node!r} / action {action!r}: a node is a work queue's name (letters, digits, "
                              "'.', '_', '-')")
    return session_dir / "runs" / f"{action}-{node}.txt"


def run_on_node(node: str, action: str, session_dir: Path, what: str) -> _NodeRun:
    """Start the node-work deployment on `node`'s work queue (that node's process worker): it is
    told the session folder and the node, and reads the rest from the session's record."""
    from prefect.deployments import run_deployment

    run = run_deployment(EVAL_NODE_DEPLOYMENT, parameters={"action": action, "node": node,
                                                          "session_dir": str(session_dir)},
                         work_queue_name=node, timeout=0)
    return _NodeRun(run.id, str(node_result_path(session_dir.resolve(), action, node)), what)


def wait_all(runs: list[_NodeRun], poll_s: float = 1.0) -> list[str]:
    """Wait for every node run; raise the first failure after all ended (so none is left running)."""
    import time

    refresh_states(runs)
    while not all(r.final() for r in runs):
        time.sleep(poll_s)
        refresh_states(runs)
    return [r.result() for r in runs]


def run_on_nodes(nodes: list[str], action: str, session_dir: Path, what: str) -> list[_NodeRun]:
    """The same action on every node, its runs created concurrently (each creation is several
    API calls; one after the other they add up on a busy server)."""
    import contextvars
    from concurrent.futures import ThreadPoolExecutor

    def start(node: str) -> _NodeRun:
        return run_on_node(node, action, session_dir, f"{what} on {node}")

    # Each thread runs in a copy of this context, so the runs are linked to this flow run as subflows.
    with ThreadPoolExecutor(max_workers=max(1, min(8, len(nodes)))) as pool:
        futures = [pool.submit(contextvars.copy_context().run, start, n) for n in nodes]
        return [f.result() for f in futures]


def node_sessions(nodes: list[str], source: str, preload_root: str | None, session_dir: Path,
                  slots: int, ready_timeout_s: float = 900.0):
    """`evalsuite.node_session.open_sessions` with one run of the node-work deployment per node,
    on the node's work queue, as the sessions."""
    from evalsuite.node_session import open_sessions

    def start(sessions) -> FlowRunSessions:
        write_session_record(session_dir, source, preload_root, slots)
        return FlowRunSessions(dict(zip(nodes, run_on_nodes(nodes, "serve", session_dir, "session"))))

    return open_sessions(session_dir, nodes, start, ready_timeout_s)


class FlowRunSessions:
    """The node sessions as flow runs of the node-work deployment (evalsuite.node_session.SessionRuns)."""

    def __init__(self, runs: dict[str, _NodeRun]) -> None:
        self.runs = runs

    def refresh(self) -> None:
        refresh_states(list(self.runs.values()))

    def ended(self, node: str) -> str | None:
        run = self.runs[node]
        if not run.final():
            return None
        return f"flow run {run.flow_run_id} ended {run.state.name}: {getattr(run.state, 'message', '')}"

    def not_started_hint(self, node: str) -> str:
        return f"is a worker running on each node's work queue (`prefect worker start --pool POOL --work-queue {node}`)"

    def cancel_unstarted(self) -> None:
        from prefect import get_client
        from prefect.states import Cancelled

        refresh_states(list(self.runs.values()))
        with get_client(sync_client=True) as client:
            for run in self.runs.values():
                if run.state is None or run.state.is_scheduled():
                    client.set_flow_run_state(run.flow_run_id, Cancelled(message="the evaluation ended before a "
                                              "worker started this session"), force=True)
                    run.state = None   # read again

    def wait_all(self) -> None:
        wait_all(list(self.runs.values()))


class NodeSubmitter(PrefectSubmitter):
    """Trials on their slot's node: handed to that node's session (`node_sessions`). Metric jobs
    stay task runs of this flow (CPU work, never in a GPU slot)."""

    def __init__(self, sessions, poll_s: float = 0.25) -> None:
        self.sessions, self.poll_s = sessions, poll_s

    def submit_trial(self, trial: Trial, on_progress: Callable[[str, int], None] | None) -> Any:
        return self.sessions.send(trial)

    def wait_first(self, handles: list[Any]) -> Any:
        """The first handle done: a trial whose result file its session wrote (or whose session
        ended), or a metric task of this flow (its local future). A local task run's state must
        not be read from the API: the server learns it from the client's events, which can lag or
        never arrive (an events client bound to another API, a dropped websocket); polling it left
        the evaluation waiting forever after every metric had finished (seen in CI: 9 minutes,
        then the test timeout)."""
        import concurrent.futures as cf
        import time

        from evalsuite.node_session import SessionTrial

        waitable = [f for h in handles if isinstance(f := getattr(h, "wrapped_future", None), cf.Future)]
        last_refresh = 0.0
        while True:
            if time.monotonic() - last_refresh > 2.0:   # a session's end is rare: ask the API now and then
                if self.sessions.runs is not None and any(isinstance(h, SessionTrial) for h in handles):
                    self.sessions.runs.refresh()
                last_refresh = time.monotonic()
            for h in handles:   # the plan's order among those already done
                if h.done() if isinstance(h, SessionTrial) else _local_done(h):
                    return h
            # Until a local task finishes or the poll interval passes; then look for result files.
            if waitable:
                cf.wait(waitable, timeout=self.poll_s, return_when=cf.FIRST_COMPLETED)
            else:
                time.sleep(self.poll_s)


def _local_done(handle: Any) -> bool:
    """A task run of this flow is done when its future is; only futures that wrap none
    (e.g. a distributed runner's) fall back to the API's view of the task run."""
    import concurrent.futures as cf

    wrapped = getattr(handle, "wrapped_future", None)
    if isinstance(wrapped, cf.Future):
        return wrapped.done()
    return handle.state.is_final()


class SlurmTaskSubmitter(SlurmSubmitter):
    """Trials as Slurm batch jobs (evalsuite.slurm_trials); metric jobs as task runs of this flow."""

    def submit_metric(self, job: MetricJob) -> PrefectFuture:
        return metric_job.submit(job)


class ProgressArtifact:
    """The executor's events as a Prefect progress artifact: trials and metric jobs done, of all."""

    def __init__(self, key: str, description: str) -> None:
        self.key, self.description = _artifact_key(key), description
        self.artifact_id = None
        self.total = self.done = 0

    def __call__(self, kind: str, info: dict[str, Any]) -> None:
        from prefect.artifacts import create_progress_artifact, update_progress_artifact

        if kind == "plan":
            self.total = info["trials"] + info["shards"]
            self.artifact_id = create_progress_artifact(0.0, key=self.key, description=self.description)
        elif kind in ("trial_done", "trial_failed", "metric_done", "metric_failed") and self.artifact_id:
            self.done += 1
            update_progress_artifact(self.artifact_id, round(100.0 * self.done / max(1, self.total), 1))


@task(name="publish-results", cache_policy=NO_CACHE)
def publish_results(checkpoint: str, suite_name: str, payload: dict[str, Any], output_dir: str,
                    job: str | None = None, spec: JobSpec | None = None) -> dict[str, str]:
    """Results JSON next to the checkpoint; the job's scores per step (JSONL beside its checkpoints);
    artifacts: this checkpoint's table, and the trend (chart inline + table) over every step so far;
    with the job's spec, the scores at the checkpoint's step in its TensorBoard (training.metrics)."""
    from prefect.artifacts import create_markdown_artifact

    from evalsuite.reporting import (results_table, split_checkpoint_url, step_of, trend_chart_png, trend_markdown,
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
    if spec is not None and step_of(name) is not None:
        from training.metrics import log_eval_scores

        log_eval_scores(spec, step_of(name), payload["results"])
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
