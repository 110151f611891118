"""From "a checkpoint" to a Hugging Face model folder the backends can load.

A checkpoint given to `forgeflow eval` / the evaluate-checkpoint flow is either

- an exported Hugging Face folder (has config.json) — a path, file:// or s3:// URL;
  used as it is; or
- a committed training checkpoint: a `checkpoint.manifest.CheckpointRef` (what the
  checkpoint event carries: root URL, step, format), or a step folder / checkpoint root
  (its newest committed step) located once into one — exported once with
  `training.export.export_hf` (needs the job spec) into the evaluation's work folder,
  which then is what trials preload.

`eval_output_dir` is where an evaluation writes by default: under the job's own run
directory, named by step and suite (`<run_dir>/eval/step-N-SUITE/`), so two jobs'
checkpoints at one step never share a folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from checkpoint.manifest import CheckpointRef
from evalsuite.errors import EvalConfigError


def is_hf_folder(url: str) -> bool:
    from infra.storage import open_storage

    storage = open_storage(url)
    try:
        return storage.exists("config.json")
    finally:
        storage.close()


def checkpoint_to_evaluate(checkpoint: CheckpointRef | dict | str, job_spec: Any | None) -> CheckpointRef | str:
    """What `checkpoint` names: a committed training checkpoint (a CheckpointRef, located here
    once when given as a path or URL), or an exported Hugging Face folder (its URL, as given).
    A dict is a CheckpointRef's `to_dict()` (an event payload, a flow parameter)."""
    if isinstance(checkpoint, CheckpointRef):
        return checkpoint
    if isinstance(checkpoint, dict):
        try:
            return CheckpointRef.from_dict(checkpoint)
        except (TypeError, ValueError) as e:
            raise EvalConfigError(str(e)) from None
    if is_hf_folder(checkpoint):
        return checkpoint
    from training.checkpoint_reader import CheckpointReadError, locate_checkpoint

    try:
        return locate_checkpoint(checkpoint, job_spec)
    except CheckpointReadError as e:
        raise EvalConfigError(f"{checkpoint}: not an exported Hugging Face folder (no config.json) "
                              f"and not a training checkpoint: {e}") from None


def checkpoint_name(checkpoint: CheckpointRef | str) -> str:
    """The checkpoint's folder name (step-00000040, or an exported folder's own name)."""
    if isinstance(checkpoint, CheckpointRef):
        return checkpoint.name
    return checkpoint.rstrip("/").rsplit("/", 1)[-1] or "checkpoint"


def checkpoint_url(checkpoint: CheckpointRef | str) -> str:
    """Where the checkpoint's folder is: results are published beside it."""
    return checkpoint.step_url if isinstance(checkpoint, CheckpointRef) else checkpoint


def eval_output_dir(checkpoint: CheckpointRef | str, suite_name: str, job_spec: Any | None) -> Path:
    """The default folder of one evaluation (its export, trials, results): `<run_dir>/eval/
    step-N-SUITE/` under the job's run directory; `runs/eval/NAME-SUITE/` for a model
    evaluated without a job spec."""
    base = Path(job_spec.resolved_run_dir) if job_spec is not None else Path("runs")
    return base / "eval" / f"{checkpoint_name(checkpoint)}-{suite_name}"


def model_source_for(checkpoint: CheckpointRef | dict | str, job_spec: Any | None, work_dir: str | Path) -> str:
    """The HF folder (path or URL) to evaluate for `checkpoint`, exporting it if needed: once
    per step into `work_dir`, reused by later runs."""
    checkpoint = checkpoint_to_evaluate(checkpoint, job_spec)
    if isinstance(checkpoint, str):
        return checkpoint
    if is_hf_folder(checkpoint.step_url):  # a committed step that holds an exported folder
        return checkpoint.step_url
    if job_spec is None:
        raise EvalConfigError(f"{checkpoint.step_url}: a training checkpoint needs its job spec to be "
                              "exported; pass --config JOB.yaml (or give an exported Hugging Face folder)")
    from training.export import ExportError, export_hf

    out = Path(work_dir) / f"hf-{checkpoint.name}"
    try:
        if not (out / "config.json").is_file():
            export_hf(checkpoint, out, job_spec)
    except ExportError as e:
        raise EvalConfigError(f"{checkpoint.step_url}: cannot export it for evaluation: {e}") from e
    return str(out)
