"""What a queued job may run on: its options per policy, computed once at submit and stored with it.

A training job (a `JobSpec`) gets MARP's plans on the cluster's GPU types: the user
may name no GPU type and no count (Frenzy-style), or pin either. A plain GPU demand
(count, memory, duration: evaluation jobs, benchmarks) gets one option per GPU type
that holds it. Both are the same `scheduler.policy.Option`s the simulator weighs.
"""

from __future__ import annotations

from typing import Any, Sequence

from scheduler.cluster import Cluster
from scheduler.gpus import checked_gpu_type
from scheduler.placement import NodeAssignment, Placement, has_select
from scheduler.planner import PlannerConfig, gpu_pools, plan_job, worker_planner_config
from scheduler.policy import POLICIES, FreeGpus, Option
from scheduler.orchestrator.config import OrchestratorError


def _all_ready(cluster: Cluster) -> Cluster:
    """Plan against the whole inventory: a job that fits only cordoned nodes still waits for them."""
    copy = cluster.copy_state()
    for node in copy.nodes:
        node.cordoned = False
    return copy


# Policies whose options are the requested count, FCFS's list (stored for them since issue 30; a
# job queued before has an empty list for them, and its FCFS list stands in: service, start_estimates)
# (elastic since issue 31: it admits the requested count FCFS, `scheduler.policy.ADMITS_AS`)
REQUESTED_AS = {"easy": "fcfs", "sjf": "fcfs", "elastic": "fcfs"}
# The stored list a running job's elastic layouts come from (`scheduler.elastic.resizable_layouts`):
# the best plan of every (GPU type, count, tp, pp), so that the data-parallel variants of the layout
# a job runs are there even where another layout is the best of its count (ECT's list keeps only
# that one: two GPUs of tp=2 hide the two of dp=2 a dp=1 job could grow to). A job queued before
# has none; its ECT list stands in.
ELASTIC_LAYOUTS = "layouts"
# The option lists stored with a job: one per admission policy, elastic's, and its layouts
STORED_POLICIES: tuple[str, ...] = POLICIES + ("elastic", ELASTIC_LAYOUTS)


def _by_policy(sized: list[Option], fastest_type_first: list[str]) -> dict[str, list[Option]]:
    smallest: dict[str, Option] = {}
    for o in sorted(sized, key=lambda o: (o.num_gpus, o.run_s)):
        smallest.setdefault(o.gpu_type, o)
    has = sorted(smallest.values(), key=lambda o: (o.run_s, o.num_gpus))
    rank = {t: i for i, t in enumerate(fastest_type_first)}
    fcfs = sorted(smallest.values(), key=lambda o: rank.get(o.gpu_type, len(rank)))
    ect = sorted(sized, key=lambda o: (o.run_s, o.num_gpus))
    # the Slurm-style baselines run what was asked for, like FCFS (as in the simulator's catalogue)
    return {"fcfs": fcfs, "has": has, "ect": ect, "easy": fcfs, "sjf": fcfs, "elastic": fcfs}


def job_options(job: Any, cluster: Cluster, *, gpu_type: str | None = None, gpus: int | None = None,
                planner: PlannerConfig | None = None) -> dict[str, list[Option]]:
    """Options of a training job from its MARP plans (best plan per GPU type and count).

    Raises `scheduler.planner.InfeasibleJobError` when no GPU type can hold it.
    """
    plans = job_plans(job, cluster, gpu_type=gpu_type, gpus=gpus, planner=planner)
    return options_from_plans(plans, job.training.steps, cluster.gpu_types())


def job_plans(job: Any, cluster: Cluster, *, gpu_type: str | None = None, gpus: int | None = None,
              planner: PlannerConfig | None = None) -> list:
    """The job's MARP plans on the whole inventory (cordoned nodes may come back), ranked best
    first; only `gpu_type` and only `gpus` GPUs when the user asked for them (OrchestratorError
    when the cluster has no such type, or not that many)."""
    whole = _all_ready(cluster)
    if gpu_type is not None:   # a typo is one error naming the known types; an alias is the inventory's name
        gpu_type = checked_gpu_type(gpu_type, whole.gpu_types())
    if gpu_type is not None and gpu_type not in whole.gpu_types():
        raise OrchestratorError(f"cluster {cluster.name!r} has no {gpu_type} GPUs; types: {whole.gpu_types()}")
    if gpus is not None and gpus < 1:
        raise OrchestratorError(
            f"job asks for {gpus} GPU(s); ask for at least 1 GPU, or give no count (MARP sizes it)")
    if gpus is not None:
        most = max(n for t, n in whole.total_gpus_by_type().items() if gpu_type in (None, t))
        if gpus > most:
            raise OrchestratorError(
                f"job asks for {gpus} GPU(s) but the cluster {cluster.name!r} has at most {most} of "
                f"{'type ' + gpu_type if gpu_type else 'one type'}; ask for fewer, or give no count (MARP sizes it)"
            )
    config = planner or worker_planner_config(whole)  # plans the training worker can run
    update: dict[str, Any] = {}
    if gpu_type is not None:
        update["gpu_types"] = (gpu_type,)
    if gpus is not None:
        update["gpu_counts"] = (gpus,)
    return plan_job(job, whole, config.model_copy(update=update))


def options_from_plans(plans: list[Any], steps: int, fastest_type_first: list[str]) -> dict[str, list[Option]]:
    """Options from ranked plans (best first): the best plan of each (GPU type, count); the
    plan object rides along so the submitter can launch the layout it is admitted with."""
    seen: set[tuple[str, int]] = set()
    sized: list[Option] = []
    for p in plans:  # best first: the first plan of a (type, count) is the one to run
        if (p.gpu_type, p.num_gpus) in seen:
            continue
        seen.add((p.gpu_type, p.num_gpus))
        sized.append(Option(gpu_type=p.gpu_type, num_gpus=p.num_gpus, unit=p.tp,
                            min_memory_bytes=p.required_memory_bytes, run_s=steps * p.predicted_step_time_s,
                            plan=p, dp=p.dp, tp=p.tp, pp=p.pp))
    options = _by_policy(sized, fastest_type_first)
    # HAS on a live job (ARCHITECTURE.md): walk the ranked plans, take the first the free GPUs satisfy.
    options["has"] = sized
    layouts: dict[tuple[str, int, int, int], Option] = {}
    for p in plans:  # best first: the first plan of a layout is the one to run
        layouts.setdefault((p.gpu_type, p.num_gpus, p.tp, p.pp), Option(
            gpu_type=p.gpu_type, num_gpus=p.num_gpus, unit=p.tp, min_memory_bytes=p.required_memory_bytes,
            run_s=steps * p.predicted_step_time_s, plan=p, dp=p.dp, tp=p.tp, pp=p.pp))
    options[ELASTIC_LAYOUTS] = list(layouts.values())
    return options


def demand_options(cluster: Cluster, num_gpus: int, *, min_memory_gib: float = 0.0, duration_s: float = 3600.0,
                   gpu_type: str | None = None) -> dict[str, list[Option]]:
    """Options of a plain GPU demand: `num_gpus` GPUs of any type (or `gpu_type`) with enough memory.

    Run time scales with peak TFLOP/s from `duration_s` on the fastest type. Raises
    OrchestratorError when no GPU type of the cluster can ever hold it.
    """
    if num_gpus < 1:
        raise OrchestratorError(f"a job needs at least 1 GPU (got {num_gpus})")
    need = int(min_memory_gib * 2**30)
    pools = gpu_pools(_all_ready(cluster))
    fastest = max((p.peak_tflops for p in pools), default=1.0)
    fits = [p for p in pools
            if p.memory_bytes >= need and p.total_gpus >= num_gpus and gpu_type in (None, p.gpu_type)]
    if not fits:
        have = ", ".join(f"{p.total_gpus}x {p.gpu_type} ({p.memory_bytes / 2**30:.0f} GiB)" for p in pools)
        raise OrchestratorError(
            f"no GPU type of cluster {cluster.name!r} can ever hold {num_gpus} GPU(s)"
            f"{' of ' + gpu_type if gpu_type else ''} with {min_memory_gib:g} GiB each [{have}]; "
            "ask for fewer GPUs or less memory"
        )
    sized = [Option(gpu_type=p.gpu_type, num_gpus=num_gpus, unit=1, min_memory_bytes=need,
                    run_s=duration_s * fastest / p.peak_tflops, dp=num_gpus) for p in fits]
    return _by_policy(sized, [p.gpu_type for p in pools])


def idle_fit(options: Sequence[Option], cluster: Cluster) -> Option | None:
    """The first option the cluster's schedulable nodes could hold if no job held a GPU; None when
    none can (the job would wait until a node comes back or is added).

    The fit test of a policy pass (`FreeGpus.try_place`, HAS over the eligible nodes) on a copy of
    the cluster with every GPU free: what other jobs hold is ignored, cordoned and drained nodes
    stay out. (A pass's two selectors fail alike: only when the eligible nodes lack usable GPUs.)
    """
    idle = cluster.copy_state()
    for node in idle.nodes:
        node.free_gpus = list(range(node.gpu_count))
    free = FreeGpus(idle)
    return next((o for o in options if free.try_place("idle-fit", o, has_select) is not None), None)


def require_idle_fit(options: Sequence[Option], cluster: Cluster, *, job: str,
                     out_of_service: dict[str, str] | None = None) -> Option:
    """`idle_fit`, or an OrchestratorError that says what the job needs, what the schedulable
    nodes hold, which nodes are out of service (`out_of_service`: node -> why) and how to fix it."""
    fit = idle_fit(options, cluster)
    if fit is not None:
        return fit
    smallest: dict[str, Option] = {}
    for o in sorted(options, key=lambda o: (o.num_gpus, o.unit, o.min_memory_bytes)):
        smallest.setdefault(o.gpu_type, o)
    needs = "; ".join(
        f"{o.num_gpus}x {o.gpu_type} with {o.min_memory_bytes / 2**30:.1f} GiB each"
        + (f" in tensor-parallel groups of {o.unit} on one node" if o.unit > 1 else "")
        for o in smallest.values()) or "no GPU at all (it has no plan)"
    by_type: dict[str, list] = {}
    for node in cluster.schedulable_nodes():
        by_type.setdefault(node.gpu_type, []).append(node)
    left = "; ".join(
        f"{sum(n.gpu_count for n in group)}x {gpu_type} on {len(group)} node(s) "
        f"({_names([n.name for n in group])}; at most {max(n.gpu_count for n in group)} per node, "
        f"{min(n.gpu_memory_gib for n in group):g} GiB each)"
        for gpu_type, group in by_type.items()) or "none"
    down = out_of_service or {n.name: "cordoned or drained" for n in cluster.nodes if n.cordoned}
    down_text = ", ".join(f"{name} ({why})" for name, why in down.items()) or "none"
    raise OrchestratorError(
        f"job {job!r} cannot be placed on cluster {cluster.name!r} any more, even with no other job running: "
        f"its smallest plan per GPU type needs {needs}; the schedulable nodes hold {left}; "
        f"out of service: {down_text}. "
        f"Return a repaired node to service (`forgeflow cluster uncordon NODE --cluster {cluster.name}`) or add "
        "nodes to the inventory (`forgeflow cluster register CLUSTER.yaml`), then run the job again"
    )


def _names(names: list[str], most: int = 4) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def options_to_json(options: dict[str, list[Option]]) -> dict[str, list[dict[str, Any]]]:
    return {policy: [o.to_dict() for o in options.get(policy, [])] for policy in STORED_POLICIES}


def placement_from_dict(data: dict[str, Any]) -> Placement:
    """The inverse of `Placement.to_dict()` (without the plan object)."""
    return Placement(
        job=data["job"], gpu_type=data["gpu_type"], dp=data["dp"], tp=data["tp"], pp=data["pp"],
        assignments=[
            NodeAssignment(node=n["node"], address=n["address"], gpus=tuple(n["gpus"]), ranks=tuple(n["ranks"]),
                           stages=tuple(n["stages"]), root_complexes=tuple(n["root_complexes"]))
            for n in data["nodes"]
        ],
        master_addr=data["master_addr"], master_port=data["master_port"],
        predicted_step_time_s=data.get("predicted_step_time_s"), cross_mapped=data.get("cross_mapped", False),
    )
