"""The worker's command line for one attempt: the only place a placement's layout and the
attempt's typed overrides (diagnosis.recovery.AttemptOverrides) become `training.train` arguments.

Every launcher (local, Prefect node-launch, Slurm, Kubernetes) starts the same command."""

from __future__ import annotations

from diagnosis.recovery import AttemptOverrides
from scheduler.placement import Placement


def plan_overrides(placement: Placement) -> list[str]:
    """The plan's layout as worker `--set` overrides (the user did not choose it)."""
    plan = placement.plan
    # tp and pp from the placement: its ranks follow megatron's order (tp, dp, pp), so the
    # worker's pipeline stages land on the GPUs the placement's cross mapping chose for them
    out = [f"training.tensor_parallel={placement.tp}", f"training.pipeline_parallel={placement.pp}"]
    if plan is not None:
        out += [
            f"training.micro_batch_size={plan.micro_batch_size}",
            f"training.recompute={plan.recompute}",
            f"training.use_distributed_optimizer={str(plan.distributed_optimizer).lower()}",
        ]
    return out


def worker_args(spec_path: str, placement: Placement, resume_from_step: int | None = None,
                overrides: AttemptOverrides = AttemptOverrides()) -> list[str]:
    """The worker's command line for one attempt (after `python`)."""
    args = ["-m", "training.train", spec_path]
    sets = plan_overrides(placement)
    if overrides.skip_batches:
        sets.append(f"spike.skip_batches={overrides.skip_batches}")
    if overrides.skip_from_step is not None:
        sets.append(f"spike.skip_from_step={overrides.skip_from_step}")
    for item in sets:
        args += ["--set", item]
    if resume_from_step is not None:
        args += ["--resume-from-step", str(resume_from_step)]
    return args
