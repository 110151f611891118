"""Prefect tasks between a flow and the cluster orchestrator: join the shared cluster, queue the
job, wait for GPUs where people can see it, and show the cluster as a table.

The orchestrator (`scheduler.orchestrator`) keeps the cluster's state in the state
database every flow shares (FORGEFLOW_DB_URL, else SQLite in the state dir), so two
flows never place onto the same GPUs and a node one flow cordoned stays cordoned for
all of them.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from scheduler.cluster import Cluster
from scheduler.orchestrator import Orchestrator, OrchestratorConfig
from scheduler.orchestrator.lease import HeldJob
from scheduler.orchestrator.options import options_from_plans, require_idle_fit
from scheduler.orchestrator.views import cluster_markdown, cluster_status, queue_snapshot
from scheduler.placement import Placement, placed_step_time
from training.config import JobSpec

# A flow renews every lease_s / 3 seconds; a flow that died frees its GPUs lease + grace later.
FLOW_LEASE_S = 30.0
FLOW_GRACE_S = 30.0
WAIT_LOG_EVERY_S = 60.0
INVENTORY_CORDON = "unschedulable in the inventory"


def cluster_orchestrator(db_url: str | None = None) -> Orchestrator:
    return Orchestrator(db_url, OrchestratorConfig(lease_s=FLOW_LEASE_S, grace_s=FLOW_GRACE_S))


def _slug(text: str) -> str:
    """Artifact keys: lowercase letters, digits and dashes."""
    return re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-") or "cluster"


def publish_cluster_table(orch: Orchestrator, cluster: str) -> None:
    """The live cluster table (nodes x GPUs: the job holding each GPU, or the node's cordon)."""
    status = cluster_status(orch.engine, cluster)
    create_markdown_artifact(key=f"cluster-{_slug(cluster)}", markdown=cluster_markdown(status),
                             description=f"Cluster {cluster}: who holds which GPU, and cordoned nodes")


@task(name="join-cluster", cache_policy=NO_CACHE)
def join_cluster(orch: Orchestrator, inventory: Cluster) -> str:
    """Register the inventory with the orchestrator, or update it when its nodes changed (the
    node health recorded there is kept either way); nodes the inventory marks unschedulable
    (e.g. drained in Slurm) are cordoned in the orchestrator too."""
    logger = get_run_logger()
    known = _nodes_or_none(orch, inventory.name)
    registered = {n["node"]: n["state"] for n in known}
    shape = {(n["node"], n["gpu_type"], n["gpu_count"]) for n in known}
    if shape != {(n.name, n.gpu_type, n.gpu_count) for n in inventory.nodes}:
        orch.register(inventory, source="pretrain flow")
        logger.info("registered cluster %s (%d GPUs) with the orchestrator", inventory.name, inventory.total_gpus)
    else:
        logger.info("cluster %s is registered with the orchestrator; node health comes from there",
                    inventory.name)
    reasons = {n["node"]: n["reason"] or "" for n in known}
    for node in inventory.nodes:  # mirror what the batch system says (a cordon of ours stays ours)
        if node.cordoned and registered.get(node.name, "ready") == "ready":
            orch.cordon(node.name, reason=f"{INVENTORY_CORDON} (e.g. drained in Slurm)",
                        cluster=inventory.name, by="pretrain flow")
        elif not node.cordoned and registered.get(node.name) == "cordoned" \
                and reasons.get(node.name, "").startswith(INVENTORY_CORDON):
            orch.uncordon(node.name, reason="schedulable again in the inventory", cluster=inventory.name,
                          by="pretrain flow")
    publish_cluster_table(orch, inventory.name)
    return inventory.name


def _nodes_or_none(orch: Orchestrator, cluster: str) -> list[dict]:
    from scheduler.orchestrator import OrchestratorError

    try:
        return cluster_status(orch.engine, cluster)["nodes"]
    except OrchestratorError:
        return []


@task(name="submit-job", cache_policy=NO_CACHE)
def submit_job(orch: Orchestrator, spec: JobSpec, cluster: str, priority: int = 0) -> tuple[int, list]:
    """MARP plans on every GPU type of the cluster (the user chose none), queued with the orchestrator.
    Returns (job id, ranked plans); a job no GPU type can hold fails here with the planner's advice."""
    from scheduler.planner import PlannerError, plan_job, worker_planner_config

    inventory = orch.cluster(cluster)
    if not inventory.schedulable_nodes():
        held = ", ".join(f"{n['node']} ({n['state']}: {n['reason'] or 'no reason given'})"
                         for n in cluster_status(orch.engine, cluster)["nodes"])
        raise PlannerError(f"cluster {cluster!r} has no schedulable node: {held}; "
                           "`forgeflow cluster uncordon NODE` returns one to service")
    for node in inventory.nodes:  # size against every node: a cordoned one may come back
        node.cordoned = False
    plans = plan_job(spec, inventory, worker_planner_config(inventory))  # only plans the worker runs
    options = options_from_plans(plans, spec.training.steps, inventory.gpu_types())
    job_id = orch.submit(spec.name, options, cluster=cluster, spec=spec.model_dump(mode="json"), priority=priority)
    create_table_artifact(
        key="pretrain-plans",
        table=[
            {"rank": i + 1, "gpu_type": p.gpu_type, "gpus": p.num_gpus, "layout": p.layout,
             "peak_gib": round(p.required_memory_bytes / 2**30, 2),
             "step_s": round(p.predicted_step_time_s, 3), "tokens_per_s": round(p.tokens_per_s)}
            for i, p in enumerate(plans[:10])
        ],
        description=f"Ranked plans for {spec.name} on {cluster} (MARP memory, cost-model step time)",
    )
    get_run_logger().info("job %s queued with the orchestrator as job %d (%d plan(s) on %s)",
                          spec.name, job_id, len(plans), ", ".join(inventory.gpu_types()))
    return job_id, plans


@task(name="wait-for-gpus", cache_policy=NO_CACHE)
def wait_for_gpus(orch: Orchestrator, job_id: int, plans: list, job: str, poll_s: float = 2.0) -> Placement:
    """Wait in the queue until the policy admits the job; the run shows "waiting for GPUs,
    position N of M" (a markdown artifact updated on change) and logs at least every minute."""
    logger = get_run_logger()
    key = f"queue-{_slug(job)}"
    shown: dict[str, object] = {"position": None, "logged_at": 0.0}
    started = time.monotonic()

    def on_wait(position: int, length: int) -> None:
        now = time.monotonic()
        if position != shown["position"]:
            shown["position"] = position
            snap = queue_snapshot(orch.engine, orch.job(job_id)["cluster"])
            ahead = "\n".join(f"| {q['position']} | {q['name']} | {q['wants']} |" for q in snap["queued"][:10])
            holders = "\n".join(f"| {r['name']} | {r['placement']['world_size']}x {r['placement']['gpu_type']} |"
                                for r in snap["running"][:10] if r.get("placement"))
            create_markdown_artifact(
                key=key, description=f"{job}: waiting for GPUs, position {position} of {length}",
                markdown=(f"## {job}: waiting for GPUs, position {position} of {length}\n\n"
                          f"| # | queued job | wants |\n|---|---|---|\n{ahead}\n\n"
                          f"| running job | holds |\n|---|---|\n{holders}\n"))
        if position != shown.get("logged_position") or now - shown["logged_at"] >= WAIT_LOG_EVERY_S:
            shown["logged_at"], shown["logged_position"] = now, position
            logger.info("%s: waiting for GPUs, position %d of %d (%.0f s so far)", job, position, length,
                        now - started)

    admission = orch.wait_admitted(job_id, poll_s=poll_s, on_wait=on_wait)
    placement = admission.placement
    layout = (placement.gpu_type, placement.world_size, placement.dp, placement.tp, placement.pp)
    placement.plan = next((p for p in plans if (p.gpu_type, p.num_gpus, p.dp, p.tp, p.pp) == layout), None)
    if placement.plan is not None:
        placement.predicted_step_time_s = placed_step_time(placement.plan, placement, orch.cluster(
            orch.job(job_id)["cluster"]))
    waited = time.monotonic() - started
    if shown["position"] is not None:
        create_markdown_artifact(key=key, description=f"{job}: admitted after {waited:.0f} s in the queue",
                                 markdown=f"## {job}: admitted after {waited:.0f} s in the queue\n")
    logger.info("%s admitted: %dx %s on %s (dp%d tp%d pp%d)", job, placement.world_size, placement.gpu_type,
                ", ".join(placement.nodes), placement.dp, placement.tp, placement.pp)
    create_markdown_artifact(
        key="pretrain-placement",
        markdown=_placement_markdown(placement, orch, job_id),
        description=f"HAS placement of {job} by the orchestrator",
    )
    publish_cluster_table(orch, orch.job(job_id)["cluster"])
    return placement


def _placement_markdown(placement: Placement, orch: Orchestrator, job_id: int) -> str:
    """The placement picture (nodes x GPUs, inline) over the table and JSON; the JSON alone if the
    picture cannot be drawn (a picture is never worth failing the run for)."""
    from scheduler.placement_chart import placement_markdown

    try:
        return placement_markdown(placement, orch.cluster(orch.job(job_id)["cluster"]))
    except Exception as e:
        get_run_logger().warning("placement picture not drawn: %s: %s", type(e).__name__, e)
        return "## Placement\n```json\n" + json.dumps(placement.to_dict(), indent=2) + "\n```"


def withdraw(orch: Orchestrator, job_id: int) -> None:
    """Take the job out of the queue if it is still waiting (a cancelled or failed flow)."""
    try:
        if orch.job(job_id)["state"] == "queued":
            orch.cancel(job_id, reason="the flow run ended while waiting")
    except Exception as e:  # cleanup must not mask the flow's own outcome
        get_run_logger().warning("could not withdraw job %s from the queue: %s", job_id, e)


@task(name="cordon-faulty-nodes", cache_policy=NO_CACHE)
def cordon_faulty(orch: Orchestrator, cluster: str, inventory: Cluster, faulty: list[str], why: str) -> None:
    """Cordon the nodes the node check found faulty, in the orchestrator (for every flow, across
    restarts) and, on a Slurm-managed cluster, in Slurm too so no other Slurm job lands there."""
    for name in faulty:
        orch.cordon(name, reason=why, cluster=cluster, by="pretrain flow")
        inventory.cordon(name)
        if inventory.slurm is not None and inventory.slurm.drain_on_cordon:
            from infra.slurm import drain_node

            drain_node(name, f"forgeflow: {why}", inventory.slurm)
    publish_cluster_table(orch, cluster)


@dataclass
class Seat:
    """A flow's admitted job on the shared cluster: what it needs to be placed again."""

    orchestrator: Orchestrator
    job_id: int
    held: HeldJob
    cluster: str
    plans: list
    job: str

    def replace(self, faulty: list[str], inventory: Cluster, why: str) -> Placement:
        """Cordon the faulty nodes, give the GPUs back and wait to be placed on healthy ones.

        When none of the job's plans fits the nodes still in service (even with no other job
        running), OrchestratorError says so here instead of waiting forever: the job keeps its
        GPUs until the flow stops (a stop decision) and its HeldJob releases them as failed."""
        cordon_faulty(self.orchestrator, self.cluster, inventory, faulty, f"{why} (job {self.job})")
        self.check_still_fits()
        self.held.hand_back()
        self.orchestrator.requeue(self.job_id, reason=f"placed again: {why}")
        placement = wait_for_gpus(self.orchestrator, self.job_id, self.plans, self.job)
        self.held.resume()
        return placement

    def rejoin(self) -> Placement:
        """After the job's lease was lost (this flow stalled past it; the watcher stopped the
        ranks): wait until the orchestrator admits the job again (it re-queued it) and hold the
        new admission. A job lost more often than `max_requeues` failed there, and a job an
        operator cancelled ended: OrchestratorError says which."""
        self.held.hand_back()
        placement = wait_for_gpus(self.orchestrator, self.job_id, self.plans, self.job)
        self.held.resume()
        return placement

    def lease_lost(self) -> str | None:
        """Why the job no longer holds its GPUs, or None (the watcher's `stop_when`)."""
        lost = self.held.lost
        return None if lost is None else f"the job's GPU lease was lost: {lost}"

    def check_still_fits(self) -> None:
        """Raise OrchestratorError when no plan of the job fits the cluster's schedulable nodes."""
        cluster = self.orchestrator.cluster(self.cluster)
        # the options the orchestrator admits the job on (steps only scale run times: any will do)
        options = options_from_plans(self.plans, 1, cluster.gpu_types())
        out_of_service = {n["node"]: f"{n['state']}: {n['reason'] or 'no reason given'}"
                          for n in cluster_status(self.orchestrator.engine, self.cluster)["nodes"]
                          if n["state"] != "ready"}
        require_idle_fit(options.get(self.orchestrator.config.policy) or options["has"], cluster, job=self.job,
                         out_of_service=out_of_service)
