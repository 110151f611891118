"""Live training progress read from the run directory: the status (attempt, step/total, loss,
tokens/s, ETA, last event), rendered live on a terminal, as plain lines elsewhere, silent when off."""

from __future__ import annotations

import io

from infra import runfiles
from training.progress import LiveProgress, RunWatcher, format_duration
from training.runlog import format_event_line, format_step_line


def _append(run_dir, *lines):
    path = runfiles.log_path(run_dir, 0)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write("".join(line + "\n" for line in lines))


def _step(step, loss=3.0, elapsed=None):
    return format_step_line(0, step, loss, 1e-4, 0.5, 2000.0, float(step) if elapsed is None else elapsed)


def test_status_follows_attempts_steps_eta_and_events(tmp_path):
    _append(tmp_path, _step(1, 9.0), _step(2, 9.0))  # an earlier run's lines are not this run's
    watcher = RunWatcher(tmp_path, total_steps=20)
    assert watcher.poll().attempt == -1 and watcher.poll().step == 0
    _append(tmp_path, *[_step(s, 5.0 - 0.1 * s, elapsed=0.5 * s) for s in range(1, 7)],
            format_event_line(0, "checkpoint_saved", step=6, stall_s=0.125))
    status = watcher.poll()
    assert (status.attempt, status.step, status.loss, status.tokens_per_s) == (0, 6, 4.4, 2000.0)
    assert status.eta_s == 7.0  # 2 steps/s over steps 1..6; 14 steps left
    assert status.last_event == "checkpoint 6 saved (training stalled 0.12 s)"

    watcher.note("attempt 0 failed at step 7: CUDAError -> restart in place")
    assert watcher.poll().last_event.startswith("attempt 0 failed at step 7: CUDAError")
    _append(tmp_path, format_event_line(0, "resumed", step=6, skipped_batches=0), _step(7))
    status = watcher.poll()
    assert (status.attempt, status.step, status.last_event) == (1, 7, "resumed from checkpoint 6")
    # a half-written line waits for its end
    path = runfiles.log_path(tmp_path, 0)
    text = _step(8, 1.5) + "\n"
    with open(path, "a") as f:
        f.write(text[:20])
    assert watcher.poll().step == 7
    with open(path, "a") as f:
        f.write(text[20:])
    assert watcher.poll().loss == 1.5
    _append(tmp_path, _step(1), _step(2))  # a restart from scratch (no checkpoint yet) is an attempt too
    assert watcher.poll().attempt == 2


def test_plain_lines_when_not_a_terminal(tmp_path):
    from rich.console import Console

    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=200)
    with LiveProgress(tmp_path, 10, console, poll_s=0.05, plain_every_s=3600) as live:
        assert live.mode == "plain"
        _append(tmp_path, _step(1, 4.0), format_event_line(0, "checkpoint_saved", step=1))
        live.show()
        live.note("attempt 0 failed at step 1: LossSpike -> roll back")
        live.show()
        live.show()  # nothing new: no new line
        _append(tmp_path, _step(2, 3.5), format_event_line(0, "finished", step=2))
    lines = out.getvalue().splitlines()
    assert lines[0] == "attempt 0 | step 1/10 (10%) | loss 4.0000 | 2,000 tok/s | ETA - | checkpoint 1 saved"
    assert lines[1].endswith("| attempt 0 failed at step 1: LossSpike -> roll back")
    assert lines[-1] == "attempt 0 | step 2/10 (20%) | loss 3.5000 | 2,000 tok/s | ETA 0s | finished at step 2"
    assert len(lines) == 3 and "\x1b[" not in out.getvalue()  # no escape codes in a file


def test_live_panel_on_a_terminal_and_silence_when_off(tmp_path):
    from rich.console import Console

    _append(tmp_path, "")
    terminal = Console(record=True, force_terminal=True, width=160, file=io.StringIO())
    with LiveProgress(tmp_path, 40, terminal, poll_s=0.05) as live:
        assert live.mode == "live"
        _append(tmp_path, *[_step(s, 2.0, elapsed=float(s)) for s in range(1, 11)])
        live.show()
    screen = terminal.export_text()
    for shown in ("attempt 0", "step 10/40", "loss 2.0000", "2,000 tok/s", "ETA 30s", "last event"):
        assert shown in screen, screen

    quiet = Console(record=True, force_terminal=True, file=io.StringIO())
    with LiveProgress(tmp_path, 40, quiet, mode="off") as live:
        _append(tmp_path, _step(11))
        live.note("anything")
    assert quiet.export_text() == ""
    assert format_duration(3725) == "1h02m" and format_duration(75) == "1m15s" and format_duration(None) == "-"
