"""The trial coordinator: decompose a suite into trials, balance them over slots, run them.

Acme's three ideas, in order:

1. **Decompose with priors.** Every dataset's inference and metric cost is
   estimated from the runtime history (or sample count × a per-dataset factor).
   Datasets much shorter than a target trial length are batched into one trial
   (one model load serves them all); long ones are split into equal shards so
   no single dataset sets the makespan.
2. **Balance.** Trials are sorted longest first — by inference plus metric
   time, so trials whose CPU metric phase is long start early and that phase
   overlaps the remaining inference — and dealt round-robin over the sorted
   queue to the slot that frees up first (longest-processing-time list
   scheduling).
3. **Decouple.** A slot runs only model load + inference; as soon as a trial's
   shard files are complete its metric jobs go to a CPU pool and the slot moves
   on. The model comes from the node's preload in shared memory. (Running a plan
   is `evalsuite.executor`'s job, the same loop for the CLI and the flow.)

`Policy` switches each idea off, which gives the naive baseline the benchmark
compares against (one trial per dataset, model loaded from storage per trial,
metrics in the slot, first in first out).

The plan is printed before running (slots × trials with predicted times) and
the executor's report after (predicted vs actual); the history is updated from
the actuals.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, Field

from evalsuite.datasets import DatasetRef, EvalDataset
from evalsuite.history import RuntimeHistory
from evalsuite.trials import ShardSpec, Trial


class Policy(BaseModel):
    batch_small: bool = True
    split_large: bool = True
    preload: bool = True
    metrics_in_slot: bool = False
    order: Literal["lpt", "fifo"] = "lpt"

    @classmethod
    def naive(cls) -> "Policy":
        return cls(batch_small=False, split_large=False, preload=False, metrics_in_slot=True, order="fifo")


@dataclass(frozen=True)
class DatasetCost:
    """What decomposition needs to know about one dataset."""

    ref: DatasetRef
    samples: int
    gpu_s: float        # predicted inference seconds for all samples
    metric_s: float     # predicted CPU metric seconds for all samples


def estimate_costs(datasets: list[tuple[DatasetRef, EvalDataset]], history: RuntimeHistory,
                   backend: str, model_key: str) -> list[DatasetCost]:
    out = []
    for ref, ds in datasets:
        n = ds.num_samples()
        out.append(DatasetCost(ref, n, history.gpu_s(ds, backend, model_key, n),
                               history.metric_s(ds, backend, model_key, n)))
    return out


def decompose(costs: list[DatasetCost], *, slots: int, backend: str, output_dir: str, load_s: float,
              policy: Policy | None = None, target_trial_s: float | None = None,
              backend_options: dict | None = None, trials_per_slot: int = 3,
              batch_size: int = 1) -> list[Trial]:
    """Datasets → trials: split the long, batch the short (each as the policy allows).

    A split dataset is cut at multiples of `batch_size` (the requests the backend answers in one
    pass): its shards then cost no more passes than the whole dataset does (32 samples in batches
    of 8 are 4 passes whole, but 5 when cut into 5 shards of 6-7)."""
    policy = policy or Policy()
    total = sum(c.gpu_s for c in costs)
    # A few trials per slot leave the balancer room to even slots out; never aim below the
    # load time, or loads would dominate.
    target = target_trial_s or max(total / (trials_per_slot * slots), load_s, 1e-9)
    pieces: list[list[ShardSpec]] = []
    small: list[ShardSpec] = []
    for c in costs:
        k = 1
        # A long metric phase is split too: its shards are scored in parallel on the CPU pool.
        longest = max(c.gpu_s, c.metric_s)
        batches = max(1, math.ceil(c.samples / max(1, batch_size)))
        if policy.split_large and longest > target:
            k = min(batches, math.ceil(longest / target))
        bounds = [min(c.samples, round(i * batches / k) * max(1, batch_size)) for i in range(k + 1)]
        bounds[-1] = c.samples
        shards = [ShardSpec(dataset=c.ref, shard=i, start=bounds[i], stop=bounds[i + 1],
                            predicted_gpu_s=c.gpu_s * (bounds[i + 1] - bounds[i]) / max(1, c.samples),
                            predicted_metric_s=c.metric_s * (bounds[i + 1] - bounds[i]) / max(1, c.samples))
                  for i in range(k)]
        if policy.batch_small and k == 1 and longest < target / 2:
            small.extend(shards)
        else:
            pieces.extend([s] for s in shards)
    # First-fit decreasing of the short datasets into trials of about `target`.
    bins: list[list[ShardSpec]] = []
    for s in sorted(small, key=lambda s: -s.predicted_gpu_s):
        for b in bins:
            if sum(x.predicted_gpu_s for x in b) + s.predicted_gpu_s <= target:
                b.append(s)
                break
        else:
            bins.append([s])
    samples_of = {c.ref.name: c.samples for c in costs}
    trials = []
    for i, shards in enumerate(pieces + bins):
        label = "+".join(sorted({s.dataset.name for s in shards}))[:48]
        if len(shards) == 1 and shards[0].samples < samples_of[shards[0].dataset.name]:
            label += f"#{shards[0].shard}"  # one shard of a split dataset
        trials.append(Trial(
            trial_id=f"t{i:03d}-{label}", shards=shards, backend=backend,
            backend_options=dict(backend_options or {}), output_dir=output_dir, predicted_load_s=load_s,
            predicted_gpu_s=sum(s.predicted_gpu_s for s in shards),
            predicted_metric_s=sum(s.predicted_metric_s for s in shards)))
    return trials


class Plan(BaseModel):
    slots: list[str]
    trials: list[Trial]
    assignment: dict[str, list[str]]          # slot -> trial ids, in run order
    predicted_start: dict[str, float]
    predicted_end: dict[str, float]           # end of inference (the slot is free again)
    metrics_in_slot: bool = False
    devices: dict[str, list[str]] = Field(default_factory=dict)   # slot -> its device set
    model_key: str = "unknown"                # the history's size class of the model
    history_used: list[str] = Field(default_factory=list)          # datasets predicted from recorded runtimes

    def trial(self, trial_id: str) -> Trial:
        return next(t for t in self.trials if t.trial_id == trial_id)

    @property
    def predicted_makespan(self) -> float:
        ends = [self.predicted_end[t.trial_id] + (0 if self.metrics_in_slot else t.predicted_metric_s)
                for t in self.trials]
        return max(ends, default=0.0)


def assign(trials: list[Trial], slots: list[str], policy: Policy | None = None) -> Plan:
    """Deal trials to slots: sorted queue (LPT) or arrival order (FIFO), next free slot takes next."""
    policy = policy or Policy()
    inline = policy.metrics_in_slot

    def slot_time(t: Trial) -> float:
        return t.predicted_slot_s + (t.predicted_metric_s if inline else 0.0)

    queue = list(trials)
    if policy.order == "lpt":
        # Long metric phases first (they overlap later inference), then longest inference.
        queue.sort(key=lambda t: (-(t.predicted_slot_s + t.predicted_metric_s), t.trial_id))
    free_at = {s: 0.0 for s in slots}
    assignment: dict[str, list[str]] = {s: [] for s in slots}
    start, end = {}, {}
    for t in queue:
        slot = min(slots, key=lambda s: (free_at[s], slots.index(s)))
        start[t.trial_id] = free_at[slot]
        free_at[slot] += slot_time(t)
        end[t.trial_id] = free_at[slot]
        assignment[slot].append(t.trial_id)
    return Plan(slots=list(slots), trials=queue, assignment=assignment, predicted_start=start,
                predicted_end=end, metrics_in_slot=inline)


def format_plan(plan: Plan) -> str:
    lines = [f"evaluation plan: {len(plan.trials)} trial(s) on {len(plan.slots)} slot(s), "
             f"predicted makespan {plan.predicted_makespan:.1f}s"]
    for slot in plan.slots:
        devices = plan.devices.get(slot)
        lines.append(f"  {slot}:" + (f" ({', '.join(devices)})" if devices else ""))
        for tid in plan.assignment[slot]:
            t = plan.trial(tid)
            shards = ", ".join(f"{s.dataset.name}[{s.start}:{s.stop}]" for s in t.shards)
            lines.append(f"    {tid:<40} load {t.predicted_load_s:6.1f}s  infer {t.predicted_gpu_s:7.1f}s  "
                         f"metric {t.predicted_metric_s:6.1f}s  ({shards})")
    return "\n".join(lines)


def slot_names(count: int) -> list[str]:
    return [f"slot{i}" for i in range(count)]
