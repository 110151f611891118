"""Prefect tasks between a flow and the cluster orchestrator: join the shared cluster, queue the
job, wait for GPUs where people can see it, and show the cluster as a table.

The decisions are `scheduler.orchestrator.seat`'s (testable without Prefect); these tasks add
what people see in the Prefect UI: the ranked plans, the queue while the job waits, the
placement picture and the live cluster table. The orchestrator keeps the cluster's state in
the state database every flow shares (FORGEFLOW_DB_URL, else SQLite in the state dir), so two
flows never place onto the same GPUs and a node one flow cordoned stays cordoned for all of them.
Every call to it goes through the flow's `StateDbRetry` (`flow_db_retry`): a database outage
is waited out, in the run's log, with an alert once it lasts; the tables are skipped instead.
"""

from __future__ import annotations

import json
import re
import time

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from infra.notify import flow_run_url
from infra.statedb.retry import OUTAGE_ERRORS, OutagePolicy, StateDbRetry
from infra.untrusted_text import fenced
from scheduler.cluster import Cluster
from scheduler.orchestrator import Orchestrator
from scheduler.orchestrator.seat import (DelegatedSeat, Seat, SubmittedJob, adopt_job, admitted_placement,
                                        cordon_nodes, plan_and_submit, sync_inventory)
from scheduler.orchestrator.start_estimates import queue_estimates, start_text
from scheduler.orchestrator.views import cluster_markdown, cluster_status, queue_snapshot
from scheduler.placement import Placement
from training.config import JobSpec

WAIT_LOG_EVERY_S = 60.0


def _slug(text: str) -> str:
    """Artifact keys: lowercase letters, digits and dashes."""
    return re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-") or "cluster"


def flow_db_retry(subject: str) -> StateDbRetry:
    """The flow run's StateDbRetry: its waits in the run's log, its alerts through the flow's
    notifier (Slack) with a link to the run, after $FORGEFLOW_DB_ALERT_AFTER_S (default 60 s)."""
    from prefect import runtime
    from prefect.exceptions import MissingContextError

    from tasks.pretrain_tasks import build_notifier

    try:
        logger = get_run_logger()
    except MissingContextError:  # the flow's function called directly (`.fn`): no run to log into
        return StateDbRetry(OutagePolicy.from_environ(), subject=subject)
    return StateDbRetry(OutagePolicy.from_environ(), notify=build_notifier().send, logger=logger, subject=subject,
                        link=flow_run_url(runtime.flow_run.id))


def publish_cluster_table(orch: Orchestrator, cluster: str) -> None:
    """The live cluster table (nodes x GPUs: the job holding each GPU, or the node's cordon);
    skipped while the database does not answer (a table is never worth failing the run for)."""
    try:
        status = cluster_status(orch.engine, cluster)
    except OUTAGE_ERRORS as e:
        get_run_logger().warning("cluster table of %s not updated: %s", cluster, e)
        return
    create_markdown_artifact(key=f"cluster-{_slug(cluster)}", markdown=cluster_markdown(status),
                             description=f"Cluster {cluster}: who holds which GPU, and cordoned nodes")


@task(name="join-cluster", cache_policy=NO_CACHE)
def join_cluster(orch: Orchestrator, inventory: Cluster, db: StateDbRetry | None = None,
                 source: str | None = None) -> str:
    """`sync_inventory`: the inventory (from the file `source`, None for this machine) registered
    (or updated) with the orchestrator, its unschedulable nodes cordoned there too; then the
    cluster table."""
    if (db or StateDbRetry()).call(lambda: sync_inventory(orch, inventory, source=source),
                                   f"joining cluster {inventory.name}"):
        get_run_logger().info("registered cluster %s (%d GPUs) with the orchestrator", inventory.name,
                              inventory.total_gpus)
    else:
        get_run_logger().info("cluster %s is registered with the orchestrator; node health comes from there",
                              inventory.name)
    publish_cluster_table(orch, inventory.name)
    return inventory.name


def plans_table(plans: list, chosen=None, top: int = 10, starts: dict | None = None) -> list[dict]:
    """The ranked plans as rows: `peak_gib` is MARP's per-GPU peak (what `forgeflow plan`
    shows), `needs_gib` that with the planner's safety margin (the GPU memory the plan asks
    of a GPU); `chosen` marks the plan the orchestrator admitted, once known (listed after
    the `top` when it ranks below them). `starts` (delegated Slurm: id(plan) -> its
    `infra.slurm_start.StartOption`) adds Slurm's predicted start and completion of each option."""
    rows = []
    for i, p in enumerate(plans):
        if not (i < top or p is chosen or (starts and id(p) in starts)):
            continue
        row = {"rank": i + 1, "chosen": "✓" if p is chosen else "", "gpu_type": p.gpu_type, "gpus": p.num_gpus,
               "layout": p.layout, "peak_gib": round(p.peak_memory_bytes / 2**30, 2),
               "needs_gib": round(p.required_memory_bytes / 2**30, 2),
               "step_s": round(p.predicted_step_time_s, 3), "tokens_per_s": round(p.tokens_per_s)}
        if starts is not None:
            option = starts.get(id(p))
            row["slurm_start"] = ("" if option is None else f"refused: {option.said}" if option.refused
                                  else f"{option.start:%Y-%m-%d %H:%M:%S} UTC")
            row["slurm_completes"] = "" if option is None or option.refused else f"{option.completion:%Y-%m-%d %H:%M:%S} UTC"
        rows.append(row)
    return rows


def publish_plans(job: str, cluster: str, plans: list, chosen=None, starts: dict | None = None) -> None:
    """The `pretrain-plans` table: at submission, and again with the admitted plan marked (on a
    delegated Slurm, with Slurm's predicted start of each option and the one submitted marked)."""
    what = "submitted to Slurm: the earliest predicted completion" if starts is not None else "admitted"
    admitted = f"; ✓ the {what} plan ({chosen.num_gpus}x {chosen.gpu_type}, {chosen.layout})" if chosen else ""
    create_table_artifact(
        key="pretrain-plans", table=plans_table(plans, chosen, starts=starts),
        description=(f"Ranked plans for {job} on {cluster} (MARP peak memory per GPU, and with the safety "
                     f"margin; cost-model step time){admitted}"),
    )


def slurm_candidates(spec: JobSpec, plans: list, placement: Placement, attempt: int, inventory: Cluster,
                     steps_left: int) -> list[tuple[object, Placement, object]]:
    """The job's options as Slurm would be asked for them, in the planner's order: the best plan
    of each (GPU type, GPU count), laid out in nodes x ranks per node as the orchestrator lays it
    (the admitted option: the admitted placement; the others on the idle inventory: Slurm chooses
    the nodes, only their number and ranks per node are asked for). (plan, placement, candidate)."""
    from infra.launch import LaunchRequest
    from infra.slurm_start import StartCandidate
    from scheduler.placement import place_plans

    admitted = (placement.gpu_type, placement.world_size)
    seen: set[tuple[str, int]] = set()
    out = []
    for plan in plans:
        key = (plan.gpu_type, plan.num_gpus)
        if key in seen:
            continue
        seen.add(key)
        laid = placement if key == admitted else place_plans([plan], inventory, job=spec.name)
        if laid is None:  # no longer fits the inventory's schedulable nodes
            continue
        if laid is placement and placement.plan is None:
            placement.plan = plan
        step_s = laid.predicted_step_time_s or plan.predicted_step_time_s
        per_node = max(a.nproc for a in laid.assignments)
        label = (f"{plan.num_gpus}x {plan.gpu_type} on {len(laid.assignments)} node(s) x {per_node} "
                 f"({plan.layout})")
        request = LaunchRequest(spec.name, laid.launch_specs(), [], spec.resolved_run_dir, attempt=attempt)
        out.append((plan, laid, StartCandidate(label, request, laid.gpu_type, max(1, steps_left) * step_s)))
    return out


@task(name="choose-slurm-option", cache_policy=NO_CACHE)
def choose_slurm_option(spec: JobSpec, plans: list, placement: Placement, attempt: int, inventory: Cluster,
                        steps_left: int) -> Placement:
    """Delegated Slurm: `sbatch --test-only` for each of the job's options and the placement of
    the one Slurm would finish first (`infra.slurm_start.choose_start`); the choice and the
    others' predicted starts in the log and the plans table. SlurmStartRefused when Slurm would
    start none."""
    from datetime import datetime, timezone

    from infra.slurm_start import choose_start
    from tasks.launchers import make_launcher

    options = slurm_candidates(spec, plans, placement, attempt, inventory, steps_left)
    if not options:
        return placement
    launcher = make_launcher("slurm", cluster=inventory, gpu_type=placement.gpu_type)
    choice = choose_start(launcher, [candidate for _, _, candidate in options])
    plan, chosen, _ = options[choice.chosen_index]
    get_run_logger().info("attempt %d: %s", attempt, choice.summary(datetime.now(timezone.utc)))
    chosen.plan = chosen.plan or plan
    publish_plans(spec.name, inventory.name, plans, plan,
                  starts={id(p): option for (p, _, _), option in zip(options, choice.options)})
    return chosen


@task(name="submit-job", cache_policy=NO_CACHE)
def submit_job(orch: Orchestrator, spec: JobSpec, cluster: str, priority: int = 0,
               job_id: int | None = None, db: StateDbRetry | None = None,
               delegated_to: str | None = None) -> SubmittedJob:
    """`plan_and_submit` (MARP plans on every GPU type, queued), or with `job_id` `adopt_job` (the
    job `forgeflow submit` queued), and the ranked plans as a table. A submission the database
    did not answer was rolled back, so it is made again. `delegated_to` ("slurm": delegated
    mode, `seat.delegated_to`): recorded as a delegated job, never queued for the orchestrator's
    GPUs (an adopted one leaves the queue: `Orchestrator.delegate`)."""
    db = db or StateDbRetry()

    def submit() -> SubmittedJob:
        if job_id is None:
            return plan_and_submit(orch, spec, cluster, priority, delegated_to=delegated_to)
        adopted = adopt_job(orch, job_id)
        if delegated_to is not None:
            orch.delegate(job_id, delegated_to)
        return adopted

    submitted = db.call(submit, f"queueing {spec.name}")
    job_id, plans, spec = submitted.job_id, submitted.plans, submitted.spec
    inventory = db.call(lambda: orch.cluster(cluster), f"job {job_id} reading its cluster")
    publish_plans(spec.name, cluster, plans)
    where = (f"recorded with the orchestrator as job {job_id}, delegated to {delegated_to} (it decides where and "
             "when; nothing is held here)" if delegated_to else f"queued with the orchestrator as job {job_id}")
    get_run_logger().info("job %s %s (%d plan(s) on %s); run directory %s",
                          spec.name, where, len(plans), ", ".join(inventory.gpu_types()), spec.run_dir)
    return submitted


@task(name="wait-for-gpus", cache_policy=NO_CACHE)
def wait_for_gpus(orch: Orchestrator, job_id: int, plans: list, job: str, poll_s: float = 2.0,
                  db: StateDbRetry | None = None) -> Placement:
    """`admitted_placement`, while the run shows "waiting for GPUs, position N of M", why it waits
    and when it should start (`start_estimates`: a markdown artifact updated when the position
    changes and at least every minute), and logs the same at least every minute. A database
    outage is waited out (`db`) and the wait goes on."""
    db = db or StateDbRetry(logger=get_run_logger())
    logger = get_run_logger()
    key = f"queue-{_slug(job)}-{job_id}"
    shown: dict[str, object] = {"position": None, "at": 0.0}
    started = time.monotonic()

    def on_wait(position: int, length: int) -> None:
        now = time.monotonic()
        if position == shown["position"] and now - shown["at"] < WAIT_LOG_EVERY_S:
            return
        shown["position"], shown["at"] = position, now
        cluster = orch.job(job_id)["cluster"]
        estimate = queue_estimates(orch.engine, cluster).get(job_id)
        headline = f"{job} (job {job_id}): waiting for GPUs, position {position} of {length}"
        detail = "" if estimate is None else f"{estimate.why}; {start_text(estimate.start_s)}"
        snap = queue_snapshot(orch.engine, cluster)
        ahead = "\n".join(f"| {q['position']} | {q['job_id']} | {q['name']} | {q['wants']} |" for q in snap["queued"][:10])
        holders = "\n".join(f"| {r['job_id']} | {r['name']} | {r['placement']['world_size']}x {r['placement']['gpu_type']} |"
                            for r in snap["running"][:10] if r.get("placement"))
        create_markdown_artifact(
            key=key, description=f"{headline}; {detail}" if detail else headline,
            markdown=(f"## {headline}\n\n" + (f"**Why:** {detail}\n\n" if detail else "")
                      + f"| # | job | queued job | wants |\n|---|---|---|---|\n{ahead}\n\n"
                      f"| job | running job | holds |\n|---|---|---|\n{holders}\n"))
        logger.info("%s (%.0f s so far)%s", headline, now - started, f": {detail}" if detail else "")

    placement = admitted_placement(orch, job_id, plans, poll_s=poll_s, on_wait=on_wait, db=db)
    cluster = db.call(lambda: orch.job(job_id)["cluster"], f"job {job_id} reading its cluster")
    waited = time.monotonic() - started
    if shown["position"] is not None:
        create_markdown_artifact(key=key, description=f"{job}: admitted after {waited:.0f} s in the queue",
                                 markdown=f"## {job}: admitted after {waited:.0f} s in the queue\n")
    logger.info("%s admitted: %dx %s on %s (dp%d tp%d pp%d)", job, placement.world_size, placement.gpu_type,
                ", ".join(placement.nodes), placement.dp, placement.tp, placement.pp)
    create_markdown_artifact(
        key="pretrain-placement",
        markdown=_placement_markdown(placement, orch, cluster),
        description=f"HAS placement of {job} by the orchestrator",
    )
    if placement.plan is not None:  # the plans again, the admitted one marked
        publish_plans(job, cluster, plans, placement.plan)
    publish_cluster_table(orch, cluster)
    return placement


def _placement_markdown(placement: Placement, orch: Orchestrator, cluster: str) -> str:
    """The placement picture (nodes x GPUs, inline) over the table and JSON; the JSON alone if the
    picture cannot be drawn (a picture is never worth failing the run for)."""
    from scheduler.placement_chart import placement_markdown

    try:
        return placement_markdown(placement, orch.cluster(cluster))
    except Exception as e:
        get_run_logger().warning("placement picture not drawn: %s: %s", type(e).__name__, e)
        return "## Placement\n" + fenced(json.dumps(placement.to_dict(), indent=2), "json")


@task(name="cordon-faulty-nodes", cache_policy=NO_CACHE)
def cordon_faulty(orch: Orchestrator, cluster: str, inventory: Cluster, faulty: list[str], why: str,
                  db: StateDbRetry | None = None) -> None:
    """`cordon_nodes` (orchestrator, inventory, Slurm; a cordon made again changes nothing), then
    the cluster table."""
    (db or StateDbRetry()).call(lambda: cordon_nodes(orch, cluster, inventory, faulty, why),
                                f"cordoning {', '.join(faulty)}")
    publish_cluster_table(orch, cluster)


class FlowSeat(Seat):
    """`Seat` whose cordon and wait for GPUs are this module's tasks (seen in the Prefect UI)."""

    def wait_for_gpus(self) -> Placement:
        return wait_for_gpus(self.orchestrator, self.job_id, self.plans, self.job, poll_s=self.poll_s, db=self.db)

    def cordon(self, inventory: Cluster, nodes: list[str], why: str) -> None:
        cordon_faulty(self.orchestrator, self.cluster, inventory, nodes, why, db=self.db)


class FlowDelegatedSeat(DelegatedSeat):
    """`DelegatedSeat` (Slurm's delegate mode: no GPUs held here) whose cordon is this module's task."""

    def cordon(self, inventory: Cluster, nodes: list[str], why: str) -> None:
        cordon_faulty(self.orchestrator, self.cluster, inventory, nodes, why, db=self.db)
