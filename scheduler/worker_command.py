"""The worker's command line for one attempt: the only place a placement's layout and the
attempt's typed overrides (diagnosis.recovery.AttemptOverrides) become `training.train` arguments.

Every launcher (local, Prefect node-launch, Slurm, Kubernetes) starts the same command. The
ranks read the spec the flow validated (`write_attempt_spec`: JSON in the run directory, which
every node sees), not the user's YAML file, and check its config hash: one spec, parsed once,
for the flow and every rank of every attempt."""

from __future__ import annotations

from pathlib import Path

from diagnosis.recovery import AttemptOverrides
from infra.atomic_write import atomic_write_json
from infra.runfiles import attempt_spec_path
from scheduler.placement import Placement
from training.config import JobSpec


def write_attempt_spec(spec: JobSpec, attempt: int) -> Path:
    """The validated spec as JSON (a YAML subset `training.train` loads) for attempt `attempt`."""
    path = attempt_spec_path(spec.resolved_run_dir, attempt)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, spec.model_dump(mode="json"))
    return path


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


def worker_args(spec_path: str | Path, placement: Placement, resume_from_step: int | None = None,
                overrides: AttemptOverrides = AttemptOverrides(), config_hash: str | None = None) -> list[str]:
    """The worker's command line for one attempt (after `python`); with `config_hash`, the
    worker refuses a spec file whose model, training and data differ from the flow's."""
    args = ["-m", "training.train", str(spec_path)]
    if config_hash is not None:
        args += ["--config-hash", config_hash]
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
