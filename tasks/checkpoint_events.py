"""Committed checkpoints of a job, and the Prefect event that announces each one.

The training side commits checkpoints (checkpoint.manifest: manifest last,
then the `latest` pointer); this is where the flows read them and where the
`forgeflow.checkpoint.committed` event comes from, the event the evaluate
deployment is triggered by.
"""

from __future__ import annotations

import time

from training.config import JobSpec

CHECKPOINT_COMMITTED = "forgeflow.checkpoint.committed"


def committed_checkpoints(spec: JobSpec) -> list[tuple[int, str]]:
    """(step, URL) of the job's committed checkpoints, oldest first, whichever writer produced them."""
    if spec.checkpoint.async_save or spec.checkpoint.url.startswith("s3://"):
        from checkpoint.manifest import list_committed
        from infra.storage import storage_options_from_config

        return [(r.step, r.url) for r in list_committed(spec.checkpoint.url,
                                                         storage_options_from_config(spec.checkpoint))]
    from training.checkpointing import complete_steps, local_root, step_dir_name

    root = local_root(spec.checkpoint.url)
    return [(s, str(root / step_dir_name(s))) for s in complete_steps(root)]


def emit_checkpoint_committed(checkpoint_url: str, job: str, step: int | None = None,
                              job_spec_path: str | None = None) -> None:
    """What the training side sends when a checkpoint commits (the evaluate deployment's trigger)."""
    from prefect.events import emit_event

    emit_event(event=CHECKPOINT_COMMITTED, resource={
        "prefect.resource.id": f"forgeflow.checkpoint.{checkpoint_url}",
        "forgeflow.checkpoint.url": checkpoint_url, "forgeflow.job": job,
        "forgeflow.step": "" if step is None else str(step), "forgeflow.job_spec": job_spec_path or ""})


class CommitAnnouncer:
    """Emits one event per checkpoint committed from now on, listing storage at most every `every_s`.

    Checkpoints already committed when it starts (a resubmitted job) were announced by the
    run that made them, or are picked up by the catch-up deployment; announcing them again
    would re-trigger their evaluation.
    """

    def __init__(self, spec: JobSpec, job_spec_path: str, every_s: float = 30.0):
        self.spec = spec
        self.job_spec_path = job_spec_path
        self.every_s = every_s
        self.announced: set[int] = {step for step, _ in _list_or_empty(spec)}
        self._last = 0.0

    def poll(self, force: bool = False) -> list[int]:
        if not force and time.monotonic() - self._last < self.every_s:
            return []
        self._last = time.monotonic()
        found = _list_or_empty(self.spec)
        new = [(step, url) for step, url in found if step not in self.announced]
        for step, url in new:
            emit_checkpoint_committed(url, self.spec.name, step, self.job_spec_path)
            self.announced.add(step)
        return [step for step, _ in new]


def _list_or_empty(spec: JobSpec) -> list[tuple[int, str]]:
    try:
        return committed_checkpoints(spec)
    except Exception:  # storage hiccup: the next poll lists again; training is not disturbed
        return []
