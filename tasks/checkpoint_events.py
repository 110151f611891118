"""The Prefect event that announces each committed checkpoint of a job.

The training side commits checkpoints (checkpoint.manifest: manifest last, then
the `latest` pointer); `checkpoint.manifest.committed_checkpoints` lists them for
the flows, and this is where the `forgeflow.checkpoint.committed` event comes
from, the event the evaluate deployment is triggered by.

The event's payload carries the checkpoint as a typed reference (`checkpoint`:
checkpoint.manifest.CheckpointRef.to_dict(), root URL + step + format) and the job spec
itself (`job_spec`: validated, as JSON), not the path of its YAML file: the evaluation may
run on a machine that has no such file.
"""

from __future__ import annotations

import time
from typing import Callable

from checkpoint.manifest import CheckpointRef, committed_checkpoints
from training.config import JobSpec

CHECKPOINT_COMMITTED = "forgeflow.checkpoint.committed"


def emit_checkpoint_committed(checkpoint: CheckpointRef, spec: JobSpec) -> None:
    """What the training side sends when a checkpoint commits (the evaluate deployment's trigger:
    prefect.yaml hands `event.payload.checkpoint` and `event.payload.job_spec` to the flow)."""
    from prefect.events import emit_event

    emit_event(event=CHECKPOINT_COMMITTED, resource={
        "prefect.resource.id": f"forgeflow.checkpoint.{checkpoint.step_url}",
        "forgeflow.checkpoint.url": checkpoint.step_url, "forgeflow.job": spec.name,
        "forgeflow.step": str(checkpoint.step)},
        payload={"checkpoint": checkpoint.to_dict(), "job_spec": spec.model_dump(mode="json")})


class CommitAnnouncer:
    """Emits one event per checkpoint committed from now on, listing storage at most every `every_s`.

    Checkpoints already committed when it starts (a resubmitted job) were announced by the
    run that made them, or are picked up by the catch-up deployment; announcing them again
    would re-trigger their evaluation.
    """

    def __init__(self, spec: JobSpec, every_s: float = 30.0,
                 on_commit: Callable[[int, float], None] | None = None):
        self.spec = spec
        self.every_s = every_s
        self.on_commit = on_commit  # (step, commit time) of the newest new one (the job's progress)
        self.announced: set[int] = {record.step for record in _list_or_empty(spec)}
        self._last = 0.0

    def poll(self, force: bool = False) -> list[int]:
        if not force and time.monotonic() - self._last < self.every_s:
            return []
        self._last = time.monotonic()
        new = [r for r in _list_or_empty(self.spec) if r.step not in self.announced]
        for record in new:
            emit_checkpoint_committed(record.ref, self.spec)
            self.announced.add(record.step)
        if new and self.on_commit is not None:
            newest = max(new, key=lambda r: r.step)
            self.on_commit(newest.step, newest.time)
        return [record.step for record in new]


def _list_or_empty(spec: JobSpec) -> list:
    try:
        return committed_checkpoints(spec.checkpoint)
    except Exception:  # storage hiccup: the next poll lists again; training is not disturbed
        return []
