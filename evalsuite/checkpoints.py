"""From "a checkpoint" to a Hugging Face model folder the backends can load.

A checkpoint given to `forgeflow eval` / the evaluate-checkpoint flow is either

- an exported Hugging Face folder (has config.json) — a path, file:// or s3:// URL;
  used as it is; or
- a training checkpoint (`step-N/`, local or s3://, or a checkpoint root: its
  newest committed step, found through checkpoint.committed_checkpoints) —
  exported once with `training.export.export_hf` (needs the job spec) into the
  evaluation's work folder, which then is what trials preload.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from evalsuite.errors import EvalConfigError


def is_hf_folder(url: str) -> bool:
    from infra.storage import open_storage

    storage = open_storage(url)
    try:
        return storage.exists("config.json")
    finally:
        storage.close()


def model_source_for(checkpoint: str, job_spec: Any | None, work_dir: str | Path) -> str:
    """The HF folder (path or URL) to evaluate for `checkpoint`, exporting it if needed."""
    if is_hf_folder(checkpoint):
        return checkpoint
    if job_spec is None:
        raise EvalConfigError(f"{checkpoint}: a training checkpoint needs its job spec to be exported; "
                              "pass --config JOB.yaml (or give an exported Hugging Face folder)")
    from training.checkpoint_reader import CheckpointReadError, locate_checkpoint
    from training.export import ExportError, export_hf

    try:
        location = locate_checkpoint(checkpoint, job_spec)
        out = Path(work_dir) / f"hf-{location.name}"
        if not (out / "config.json").is_file():  # exported once per step, reused by later runs
            export_hf(location.step_url, out, job_spec)
    except (CheckpointReadError, ExportError) as e:
        raise EvalConfigError(f"{checkpoint}: cannot export it for evaluation: {e}") from e
    return str(out)
