"""Watch a launched training job until it finishes, fails, hangs or spikes.

What is watched (the worker's side of the contract is infra/runfiles.py):

- exit codes of every node's torchrun: the first non-zero one is a failure; the
  other nodes get `failure_grace_s` to print their own errors (often the real
  root cause is on another rank) before they are stopped;
- heartbeats (`heartbeat/rank{R}.json`): if some rank has not advanced for
  `hang_timeout_s` the job is a Hang and is killed. Before a rank's first
  heartbeat of this attempt, `startup_timeout_s` applies instead: start-up
  (imports, building the model, loading a checkpoint) is slow and silent;
- the loss-spike marker, written before the worker exits with EXIT_LOSS_SPIKE.

The result carries the console logs of every node for the diagnosis.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal

from infra.launch import LaunchedJob
from infra import runfiles

Status = Literal["finished", "failed", "hang", "spike"]


@dataclass
class AttemptOutcome:
    status: Status
    exit_codes: dict[str, int | None]
    last_step: int  # newest step any rank reported in this attempt (0 if none)
    seconds: float  # launch to detection
    log_paths: dict[str, Path] = field(default_factory=dict)
    failed_nodes: list[str] = field(default_factory=list)
    stale_ranks: list[int] = field(default_factory=list)
    spike: dict | None = None  # the spike marker's content

    @property
    def ok(self) -> bool:
        return self.status == "finished"


def read_heartbeats(run_dir: Path) -> dict[int, dict]:
    beats = {}
    for path in (Path(run_dir) / runfiles.HEARTBEAT_DIR).glob("rank*.json"):
        try:
            beat = json.loads(path.read_text())
            beats[int(beat["rank"])] = beat
        except (OSError, ValueError, KeyError):
            continue  # being replaced right now; the next poll reads it
    return beats


def _spike_marker(run_dir: Path, since: float) -> dict | None:
    path = runfiles.spike_marker_path(run_dir)
    try:
        if path.stat().st_mtime >= since:
            return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    return None


def watch(
    job: LaunchedJob,
    run_dir: Path,
    world_size: int,
    hang_timeout_s: float = 300.0,
    startup_timeout_s: float = 600.0,
    failure_grace_s: float = 5.0,
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
        beats = read_heartbeats(run_dir)
        current = {r: b for r, b in beats.items() if float(b.get("time", 0)) >= started_wall}
        if current:
            last_step = max(last_step, max(int(b.get("step", 0)) for b in current.values()))
            if on_progress and last_step != last_reported:
                on_progress(last_step)
                last_reported = last_step

        failed = [node for node, code in codes.items() if code not in (None, 0)]
        if failed:
            job.wait(timeout=failure_grace_s)  # let the other ranks print their errors
            job.terminate(grace_s=5.0)
            codes = job.poll()
            spike = _spike_marker(run_dir, started_wall)
            return AttemptOutcome(
                status="spike" if spike else "failed",
                exit_codes=codes,
                last_step=last_step,
                seconds=time.monotonic() - started,
                log_paths=job.log_paths(),
                failed_nodes=failed,
                spike=spike,
            )
        if codes and all(code == 0 for code in codes.values()):
            finished = runfiles.finished_marker_path(run_dir)
            status: Status = "finished" if finished.exists() and finished.stat().st_mtime >= started_wall else "failed"
            return AttemptOutcome(status, codes, last_step, time.monotonic() - started, job.log_paths())

        now = time.time()
        stale = []
        for rank in range(world_size):
            beat_time = float(beats.get(rank, {}).get("time", 0))
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
