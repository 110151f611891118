"""Prefect tasks of the pretrain flow: thin, typed wrappers over infra/, training/, diagnosis/, scheduler/.

Each task is one step of the on-call runbook; the logic lives in the libraries so
it can be tested and used without Prefect. Queueing for GPUs and placement on the
shared cluster are in tasks/cluster_tasks.py.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.artifacts import create_markdown_artifact, update_progress_artifact

from diagnosis.recovery import AttemptOverrides
from diagnosis.vocabulary import Diagnosis
from scheduler.cluster import Cluster
from infra.launch import CHOOSE_ON_NODE_0, LaunchRequest, wait_until_started
from infra.slurm import placed_first_ranks
from infra.standby import WarmRestarts
from infra.nodecheck import LauncherWorldRunner, NodeCheckReport, two_round_check
from infra.notify import SLACK_BLOCK_VARIABLE, Alert, Notifier, notifier_for, slack_block_name
from scheduler.placement import Placement
from infra.watch import AttemptOutcome, watch
from scheduler.worker_command import worker_args, write_attempt_spec
from tasks.launchers import (STOPPED_BY_PEER, get_run_logger_or_print, make_launcher, mark_stopped_by_peer,
                             node_check_launcher)
from training.config import JobSpec


@task(name="prepare-data", cache_policy=NO_CACHE)
def prepare_data(spec: JobSpec) -> str:
    from training.data import prepare_data as prepare

    prepared = prepare(spec, progress=False)
    return str(getattr(prepared, "data_dir", spec.data.data_dir))


@task(name="preflight-storage", cache_policy=NO_CACHE)
def preflight_storage(spec: JobSpec) -> None:
    """Wrong credentials or a missing bucket fail here, before any GPU time is spent."""
    from infra.storage import open_storage, storage_options_from_config

    open_storage(spec.checkpoint.url, storage_options_from_config(spec.checkpoint)).check_writable()


@task(name="set-aside-abandoned-checkpoints", cache_policy=NO_CACHE, retries=3, retry_delay_seconds=[5, 15, 45])
def set_aside_abandoned(spec: JobSpec, after_step: int, why: str) -> list[int]:
    """A spike rollback's abandoned timeline: the checkpoints committed after `after_step` stop
    counting (checkpoint.manifest.set_aside_after), so a later plain restart resumes from the
    rollback's. Retried through a storage blip; one that outlasts the retries fails the run with
    the storage's error rather than leave the spike's timeline as "the newest checkpoint"."""
    from checkpoint.manifest import set_aside_after

    return set_aside_after(spec.checkpoint, after_step, why)


@task(name="run-attempt", cache_policy=NO_CACHE)
def run_attempt(
    spec: JobSpec,
    placement: Placement,
    attempt: int,
    resume_from_step: int | None,
    overrides: AttemptOverrides,
    hang_timeout_s: float,
    env: dict[str, str],
    progress_artifact_id=None,
    launcher: str = "local",
    announcer=None,
    cluster: Cluster | None = None,
    stop_when: Callable[[], str | None] | None = None,
    stop_requested: Callable[[], str | None] | None = None,
    on_step: Callable[[int], None] | None = None,
    on_waiting: Callable[[str | None], None] | None = None,
    on_started: Callable[[object], None] | None = None,
    warm: WarmRestarts | None = None,
) -> AttemptOutcome:
    """Launch one torchrun per node, then watch until done, failure, hang or spike (or until
    `stop_when()` gives a reason: the job's GPU lease was lost; or `stop_requested()` does:
    `forgeflow cancel`, the ranks commit the step they are on). `on_step(step)`: each new step;
    `on_waiting(reason)`: while a batch system (Slurm) keeps the job queued, and None once it runs;
    `on_started(job)`: the launcher's handle of the attempt, once launched (submitted to Slurm).
    An attempt Slurm ended (time limit, preemption, node failure) comes back "evicted", with why.
    `warm` (infra.standby): the attempt runs in the standby world started for it when that fits,
    and once it trains, the next attempt's standby is started.

    `announcer` (tasks.checkpoint_events.CommitAnnouncer) emits a checkpoint-committed
    event for each checkpoint that commits meanwhile; `cluster` carries a Slurm
    cluster's submission settings (partition, account, time limit)."""
    logger = get_run_logger()
    # A fresh rendezvous port per attempt (the last one may linger in TIME_WAIT), chosen by
    # node rank 0 on itself when it starts: a port free on the flow's machine proves nothing there.
    launches = [replace(l, master_port=CHOOSE_ON_NODE_0) for l in placement.launch_specs()]
    # Every rank reads the spec this flow validated, written into the run directory, and checks
    # its hash: not the user's YAML file, which another node may not have (or may have changed).
    spec_file = write_attempt_spec(spec, attempt)
    args = worker_args(spec_file, placement, resume_from_step, overrides, config_hash=spec.config_hash())
    # torchrun SIGKILLs its ranks 30 s after forwarding a SIGTERM unless told to wait longer
    env = {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(int(spec.checkpoint.stop_deadline_s) + 5), **env}
    request = LaunchRequest(spec.name, launches, args, spec.resolved_run_dir, env=env, attempt=attempt)
    logger.info("attempt %d: %d node(s), world size %d: %s", attempt, len(launches), request.world_size, " ".join(args))
    stop_s = spec.checkpoint.stop_deadline_s + 10.0  # SIGTERM: commit, then exit
    cold = make_launcher(launcher, cluster=cluster, gpu_type=placement.gpu_type, grace_s=stop_s, job_id=_job_id(spec))
    warm = warm or WarmRestarts(enabled=False)
    job, started_warm = warm.launch(request, cold.start)
    if started_warm:
        logger.info("attempt %d: started warm, in the world that waited for it (infra.standby)", attempt)

    def progress(step: int) -> None:
        warm.prepare_next(request)  # the attempt trains: the next one's world gets ready meanwhile
        if progress_artifact_id is not None:
            report_progress(progress_artifact_id, spec.name, step, spec.training.steps)
        if announcer is not None:  # evaluation starts while training goes on
            announcer.poll()
        if on_step is not None:
            on_step(step)

    def straggler(found) -> None:  # reported while the job runs: nothing has failed (yet)
        logger.warning("straggler: %s", found.summary())
        report_straggler(spec.name, attempt, found)

    def waiting(reason: str | None) -> None:
        logger.info("attempt %d: %s", attempt, reason or "started by the batch system")
        if on_waiting is not None:
            on_waiting(reason)

    try:
        if on_started is not None:  # (inside the try: the job is terminated whatever the hook does)
            on_started(job)
        # A job the batch system keeps queued is no hang: the watcher's start-up timeout starts once it runs.
        requested = wait_until_started(job, on_waiting=waiting, stop_requested=stop_requested)
        if requested:
            return AttemptOutcome("stopped", job.poll(), 0, 0.0, job.log_paths(), requested_stop=requested)
        outcome = watch(job, spec.resolved_run_dir, request.world_size, hang_timeout_s=hang_timeout_s,
                        stop_grace_s=stop_s, on_progress=progress, on_straggler=straggler, stop_when=stop_when,
                        stop_requested=stop_requested)
        ended_by = (job.ended_by_batch_system() if outcome.status in ("failed", "hang")
                    and hasattr(job, "ended_by_batch_system") else None)
        if ended_by:  # a time limit, a preemption, a node failure: not the job's fault, not a failure
            outcome = replace(outcome, status="evicted", evicted=ended_by, failed_nodes=[])
        return outcome
    finally:
        # no-op when already gone; never leave ranks behind. On a cancellation of this flow
        # the ranks get SIGTERM here and commit the current step before the grace runs out.
        job.terminate(grace_s=stop_s)


def report_progress(artifact_id, job: str, step: int, steps: int) -> None:
    """The progress artifact at `step` of `steps`: its bar, and "step N of M (P%)" in its
    description, which its card in the Prefect UI shows (the bar alone shows no number)."""
    percent = 100.0 * min(step, steps) / max(1, steps)
    update_progress_artifact(artifact_id, progress=percent,
                             description=f"{job}: step {step} of {steps} ({percent:.0f}%)")


def _job_id(spec: JobSpec) -> int | None:
    """The job's id in the orchestrator (None for a spec run outside it)."""
    return int(spec.job) if spec.job.isdigit() else None


def report_straggler(job: str, attempt: int, found) -> None:
    """A straggling rank: an artifact and an alert naming its node and rank."""
    create_markdown_artifact(
        key=f"straggler-{job}-{attempt}-rank{found.rank}".lower().replace("_", "-").replace(".", "-"),
        markdown=(f"## {job}: straggler in attempt {attempt}\n\n"
                  "| rank | node | host | step | compute (s) | others' median (s) | x slower |\n"
                  "|---|---|---|---|---|---|---|\n"
                  f"| {found.rank} | {found.node} | {found.host} | {found.step} | {found.compute_s:.3f} "
                  f"| {found.others_median_s:.3f} | {found.ratio:.1f} |\n"),
        description=f"{job}: rank {found.rank} on {found.node} is slow",
    )
    send_alert(build_notifier(), Alert(f"{job}: straggler — rank {found.rank} on {found.node}", "warning", {
        "rank": str(found.rank), "node": found.node, "host": found.host, "step": str(found.step),
        "slower by": f"{found.ratio:.1f}x (compute {found.compute_s:.3f} s vs {found.others_median_s:.3f} s)",
    }))


@task(name="diagnose-attempt", cache_policy=NO_CACHE)
def diagnose_attempt(spec: JobSpec, outcome: AttemptOutcome, attempt: int,
                     placement: Placement | None = None) -> Diagnosis:
    """Spike and hang come from the watcher; everything else from the logs.

    Each node's log is diagnosed as that node's (diagnosis.compressed.LogOrigin), so the
    suspect nodes are the inventory's names, and with the attempt's `placement` torchrun's
    local ranks become global ones. On the prefect launcher, the node runs that stopped only
    because a suspect node failed are then marked so (tasks.launchers.mark_stopped_by_peer)."""
    from diagnosis.api import diagnose_log
    from diagnosis.compressed import LogOrigin

    if outcome.status == "spike" and outcome.spike:
        return Diagnosis(
            "LossSpike", "training", True, confidence=1.0,
            culprit_lines=[json.dumps(asdict(outcome.spike))],
            mitigation="roll back to a checkpoint before the spike and skip the spike's batches",
            source="rule",
        )
    # Every node's log in one file, for a person to read or confirm (`forgeflow diagnose FILE --confirm`).
    node_logs = [(node, Path(path)) for node, path in sorted(outcome.log_paths.items()) if Path(path).exists()]
    combined = spec.resolved_run_dir / "diagnosis" / f"attempt-{attempt}.log"
    combined.parent.mkdir(parents=True, exist_ok=True)
    with open(combined, "wb") as out:
        for _, path in node_logs:
            out.write(path.read_bytes())
    first_rank = {launch.node: launch.first_global_rank for launch in placement.launch_specs()} if placement else {}
    first_rank.update(placed_first_ranks(spec.resolved_run_dir, attempt))  # delegated Slurm: where it really ran
    from diagnosis.agents import build_default_agent

    # The agent (LLM with retrieval, or a retrieval vote without an LLM) is consulted only
    # when no rule names a cause, or a rule names only symptoms or the exception's class;
    # it opens the embedding model and Chroma only then.
    diagnosis = diagnose_log(
        [path for _, path in node_logs] or combined, job_family=spec.name,
        hang_suspected=outcome.status == "hang", agent=build_default_agent(job_family=spec.name),
        # a log that is no node's (a Slurm batch script's output) gets no origin
        origins=[LogOrigin(node, first_rank.get(node)) if node in outcome.exit_codes else None
                 for node, _ in node_logs] if node_logs else None)
    if outcome.unrequested_stop:  # the watcher's finding comes first in the alert and the report
        diagnosis.culprit_lines.insert(0, outcome.unrequested_stop)
    if outcome.stall is not None:  # a hang seen from the collectives names who did not join
        diagnosis.culprit_lines.insert(0, outcome.stall.describe())
        diagnosis.suspect_nodes = list(dict.fromkeys([*outcome.stall.nodes, *diagnosis.suspect_nodes]))
        diagnosis.suspect_ranks = list(dict.fromkeys([*outcome.stall.absent, *diagnosis.suspect_ranks]))
    try:
        stopped = mark_stopped_by_peer(spec.resolved_run_dir, attempt, diagnosis.suspect_nodes, diagnosis.root_cause)
    except Exception as e:  # the runs' labels are for people: never let them stop the recovery
        get_run_logger().warning("could not mark the node runs a peer stopped: %s: %s", type(e).__name__, e)
    else:
        for node, why in stopped.items():
            get_run_logger().info("node-launch run of %s marked %s: %s", node, STOPPED_BY_PEER, why)
    return diagnosis


@task(name="node-check", cache_policy=NO_CACHE)
def node_check(placement: Placement, run_dir: Path, attempt: int, env: dict[str, str],
               launcher: str = "local", cluster: Cluster | None = None, job_id: int | None = None,
               warm: WarmRestarts | None = None) -> NodeCheckReport:
    """Two-round pairwise collective test of the placement's nodes, run through the
    same launcher as training (on a cluster: on the nodes themselves), or in the standby world
    waiting on those nodes when there is one (`warm`: infra.standby). On Slurm, a faulty node is
    also kept out of the job's later attempts, and, where the flow may not drain it, an alert names
    the node and the operator's command (`slurm_faulty_nodes`)."""
    addresses = {launch.node: launch.address for launch in placement.launch_specs()}
    runner = LauncherWorldRunner(
        node_check_launcher(launcher, grace_s=2.0, cluster=cluster, gpu_type=placement.gpu_type, job_id=job_id),
        Path(run_dir) / "nodecheck" / f"attempt-{attempt}", timeout_s=60.0, env=env,
        rendezvous_host=lambda node: addresses.get(node, "127.0.0.1"),
        free_port=lambda: CHOOSE_ON_NODE_0,  # each world's first node picks its own port
    )
    report = two_round_check(placement.nodes, warm.node_check_runner(placement.nodes, runner) if warm else runner)
    if report.faulty and getattr(cluster, "slurm", None) is not None:
        slurm_faulty_nodes(report.faulty, cluster.slurm, Path(run_dir), report.summary())
    return report


def slurm_faulty_nodes(faulty: list[str], settings, job_run_dir: Path, why: str,
                       notifier: Notifier | None = None) -> list[str]:
    """Faulty nodes on Slurm: drained where the flow may; otherwise one alert per node with the
    operator's command. Either way `--exclude`d from this job's later attempts. Never raises for
    lack of Slurm privileges. Returns the operators' commands that were alerted."""
    from infra.slurm import drain_node_if_allowed, exclude_nodes

    exclude_nodes(job_run_dir, faulty)
    alerted = []
    for node in faulty:
        not_drained = drain_node_if_allowed(node, f"failed the node check: {why}", settings)
        if not_drained:
            get_run_logger_or_print(not_drained)
            send_alert(notifier or build_notifier(), Alert(f"node {node} failed the node check; drain it in Slurm", "warning",
                                               {"node": node, "operator": not_drained,
                                                "this job": f"excludes {node} from its later attempts"}))
            alerted.append(not_drained)
    return alerted


def build_notifier() -> Notifier:
    """infra.notify.notifier_for, with the Slack webhook block looked up on the Prefect server."""
    return notifier_for(os.environ, _server_slack_block)


def _server_slack_block() -> tuple[str, object] | None:
    """(name, WebhookClient) of the Slack webhook block the server holds, or None (no such
    block, no server, prefect-slack missing)."""
    try:
        from prefect.variables import Variable
        from prefect_slack import SlackWebhook

        name = slack_block_name(Variable.get(SLACK_BLOCK_VARIABLE, default=None))
        return name, SlackWebhook.load(name).get_client(sync_client=True)
    except Exception:
        return None


@task(name="alert", cache_policy=NO_CACHE)
def send_alert(notifier: Notifier, alert: Alert) -> bool:
    delivery = notifier.send(alert)
    if not delivery.ok:
        get_run_logger().warning("alert not delivered: %s", delivery.detail)
    return delivery.ok


@task(name="loss-curve", cache_policy=NO_CACHE)
def loss_curve(spec: JobSpec, failure_labels: list[str] | None = None) -> Path | None:
    """Rank 0's loss over steps, attempt by attempt (failures, rollbacks and checkpoints marked:
    training.loss_chart), as an artifact whose chart is inline (it renders in the Prefect UI) and
    as `loss_curve.png` in the run directory. `failure_labels`: the flow's diagnoses, in order."""
    from infra import runfiles
    from training.loss_chart import loss_curve_report

    path = runfiles.log_path(spec.resolved_run_dir, 0)
    out = spec.resolved_run_dir / "loss_curve.png"
    report = loss_curve_report(path, spec.name, failure_labels, png_path=out) if path.exists() else None
    if report is None:
        return None
    create_markdown_artifact(key="pretrain-loss-curve", markdown=report.markdown, description=report.summary)
    return out


def wait(seconds: float) -> None:
    if seconds > 0:
        time.sleep(seconds)
