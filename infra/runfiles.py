"""The run directory and exit codes of the training worker — the contract with its watchers.

The flow (flows/), the diagnosis code (diagnosis/) and tests read what the worker
leaves behind; this module is the one place that says what that is.

Run directory (`JobSpec.resolved_run_dir`, default `runs/{name}`)::

    logs/rank{R}.log          one line per logged step (training.runlog.format_step_line):
                              `2026-11-22T08:00:00.123Z rank=0 step=12 loss=3.21234512
                               lr=1.000e-04 grad_norm=0.5213 tokens_per_s=12345.6 elapsed_s=10.12`
                              and event lines (`... rank=0 event=checkpoint_saved step=20 ...`);
                              appended across restarts, parse with training.runlog.
    heartbeat/rank{R}.json    {"rank", "step", "time", "pid", "host", "phase", "step_time_s",
                              "compute_s"}, atomically replaced (tmp + os.replace) at start
                              and after every step; a heartbeat whose `time` stops advancing
                              means a hang. `step_time_s` is the step's wall time (the same on
                              every rank: collectives wait for the slowest), `compute_s` the
                              rank's own forward+backward compute in it (megatron's
                              forward-/backward-compute timers, no waiting on peers): the
                              straggler signal (infra.watch.StragglerDetector).
    heartbeat/where/rank{R}.json  {"rank", "time", "step", "collective", "since", "pid"}: where the
                              rank's main thread is, sampled every second by a thread of its own
                              (training.collective_watch): the collective it waits in (None:
                              not in one) and since when. Peers waiting in a collective while
                              one rank is elsewhere is a hang, seen in seconds with its culprit
                              (infra.watch.collective_stall).
    markers/loss_spike.json   written by rank 0 (training.spike.write_spike_marker) before
                              every rank exits with EXIT_LOSS_SPIKE; stderr also gets the
                              `FORGEFLOW_LOSS_SPIKE onset_step=...` line.
    markers/fault_fired.*     records of injected faults that fired (training.faults).
    markers/finished.json     written by rank 0 after the last step: {"step", "time"}.
    spec/attempt-{N}.json     the job spec the flow validated, as JSON, written by the flow before
                              attempt N launches (scheduler.worker_command.write_attempt_spec):
                              what every rank of the attempt reads, wherever the user's YAML
                              file (and its `base:` chain) is; the worker checks its config hash.
    markers/stopped.json      written by rank 0 after a graceful stop (SIGTERM) once the
                              stop step's checkpoint is committed: {"step", "checkpoint_step",
                              "signal", "time"}; every rank then exits EXIT_STOPPED.

Readers of the run directory (the watcher, tests, tools) use the typed readers below:
`read_heartbeat` / `read_heartbeats` -> `HeartbeatRecord`, `read_wheres` -> `WhereRecord`, `read_spike_marker` -> `SpikeMarker`,
`read_stop_marker` -> `StopMarker`.

Checkpoints live at `spec.checkpoint.url` (see training.checkpointing), not here.
Errors and tracebacks go to the worker's stderr (torchrun's output), which the
launcher captures; the rank log holds only the structured lines.

Exit codes of one worker process:

    0                   all steps done
    1                   an uncaught exception (Python's default; includes injected
                        cuda_error and script_error faults, whose tracebacks look real)
    EXIT_LOSS_SPIKE     a loss spike that did not recover (marker written first)
    EXIT_FAULT_MID_CHECKPOINT  the exit_mid_checkpoint fault: os._exit while a checkpoint
                        is half written (like a node dying mid-save)
    EXIT_STOPPED        stopped by request (SIGTERM: Prefect cancellation, scheduler
                        preemption, `kill`): every rank finished its step, the checkpoint
                        of that step is committed, markers/stopped.json written. Not a
                        failure. torchrun reports any non-zero worker exit as its own 1
                        (or dies of the signal), so watchers read the marker, not the code.
    -9 (shell: 137)     killed by SIGKILL: the oom_kill fault, or the kernel's OOM killer
    (never exits)       the hang fault: the heartbeat stops; a watcher must kill it
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

EXIT_OK = 0
EXIT_EXCEPTION = 1
EXIT_LOSS_SPIKE = 86  # clear of Python (1), argparse (2), sysexits (64-78), signals (128+n)
EXIT_FAULT_MID_CHECKPOINT = 44
EXIT_STOPPED = 87  # next to EXIT_LOSS_SPIKE, clear of the ranges above
EXIT_SIGKILL = 137  # how a shell/launcher reports a SIGKILLed child (128 + 9)

EXIT_CODE_NAMES = {
    EXIT_OK: "ok",
    EXIT_EXCEPTION: "exception",
    EXIT_LOSS_SPIKE: "loss_spike",
    EXIT_FAULT_MID_CHECKPOINT: "exit_mid_checkpoint",
    EXIT_STOPPED: "stopped",
    EXIT_SIGKILL: "sigkill",
    -9: "sigkill",
}

LOGS_DIR = "logs"
HEARTBEAT_DIR = "heartbeat"
MARKERS_DIR = "markers"
SPIKE_MARKER = "loss_spike.json"
FINISHED_MARKER = "finished.json"
STOP_MARKER = "stopped.json"
SPEC_DIR = "spec"


def log_path(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / LOGS_DIR / f"rank{rank}.log"


def heartbeat_path(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / HEARTBEAT_DIR / f"rank{rank}.json"


def where_path(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / HEARTBEAT_DIR / "where" / f"rank{rank}.json"


def spike_marker_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / MARKERS_DIR / SPIKE_MARKER


def finished_marker_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / MARKERS_DIR / FINISHED_MARKER


def stop_marker_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / MARKERS_DIR / STOP_MARKER


def attempt_spec_path(run_dir: str | Path, attempt: int) -> Path:
    return Path(run_dir) / SPEC_DIR / f"attempt-{attempt}.json"


# --- readers -------------------------------------------------------------------------


@dataclass(frozen=True)
class HeartbeatRecord:
    """One rank's last heartbeat (written by training.runlog.Heartbeat)."""

    rank: int
    step: int
    time: float  # time.time() of the beat
    pid: int
    host: str
    phase: str  # "start", "train", "checkpoint", "stopping"
    step_time_s: float | None = None  # wall time of the last step
    compute_s: float | None = None  # this rank's forward+backward compute in the last step


@dataclass(frozen=True)
class WhereRecord:
    """Where one rank's main thread was at `time` (written by training.collective_watch)."""

    rank: int
    time: float  # time.time() of the sample: a record that stops advancing is a frozen process
    step: int  # the last step the rank finished
    collective: str | None  # the collective it waits in (torch.distributed's function), or None
    since: float  # time.time() since which it has been there (in that collective, or out of any)


@dataclass(frozen=True)
class SpikeMarker:
    """The loss-spike marker (written by training.spike.write_spike_marker)."""

    onset_step: int  # first step of the spike: roll back to a checkpoint before it
    last_healthy_step: int  # -1 if no healthy step preceded the onset
    detected_step: int
    loss: float  # NaN/inf for a non-finite loss (stored as null + loss_repr)
    median: float  # NaN if there was no baseline yet
    z: float  # inf for a non-finite loss
    reason: str  # "nonfinite" or "zscore"
    time: float  # when it was written (time.time())


def read_heartbeat(path: str | Path) -> HeartbeatRecord | None:
    """The heartbeat in `path`, or None if there is none yet (or it is being replaced right
    now, or unreadable: the next poll reads it)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        return HeartbeatRecord(rank=int(data["rank"]), step=int(data.get("step", 0)),
                               time=float(data.get("time", 0.0)), pid=int(data.get("pid", 0)),
                               host=str(data.get("host", "")), phase=str(data.get("phase", "")),
                               step_time_s=_optional_float(data.get("step_time_s")),
                               compute_s=_optional_float(data.get("compute_s")))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _optional_float(value) -> float | None:
    return None if value is None else float(value)


def read_wheres(run_dir: str | Path) -> dict[int, WhereRecord]:
    """Every rank's last where-sample in the run directory, by rank (unreadable ones skipped:
    the next read gets them)."""
    out = {}
    for path in (Path(run_dir) / HEARTBEAT_DIR / "where").glob("rank*.json"):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            record = WhereRecord(rank=int(data["rank"]), time=float(data["time"]), step=int(data.get("step", 0)),
                                 collective=data.get("collective") or None, since=float(data["since"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
        out[record.rank] = record
    return out


def read_heartbeats(run_dir: str | Path) -> dict[int, HeartbeatRecord]:
    """Every rank's last heartbeat in the run directory, by rank."""
    beats = {}
    for path in (Path(run_dir) / HEARTBEAT_DIR).glob("rank*.json"):
        beat = read_heartbeat(path)
        if beat is not None:
            beats[beat.rank] = beat
    return beats


def read_spike_marker(run_dir: str | Path, since: float | None = None) -> SpikeMarker | None:
    """The loss-spike marker, or None if there is none (or, with `since`, none written at or
    after that time: a marker left by an earlier attempt is not this attempt's)."""
    path = spike_marker_path(run_dir)
    try:
        if since is not None and path.stat().st_mtime < since:
            return None
        data = json.loads(path.read_text(encoding="utf-8"))
        loss = data["loss"] if data["loss"] is not None else float(data.get("loss_repr", "nan"))
        return SpikeMarker(
            onset_step=int(data["onset_step"]), last_healthy_step=int(data["last_healthy_step"]),
            detected_step=int(data["detected_step"]), loss=float(loss),
            median=math.nan if data["median"] is None else float(data["median"]),
            z=math.inf if data["z"] is None else float(data["z"]),
            reason=str(data["reason"]), time=float(data.get("time", 0.0)),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


@dataclass(frozen=True)
class StopMarker:
    """A graceful stop (written by the worker's rank 0 after the checkpoint commit)."""

    step: int  # the last step trained
    checkpoint_step: int  # the committed checkpoint to resume from (== step)
    signal: str  # e.g. "SIGTERM"
    time: float


def read_stop_marker(run_dir: str | Path, since: float | None = None) -> StopMarker | None:
    """The stop marker, or None if there is none (with `since`: none written since then)."""
    path = stop_marker_path(run_dir)
    try:
        if since is not None and path.stat().st_mtime < since:
            return None
        data = json.loads(path.read_text(encoding="utf-8"))
        return StopMarker(step=int(data["step"]), checkpoint_step=int(data["checkpoint_step"]),
                          signal=str(data.get("signal", "")), time=float(data.get("time", 0.0)))
    except (OSError, ValueError, KeyError, TypeError):
        return None
