"""Structured run output: per-rank step log lines and heartbeat files.

Line format (one per logged step, stable — the flow, diagnosis and benchmarks parse it)::

    2026-11-22T08:00:00.123Z rank=0 step=12 loss=3.21234512 lr=1.000e-04 grad_norm=0.5213 tokens_per_s=12345.6 elapsed_s=10.12 batch=11

A UTC timestamp with milliseconds, then space-separated `key=value` pairs with no
spaces inside values. `step` is the number of optimizer steps completed (1 after
the first step). `loss` is the data-parallel mean over the global batch, printed
with 9 significant digits so the float32 value round-trips exactly. `batch` (the
worker writes it; older lines lack it) is the global batch index — the data position —
the step trained: after a spike rollback it shows which batches were skipped. Event lines
use the same shape with `event=NAME` (e.g. `event=checkpoint_saved step=20`).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from infra import runfiles
from infra.atomic_write import atomic_write


class LogFormatError(ValueError):
    """A line is not in the run-log format."""


def utc_timestamp(now: float | None = None) -> str:
    moment = _dt.datetime.fromtimestamp(time.time() if now is None else now, tz=_dt.timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def epoch_seconds(stamp: str) -> float:
    """A line's time (utc_timestamp's text) as seconds since the epoch."""
    return _dt.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=_dt.timezone.utc).timestamp()


@dataclass(frozen=True)
class StepRecord:
    time: str
    rank: int
    step: int
    loss: float
    lr: float
    grad_norm: float
    tokens_per_s: float
    elapsed_s: float
    batch: int | None = None  # the global batch (data position) the step trained


@dataclass(frozen=True)
class LogLine:
    """Any run-log line: its timestamp, rank and the remaining key=value fields as text."""

    time: str
    rank: int
    fields: dict[str, str]

    @property
    def event(self) -> str | None:
        return self.fields.get("event")


_STEP_FIELDS = ("step", "loss", "lr", "grad_norm", "tokens_per_s", "elapsed_s")


def format_step_line(rank: int, step: int, loss: float, lr: float, grad_norm: float | None,
                     tokens_per_s: float, elapsed_s: float, now: float | None = None,
                     batch: int | None = None) -> str:
    gn = float("nan") if grad_norm is None else grad_norm
    line = (
        f"{utc_timestamp(now)} rank={rank} step={step} loss={loss:.9g} lr={lr:.3e} "
        f"grad_norm={gn:.4f} tokens_per_s={tokens_per_s:.1f} elapsed_s={elapsed_s:.2f}"
    )
    return line if batch is None else f"{line} batch={batch}"


def format_event_line(rank: int, event: str, now: float | None = None, **fields: object) -> str:
    parts = [f"{utc_timestamp(now)} rank={rank} event={event}"]
    for key, value in fields.items():
        text = str(value)
        if not text or any(c.isspace() for c in text):
            raise ValueError(f"log field {key}={text!r} must be non-empty without spaces")
        parts.append(f"{key}={text}")
    return " ".join(parts)


def parse_line(line: str) -> LogLine:
    """Parse any run-log line; raises LogFormatError naming what is wrong."""
    parts = line.strip().split()
    if len(parts) < 2 or not parts[0].endswith("Z") or "T" not in parts[0]:
        raise LogFormatError(f"not a run-log line (no leading UTC timestamp): {line!r}")
    fields: dict[str, str] = {}
    for part in parts[1:]:
        key, sep, value = part.partition("=")
        if not sep or not key:
            raise LogFormatError(f"run-log field {part!r} is not key=value in line {line!r}")
        fields[key] = value
    if "rank" not in fields:
        raise LogFormatError(f"run-log line has no rank=: {line!r}")
    rank = int(fields.pop("rank"))
    return LogLine(time=parts[0], rank=rank, fields=fields)


def parse_step_line(line: str) -> StepRecord | None:
    """The StepRecord of a step line; None for event lines."""
    parsed = parse_line(line)
    if parsed.event is not None:
        return None
    missing = [k for k in _STEP_FIELDS if k not in parsed.fields]
    if missing:
        raise LogFormatError(f"step line lacks {', '.join(missing)}: {line!r}")
    f = parsed.fields
    return StepRecord(
        time=parsed.time, rank=parsed.rank, step=int(f["step"]), loss=float(f["loss"]),
        lr=float(f["lr"]), grad_norm=float(f["grad_norm"]),
        tokens_per_s=float(f["tokens_per_s"]), elapsed_s=float(f["elapsed_s"]),
        batch=int(f["batch"]) if "batch" in f else None,
    )


def read_steps(path: str | Path, latest_only: bool = True) -> list[StepRecord]:
    """Step records of one rank log, in order; lines that are not run-log lines are skipped.

    A restarted run appends to the same log and re-logs the steps after its
    checkpoint; with `latest_only` the last record of each step wins.
    """
    records: list[StepRecord] = []
    for line in Path(path).read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = parse_step_line(line)
        except (LogFormatError, ValueError):
            continue
        if record is not None:
            records.append(record)
    if not latest_only:
        return records
    by_step = {r.step: r for r in records}
    return [by_step[s] for s in sorted(by_step)]


def events(path: str | Path, event: str) -> list[dict[str, str]]:
    """The fields of each `event=EVENT` line of one rank log, in order (e.g. every `started`)."""
    found = []
    for line in Path(path).read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            parsed = parse_line(line)
        except (LogFormatError, ValueError):
            continue
        if parsed.event == event:
            found.append(dict(parsed.fields))
    return found


def event_steps(path: str | Path, event: str) -> list[int]:
    """The `step=` of each `event=EVENT` line of one rank log, in order (e.g. every `resumed`)."""
    return [int(fields["step"]) for fields in events(path, event) if "step" in fields]


def last_step(path: str | Path, tail_bytes: int = 16384) -> StepRecord | None:
    """The newest step record of a rank log, read from its last `tail_bytes` (cheap on a long
    log: a job's flow asks every few seconds); None when there is none there."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - tail_bytes))
            lines = f.read().decode("utf-8", errors="replace").splitlines()
    except FileNotFoundError:
        return None
    for line in reversed(lines):
        try:
            record = parse_step_line(line)
        except (LogFormatError, ValueError):
            continue
        if record is not None:
            return record
    return None


class RankLog:
    """Appends step and event lines to `{run_dir}/logs/rank{R}.log` (line-buffered)."""

    def __init__(self, run_dir: str | Path, rank: int):
        self.rank = rank
        self.path = runfiles.log_path(run_dir, rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8", buffering=1)

    def step(self, step: int, loss: float, lr: float, grad_norm: float | None,
             tokens_per_s: float, elapsed_s: float, batch: int | None = None) -> str:
        line = format_step_line(self.rank, step, loss, lr, grad_norm, tokens_per_s, elapsed_s,
                                batch=batch)
        self._file.write(line + "\n")
        return line

    def event(self, event: str, **fields: object) -> str:
        line = format_event_line(self.rank, event, **fields)
        self._file.write(line + "\n")
        return line

    def close(self) -> None:
        self._file.close()


class Heartbeat:
    """`{run_dir}/heartbeat/rank{R}.json`, atomically replaced on every beat.

    Read it with `infra.runfiles.read_heartbeat(s)` (the run-directory contract)."""

    def __init__(self, run_dir: str | Path, rank: int):
        self.rank = rank
        self.path = runfiles.heartbeat_path(run_dir, rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._host = socket.gethostname()

    def beat(self, step: int, phase: str = "train", step_time_s: float | None = None,
             compute_s: float | None = None) -> None:
        payload = {"rank": self.rank, "step": step, "time": time.time(), "pid": os.getpid(),
                   "host": self._host, "phase": phase}
        if step_time_s is not None:
            payload.update(step_time_s=round(step_time_s, 6), compute_s=round(compute_s or 0.0, 6))
        # No fsync: the next beat replaces a lost one, and one per step would slow the loop.
        atomic_write(self.path, json.dumps(payload), durable=False)


class ComputeTimers:
    """megatron's `config.timers` hook, keeping only this rank's compute time.

    The pipeline schedules time each micro batch's forward and backward as
    'forward-compute' / 'backward-compute' (pipeline_parallel/schedules.py) and the
    transfers and gradient all-reduce under other names; `take()` returns the
    forward+backward seconds since the last call. Unlike the step's wall time, which
    every rank shares because collectives wait for the slowest, it shows which rank
    is slow. On a GPU the intervals are CUDA events (kernels run asynchronously, so host
    time would measure launches), read once per step in `take()` with no extra sync."""

    COMPUTE = ("forward-compute", "backward-compute")

    def __init__(self) -> None:
        import torch

        self._cuda = torch.cuda.is_available()
        self._total = 0.0
        self._started: dict[str, object] = {}
        self._intervals: list[tuple[object, object]] = []  # CUDA (start, stop) events

    def __call__(self, name: str, log_level: int | None = None) -> "_Timer":
        return _Timer(self, name)

    def _mark(self):
        if self._cuda:
            import torch

            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def take(self) -> float:
        total, self._total = self._total, 0.0
        if self._intervals:
            self._intervals[-1][1].synchronize()
            total += sum(a.elapsed_time(b) for a, b in self._intervals) / 1000.0
            self._intervals.clear()
        return total


class _Timer:
    def __init__(self, owner: ComputeTimers, name: str):
        self.owner, self.name = owner, name

    def start(self, barrier: bool = False) -> None:
        if self.name in ComputeTimers.COMPUTE:
            self.owner._started[self.name] = self.owner._mark()

    def stop(self, barrier: bool = False) -> None:
        began = self.owner._started.pop(self.name, None)
        if began is None:
            return
        ended = self.owner._mark()
        if self.owner._cuda:
            self.owner._intervals.append((began, ended))
        else:
            self.owner._total += ended - began
