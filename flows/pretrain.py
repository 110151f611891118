"""The `pretrain` flow: the on-call runbook for a pretraining job, automated.

    plan and place  →  launch  →  watch  →  done?  →  diagnose  →  act  →  launch again …

It stops when training finishes, when the diagnosis says a restart cannot help,
or when the restart budget or the circuit breaker says so; every failure, its
diagnosis and the action taken are alerted (Slack, or printed) and kept as
artifacts. The decisions themselves are made by `diagnosis.recovery.decide`, a
unit-tested table, not here.

Run it without a server:  python -m flows.pretrain configs/tiny-cpu.yaml
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_progress_artifact

from infra.notify import Alert
from diagnosis.recovery import Action, FailureRecord, RecoveryHistory, RecoveryPolicy, decide, rollback_step
from tasks.checkpoint_events import CommitAnnouncer, committed_checkpoints
from tasks.pretrain_tasks import (
    build_notifier,
    diagnose_attempt,
    load_cluster,
    loss_curve,
    node_check,
    plan_and_place,
    prepare_data,
    preflight_storage,
    run_attempt,
    send_alert,
    wait,
)
from training.config import load_job_spec


@dataclass
class PretrainResult:
    job: str
    finished: bool
    attempts: int
    final_step: int
    failures: list[dict] = field(default_factory=list)
    stopped_because: str = ""


def gpu_limit_name(gpu_type: str) -> str:
    """The global concurrency limit holding a GPU type's GPUs (`forgeflow deploy` creates one
    per type in the inventory, its limit the type's GPU count)."""
    return f"forgeflow-gpus-{gpu_type}"


@contextmanager
def gpu_slots(placement):
    """Hold one slot per placed GPU for as long as the attempt runs.

    Without a Prefect server, or without a limit of that name on it, this is a no-op.
    A training attempt outlives many lease periods, so a lease-renewal hiccup must not
    kill it (raise_on_lease_renewal_failure=False); the slots are released when the
    attempt ends, so diagnosis and back-off do not hold GPUs.
    """
    from prefect.concurrency.sync import concurrency
    from prefect.settings import PREFECT_API_URL

    if not PREFECT_API_URL.value():  # ephemeral API (make demo): no other flow to share GPUs with
        yield
        return
    with concurrency(gpu_limit_name(placement.gpu_type), occupy=placement.world_size, strict=False,
                     lease_duration=300, raise_on_lease_renewal_failure=False):
        yield


@flow(name="pretrain", log_prints=True)
def pretrain(
    job_spec: str,
    cluster: str = "local",
    max_restarts: int = 5,
    hang_timeout_s: float = 300.0,
    skip_batches: int = 10,
    breaker_count: int = 3,
    backoff_s: float = 5.0,
    drill_faults: list[str] | None = None,
    launcher: str = "local",
) -> PretrainResult:
    """Train a job to completion through failures, with nobody watching.

    Args:
        job_spec: path of the job spec YAML.
        cluster: cluster inventory YAML, or "local" to detect this machine.
        max_restarts: restarts allowed before giving up.
        hang_timeout_s: a rank whose heartbeat stops this long is hung.
        skip_batches: batches skipped after rolling back from a loss spike.
        breaker_count: the same failure at the same step this many times stops the job.
        backoff_s: first wait before a restart in place (doubles on repeats).
        drill_faults: fault drills, one per attempt, as FORGEFLOW_FAULT values
            (e.g. ["cuda_error@30:1", "loss_spike@70"]); empty in production.
        launcher: "local" (every node's torchrun on this machine) or "prefect" (one
            node-launch run per node, on the work queue named after the node).
    """
    logger = get_run_logger()
    spec = load_job_spec(job_spec)
    notifier = build_notifier()
    policy = RecoveryPolicy(max_restarts=max_restarts, breaker_count=breaker_count, backoff_s=backoff_s,
                            skip_batches=skip_batches)
    drills = list(drill_faults or [])

    # 1. Size and place: the user did not choose GPUs, the planner does.
    inventory = load_cluster(cluster)
    placement = plan_and_place(spec, inventory)
    # 2. Fail fast on what would fail later: data and checkpoint storage.
    prepare_data(spec)
    preflight_storage(spec)

    progress = create_progress_artifact(progress=0.0, description=f"{spec.name}: training progress")
    history = RecoveryHistory()
    result = PretrainResult(job=spec.name, finished=False, attempts=0, final_step=0)
    announcer = CommitAnnouncer(spec, str(job_spec))  # triggers the evaluate-checkpoint deployment
    resume_from: int | None = None
    extra_sets: list[str] = []
    attempt = 0
    while True:
        env = {"FORGEFLOW_FAULT": drills[attempt]} if attempt < len(drills) and drills[attempt] else {}
        # 3. Launch one torchrun per node and watch it, holding the placed GPUs in the
        #    GPU type's global concurrency limit so no other flow is placed onto them.
        if result.failures:  # when recovery from the last failure relaunched (benchmarks/recovery.py)
            result.failures[-1]["relaunched_at"] = time.time()
        with gpu_slots(placement):
            outcome = run_attempt(str(job_spec), spec, placement, attempt, extra_sets, resume_from,
                                  hang_timeout_s, env, progress, launcher, announcer)
        announcer.poll(force=True)
        result.attempts = attempt + 1
        result.final_step = max(result.final_step, outcome.last_step)
        if outcome.ok:
            break

        # 4. Diagnose: rules first, then the failure agent; spike and hang from the watcher.
        detected_at = time.time()
        diagnosis = diagnose_attempt(spec, outcome, attempt)
        diagnosed_at = time.time()
        failed_step = outcome.last_step
        history.failures.append(FailureRecord(diagnosis.root_cause, failed_step))
        decision = decide(diagnosis, failed_step, history, policy, oom_suggestion=_next_plan_hint(spec, inventory))
        logger.warning("attempt %d %s at step %d: %s -> %s (%s)", attempt, outcome.status, failed_step,
                       diagnosis.root_cause, decision.action.value, decision.reason)

        # 5. Act, and say what was done and why.
        action_text = decision.action.value
        if decision.action is Action.NODE_CHECK_RESTART:
            report = node_check(placement, spec.resolved_run_dir, attempt, {}, launcher)
            action_text += f" — node check: {report.summary()}"
            if report.faulty:
                for name in report.faulty:
                    inventory.node(name).cordoned = True
                from scheduler.placement import release_placement

                release_placement(inventory, placement)
                placement = plan_and_place(spec, inventory)
                action_text += f"; cordoned {report.faulty}, re-placed on {placement.nodes}"
            resume_from, extra_sets = None, []
        elif decision.action is Action.ROLLBACK:
            onset = int((outcome.spike or {}).get("onset_step", failed_step))
            resume_from = rollback_step([step for step, _ in committed_checkpoints(spec)], onset)
            extra_sets = [f"spike.skip_batches={policy.skip_batches}"]
            action_text += f" — resume from checkpoint step {resume_from}, skip {policy.skip_batches} batches"
            if resume_from is None:
                decision.action, decision.reason = Action.STOP, "no committed checkpoint before the spike onset"
        elif decision.action is Action.RESTART:
            resume_from, extra_sets = None, []
            action_text += f" after {decision.backoff_s:.0f}s backoff"

        failure = {"attempt": attempt, "status": outcome.status, "step": failed_step,
                   "root_cause": diagnosis.root_cause, "kind": diagnosis.kind, "source": diagnosis.source,
                   "action": action_text, "reason": decision.reason,
                   "seconds_to_detect": round(outcome.seconds, 1),
                   "detected_at": detected_at, "diagnosed_at": diagnosed_at, "decided_at": time.time()}
        result.failures.append(failure)
        _failure_artifact(spec.name, attempt, diagnosis, failure, decision.suggestion)
        send_alert(notifier, _failure_alert(spec.name, diagnosis, decision, action_text))

        if decision.action is Action.STOP:
            result.stopped_because = decision.reason
            break
        wait(decision.backoff_s)
        history.restarts += 1
        attempt += 1

    # 6. Report: loss curve, completion (or the reason it stopped).
    loss_curve(spec)
    if outcome.ok:
        result.finished = True
        title = f"{spec.name} finished: step {result.final_step} after {result.attempts} attempt(s)"
        recovered = len(result.failures)
        send_alert(notifier, Alert(title, "success", {
            "failures recovered": str(recovered),
            "checkpoints": spec.checkpoint.url,
        }))
    else:
        send_alert(notifier, Alert(f"{spec.name} stopped: {result.stopped_because}", "error",
                                   {"attempts": str(result.attempts), "last step": str(result.final_step)}))
    return result


def _next_plan_hint(spec, inventory) -> str:
    """For an OOM: the plan the planner would pick with activations recomputed."""
    try:
        from scheduler.planner import PlannerConfig, plan_job

        plans = plan_job(spec, inventory, PlannerConfig(recompute=("full",)))
        best = plans[0]
        return f"next plan: {best.num_gpus}x {best.gpu_type} {best.layout} (predicted peak {best.peak_memory_bytes / 2**30:.1f} GiB)"
    except Exception as e:  # a hint, never a second failure
        return f"no alternative plan found ({type(e).__name__})"


def _failure_alert(job: str, diagnosis, decision, action_text: str) -> Alert:
    from diagnosis.slack_format import to_alert

    alert = to_alert(diagnosis, job, action_text)
    alert.fields["why"] = decision.reason
    if decision.suggestion:
        alert.fields["suggestion"] = decision.suggestion
    return alert


def _failure_artifact(job: str, attempt: int, diagnosis, failure: dict, suggestion: str) -> None:
    evidence = "\n".join(diagnosis.culprit_lines[:10])
    create_markdown_artifact(
        key=f"pretrain-failure-{attempt}",
        markdown=(
            f"## {job}: attempt {attempt} failed at step {failure['step']}\n\n"
            f"| root cause | kind | restart helps | source | action |\n|---|---|---|---|---|\n"
            f"| {diagnosis.root_cause} | {diagnosis.kind} | {diagnosis.restart_helps} | {diagnosis.source} "
            f"| {failure['action']} |\n\n**Why:** {failure['reason']}\n\n"
            + (f"**Suggestion:** {suggestion}\n\n" if suggestion else "")
            + f"```\n{evidence}\n```"
        ),
        description=f"Failure {attempt} of {job}: {diagnosis.root_cause}",
    )


if __name__ == "__main__":
    outcome = pretrain(sys.argv[1], *(sys.argv[2:3] or []))
    print(outcome)
    sys.exit(0 if outcome.finished else 1)
