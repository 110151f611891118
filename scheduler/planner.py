"""Plan generation and ranking: which GPU type, how many, which parallel layout.

The unit that is estimated is a Crius-style **cell**: a GPU type, a GPU count
and a number of pipeline stages. Inside a cell only the data × tensor split
varies (tp inside one node, dividing the attention and key/value heads and
the MLP width; dp dividing the global batch into whole micro batches),
together with the micro-batch size and the recompute mode. A layout is kept
only when its predicted per-GPU peak memory (`scheduler.memory_model`, MARP) fits the
GPU with a safety margin (`memory_margin`, the fraction of GPU memory kept
free; default 10%); the survivors are ranked by the predicted step time of
`scheduler.cost_model`. The distributed optimizer is used whenever dp > 1: its
reduce-scatter + all-gather move what the plain all-reduce moves, so it only
saves memory.

Which GPU counts are tried: for each type, the smallest power-of-two count
that can hold the job (MARP's sizing), and by default 2× and 4× that (Crius
compares N, 2N cells), bounded by the type's schedulable GPUs and `max_gpus`.
Explicit `gpu_counts` replace this.

Pruning keeps planning a 1,280-GPU cluster around 20 ms of CPU time
(benchmarks/placement_latency.py): memory estimates are cached per (model,
layout) and shared by GPU types; a count is skipped when even its most frugal
layout does not fit; a layout is dropped after one estimate when its most
frugal candidate (smallest micro batch, most recompute) does not fit; the
others are searched best-first — every (micro batch, recompute) candidate is
priced by the cost model, memory is estimated in order of predicted step time
until `plans_per_layout` (default 1) fit, and a candidate that does not fit
rules out, unestimated, every candidate with a larger micro batch and less
recompute.

Jobs that fit nowhere raise `InfeasibleJobError`, whose message names the
smallest feasible alternative: more GPUs than the cluster has, a recompute
mode the configuration excluded, or a shorter sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from scheduler.cluster import GIB, Cluster, ClusterError
from scheduler.gpus import checked_gpu_type, gpu_spec
from scheduler.cost_model import CostModelConfig, LinkSpeeds, StepTime, predict_step_time
from scheduler import memory_model as marp
from training.capabilities import WORKER
from training.config import JobSpec, ModelConfig

RecomputeMode = Literal["none", "selective", "full"]


class PlannerError(ClusterError):
    """Planning could not run (bad request or an inventory with nothing schedulable)."""


class InfeasibleJobError(PlannerError):
    """No GPU type of the cluster can hold the job; `alternatives` says what would."""

    def __init__(self, message: str, alternatives: list[str]):
        super().__init__(message)
        self.alternatives = alternatives
        self.offload_plan = None  # a scheduler.offload.plan.OffloadPlan when host memory can hold it


class PlannerConfig(BaseModel):
    """What the planner may consider and how it ranks."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    memory_margin: float = Field(default=0.10, ge=0, lt=1, description="GPU memory kept free")
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    recompute: tuple[RecomputeMode, ...] = ("none", "selective", "full")
    distributed_optimizer: bool = True
    max_pipeline_stages: int = Field(default=16, ge=1)
    scale_options: tuple[int, ...] = Field(
        default=(1, 2, 4), description="multiples of each type's smallest feasible GPU count"
    )
    gpu_counts: tuple[int, ...] | None = Field(default=None, description="explicit counts to try")
    max_gpus: int | None = Field(default=None, gt=0)
    gpu_types: tuple[str, ...] | None = Field(default=None, description="restrict to these types")
    rank_by: Literal["step_time", "gpu_seconds"] = "step_time"
    plans_per_layout: int = Field(default=1, ge=1, description="fitting (micro batch, recompute) variants kept per dp/tp/pp")
    compute_efficiency: float = Field(default=0.45, gt=0, le=1)
    comm_efficiency: float = Field(default=0.7, gt=0, le=1)

    @property
    def cost(self) -> CostModelConfig:
        return CostModelConfig(
            compute_efficiency=self.compute_efficiency, comm_efficiency=self.comm_efficiency
        )


def worker_planner_config(cluster: Cluster, **fields: Any) -> PlannerConfig:
    """A planner configuration for the plans the training worker can run
    (training.capabilities); `fields` set the other PlannerConfig fields.

    On an all-CPU cluster the planner also leaves out the distributed optimizer and full
    recompute: host memory is rarely what binds there, and both trade step time for
    memory (the worker runs them on CPU; they are simply not worth choosing)."""
    caps = WORKER
    base: dict[str, Any] = dict(max_pipeline_stages=caps.max_pipeline_stages, recompute=caps.recompute,
                                distributed_optimizer=caps.distributed_optimizer)
    if all(t == "cpu" for t in cluster.gpu_types()):
        base.update(distributed_optimizer=False,
                    recompute=tuple(rc for rc in caps.recompute if rc != "full"))
    return PlannerConfig(**{**base, **fields})


@dataclass(frozen=True)
class PlanRequest:
    """What the planner needs of a job: the model shape, the batch and the precision."""

    model: ModelConfig
    global_batch: int
    precision: str = "bf16"
    name: str = "job"
    steps: int | None = None
    attention: str = "auto"  # training.attention: which core attention the worker builds

    @classmethod
    def from_job(cls, job: JobSpec) -> "PlanRequest":
        return cls(
            model=job.model,
            global_batch=job.training.global_batch_size,
            precision=job.training.precision,
            name=job.name,
            steps=job.training.steps,
            attention=job.training.attention,
        )


@dataclass(frozen=True)
class Cell:
    """Crius's unit of estimation: fixed GPU type, GPU count and pipeline stages."""

    gpu_type: str
    num_gpus: int
    pipeline_stages: int

    def __str__(self) -> str:
        return f"{self.num_gpus}x{self.gpu_type}/pp{self.pipeline_stages}"


@dataclass(frozen=True)
class GpuPool:
    """All schedulable GPUs of one type, as the planner sees them."""

    gpu_type: str
    memory_bytes: int
    peak_tflops: float
    gpus_per_node: int
    total_gpus: int
    links: LinkSpeeds


@dataclass(frozen=True, eq=False)
class Plan:
    """One way to run the job: a cell, its layout, its memory and its predicted speed."""

    cell: Cell
    dp: int
    tp: int
    pp: int
    micro_batch_size: int
    num_microbatches: int
    recompute: RecomputeMode
    distributed_optimizer: bool
    precision: str
    memory: marp.MemoryBreakdown  # the per-GPU peak, itemised
    peak_memory_bytes: int
    gpu_memory_bytes: int
    memory_margin: float
    step: StepTime
    tokens_per_step: int
    request: PlanRequest
    cost: CostModelConfig

    def step_time_on(self, *, peak_tflops: float, links: LinkSpeeds, gpus_per_node_used: int) -> StepTime:
        """This layout's step time on other GPUs or spread differently over nodes."""
        r = self.request
        return predict_step_time(
            r.model, global_batch=r.global_batch, dp=self.dp, tp=self.tp, pp=self.pp,
            micro_batch=self.micro_batch_size, recompute=self.recompute, precision=self.precision,
            peak_tflops=peak_tflops, links=links, gpus_per_node_used=gpus_per_node_used, cfg=self.cost,
        )

    @property
    def num_gpus(self) -> int:
        return self.cell.num_gpus

    @property
    def gpu_type(self) -> str:
        return self.cell.gpu_type

    @property
    def predicted_step_time_s(self) -> float:
        return self.step.total_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step.total_s

    @property
    def required_memory_bytes(self) -> int:
        """The smallest GPU that holds this layout with the safety margin (HAS's 'GPU size')."""
        return int(self.peak_memory_bytes / (1.0 - self.memory_margin)) + 1

    @property
    def layout(self) -> str:
        """e.g. 'dp4 tp2 pp1 mb2 recompute=selective dist-opt'."""
        extras = []
        if self.recompute != "none":
            extras.append(f"recompute={self.recompute}")
        if self.distributed_optimizer:
            extras.append("dist-opt")
        tail = (" " + " ".join(extras)) if extras else ""
        return f"dp{self.dp} tp{self.tp} pp{self.pp} mb{self.micro_batch_size}{tail}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "gpu_type": self.gpu_type,
            "num_gpus": self.num_gpus,
            "dp": self.dp,
            "tp": self.tp,
            "pp": self.pp,
            "micro_batch_size": self.micro_batch_size,
            "num_microbatches": self.num_microbatches,
            "recompute": self.recompute,
            "distributed_optimizer": self.distributed_optimizer,
            "precision": self.precision,
            "peak_memory_gib": round(self.peak_memory_bytes / GIB, 3),
            "gpu_memory_gib": round(self.gpu_memory_bytes / GIB, 3),
            "memory": memory_breakdown_dict(self.memory),
            "predicted_step_time_s": self.predicted_step_time_s,
            "step_time_parts_s": {
                "compute": self.step.compute_s,
                "pipeline_bubble": self.step.bubble_s,
                "tp_comm": self.step.tp_comm_s,
                "dp_comm": self.step.dp_comm_s,
                "pp_comm": self.step.pp_comm_s,
            },
            "tokens_per_s": self.tokens_per_s,
        }


# --- the cluster as the planner sees it --------------------------------


def gpu_pools(cluster: Cluster, only: tuple[str, ...] | None = None) -> list[GpuPool]:
    """One pool per GPU type with schedulable (not cordoned) nodes, fastest first."""
    pools = []
    for gpu_type in cluster.gpu_types():
        if only is not None and gpu_type not in only:
            continue
        nodes = cluster.nodes_of_type(gpu_type)
        if not nodes:
            continue
        pools.append(
            GpuPool(
                gpu_type=gpu_type,
                memory_bytes=min(n.gpu_memory_bytes for n in nodes),
                peak_tflops=min(n.peak_tflops for n in nodes),
                gpus_per_node=max(n.gpu_count for n in nodes),
                total_gpus=sum(n.gpu_count for n in nodes),
                links=LinkSpeeds(
                    intra_node_gbps=min(n.intra_bandwidth_gbps for n in nodes),
                    inter_node_gbps=cluster.inter_node_bandwidth_gbps,
                ),
            )
        )
    return pools


# --- memory estimates, cached per (model, layout) ----------------------


def _model_key(model: ModelConfig) -> tuple:
    return tuple(sorted(model.model_dump().items()))


@lru_cache(maxsize=65536)
def _model_from_key(key: tuple) -> ModelConfig:
    return ModelConfig(**dict(key))


@lru_cache(maxsize=262144)
def _cached_estimate(model_key: tuple, global_batch: int, precision: str, dp: int, tp: int,
                     pp: int, micro_batch: int, recompute: str, distributed_optimizer: bool,
                     profile: marp.RuntimeProfile) -> marp.MemoryBreakdown:
    plan = marp.ParallelPlan(
        global_batch_size=global_batch, micro_batch_size=micro_batch, dp=dp, tp=tp, pp=pp,
        recompute=recompute, distributed_optimizer=distributed_optimizer, precision=precision,
    )
    return marp.estimate_memory(_model_from_key(model_key), plan, profile)


def memory_breakdown_dict(breakdown: marp.MemoryBreakdown) -> dict[str, float]:
    """The breakdown in GiB per category (scheduler.memory_model's categories)."""
    return {c: round(getattr(breakdown, c) / GIB, 4) for c in breakdown.CATEGORIES}


# --- enumeration --------------------------------------------------------


def _powers_of_two(limit: int) -> list[int]:
    out, n = [], 1
    while n <= limit:
        out.append(n)
        n *= 2
    return out


@dataclass
class _Search:
    request: PlanRequest
    config: PlannerConfig
    model_key: tuple = field(init=False)

    def __post_init__(self) -> None:
        self.model_key = _model_key(self.request.model)
        m = self.request.model
        self.recompute_order = [rc for rc in ("none", "selective", "full") if rc in self.config.recompute]
        self.cost = self.config.cost
        self.num_parameters = m.num_parameters()
        self.tp_choices = {t for t in _powers_of_two(m.num_attention_heads)
                           if m.num_attention_heads % t == 0 and m.kv_heads % t == 0 and m.ffn_size % t == 0}
        self.profile = marp.MEGATRON_GPU

    def estimate(self, dp: int, tp: int, pp: int, mb: int, rc: str, do: bool) -> marp.MemoryBreakdown:
        r = self.request
        return _cached_estimate(self.model_key, r.global_batch, r.precision, dp, tp, pp, mb, rc, do, self.profile)

    def layouts(self, pool: GpuPool, n: int):
        """(dp, tp, pp) splits of n GPUs that the model shape and batch allow."""
        m, gb = self.request.model, self.request.global_batch
        for pp in _powers_of_two(min(n, self.config.max_pipeline_stages, m.num_layers)):
            if m.num_layers % pp or n % pp:
                continue
            for tp in _powers_of_two(min(pool.gpus_per_node, n // pp)):
                if tp not in self.tp_choices or (n // pp) % tp:
                    continue
                dp = n // (pp * tp)
                if gb % dp:
                    continue
                yield dp, tp, pp

    def fits_at_all(self, pool: GpuPool, n: int, usable: int) -> bool:
        """Cheap lower bound: does the most frugal layout of n GPUs fit?"""
        self.profile = marp.profile_for_device(pool.gpu_type, self.request.precision, self.request.attention)
        best = None
        frugal = self.recompute_order[-1]
        for dp, tp, pp in self.layouts(pool, n):
            mem = self.estimate(dp, tp, pp, 1, frugal, self.config.distributed_optimizer).total
            best = mem if best is None else min(best, mem)
            if best <= usable:
                return True
        return False

    def plans_for(self, pool: GpuPool, n: int) -> list[Plan]:
        """The best `plans_per_layout` plans of each (dp, tp, pp) split of n GPUs of the pool.

        Best-first: (micro batch, recompute) candidates are priced by the cost model
        (cheap), then memory is estimated in order of predicted step time until one fits.
        A candidate that does not fit rules out every candidate with a larger micro batch
        and less recompute without estimating it.
        """
        r, cfg = self.request, self.config
        usable = int(pool.memory_bytes * (1 - cfg.memory_margin))
        self.profile = marp.profile_for_device(pool.gpu_type, self.request.precision, self.request.attention)
        per_node = min(n, pool.gpus_per_node)
        out: list[Plan] = []
        # The distributed optimizer costs no step time here (reduce-scatter + all-gather
        # move what the all-reduce moves) and only saves memory. It is used at dp = 1 too
        # (sharded over one rank: the same memory): the optimizer's kind is part of the
        # checkpoint, and a job placed again after losing a node (dp 2 -> 1, or back) must
        # resume the optimizer state it saved, which the other kind cannot load.
        frugal_rc = self.recompute_order[-1]
        for dp, tp, pp in self.layouts(pool, n):
            per_rank = r.global_batch // dp
            dist_opt = cfg.distributed_optimizer
            micro_batches = []
            for mb in cfg.micro_batch_sizes:
                if per_rank % mb:
                    continue
                if pp > 1 and per_rank // mb < pp:
                    break  # fewer microbatches than stages: the pipeline never fills
                micro_batches.append(mb)
            if not micro_batches:
                continue
            # Most layouts of a small count hold nothing: one estimate of the most frugal
            # candidate (smallest micro batch, most recompute) settles that before pricing.
            if self.estimate(dp, tp, pp, micro_batches[0], frugal_rc, dist_opt).total > usable:
                continue
            candidates = []
            for mb in micro_batches:
                for saving, rc in enumerate(self.recompute_order):
                    step = predict_step_time(
                        r.model, global_batch=r.global_batch, dp=dp, tp=tp, pp=pp, micro_batch=mb,
                        recompute=rc, precision=r.precision, peak_tflops=pool.peak_tflops,
                        links=pool.links, gpus_per_node_used=per_node, cfg=self.cost,
                        num_parameters=self.num_parameters,
                    )
                    candidates.append((step.total_s, mb, saving, rc, per_rank // mb, step))
            candidates.sort(key=lambda c: c[:3])
            ruled_out: list[tuple[int, int]] = []
            kept = 0
            for _, mb, saving, rc, m, step in candidates:
                if any(mb >= bad_mb and saving <= bad_saving for bad_mb, bad_saving in ruled_out):
                    continue
                mem = self.estimate(dp, tp, pp, mb, rc, dist_opt)
                if mem.total > usable:
                    ruled_out.append((mb, saving))
                    continue
                out.append(Plan(
                    cell=Cell(pool.gpu_type, n, pp), dp=dp, tp=tp, pp=pp, micro_batch_size=mb,
                    num_microbatches=m, recompute=rc, distributed_optimizer=dist_opt,
                    precision=r.precision, memory=mem, peak_memory_bytes=mem.total,
                    gpu_memory_bytes=pool.memory_bytes, memory_margin=cfg.memory_margin,
                    step=step, tokens_per_step=r.global_batch * r.model.seq_length,
                    request=r, cost=self.cost,
                ))
                kept += 1
                if kept >= cfg.plans_per_layout:
                    break
        return out

    def counts_for(self, pool: GpuPool) -> list[int]:
        limit = pool.total_gpus if self.config.max_gpus is None else min(pool.total_gpus, self.config.max_gpus)
        if self.config.gpu_counts is not None:
            return sorted(n for n in set(self.config.gpu_counts) if n <= limit)
        usable = int(pool.memory_bytes * (1 - self.config.memory_margin))
        smallest = next((n for n in _powers_of_two(limit) if self.fits_at_all(pool, n, usable)), None)
        if smallest is None:
            return []
        return sorted({smallest * k for k in self.config.scale_options if smallest * k <= limit})


def _rank_key(config: PlannerConfig):
    if config.rank_by == "gpu_seconds":
        return lambda p: (p.predicted_step_time_s * p.num_gpus, p.predicted_step_time_s, p.peak_memory_bytes)
    return lambda p: (p.predicted_step_time_s, p.num_gpus, p.peak_memory_bytes)


def plan_job(
    job: JobSpec | PlanRequest,
    cluster: Cluster,
    config: PlannerConfig | None = None,
) -> list[Plan]:
    """Every feasible plan of `job` on `cluster`, best first.

    Raises InfeasibleJobError when no type can hold the job, naming the
    smallest change that would make it fit.
    """
    config = config or PlannerConfig()
    request = job if isinstance(job, PlanRequest) else PlanRequest.from_job(job)
    if config.gpu_types:   # the user's choice, as the inventory spells it; a typo is refused, not ignored
        config = config.model_copy(update={"gpu_types": tuple(
            checked_gpu_type(t, cluster.gpu_types()) for t in config.gpu_types)})
    pools = gpu_pools(cluster, config.gpu_types)
    if not pools:
        if config.gpu_types:
            raise PlannerError(
                f"cluster {cluster.name!r} has no schedulable GPUs of type(s) {list(config.gpu_types)}; "
                f"types present: {cluster.gpu_types()}"
            )
        raise PlannerError(f"cluster {cluster.name!r} has no schedulable node (all are cordoned)")
    plans = plan_on_pools(request, pools, config)
    if not plans:
        message, alternatives = _explain_infeasible(request, pools, config)
        # Mobius: nothing fits GPU memory, but the model may fit host DRAM with stages swapped
        # through the GPUs (`forgeflow finetune` runs such a plan).
        from scheduler.offload.plan import plan_offload

        offload = plan_offload(request.model, request.global_batch, cluster, memory_margin=config.memory_margin)
        if offload is not None:
            alternatives.append(offload.summary())
            message += f"; offload: {offload.summary()}"
        error = InfeasibleJobError(message, alternatives)
        error.offload_plan = offload
        raise error
    return plans


def plan_on_pools(request: PlanRequest, pools: list[GpuPool], config: PlannerConfig) -> list[Plan]:
    """Feasible plans on the given GPU pools, best first (empty when none fits)."""
    search = _Search(request, config)
    plans: list[Plan] = []
    for pool in pools:
        for n in search.counts_for(pool):
            plans.extend(search.plans_for(pool, n))
    plans.sort(key=_rank_key(config))
    return plans


def catalogue_pool(gpu_type: str, *, gpus: int = 1 << 16, gpus_per_node: int = 8,
                   inter_node_gbps: float = 200.0) -> GpuPool:
    """A pool of a catalogue GPU type that need not exist in any cluster (reference runs)."""
    spec = gpu_spec(gpu_type)
    return GpuPool(
        gpu_type=spec.name, memory_bytes=int(spec.memory_gib * GIB), peak_tflops=spec.peak_tflops,
        gpus_per_node=gpus_per_node, total_gpus=gpus,
        links=LinkSpeeds(intra_node_gbps=spec.intra_bandwidth_gbps, inter_node_gbps=inter_node_gbps),
    )


def best_plan_per_cell(plans: list[Plan]) -> list[Plan]:
    """The first (best-ranked) plan of each cell, in rank order."""
    seen: set[Cell] = set()
    out = []
    for p in plans:
        if p.cell not in seen:
            seen.add(p.cell)
            out.append(p)
    return out


# --- why a job does not fit, and what would ------------------------------


def _explain_infeasible(request: PlanRequest, pools: list[GpuPool], config: PlannerConfig) -> tuple[str, list[str]]:
    m = request.model
    alternatives: list[str] = []

    # 1. More GPUs than the cluster (or max_gpus) offers: of the type that needs the fewest.
    # Every type is tried, not only the one with the most memory per GPU: a type with larger
    # nodes allows more tensor parallelism (123B on crius-sim: 48 GiB A40s in nodes of 2 never
    # hold it, 32 GiB V100s in nodes of 16 do from 512 GPUs).
    unbounded = config.model_copy(update={"max_gpus": None, "gpu_counts": None})
    search = _Search(request, unbounded)
    fewest: tuple[int, GpuPool] | None = None
    for pool in sorted(pools, key=lambda p: -p.memory_bytes):
        usable = int(pool.memory_bytes * (1 - config.memory_margin))
        unlimited = GpuPool(pool.gpu_type, pool.memory_bytes, pool.peak_tflops, pool.gpus_per_node, 1 << 20, pool.links)
        limit = 1 << 16 if fewest is None else fewest[0] // 2
        needed = next((n for n in _powers_of_two(limit) if search.fits_at_all(unlimited, n, usable)), None)
        if needed is not None:
            fewest = (needed, pool)
    if fewest is not None:
        needed, pool = fewest
        have = pool.total_gpus if config.max_gpus is None else min(pool.total_gpus, config.max_gpus)
        alternatives.append(f"more GPUs: {needed}x {pool.gpu_type} ({pool.memory_bytes / GIB:.0f} GiB) would hold it; "
                            f"{have} are schedulable" + (f" (max_gpus={config.max_gpus})" if config.max_gpus else ""))

    # 2. A memory-saving mode the configuration excluded.
    missing = [rc for rc in ("selective", "full") if rc not in config.recompute]
    if missing or not config.distributed_optimizer:
        relaxed = config.model_copy(update={"recompute": ("none", "selective", "full"), "distributed_optimizer": True})
        if any(_Search(request, relaxed).counts_for(p) for p in pools):
            alternatives.append("recompute: allow recompute=full and the distributed optimizer "
                                "(PlannerConfig.recompute / distributed_optimizer)")

    # 3. A shorter sequence on the GPUs the cluster has.
    seq = m.seq_length // 2
    while seq >= 128:
        shorter = PlanRequest(model=m.model_copy(update={"seq_length": seq}), global_batch=request.global_batch,
                              precision=request.precision, name=request.name, attention=request.attention)
        s = _Search(shorter, config)
        if any(s.counts_for(p) for p in pools):
            alternatives.append(f"shorter sequence: seq_length {seq} (from {m.seq_length}) fits")
            break
        seq //= 2

    types = ", ".join(f"{p.total_gpus}x {p.gpu_type} ({p.memory_bytes / GIB:.0f} GiB)" for p in pools)
    message = (
        f"job {request.name!r} ({m.num_parameters() / 1e9:.2f}B parameters, seq {m.seq_length}, "
        f"global batch {request.global_batch}, {request.precision}) fits on no GPU type of this cluster "
        f"[{types}] with a {config.memory_margin:.0%} memory margin"
    )
    if alternatives:
        message += "; smallest feasible alternatives: " + "; ".join(alternatives)
    else:
        message += "; no alternative found: reduce the model size or the global batch"
    return message, alternatives


def next_plan_hint(spec: JobSpec, cluster: Cluster) -> str:
    """For an out-of-memory stop: the plan the planner would pick among the most memory-frugal
    ones the worker runs (activations recomputed, optimizer state sharded)."""
    try:
        frugal = worker_planner_config(cluster, recompute=("full",), distributed_optimizer=True)
        best = plan_job(spec, cluster, frugal)[0]
        return (f"next plan: {best.num_gpus}x {best.gpu_type} {best.layout} "
                f"(predicted peak {best.peak_memory_bytes / 2**30:.1f} GiB)")
    except Exception as e:  # a hint, never a second failure
        return f"no alternative plan found ({type(e).__name__})"
