"""The `pretrain` flow: the on-call runbook for a pretraining job, automated.

    plan and queue  →  hold GPUs  →  launch  →  watch  →  done?  →  diagnose  →  act  →  launch again …

It stops when training finishes, when the job is asked to stop (`forgeflow cancel`, or a
cancellation of this flow: the ranks commit a checkpoint of their current step first and
the next run resumes there), when the diagnosis says a restart cannot help,
or when the restart budget or the circuit breaker says so; every failure, its
diagnosis and the action taken are alerted (Slack, or printed) and kept as
artifacts. The decisions themselves are made in the libraries, not here: what an attempt's
end was (`infra.watch.exit_verdict`: ranks that stopped on a signal nobody asked for failed,
and are recovered like any failure) and the next attempt (`diagnosis.recovery.next_attempt`,
a unit-tested table: which checkpoint it resumes from, what it skips, whether the nodes are
checked first, how long it waits).

Run it without a server:  python -m flows.pretrain configs/tiny-cpu.yaml
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from dataclasses import dataclass, field

from prefect import flow, get_run_logger
from prefect import runtime as prefect_runtime
from prefect.artifacts import create_markdown_artifact, create_progress_artifact

from infra.notify import Alert, flow_run_url
from infra.standby import WarmRestarts, wanted as standby_wanted
from diagnosis.recovery import (
    AttemptOverrides,
    FailedAttempt,
    FailureRecord,
    Interruptions,
    RecoveryHistory,
    RecoveryPolicy,
    after_eviction,
    next_attempt,
)
from checkpoint.manifest import committed_checkpoints
from diagnosis.report import failure_markdown
from scheduler.orchestrator import OrchestratorError
from scheduler.orchestrator.lease import DelegatedJob, HeldJob
from scheduler.cluster import load_inventory
from scheduler.orchestrator.seat import (ProgressReport, Seat, cluster_orchestrator, delegated_placement, delegated_to,
                                        withdraw)
from scheduler.planner import next_plan_hint
from tasks.checkpoint_events import CommitAnnouncer
from flows.evaluate import created_through_the_api
from tasks.eval_tasks import register_for_evaluation
from tasks.cluster_tasks import (
    FlowDelegatedSeat,
    FlowSeat,
    choose_slurm_option,
    flow_db_retry,
    join_cluster,
    publish_cluster_table,
    submit_job,
    wait_for_gpus,
)
from tasks.pretrain_tasks import (
    build_notifier,
    diagnose_attempt,
    loss_curve,
    node_check,
    prepare_data,
    preflight_storage,
    run_attempt,
    send_alert,
    set_aside_abandoned,
    wait,
)
from training.config import JobSpec, as_job_spec


@dataclass
class PretrainResult:
    job: str
    finished: bool
    attempts: int
    final_step: int
    failures: list[FailedAttempt] = field(default_factory=list)
    stopped_because: str = ""
    cancelled: bool = False  # stopped by request (`forgeflow cancel`, or SIGTERM to the flow)
    job_id: int | None = None  # the job's id in the cluster's orchestrator
    run_dir: str = ""  # the job's own run directory (logs, heartbeats, markers, spec)
    # where each attempt ran: {"attempt", "nodes", "world_size", "dp", "tp", "pp", "gpu_type",
    # "micro_batch_size"};
    # after a cordon and re-placement the layout changes (the checkpoint reshards on load)
    placements: list[dict] = field(default_factory=list)
    # attempts ended from outside the job (its lease lost; Slurm's time limit, preemption or node
    # failure), each resumed from the newest committed checkpoint: not failures, no restart spent
    # (but three in a row that commit nothing new stop the job: diagnosis.recovery.Interruptions)
    interruptions: list[str] = field(default_factory=list)


@flow(name="pretrain", log_prints=True)
def pretrain(
    job_spec: str | dict | JobSpec,
    cluster: str = "local",
    max_restarts: int = 5,
    hang_timeout_s: float = 300.0,
    skip_batches: int = 10,
    breaker_count: int = 3,
    backoff_s: float = 5.0,
    drill_faults: list[str] | None = None,
    launcher: str = "local",
    priority: int | str = 0,
    job_id: int | None = None,
    warm_standby: bool | None = None,
) -> PretrainResult:
    """Train a job to completion through failures, with nobody watching.

    Args:
        job_spec: the job spec: a YAML path on this machine, or its content (the validated
            spec as a JSON object, so a worker on another machine needs no file of the submitter's).
            A run created through the API (a deployment's) ignores it: it trains `job_id` with
            the spec the orchestrator recorded.
        cluster: cluster inventory YAML, or "local" to detect this machine (through the API: a
            registered cluster's file).
        max_restarts: restarts allowed before giving up.
        hang_timeout_s: a rank whose heartbeat stops this long is hung.
        skip_batches: batches skipped after rolling back from a loss spike.
        breaker_count: the same failure at the same step this many times stops the job.
        backoff_s: first wait before a restart in place (doubles on repeats).
        drill_faults: fault drills, one per attempt, as FORGEFLOW_FAULT values
            (e.g. ["cuda_error@30:1", "loss_spike@70"]); empty in production.
        launcher: "local" (every node's torchrun on this machine), "prefect" (one
            node-launch run per node, on the work queue named after the node) or "slurm"
            (one batch job per attempt; the cluster file's `slurm:` section says where).
        priority: the job's place in the shared cluster's queue (higher goes first).
        job_id: a job `forgeflow submit` already queued (its spec is `job_spec`): this run
            takes it up instead of queueing a new one.
        warm_standby: keep the next attempt's world started and waiting (infra.standby), so a
            restart on the same nodes is warm; default: where the node has two cores per rank
            (local launcher only).
    """
    if created_through_the_api():  # its parameters are whoever could create a flow run's
        job_spec = _recorded_spec(job_id, cluster)
    spec = as_job_spec(job_spec)
    # 1. Fail fast on what would fail later: the data.
    prepare_data(spec)

    # 2. Queue for GPUs. The user chose none: the planner sizes the job on every GPU type and
    #    the cluster orchestrator, shared by every flow, admits it when the policy finds room
    #    (HAS best fit) — never onto GPUs another job holds, never onto a cordoned node. The
    #    job's id names its run directory, its checkpoints and this flow run. Every decision
    #    that asks the state database waits out an outage (`db`: logged, alerted once it lasts).
    inventory = load_inventory(cluster)
    db = flow_db_retry(spec.name)
    orchestrator = db.call(cluster_orchestrator, "opening the state database")
    # A job `forgeflow submit` queued is in the queue already: a cancellation from here on (the
    # worker's SIGTERM) takes it out in `finally`, however early it comes. One that comes before
    # (or a run cancelled before any worker started it) is the release-cancelled deployment's.
    cluster_name = None
    # Delegated Slurm (issue 32): Slurm decides where and when each attempt runs, so the job is
    # recorded in the orchestrator as a mirror of its batch job (`forgeflow jobs` and `cluster
    # queue` show what Slurm says) but never admitted onto the orchestrator's GPUs: it holds no
    # lease and no allocation, and no other job waits for GPUs it does not use.
    batch_system = delegated_to(launcher, inventory)  # "slurm" in Slurm's delegate mode, else None
    delegated = batch_system is not None
    try:
        cluster_name = join_cluster(orchestrator, inventory, db=db,
                                    source=None if cluster in ("", "local") else str(Path(cluster).resolve()))
        submitted = submit_job(orchestrator, spec, cluster_name, priority, job_id=job_id, db=db,
                               delegated_to=batch_system)
        job_id, spec, plans = submitted.job_id, submitted.spec, submitted.plans
        db.subject = f"{spec.name} (job {job_id})"
        _name_this_run(orchestrator, job_id, spec.name, db)
        report = ProgressReport(orchestrator, job_id, spec.resolved_run_dir, spec.training.steps)
        preflight_storage(spec)  # the job's own checkpoint prefix, before it waits for GPUs
        report.phase("queued")
        try:
            placement = (delegated_placement(plans, inventory, spec.name) if delegated
                         else wait_for_gpus(orchestrator, job_id, plans, spec.name, db=db))
        except OrchestratorError as e:  # cancelled (or failed by an operator) while it waited
            state = db.call(lambda: orchestrator.job(job_id)["state"], f"job {job_id} reading its state")
            result = PretrainResult(job=spec.name, finished=False, attempts=0, final_step=0,
                                    stopped_because=f"ended before it was placed: {e}",
                                    cancelled=state == "cancelled",
                                    job_id=job_id, run_dir=str(spec.resolved_run_dir))
            send_alert(build_notifier(), Alert(f"{spec.name} (job {job_id}) stopped: {result.stopped_because}",
                                               "warning", {"job": str(job_id)},
                                               link=flow_run_url(prefect_runtime.flow_run.id)))
            return result
        # 3. Hold the GPUs while attempts run: the lease is renewed in the background and the
        #    GPUs are released however the flow ends (a flow that dies stops renewing and its
        #    lease expires). A delegated job holds nothing: its stop requests are read all the same.
        with (DelegatedJob if delegated else HeldJob)(orchestrator, job_id, db=db) as held:
            seat = (FlowDelegatedSeat(orchestrator, job_id, held, cluster_name, plans, spec.name, db=db,
                                      inventory=inventory) if delegated
                    else FlowSeat(orchestrator, job_id, held, cluster_name, plans, spec.name, db=db))
            # the standby world (if any) is stopped however the attempts end
            with WarmRestarts(standby_wanted(launcher, placement.world_size, asked=warm_standby),
                              log=get_run_logger().info) as restarts:
                result = _train(spec, inventory, placement, seat, report, max_restarts=max_restarts,
                                hang_timeout_s=hang_timeout_s, skip_batches=skip_batches,
                                breaker_count=breaker_count, backoff_s=backoff_s, drill_faults=drill_faults,
                                launcher=launcher, warm=restarts)
            result.job_id, result.run_dir = job_id, str(spec.resolved_run_dir)
            held.outcome = "finished" if result.finished else "cancelled" if result.cancelled else "failed"
            held.reason = None if result.finished else result.stopped_because[:500]
            report.phase(held.outcome, step=result.final_step)
    finally:
        if job_id is not None:
            withdraw(orchestrator, job_id, db)  # a run cancelled while it waits leaves the queue
        if cluster_name is not None:
            publish_cluster_table(orchestrator, cluster_name)
    return result


def _recorded_spec(job_id: int | None, cluster: str) -> dict:
    """A run created through the API trains a job `forgeflow submit` queued, with the spec the
    orchestrator recorded for it, on this machine or a registered cluster: it reads no spec file
    and no inventory file a parameter points at (issue 29). ConfigError otherwise, one line."""
    from evalsuite import job_scope
    from training.config import ConfigError

    if job_id is None:
        raise ConfigError("a pretrain run created through the API trains a job `forgeflow submit` queued: give its "
                          "job_id (the spec then comes from the state database, not from this run's parameters)")
    orchestrator = cluster_orchestrator()
    if cluster not in ("", "local"):
        try:
            job_scope.check_cluster_file(orchestrator.engine, cluster, "cluster")
        except job_scope.EvalScopeError as e:
            raise ConfigError(str(e)) from None
    try:
        recorded = orchestrator.job(job_id)["spec"]
    except OrchestratorError as e:
        raise ConfigError(f"job_id {job_id}: {e}") from None
    if not recorded:
        raise ConfigError(f"job {job_id} has no recorded spec (queued by an older forgeflow): submit it again")
    return recorded


def _name_this_run(orchestrator, job_id: int, name: str, db) -> None:
    """The flow run is named after its job ("tiny-cpu-7"), and the job records the flow run that
    runs it (`forgeflow jobs` shows it; `forgeflow cancel` reaches it through the database)."""
    run_id = prefect_runtime.flow_run.id
    if not run_id:
        return
    runner = {"flow_run_id": str(run_id)}
    try:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            client.update_flow_run(run_id, name=f"{name}-{job_id}")
        link = flow_run_url(run_id)  # None when no UI address is known
        if link:
            runner["url"] = link
    except Exception as e:  # a name is not worth failing the job for
        get_run_logger().warning("could not name the flow run after job %s: %s", job_id, e)
    db.call(lambda: orchestrator.set_runner(job_id, runner), f"job {job_id} recording its flow run")


def _preempted(seat: Seat, outcome, job: str, notifier, link, report: ProgressReport):
    """Yield the GPUs to the job this one was preempted for, or for an elastic resize (released as
    preempted, queued again at its submit time; a resize's next admission is its new layout), say
    so, and wait to be placed again: (placement, None), or (None, why) when it was not placed
    again (cancelled meanwhile)."""
    by = seat.preempted_by()
    resize = seat.resize()  # an elastic resize stops the same way; its next admission is the new layout
    what = (f"resized from {resize['from_gpus']} to {resize['to_gpus']} GPUs"
            + (f" for job {by}" if resize.get("kind") == "shrink" else "") if resize else f"preempted by job {by}")
    stop = outcome.stop if outcome is not None else None
    where = (f"after step {stop.step} with checkpoint {stop.checkpoint_step} committed" if stop
             else "while it recovered from a failure" if outcome is None
             else "with no new checkpoint committed on the way out")
    get_run_logger().warning("%s %s %s; waiting to be placed again", job, what, where)
    report.phase("preempted", preempted_by=by, **({"resize": resize} if resize else {}))
    send_alert(notifier, Alert(f"{job} {what}: stopped {where}, queued again at its submit time",
                               "info" if resize else "warning",
                               {"resized" if resize else "preempted by": what if resize else f"job {by}"}, link=link))
    try:
        return seat.yield_to_preemption(), None
    except OrchestratorError as e:
        return None, f"{what} and not placed again: {e}"


def _train(spec, inventory, placement, seat: Seat, report: ProgressReport, *, max_restarts: int, hang_timeout_s: float,
           skip_batches: int, breaker_count: int, backoff_s: float, drill_faults: list[str] | None,
           launcher: str, warm: WarmRestarts) -> PretrainResult:
    """The runbook's loop on the GPUs the job holds: launch, watch, diagnose, act, launch again."""
    logger = get_run_logger()
    notifier = build_notifier()
    policy = RecoveryPolicy(max_restarts=max_restarts, breaker_count=breaker_count, backoff_s=backoff_s,
                            skip_batches=skip_batches)
    drills = list(drill_faults or [])
    flow_run_id = prefect_runtime.flow_run.id
    link = flow_run_url(flow_run_id)  # every alert links to this run (None without a UI address)
    job = f"{spec.name} (job {spec.job})"

    progress = create_progress_artifact(progress=0.0, description=f"{spec.name}: training progress")
    history = RecoveryHistory()
    interruptions = Interruptions()
    result = PretrainResult(job=spec.name, finished=False, attempts=0, final_step=0)
    # triggers the evaluate-checkpoint deployment; each commit's time goes to the job's progress
    # (what a preemption would lose is the work since: scheduler/preemption.py)
    announcer = CommitAnnouncer(spec, on_commit=report.committed)
    if spec.eval.suite:  # the job asked for evaluation: the catch-up deployment covers it from now on
        register_for_evaluation(spec, ",".join(spec.eval.suite))
    resume_from: int | None = None  # None: the newest committed checkpoint
    overrides = AttemptOverrides()
    attempt = 0
    outcome = None
    while True:
        if seat.lease_lost():
            # The lease ran out while this flow stalled (the watcher stopped the attempt's ranks,
            # or it ran out between attempts): its GPUs may run another job by now, so nothing is
            # launched there. Not a failure of the job: wait to be admitted again (the
            # orchestrator re-queued it) and go on from the newest committed checkpoint,
            # wherever the job is placed.
            logger.warning("%s; waiting to be placed again", seat.lease_lost())
            try:
                placement = seat.rejoin()
            except OrchestratorError as e:  # lost too often, or cancelled by an operator meanwhile
                result.stopped_because = (f"lost its GPUs after step {result.final_step} and was not "
                                          f"placed again: {e}")
                break
            resume_from = None
            overrides = after_eviction(history, lambda: [r.step for r in committed_checkpoints(spec.checkpoint)])
        env = {"FORGEFLOW_FAULT": drills[attempt]} if attempt < len(drills) and drills[attempt] else {}
        # A drill fires once per flow run: its "fired" record in the run directory carries this
        # run's id, so a new flow run of the same job drills again instead of skipping silently.
        env["FORGEFLOW_FAULT_SCOPE"] = str(flow_run_id or "")
        # 4. Launch one torchrun per node on the held GPUs and watch it.
        if result.failures:  # when recovery from the last failure relaunched (benchmarks/recovery.py)
            result.failures[-1].relaunched_at = time.time()
        if delegated_to(launcher, inventory):  # Slurm knows its queue: each option is put to it
            # (sbatch --test-only) and the one it would finish first is submitted (infra.slurm_start)
            placement = choose_slurm_option(spec, seat.plans, placement, attempt, inventory,
                                            spec.training.steps - result.final_step)
        result.placements.append({"attempt": attempt, "nodes": list(placement.nodes),
                                  "world_size": placement.world_size, "dp": placement.dp, "tp": placement.tp,
                                  "pp": placement.pp, "gpu_type": placement.gpu_type,
                                  "micro_batch_size": getattr(placement.plan, "micro_batch_size", None)})
        report.phase("training", attempt=attempt)
        gpus = f"{placement.world_size}x {placement.gpu_type}"
        outcome = run_attempt(spec, placement, attempt, resume_from, overrides,
                              hang_timeout_s, env, progress, launcher, announcer, cluster=inventory,
                              stop_when=seat.lease_lost, stop_requested=seat.stop_requested,
                              # each step; and Slurm's reason while it keeps the job queued (a
                              # delegated job's seat mirrors what Slurm says of its batch job)
                              on_step=lambda step: (report.step(step), seat.attempt_running()),
                              on_waiting=lambda why: (report.phase("waiting" if why else "training", waiting=why),
                                                      seat.attempt_waiting(why)),
                              on_started=lambda handle: seat.attempt_started(handle, gpus), warm=warm)
        seat.attempt_ended()
        announcer.poll(force=True)
        result.attempts = attempt + 1
        result.final_step = max(result.final_step, outcome.last_step)
        if outcome.ok:
            break
        if outcome.status == "evicted":  # lease lost (see the loop's top) or Slurm ended the job: ranks stopped
            logger.warning("attempt %d evicted at step %d: %s", attempt, outcome.last_step, outcome.evicted)
            result.interruptions.append(f"attempt {attempt}: {outcome.evicted}")
            try:
                newest = max((r.step for r in committed_checkpoints(spec.checkpoint)), default=None)
            except Exception as e:  # noqa: BLE001 - storage may be what failed: count nothing, go on
                logger.warning("could not list the committed checkpoints (%s): %s", type(e).__name__, e)
                stop = None
            else:
                stop = interruptions.record(newest, outcome.evicted)
            if stop:  # interrupted again and again before committing anything: it would never finish
                result.stopped_because = stop
                break
            resume_from = None  # the newest committed checkpoint, on whatever the next allocation gives
            attempt += 1
            continue
        if outcome.status == "stopped" and seat.preempted_by() is not None:
            # preempted for a job that needs the GPUs: the ranks committed the step they were on;
            # queued again at its submit time, it goes on from that checkpoint once placed again
            placement, stopped = _preempted(seat, outcome, job, notifier, link, report)
            if stopped:
                result.stopped_because = stopped
                break
            resume_from, overrides = None, AttemptOverrides()
            attempt += 1
            continue
        if outcome.status == "stopped":  # the watcher stopped it on `forgeflow cancel`: nothing to diagnose
            # (ranks that stopped on a signal nobody recorded asking for are a failure: below)
            why = outcome.requested_stop or "stopped by request"
            result.stopped_because = (f"{why}; stopped after step {outcome.stop.step} with checkpoint "
                                      f"{outcome.stop.checkpoint_step} committed in {spec.checkpoint.url}"
                                      if outcome.stop else f"{why}; no checkpoint was committed on the way out")
            if outcome.stop:
                result.final_step = max(result.final_step, outcome.stop.step)
            result.cancelled = True
            break

        # 5. Diagnose: rules first, then the failure agent; spike and hang from the watcher.
        detected_at = time.time()
        diagnosis = diagnose_attempt(spec, outcome, attempt, placement)
        diagnosed_at = time.time()
        failed_step = outcome.last_step
        history.failures.append(FailureRecord(diagnosis.root_cause, failed_step))
        report.phase("recovering", step=failed_step, diagnosis=diagnosis.root_cause)
        # 6. Decide the next attempt from the table: restart, node check, roll back or stop.
        decided = next_attempt(
            diagnosis, failed_step, history, policy,
            committed_steps=lambda: [r.step for r in committed_checkpoints(spec.checkpoint)],
            spike_onset_step=outcome.spike.onset_step if outcome.spike else None,
            oom_suggestion=next_plan_hint(spec, inventory) if diagnosis.root_cause == "OutOfMemoryError" else "",
        )
        logger.warning("attempt %d %s at step %d: %s -> %s (%s)", attempt, outcome.status, failed_step,
                       diagnosis.root_cause, decided.action.value, decided.reason)

        # 7. Act, and say what was done and why. A node check cordons the faulty nodes and
        #    places the job again on healthy ones.
        if decided.checks_nodes:
            checked = node_check(placement, spec.resolved_run_dir, attempt, {}, launcher, cluster=inventory,
                                 job_id=seat.job_id, warm=warm)
            try:
                if checked.faulty:  # cordoned for every flow; placed again on healthy nodes
                    placement = seat.replace(checked.faulty, inventory,
                                             f"failed the node check after attempt {attempt}")
                decided = decided.after_node_check(checked.summary(), checked.faulty, placement.nodes)
            except OrchestratorError as e:  # no plan fits the nodes left (or the job was cancelled)
                decided = decided.cannot_place(checked.summary(), checked.faulty, str(e))
        if decided.set_aside_after is not None:
            # A rollback abandons the spike's timeline: its checkpoints stop counting before
            # the relaunch, so a later plain restart resumes from the rollback's, not the spike's.
            set_aside_abandoned(spec, decided.set_aside_after,
                                f"abandoned by the loss-spike rollback after attempt {attempt}")
        resume_from, overrides = decided.resume_from, decided.overrides
        history.rollback = decided.rollback  # its skip holds for later attempts until it commits

        failure = FailedAttempt.of(attempt, outcome.status, failed_step, diagnosis, decided,
                                   seconds_to_detect=outcome.seconds, detected_at=detected_at,
                                   diagnosed_at=diagnosed_at, decided_at=time.time())
        result.failures.append(failure)
        create_markdown_artifact(key=f"pretrain-failure-{failure.attempt}",
                                 markdown=failure_markdown(job, diagnosis, failure, decided.suggestion),
                                 description=f"Failure {failure.attempt} of {job}: {diagnosis.root_cause}")
        send_alert(notifier, _failure_alert(job, diagnosis, decided, link))

        if decided.stops:
            result.stopped_because = decided.reason
            break
        wait(decided.backoff_s)
        seat.check_stop()  # as of now: a preemption or cancel while it recovered launches nothing
        if seat.preempted_by() is not None:  # preempted while it recovered: yield, then relaunch
            placement, stopped = _preempted(seat, None, job, notifier, link, report)
            if stopped:
                result.stopped_because = stopped
                break
        elif seat.stop_requested():  # cancelled while it recovered: launch nothing more
            result.stopped_because, result.cancelled = seat.stop_requested(), True
            break
        history.restarts += 1
        attempt += 1

    # 8. Report: loss curve, completion (or the reason it stopped).
    loss_curve(spec, [f"{f.root_cause}: {f.action.split(' — ')[0]}" for f in result.failures])
    if outcome is not None and outcome.ok:
        result.finished = True
        title = f"{job} finished: step {result.final_step} after {result.attempts} attempt(s)"
        recovered = len(result.failures)
        send_alert(notifier, Alert(title, "success", {
            "failures recovered": str(recovered),
            "checkpoints": spec.checkpoint.url,
        }, link=link))
    else:
        severity = "warning" if outcome is not None and outcome.status == "stopped" else "error"
        send_alert(notifier, Alert(f"{job} stopped: {result.stopped_because}", severity,
                                   {"attempts": str(result.attempts), "last step": str(result.final_step)},
                                   link=link))
    return result


def _failure_alert(job: str, diagnosis, decided, link: str | None) -> Alert:
    from diagnosis.slack_format import to_alert

    alert = to_alert(diagnosis, job, decided.text, link)
    alert.fields["why"] = decided.reason
    if decided.suggestion:
        alert.fields["suggestion"] = decided.suggestion
    return alert


if __name__ == "__main__":
    outcome = pretrain(sys.argv[1], *(sys.argv[2:3] or []))
    print(outcome)
    sys.exit(0 if outcome.finished else 1)
