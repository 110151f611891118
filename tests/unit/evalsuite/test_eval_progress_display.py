"""`forgeflow eval`'s progress from the executor's events: live bars with ETA and the last event
on a terminal, plain lines on a file or pipe."""

from __future__ import annotations

import io

from rich.console import Console

from evalsuite.cli import _Progress

EVENTS = [
    ("plan", {"trials": 2, "shards": 2}),
    ("trial_started", {"trial": "t0", "slot": "slot0"}),
    ("progress", {"trial": "t0", "n": 4}),
    ("trial_done", {"trial": "t0", "slot": "slot0", "seconds": 1.25}),
    ("metric_done", {"trial": "t0", "dataset": "arith", "shard": 0}),
    ("trial_started", {"trial": "t1", "slot": "slot1"}),
    ("trial_failed", {"trial": "t1", "slot": "slot1", "error": "CUDA out of memory.\nTried to allocate"}),
    ("metric_failed", {"trial": "t1", "dataset": "capitals", "error": "no outputs"}),
]


def test_plain_lines_on_a_file():
    out = io.StringIO()
    with _Progress(Console(file=out, force_terminal=False, width=300)) as progress:
        for kind, info in EVENTS:
            progress.on_event(kind, info)
    lines = out.getvalue().splitlines()
    assert lines[0] == "eval | trials 0/2 | metric jobs 0/2 | ETA - | plan: 2 trial(s), 2 metric job(s)"
    assert lines[1].startswith("eval | trials 1/2 | metric jobs 0/2 | ETA ") and lines[1].endswith("trial t0 done in 1.2 s")
    assert lines[2].endswith("trial t1 FAILED: CUDA out of memory. Tried to allocate")
    assert lines[3].startswith("eval | trials 2/2 | metric jobs 2/2 | ETA 0s") and "metric job capitals FAILED" in lines[3]
    assert len(lines) == 4 and "\x1b[" not in out.getvalue()


def test_live_bars_with_eta_and_last_event_on_a_terminal():
    console = Console(record=True, force_terminal=True, width=160, file=io.StringIO())
    with _Progress(console) as progress:
        for kind, info in EVENTS[:4]:
            progress.on_event(kind, info)
        progress.bars.refresh()
    screen = console.export_text()
    assert "inference trials" in screen and "1/2" in screen and "ETA" in screen
    assert "last event: trial t0 done in 1.2 s" in screen
