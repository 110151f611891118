"""Watch a launched training job until it finishes, fails, hangs or spikes.

What is watched (the worker's side of the contract is infra/runfiles.py):

- exit codes of every node's torchrun: the first non-zero one is a failure; the
  other nodes get `failure_grace_s` to print their own errors (often the real
  root cause is on another rank) before they are stopped;
- heartbeats (`heartbeat/rank{R}.json`): if some rank has not advanced for
  `hang_timeout_s` the job is a Hang and is killed. Before a rank's first
  heartbeat of this attempt, `startup_timeout_s` applies instead: start-up
  (imports, building the model, loading a checkpoint) is slow and silent;
- the loss-spike marker, written before the worker exits with EXIT_LOSS_SPIKE;
- the stop marker: after a SIGTERM (Prefect cancellation, preemption) the ranks commit
  a checkpoint, rank 0 writes markers/stopped.json and they exit EXIT_STOPPED, which
  torchrun turns into a plain non-zero exit: with this attempt's marker present the
  outcome is "stopped" (by request, resumable from `stop.checkpoint_step`), not a failure.

The result carries the console logs of every node for the diagnosis.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal

from infra.launch import LaunchedJob
from infra import runfiles

Status = Literal["finished", "failed", "hang", "spike", "stopped"]


@dataclass
class AttemptOutcome:
    status: Status
    exit_codes: dict[str, int | None]
    last_step: int  # newest step any rank reported in this attempt (0 if none)
    seconds: float  # launch to detection
    log_paths: dict[str, Path] = field(default_factory=dict)
    failed_nodes: list[str] = field(default_factory=list)
    stale_ranks: list[int] = field(default_factory=list)
    spike: runfiles.SpikeMarker | None = None  # this attempt's loss-spike marker
    stop: runfiles.StopMarker | None = None  # this attempt's graceful-stop marker

    @property
    def ok(self) -> bool:
        return self.status == "finished"


def watch(
    job: LaunchedJob,
    run_dir: Path,
    world_size: int,
    hang_timeout_s: float = 300.0,
    startup_timeout_s: float = 600.0,
    failure_grace_s: float = 5.0,
    stop_grace_s: float = 120.0,
    poll_s: float = 0.5,
    on_progress: Callable[[int], None] | None = None,
) -> AttemptOutcome:
    run_dir = Path(run_dir)
    started_wall = time.time()
    started = time.monotonic()
    last_reported = -1
    last_step = 0
    while True:
        codes = job.poll()
        beats = runfiles.read_heartbeats(run_dir)
        current = {r: b for r, b in beats.items() if b.time >= started_wall}  # this attempt's
        if current:
            last_step = max(last_step, max(b.step for b in current.values()))
            if on_progress and last_step != last_reported:
                on_progress(last_step)
                last_reported = last_step

        failed = [node for node, code in codes.items() if code not in (None, 0)]
        if failed:
            # Let the other ranks print their errors — or, when ranks are stopping gracefully
            # (heartbeat phase "stopping"), finish committing their checkpoint: give them the
            # job's checkpoint.stop_deadline_s before anything is killed.
            stopping = any(b.phase == "stopping" for b in current.values())
            job.wait(timeout=stop_grace_s if stopping else failure_grace_s)
            job.terminate(grace_s=5.0)
            codes = job.poll()
            spike = runfiles.read_spike_marker(run_dir, since=started_wall)
            stop = runfiles.read_stop_marker(run_dir, since=started_wall)
            return AttemptOutcome(
                status="spike" if spike else "stopped" if stop else "failed",
                exit_codes=codes,
                last_step=last_step,
                seconds=time.monotonic() - started,
                log_paths=job.log_paths(),
                failed_nodes=[] if stop and not spike else failed,
                spike=spike,
                stop=stop,
            )
        if codes and all(code == 0 for code in codes.values()):
            finished = runfiles.finished_marker_path(run_dir)
            status: Status = "finished" if finished.exists() and finished.stat().st_mtime >= started_wall else "failed"
            return AttemptOutcome(status, codes, last_step, time.monotonic() - started, job.log_paths())

        now = time.time()
        stale = []
        for rank in range(world_size):
            beat_time = beats[rank].time if rank in beats else 0.0
            if beat_time >= started_wall:
                if now - beat_time > hang_timeout_s:
                    stale.append(rank)
            elif now - started_wall > startup_timeout_s:
                stale.append(rank)
        if stale:
            job.terminate(grace_s=5.0)
            return AttemptOutcome(
                status="hang",
                exit_codes=job.poll(),
                last_step=last_step,
                seconds=time.monotonic() - started,
                log_paths=job.log_paths(),
                stale_ranks=stale,
            )
        time.sleep(poll_s)
