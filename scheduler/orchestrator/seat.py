"""A flow's job on the shared cluster: joining, queueing, waiting, and being placed again.

What a pretraining flow decides about its seat on the cluster, without Prefect
(`tasks/cluster_tasks.py` runs these as Prefect tasks that show the queue, the plans
and the cluster table in the UI):

- `sync_inventory`: register the flow's inventory, or update it when its nodes changed, and
  mirror what the batch system marks unschedulable as cordons (a cordon of ours stays ours);
- `plan_and_submit`: MARP plans on every GPU type of the cluster, queued with the orchestrator
  (`SubmittedJob`: the id, the spec as that job, the plans); `adopt_job`: the same for a job
  `forgeflow submit` queued, taken up by the flow that runs it;
- `admitted_placement`: wait until the policy admits the job; the placement with its plan;
- `cordon_nodes`: cordon in the orchestrator, the flow's inventory and (Slurm) the batch system;
- `Seat`: an admitted job placed again after a node check (`replace`) or a lost lease (`rejoin`);
- `DelegatedSeat` (issue 32): a job a site's batch system places (Slurm's delegate mode): recorded
  in the orchestrator as a mirror of the batch job (`Orchestrator.mirror`), never admitted onto
  its GPUs, holding no lease (`lease.DelegatedJob`);
- `withdraw`: take a job that still waits out of the queue;
- `ProgressReport`: how far the job got (phase, step, loss, step time), for `forgeflow jobs`.

A state database outage during a decision (`StateDbUnreachable`) is waited out, not raised:
each call goes through the seat's `StateDbRetry` (`infra.statedb.retry`: backoff, logged,
an alert through the flow's notifier once it lasts).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from infra import runfiles
from infra.statedb.retry import StateDbRetry
from scheduler.cluster import Cluster
from scheduler.orchestrator.config import OrchestratorConfig, OrchestratorError
from scheduler.orchestrator.lease import DelegatedJob, HeldJob
from scheduler.orchestrator.options import job_plans, options_from_plans, require_idle_fit
from scheduler.orchestrator.service import DELEGATED, Orchestrator
from scheduler.orchestrator.views import cluster_status
from scheduler.placement import Placement, placed_step_time
from training.config import JobSpec
from training.runlog import last_step

log = logging.getLogger(__name__)

# A flow renews every lease_s / 3 seconds; a flow that died frees its GPUs lease + grace later.
FLOW_LEASE_S = 30.0
FLOW_GRACE_S = 30.0
INVENTORY_CORDON = "unschedulable in the inventory"


def cluster_orchestrator(db_url: str | None = None) -> Orchestrator:
    """The orchestrator as flows use it (their leases: FLOW_LEASE_S + FLOW_GRACE_S)."""
    return Orchestrator(db_url, OrchestratorConfig(lease_s=FLOW_LEASE_S, grace_s=FLOW_GRACE_S))


def sync_inventory(orch: Orchestrator, inventory: Cluster, by: str = "pretrain flow", *,
                   source: str | None = None) -> bool:
    """Register the inventory, or update it when its nodes changed (node health recorded in the
    orchestrator is kept either way); cordon the nodes the inventory marks unschedulable (e.g.
    drained in Slurm) and uncordon those it no longer marks, if that cordon was the inventory's.
    `source`: the inventory's file, recorded with it (what `default_cluster_source` and a run
    created through the API may name). True when the inventory was (re-)registered."""
    known = _nodes_or_none(orch, inventory.name)
    registered = {n["node"]: n["state"] for n in known}
    shape = {(n["node"], n["gpu_type"], n["gpu_count"]) for n in known}
    changed = shape != {(n.name, n.gpu_type, n.gpu_count) for n in inventory.nodes}
    if changed:
        orch.register(inventory, source=source)
    reasons = {n["node"]: n["reason"] or "" for n in known}
    for node in inventory.nodes:  # mirror what the batch system says (a cordon of ours stays ours)
        if node.cordoned and registered.get(node.name, "ready") == "ready":
            orch.cordon(node.name, reason=f"{INVENTORY_CORDON} (e.g. drained in Slurm)",
                        cluster=inventory.name, by=by)
        elif not node.cordoned and registered.get(node.name) == "cordoned" \
                and reasons.get(node.name, "").startswith(INVENTORY_CORDON):
            orch.uncordon(node.name, reason="schedulable again in the inventory", cluster=inventory.name, by=by)
    return changed


def _nodes_or_none(orch: Orchestrator, cluster: str) -> list[dict]:
    try:
        return cluster_status(orch.engine, cluster)["nodes"]
    except OrchestratorError:
        return []


@dataclass(frozen=True)
class SubmittedJob:
    """A job in the orchestrator's queue: its id, its spec as that job (paths filled in with the
    id: `JobSpec.for_job`) and its ranked plans."""

    job_id: int
    spec: JobSpec
    plans: list
    cluster: str


def plan_and_submit(orch: Orchestrator, spec: JobSpec, cluster: str, priority: int = 0, *,
                    gpu_type: str | None = None, gpus: int | None = None,
                    delegated_to: str | None = None) -> SubmittedJob:
    """MARP plans on every GPU type of the cluster (the user chose none), queued with the
    orchestrator. A cluster with no schedulable node, a job no GPU type can hold (PlannerError /
    InfeasibleJobError with the planner's advice), or a spec whose fixed run directory or
    checkpoint URL a queued or running job already uses (ConfigError) is refused here. `gpu_type`,
    `gpus`: only plans of that type / that many GPUs (the user's choice; default: MARP's).
    `delegated_to` ("slurm"): recorded as a delegated job (`Orchestrator.submit`), not queued."""
    refuse_shared_paths(orch, spec)
    plans = _plans(orch, spec, cluster, gpu_type=gpu_type, gpus=gpus)
    options = options_from_plans(plans, spec.training.steps, orch.cluster(cluster).gpu_types())
    job_id = orch.submit(spec.name, options, cluster=cluster, spec=spec.model_dump(mode="json"), priority=priority,
                         delegated_to=delegated_to)
    job_spec = spec.for_job(job_id)
    orch.set_spec(job_id, job_spec.model_dump(mode="json"))
    return SubmittedJob(job_id, job_spec, plans, cluster)


def default_cluster_source(orch: Orchestrator) -> str:
    """Where `forgeflow submit` places a job given no --cluster: the inventory file of the one
    cluster registered with the orchestrator (`forgeflow cluster register FILE`, the owner's
    choice), else this machine ("local")."""
    import sqlalchemy as sa

    from infra.statedb import read_transaction
    from infra.statedb.schema import clusters

    with read_transaction(orch.engine) as conn:
        sources = [s for (s,) in conn.execute(sa.select(clusters.c.source))]
    if len(sources) == 1 and sources[0] and Path(sources[0]).is_file():
        return sources[0]
    return "local"


def delegated_to(launcher: str, inventory: Cluster) -> str | None:
    """"slurm" when the job's attempts go to a site's Slurm that chooses the nodes (launcher
    slurm, the cluster file's `slurm:` mode delegate, the default): the orchestrator then keeps
    the job as a mirror of its batch job, never on its own GPUs. None otherwise."""
    slurm = getattr(inventory, "slurm", None)
    return "slurm" if launcher == "slurm" and (slurm is None or slurm.mode == "delegate") else None


def queue_spec(spec: JobSpec, cluster_source: str | None = None, priority: int = 0, *, gpu_type: str | None = None,
               gpus: int | None = None, by: str = "forgeflow submit", launcher: str = "local") -> SubmittedJob:
    """`forgeflow submit` / `pretrain`: the inventory (a YAML file, or "local" for this machine)
    joined with the orchestrator, and the job planned and queued there (recorded as delegated
    when `launcher` hands it to a site's Slurm: `delegated_to`); no source: the one registered
    cluster's file, else this machine (`default_cluster_source`)."""
    from scheduler.cluster import load_inventory

    orch = cluster_orchestrator()
    cluster_source = cluster_source or default_cluster_source(orch)
    inventory = load_inventory(cluster_source)
    sync_inventory(orch, inventory, by=by,
                   source=None if cluster_source in ("", "local") else str(Path(cluster_source).resolve()))
    return plan_and_submit(orch, spec, inventory.name, priority, gpu_type=gpu_type, gpus=gpus,
                           delegated_to=delegated_to(launcher, inventory))


def adopt_job(orch: Orchestrator, job_id: int) -> SubmittedJob:
    """A job `forgeflow submit` queued, taken up by the flow that runs it: its spec as recorded
    and its plans (the same MARP plans its options came from). OrchestratorError if it ended."""
    from training.config import parse_job_spec

    job = orch.job(job_id)
    if job["state"] not in ("queued", "running", DELEGATED):
        raise OrchestratorError(f"job {job_id} ({job['name']}) is {job['state']}: nothing to run"
                                + (f" ({job['reason']})" if job["reason"] else ""))
    spec = parse_job_spec(job["spec"] or {}, source=f"job {job_id}'s spec in the state database")
    return SubmittedJob(job_id, spec.for_job(job_id), _plans(orch, spec, job["cluster"]), job["cluster"])


def refuse_shared_paths(orch: Orchestrator, spec: JobSpec) -> None:
    """ConfigError when the spec's run directory or checkpoint URL, fixed (no {job} in it), is
    one a queued or running job uses: the two would resume from and prune each other's files."""
    from training.config import ConfigError

    mine = {"run_dir": spec.run_dir, "checkpoint.url": spec.checkpoint.url}
    for job_id, name, other in orch.active_specs():
        theirs = {"run_dir": (other or {}).get("run_dir"),
                  "checkpoint.url": ((other or {}).get("checkpoint") or {}).get("url")}
        for field, path in mine.items():
            if path is not None and theirs[field] == path:
                raise ConfigError(
                    f"{field} {path!r} is in use by job {job_id} ({name}), which is still queued or running; "
                    f"put {{job}} in {field} (the default does) so each job has its own, or wait for it to end")


def _plans(orch: Orchestrator, spec: JobSpec, cluster: str, **choice) -> list:
    from scheduler.planner import PlannerError

    inventory = orch.cluster(cluster)
    if not inventory.schedulable_nodes():
        held = ", ".join(f"{n['node']} ({n['state']}: {n['reason'] or 'no reason given'})"
                         for n in cluster_status(orch.engine, cluster)["nodes"])
        raise PlannerError(f"cluster {cluster!r} has no schedulable node: {held}; "
                           "`forgeflow cluster uncordon NODE` returns one to service")
    return job_plans(spec, inventory, **choice)  # every node (a cordoned one may come back); plans the worker runs


def admitted_placement(orch: Orchestrator, job_id: int, plans: list, *, poll_s: float = 2.0,
                       on_wait: Callable[[int, int], None] | None = None,
                       timeout_s: float | None = None, db: StateDbRetry | None = None) -> Placement:
    """Wait in the queue until the policy admits the job (`on_wait(position, length)` while it
    waits); the admitted placement with the plan of its layout and that plan's step time on the
    nodes it got. A database outage meanwhile is waited out (`db`, default: logged only) and the
    wait goes on where it was: admission is a row in the database, not a message to miss."""
    db = db or StateDbRetry()
    what = f"job {job_id} waiting for GPUs"

    def on_unreachable(message: str) -> None:  # wait_admitted retries by itself; the outage is counted here
        db.log.warning(message)
        if "answers again" in message:
            db.answered(what)
        else:
            db.failed(message, what)

    admission = db.call(lambda: orch.wait_admitted(job_id, poll_s=poll_s, on_wait=on_wait, timeout_s=timeout_s,
                                                   on_unreachable=on_unreachable), what)
    placement = admission.placement
    layout = (placement.gpu_type, placement.world_size, placement.dp, placement.tp, placement.pp)
    placement.plan = next((p for p in plans if (p.gpu_type, p.num_gpus, p.dp, p.tp, p.pp) == layout), None)
    if placement.plan is not None:
        cluster = db.call(lambda: orch.cluster(orch.job(job_id)["cluster"]), f"job {job_id} reading its cluster")
        placement.predicted_step_time_s = placed_step_time(placement.plan, placement, cluster)
    return placement


def cordon_nodes(orch: Orchestrator, cluster: str, inventory: Cluster, nodes: list[str], why: str,
                 by: str = "pretrain flow") -> None:
    """Cordon `nodes` in the orchestrator (for every flow, across restarts), in the flow's
    inventory and, on a Slurm cluster that drains on cordon, in Slurm too so no other Slurm job
    lands there, where this user may drain (else a warning with the operator's command: the pretrain
    flow's node check alerts with it, `tasks.pretrain_tasks.node_check`)."""
    for name in nodes:
        orch.cordon(name, reason=why, cluster=cluster, by=by)
        inventory.cordon(name)
        if inventory.slurm is not None and inventory.slurm.drain_on_cordon:
            from infra.slurm import drain_node_if_allowed

            not_drained = drain_node_if_allowed(name, why, inventory.slurm)
            if not_drained:
                log.warning("%s", not_drained)


WITHDRAW_GIVES_UP_S = 60.0  # then the job stays queued; `forgeflow cancel` takes it out


def withdraw(orch: Orchestrator, job_id: int, db: StateDbRetry | None = None) -> None:
    """Take the job out of the queue if it is still waiting (a cancelled or failed flow), waiting
    out a database outage for up to WITHDRAW_GIVES_UP_S. Never raises: cleanup must not mask the
    flow's own outcome."""
    def cancel_if_queued() -> None:  # (a delegated job its flow no longer mirrors ends too)
        if orch.job(job_id)["state"] in ("queued", DELEGATED):
            orch.cancel(job_id, reason="the flow run ended while waiting")

    try:
        (db or StateDbRetry()).call(cancel_if_queued, f"withdrawing job {job_id} from the queue",
                                    give_up_after_s=WITHDRAW_GIVES_UP_S)
    except Exception as e:
        log.warning("could not withdraw job %s from the queue: %s", job_id, e)


@dataclass
class Seat:
    """A flow's admitted job on the shared cluster: what it needs to be placed again.

    `wait_for_gpus` and `cordon` are the two steps a flow shows its users (tasks.cluster_tasks
    overrides them with Prefect tasks); here they wait and cordon without showing anything."""

    orchestrator: Orchestrator
    job_id: int
    held: HeldJob
    cluster: str
    plans: list
    job: str
    poll_s: float = 2.0  # how often the wait for GPUs asks the orchestrator
    db: StateDbRetry = field(default_factory=StateDbRetry)  # waits out a database outage

    def wait_for_gpus(self) -> Placement:
        return admitted_placement(self.orchestrator, self.job_id, self.plans, poll_s=self.poll_s, db=self.db)

    def cordon(self, inventory: Cluster, nodes: list[str], why: str) -> None:
        cordon_nodes(self.orchestrator, self.cluster, inventory, nodes, why)

    def replace(self, faulty: list[str], inventory: Cluster, why: str) -> Placement:
        """Cordon the faulty nodes, give the GPUs back and wait to be placed on healthy ones.

        When none of the job's plans fits the nodes still in service (even with no other job
        running), OrchestratorError says so here instead of waiting forever: the job keeps its
        GPUs until the flow stops (a stop decision) and its HeldJob releases them as failed."""
        self.cordon(inventory, faulty, f"{why} (job {self.job})")
        self.db.call(self.check_still_fits, f"job {self.job_id} checking that a plan still fits")
        self.held.hand_back()
        tries: list[int] = []

        def requeue() -> None:
            # made again after an outage, a re-queue whose COMMIT went through although its answer
            # was lost finds the job queued (or admitted again) already: what it asked for
            tries.append(1)
            try:
                self.orchestrator.requeue(self.job_id, reason=f"placed again: {why}")
            except OrchestratorError:
                if len(tries) == 1 or self.orchestrator.job(self.job_id)["state"] not in ("queued", "running"):
                    raise

        self.db.call(requeue, f"job {self.job_id} re-queued after a node check")
        placement = self.wait_for_gpus()
        self.held.resume()  # waits out an outage itself (HeldJob.db)
        return placement

    def rejoin(self) -> Placement:
        """After the job's lease was lost (this flow stalled past it; the watcher stopped the
        ranks): wait until the orchestrator admits the job again (it re-queued it) and hold the
        new admission. A job lost more often than `max_requeues` failed there, and a job an
        operator cancelled ended: OrchestratorError says which."""
        self.held.hand_back()
        placement = self.wait_for_gpus()
        self.held.resume()
        return placement

    def yield_to_preemption(self) -> Placement:
        """After a preemption stop (`preempted_by`; the ranks committed the step they were on):
        release the job as preempted — the orchestrator queues it again at its submit time —
        wait until it is admitted again and hold the new admission. A job force-released at
        its deadline meanwhile is queued already (the release changes nothing); one an operator
        cancelled while it waited ended: OrchestratorError says so."""
        attempt = self.held.attempt
        self.held.hand_back()
        self.db.call(lambda: self.orchestrator.release(self.job_id, outcome="preempted", attempt=attempt),
                     f"job {self.job_id} released as preempted")
        self.held.stop_requested = None
        placement = self.wait_for_gpus()
        self.held.resume()
        return placement

    # What the batch system says of each attempt's job: nothing to mirror for a job that holds its
    # GPUs here (`DelegatedSeat` mirrors Slurm's state).
    def attempt_started(self, handle: Any, gpus: str | None = None) -> None:
        """The attempt's job was launched (`run_attempt`'s on_started)."""

    def attempt_waiting(self, reason: str | None) -> None:
        """The batch system keeps the attempt's job queued (reason), or started it (None)."""

    def attempt_running(self) -> None:
        """The attempt reported a step."""

    def attempt_ended(self) -> None:
        """The attempt is over."""

    def check_stop(self) -> None:
        """Read the job's stop request now, not as of the holder's last look (every
        lease.STOP_CHECK_S): a decision between attempts acts on it, and a preemption or a cancel
        asked a moment ago must not start an attempt only to stop it."""
        self.held.stop_requested = self.db.call(lambda: self.orchestrator.stop_request(self.job_id),
                                                f"job {self.job_id} reading its stop request")

    def preempted_by(self) -> int | None:
        """The job the orchestrator asked this one to stop for (`Orchestrator.preempt`), or None."""
        request = self.held.stop_requested
        return None if not request else request.get("preempted_by")

    def resize(self) -> dict[str, Any] | None:
        """When the stop request is an elastic resize (`Orchestrator.resize`, also `preempted_by`:
        the waiting job a shrink makes room for, or the job itself when it grows): {"kind":
        "shrink" | "grow", "from_gpus", "to_gpus"}; its next admission is on the new layout. None
        otherwise."""
        return (self.held.stop_requested or {}).get("resize")

    def stop_requested(self) -> str | None:
        """Who asked the job to stop and why (`forgeflow cancel`, or "preempted by job N"), or None
        (the watcher's `stop_requested`)."""
        request = self.held.stop_requested
        if not request:
            return None
        if request.get("preempted_by") is not None:
            return request["reason"]
        return f"cancelled by {request['by']}: {request['reason']}"

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
        require_idle_fit(options.get(self.orchestrator.policy or "") or options["has"], cluster, job=self.job,
                         out_of_service=out_of_service)


MIRROR_ASK_S = 10.0  # a delegated job's flow asks Slurm where it runs at most this often while it trains


def delegated_placement(plans: list, inventory: Cluster, job: str) -> Placement:
    """A delegated job's layout: the best plan that fits the inventory's schedulable nodes, laid out
    on the idle inventory (the batch system chooses the nodes and when; `tasks.cluster_tasks.
    choose_slurm_option` asks Slurm about each option before each attempt). Nothing is admitted
    or held. OrchestratorError when no plan fits the nodes in service."""
    from scheduler.placement import place_plans

    idle = inventory.copy_state()
    for node in idle.nodes:  # the batch system's nodes: what this orchestrator's jobs hold is no matter
        node.free_gpus = list(range(node.gpu_count))
    placement = place_plans(plans, idle, job=job)
    if placement is None:
        raise OrchestratorError(f"no plan of {job} fits the schedulable nodes of {inventory.name} "
                                f"({len(idle.schedulable_nodes())} in service)")
    return placement


def batch_said(handle: Any) -> dict[str, Any] | None:
    """What the batch system says of an attempt's job now (`infra.launch` handle; Slurm's only):
    {"id", "state", "reason", "nodes"} from one squeue (once gone from it, the handle's final
    state), or None for a handle that is no batch job."""
    job_id, settings = getattr(handle, "job_id", None), getattr(handle, "settings", None)
    if job_id is None or settings is None:
        return None
    from infra.slurm import FINAL_STATES, slurm_command

    out = slurm_command(["squeue", "-h", "-j", str(job_id), "-o", "%T|%r|%N"], settings, check=False)
    state, reason, nodes = ((out.stdout.strip() if out.returncode == 0 else "").split("|") + ["", "", ""])[:3]
    state = state.strip().upper()
    if not state or state in FINAL_STATES:  # gone from squeue: its end state; the nodes it ran on stay
        return {"id": str(job_id), "state": handle.state(fresh=True), "reason": None}
    reason = reason.strip()
    return {"id": str(job_id), "state": state, "reason": None if reason in ("", "None") else reason,
            "nodes": _expand_nodes(nodes.strip(), settings)}


def _expand_nodes(nodelist: str, settings: Any) -> list[str]:
    """Slurm's compressed node list ("n[1-3]") as names (`scontrol show hostnames`); [] for none."""
    if not nodelist or nodelist in ("(null)", "None"):
        return []
    if "[" not in nodelist:
        return nodelist.split(",")
    from infra.slurm import slurm_command

    out = slurm_command(["scontrol", "show", "hostnames", nodelist], settings, check=False)
    return out.stdout.split() if out.returncode == 0 and out.stdout.strip() else [nodelist]


@dataclass
class DelegatedSeat(Seat):
    """A delegated job's seat (Slurm's delegate mode): the job is `DELEGATED` in the orchestrator,
    holds nothing there (`held` is a `lease.DelegatedJob`), and its flow mirrors what Slurm says
    of each attempt's batch job (`attempt_started`, `attempt_waiting`, `attempt_running`,
    `attempt_ended`: `Orchestrator.mirror`). A mirror that cannot be written is logged, never
    raised: a mirror is not worth stopping the job for. Placed again means laid out again: Slurm
    decides where."""

    inventory: Cluster | None = None  # the flow's inventory (its cordons); default: the orchestrator's
    _handle: Any = field(default=None, init=False, repr=False)  # the attempt's batch job (infra.launch)
    _said: dict | None = field(default=None, init=False, repr=False)  # what the mirror last recorded
    _asked_at: float = field(default=-1e9, init=False, repr=False)

    def wait_for_gpus(self) -> Placement:
        if self.inventory is None:
            self.inventory = self.orchestrator.cluster(self.cluster)
        return delegated_placement(self.plans, self.inventory, self.job)

    def replace(self, faulty: list[str], inventory: Cluster, why: str) -> Placement:
        """Cordon the faulty nodes (here, in the inventory and, where it drains on cordon, in Slurm)
        and lay the job out again on the nodes in service; nothing to give back or wait for."""
        self.cordon(inventory, faulty, f"{why} (job {self.job})")
        self.inventory = inventory
        return self.wait_for_gpus()

    def rejoin(self) -> Placement:  # no lease: never lost
        return self.wait_for_gpus()

    def yield_to_preemption(self) -> Placement:  # no preemption pass looks at a delegated job
        self.held.stop_requested = None
        return self.wait_for_gpus()

    def check_still_fits(self) -> None:
        self.wait_for_gpus()

    # ------------------------------------------------------------ the mirror
    def attempt_started(self, handle: Any, gpus: str | None = None) -> None:
        """The attempt's batch job was submitted (`run_attempt`'s on_started)."""
        self._handle, self._said = handle, None
        self._mirror(gpus=gpus)

    def attempt_waiting(self, reason: str | None) -> None:
        """The batch system keeps it queued (reason), or it started (None)."""
        self._mirror()

    def attempt_running(self) -> None:
        """A step was reported: say where it runs, once per attempt (asking Slurm at most every
        MIRROR_ASK_S until it says RUNNING on its nodes)."""
        if self._said is not None and self._said.get("state") == "RUNNING" and self._said.get("nodes"):
            return
        if time.monotonic() - self._asked_at >= MIRROR_ASK_S:
            self._mirror()

    def attempt_ended(self) -> None:
        """The attempt is over: its batch job's end state."""
        self._mirror()

    def _mirror(self, **extra: Any) -> None:
        self._asked_at = time.monotonic()
        try:
            said = batch_said(self._handle)
            if said is None or said == self._said:
                return
            self._said = said
            self.orchestrator.mirror(self.job_id, **said, **{k: v for k, v in extra.items() if v is not None})
        except Exception as e:  # noqa: BLE001 - Slurm or the database out of reach: the next change writes it
            log.warning("job %s: the mirror of its batch job was not updated: %s", self.job_id, e)


class ProgressReport:
    """How far the job got, in the orchestrator for `forgeflow jobs` and the queue's estimates:
    the phase (training, recovering, evaluating...), the newest step with its loss and measured
    step time (rank 0's log and heartbeat), and the last diagnosis. Steps are written at most
    every `every_s` seconds; a phase change at once. Never raises or waits: a database outage
    must not stop training; what could not be written goes with the next write."""

    def __init__(self, orch: Orchestrator, job_id: int, run_dir, steps: int, every_s: float = 5.0):
        self.orch, self.job_id, self.run_dir, self.steps, self.every_s = orch, job_id, run_dir, steps, every_s
        self._written = 0.0
        self._unsent: dict = {}  # fields of writes that failed (a phase change not to lose)

    def phase(self, phase: str, **fields) -> None:
        self._write(phase=phase, **fields)

    def committed(self, step: int, at: float) -> None:
        """A checkpoint of `step` committed at `at`: what a preemption of the job would lose is
        the work since (`scheduler.preemption`)."""
        self._write(committed_step=step, committed_at=at)

    def step(self, step: int) -> None:
        if time.monotonic() - self._written < self.every_s:
            return
        record = last_step(runfiles.log_path(self.run_dir, 0))
        beat = runfiles.read_heartbeats(self.run_dir).get(0)
        self._write(phase="training", step=step, steps=self.steps,
                    loss=None if record is None else record.loss,
                    step_s=None if beat is None else beat.step_time_s)

    def _write(self, **fields) -> None:
        fields = {**self._unsent, **fields}
        try:
            self.orch.report_progress(self.job_id, **fields)
            self._written, self._unsent = time.monotonic(), {}
        except Exception as e:
            self._unsent = fields
            log.warning("could not record the progress of job %s (sent with the next write): %s", self.job_id, e)
