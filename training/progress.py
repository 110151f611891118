"""Live progress of a training run in the terminal, read from the run directory.

The worker already says everything needed (infra.runfiles): rank 0's log has a line per
logged step (loss, tokens/s, elapsed time) and events (`resumed`, `checkpoint_saved`,
`loss_spike`, `stopped`, `finished`); heartbeats say the phase. `RunWatcher` tails that log
from where it was when watching began (a run directory keeps earlier runs' lines) and keeps a
`TrainingStatus`: attempt, step/total, loss, tokens/s, ETA, and the last event. What only the
flow knows (a failure's diagnosis and the action taken) comes in through `note()`.

`LiveProgress` shows it: a rich live panel on a terminal, one plain line per change (and at
most every `plain_every_s` while steps advance) when the output is a file or a pipe, nothing
at all in mode "off" (`--json`: stdout is one JSON object and stderr stays quiet).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from infra import runfiles
from training.runlog import LogFormatError, parse_line, parse_step_line

Mode = Literal["auto", "live", "plain", "off"]


@dataclass
class TrainingStatus:
    total_steps: int
    attempt: int = -1  # -1: no step or event of this run logged yet
    step: int = 0
    loss: float | None = None
    tokens_per_s: float | None = None
    eta_s: float | None = None
    last_event: str = "starting"
    phase: str = ""  # rank 0's heartbeat phase: start, train, checkpoint, stopping

    def plain(self) -> str:
        """One line: `attempt 1 | step 120/200 (60%) | loss 5.1234 | 1234 tok/s | ETA 1m20s | <event>`."""
        parts = [f"attempt {max(self.attempt, 0)}",
                 f"step {self.step}/{self.total_steps} ({self.fraction:.0%})",
                 f"loss {self.loss:.4f}" if self.loss is not None else "loss -",
                 f"{self.tokens_per_s:,.0f} tok/s" if self.tokens_per_s is not None else "- tok/s",
                 f"ETA {format_duration(self.eta_s)}",
                 self.last_event]
        return " | ".join(parts)

    @property
    def fraction(self) -> float:
        return min(1.0, self.step / self.total_steps) if self.total_steps else 0.0

    def rich(self) -> Any:
        """A line of figures with a bar, then the last event on its own line."""
        from rich.console import Group
        from rich.progress_bar import ProgressBar
        from rich.table import Table
        from rich.text import Text

        grid = Table.grid(padding=(0, 2))
        grid.add_row(f"[bold]attempt {max(self.attempt, 0)}[/]",
                     ProgressBar(total=self.total_steps or 1, completed=self.step, width=30),
                     f"step {self.step}/{self.total_steps}",
                     f"loss {self.loss:.4f}" if self.loss is not None else "loss -",
                     f"{self.tokens_per_s:,.0f} tok/s" if self.tokens_per_s is not None else "- tok/s",
                     f"ETA {format_duration(self.eta_s)}")
        event = Text.assemble(("last event: ", "dim"), self.last_event)  # plain text, not markup
        return Group(grid, event)


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class RunWatcher:
    """Tails rank 0's log of `run_dir` from its size at construction; `poll()` -> the status."""

    def __init__(self, run_dir: str | Path, total_steps: int) -> None:
        self.run_dir = Path(run_dir)
        self.log = runfiles.log_path(self.run_dir, 0)
        self.offset = self.log.stat().st_size if self.log.exists() else 0
        self.status = TrainingStatus(total_steps=total_steps)
        self._partial = ""
        self._rate_from: tuple[int, float] | None = None  # (step, elapsed_s) at the attempt's first line
        self._lock = threading.Lock()
        self.changes = 0  # attempts and events seen: a plain printer prints on change

    def note(self, text: str) -> None:
        """An event only the flow knows (a failure's diagnosis and the action taken)."""
        with self._lock:
            self.status.last_event = " ".join(text.split())
            self.changes += 1

    def poll(self) -> TrainingStatus:
        with self._lock:
            for line in self._new_lines():
                self._take(line)
            beat = runfiles.read_heartbeat(runfiles.heartbeat_path(self.run_dir, 0))
            if beat is not None:
                self.status.phase = beat.phase
            return TrainingStatus(**vars(self.status))

    def _new_lines(self) -> list[str]:
        try:
            with open(self.log, "rb") as f:
                if f.seek(0, 2) < self.offset:  # the log was replaced (a new run removed the old)
                    self.offset = 0
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        self.offset += len(data)
        text = self._partial + data.decode("utf-8", errors="replace")
        *lines, self._partial = text.split("\n")  # the last piece may be half written
        return lines

    def _new_attempt(self) -> None:
        self.status.attempt += 1
        self._rate_from = None
        self.changes += 1

    def _take(self, line: str) -> None:
        try:
            parsed = parse_line(line)
            record = parse_step_line(line)
        except (LogFormatError, ValueError):
            return
        s = self.status
        if record is not None:
            if s.attempt < 0 or record.step <= s.step and self._rate_from is not None:
                self._new_attempt()  # the first line of this run, or a restart from scratch
            s.step, s.loss, s.tokens_per_s = record.step, record.loss, record.tokens_per_s
            if self._rate_from is None:
                self._rate_from = (record.step, record.elapsed_s)
            first_step, first_elapsed = self._rate_from
            if record.step > first_step and record.elapsed_s > first_elapsed:
                rate = (record.step - first_step) / (record.elapsed_s - first_elapsed)
                s.eta_s = max(0.0, (s.total_steps - record.step) / rate)
            return
        event, fields = parsed.event, parsed.fields
        if event == "resumed":
            self._new_attempt()
            s.step = int(fields.get("step", s.step))
            skipped = int(fields.get("skipped_batches", 0) or 0)
            s.last_event = f"resumed from checkpoint {s.step}" + (f", skipping {skipped} batches" if skipped else "")
        elif event == "checkpoint_saved":
            stall = f" (training stalled {float(fields['stall_s']):.2f} s)" if "stall_s" in fields else ""
            s.last_event = f"checkpoint {fields.get('step', '?')} saved{stall}"
        elif event == "loss_spike":
            s.last_event = f"loss spike from step {fields.get('onset_step', '?')}"
        elif event == "stopped":
            s.last_event = f"stopped by request at step {fields.get('step', '?')}"
        elif event == "finished":
            s.last_event, s.eta_s = f"finished at step {fields.get('step', s.step)}", 0.0
        else:
            return
        self.changes += 1


class LiveProgress:
    """Shows a RunWatcher's status until the block ends (a background thread polls the files).

        with LiveProgress(spec.resolved_run_dir, spec.training.steps, console) as live:
            ...                        # live.note("attempt 0 failed: ...") from the flow's side
    """

    def __init__(self, run_dir: str | Path, total_steps: int, console: Any = None, mode: Mode = "auto",
                 poll_s: float = 1.0, plain_every_s: float = 30.0) -> None:
        self.watcher = RunWatcher(run_dir, total_steps)
        self.poll_s, self.plain_every_s = poll_s, plain_every_s
        if mode != "off" and console is None:
            from rich.console import Console

            console = Console(stderr=True)  # stdout is the command's result
        self.console = console
        self.mode: Mode = mode if mode != "auto" else ("live" if console.is_terminal else "plain")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._live: Any = None
        self._printed: tuple[int, int, float] = (-1, -1, 0.0)  # changes, step, time of the last plain line

    def note(self, text: str) -> None:
        self.watcher.note(text)

    def __enter__(self) -> "LiveProgress":
        if self.mode == "off":
            return self
        if self.mode == "live":
            from rich.live import Live

            self._live = Live(self.watcher.status.rich(), console=self.console, refresh_per_second=2,
                              transient=False)
            self._live.__enter__()
        self._thread = threading.Thread(target=self._run, name="forgeflow-progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.mode == "off":
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.show(final=True)
        if self._live is not None:
            self._live.__exit__(*exc)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.show()
            except Exception:  # a display must never break the run it shows
                pass

    def show(self, final: bool = False) -> None:
        if self.mode == "off":
            return
        status = self.watcher.poll()
        if self._live is not None:
            self._live.update(status.rich())
            return
        changes, step, printed_at = self._printed
        now = time.monotonic()
        if (self.watcher.changes != changes or (status.step != step and now - printed_at >= self.plain_every_s)
                or (final and status.step != step)):
            self.console.print(status.plain(), markup=False, highlight=False, soft_wrap=True)
            self._printed = (self.watcher.changes, status.step, now)
