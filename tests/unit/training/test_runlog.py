"""The run-log line format, its parser, and heartbeat files."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from infra import runfiles
from training.runlog import (
    Heartbeat,
    LogFormatError,
    RankLog,
    epoch_seconds,
    format_event_line,
    format_step_line,
    parse_line,
    parse_step_line,
    read_steps,
)

T0 = 1_795_000_000.123  # a fixed instant, so the timestamp text is known


def test_a_lines_time_reads_back_as_the_instant_it_was_written_to_the_millisecond():
    line = parse_line(format_event_line(0, "started", now=T0))
    assert line.time == "2026-11-18T11:06:40.123Z"
    assert epoch_seconds(line.time) == pytest.approx(T0, abs=1e-6)
    with pytest.raises(ValueError):
        epoch_seconds("2026-11-18 08:26:40")  # not the log's format


def test_step_line_has_the_documented_shape():
    line = format_step_line(0, 12, 3.2123451232, 1e-4, 0.52131, 12345.64, 10.123, now=T0)
    assert line == (
        "2026-11-18T11:06:40.123Z rank=0 step=12 loss=3.21234512 lr=1.000e-04 "
        "grad_norm=0.5213 tokens_per_s=12345.6 elapsed_s=10.12"
    )


def test_step_line_round_trips_through_the_parser():
    loss = float(np.float32(2.7182817))  # a float32 loss survives its 9 printed digits exactly
    record = parse_step_line(format_step_line(3, 7, loss, 2.5e-3, 1.25, 99.0, 1.5, now=T0))
    assert (record.rank, record.step, record.lr) == (3, 7, 2.5e-3)
    assert np.float32(record.loss) == np.float32(loss)
    assert (record.grad_norm, record.tokens_per_s, record.elapsed_s) == (1.25, 99.0, 1.5)
    assert record.time == "2026-11-18T11:06:40.123Z"


def test_nan_loss_and_missing_grad_norm_stay_parseable():
    record = parse_step_line(format_step_line(0, 1, float("nan"), 1e-3, None, 1.0, 1.0))
    assert math.isnan(record.loss) and math.isnan(record.grad_norm)


def test_event_lines_parse_but_are_not_steps():
    line = format_event_line(1, "checkpoint_saved", now=T0, step=20, async_=False)
    parsed = parse_line(line)
    assert parsed.rank == 1 and parsed.event == "checkpoint_saved"
    assert parsed.fields["step"] == "20"
    assert parse_step_line(line) is None


def test_event_fields_with_spaces_are_refused():
    with pytest.raises(ValueError, match="without spaces"):
        format_event_line(0, "note", text="two words")


@pytest.mark.parametrize("bad", [
    "",
    "hello world",
    "2026-11-18T11:06:40.123Z step=1 loss=2",       # no rank
    "2026-11-18T11:06:40.123Z rank=0 step=1 loss",  # field without '='
])
def test_malformed_lines_raise_a_format_error(bad):
    with pytest.raises(LogFormatError):
        parse_line(bad)


def test_step_line_missing_a_metric_names_it():
    with pytest.raises(LogFormatError, match="grad_norm"):
        parse_step_line("2026-11-18T11:06:40.123Z rank=0 step=1 loss=2 lr=1 tokens_per_s=1 elapsed_s=1")


def test_read_steps_skips_foreign_lines_and_keeps_the_latest_of_a_restarted_step(tmp_path):
    log = RankLog(tmp_path, rank=0)
    log.step(1, 5.0, 1e-3, 1.0, 10.0, 1.0)
    log.step(2, 4.0, 1e-3, 1.0, 10.0, 2.0)
    log.event("resumed", step=1)
    log.step(2, 3.5, 1e-3, 1.0, 10.0, 0.5)  # re-run after a restart from step 1
    log.close()
    path = runfiles.log_path(tmp_path, 0)
    with open(path, "a") as f:
        f.write("Traceback (most recent call last):\n")
    assert [r.loss for r in read_steps(path)] == [5.0, 3.5]
    assert [r.loss for r in read_steps(path, latest_only=False)] == [5.0, 4.0, 3.5]


def test_heartbeat_is_replaced_atomically_and_readable(tmp_path):
    beat = Heartbeat(tmp_path, rank=1)
    assert runfiles.read_heartbeat(beat.path) is None
    beat.beat(3)
    beat.beat(4, phase="checkpoint")
    data = runfiles.read_heartbeat(runfiles.heartbeat_path(tmp_path, 1))
    assert (data.step, data.rank, data.phase) == (4, 1, "checkpoint")
    assert data.time > 0 and data.pid > 0 and data.host
    assert runfiles.read_heartbeats(tmp_path) == {1: data}
    # nothing but the heartbeat itself is left in the folder (the temp file was renamed)
    assert [p.name for p in beat.path.parent.iterdir()] == ["rank1.json"]
    json.loads(beat.path.read_text())


def test_compute_timers_sum_only_forward_and_backward_compute():
    import time

    from training.runlog import ComputeTimers

    timers = ComputeTimers()
    timers("forward-recv", log_level=2).start()  # waiting on a peer: not this rank's compute
    time.sleep(0.01)
    timers("forward-recv").stop()
    assert timers.take() == 0.0
    for name in ("forward-compute", "backward-compute"):
        timers(name, log_level=2).start()
        time.sleep(0.01)
        timers(name).stop()
    assert timers.take() >= 0.02  # both intervals, at least as long as the sleeps
    assert timers.take() == 0.0  # take() resets


def test_event_steps_reads_each_events_step_in_order_and_skips_other_lines(tmp_path):
    from training.runlog import event_steps

    log = tmp_path / "rank0.log"
    log.write_text("2026-11-29T10:00:00.000Z rank=0 event=stopped step=12 signal=SIGTERM\n"
                   "torchrun noise\n"
                   "2026-11-29T10:00:01.000Z rank=0 step=13 loss=1 lr=1e-3 grad_norm=1 tokens_per_s=1 elapsed_s=1\n"
                   "2026-11-29T10:00:02.000Z rank=0 event=resumed step=12 world_size=2\n"
                   "2026-11-29T10:00:03.000Z rank=0 event=stopped step=30\n")
    assert event_steps(log, "stopped") == [12, 30] and event_steps(log, "resumed") == [12]
    assert event_steps(log, "finished") == []
