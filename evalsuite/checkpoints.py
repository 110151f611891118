"""From "a checkpoint" to a Hugging Face model folder the backends can load.

A checkpoint given to `forgeflow eval` / the evaluate-checkpoint flow is either

- an exported Hugging Face folder (has config.json) — a path, file:// or s3:// URL;
  used as it is; or
- a training checkpoint (a `step_N` directory or the checkpoint root) — exported
  once with `training.export.export_hf` (needs the job spec) into the
  evaluation's output folder, which then is what trials preload.
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
    if checkpoint.startswith("s3://"):
        raise EvalConfigError(f"{checkpoint}: not an exported model folder (no config.json); export it "
                              "first with `forgeflow export` and evaluate the exported folder")
    if job_spec is None:
        raise EvalConfigError(f"{checkpoint}: a training checkpoint needs its job spec to be exported; "
                              "pass --config JOB.yaml (or give an exported Hugging Face folder)")
    from training.export import export_hf, resolve_checkpoint

    step_dir = resolve_checkpoint(checkpoint)
    out = Path(work_dir) / f"hf-{step_dir.name}"
    if not (out / "config.json").is_file():
        export_hf(step_dir, out, job_spec)
    return str(out)
