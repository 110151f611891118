"""The loss-spike detector on synthetic loss curves, its log line and its marker."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from infra import runfiles
from training.config import SpikeConfig
from training.spike import (
    LossSpikeDetector,
    format_spike_line,
    parse_spike_line,
    write_spike_marker,
)

CFG = SpikeConfig(window=50, min_history=10, z_threshold=6.0, patience=5)


def run(curve, cfg=CFG):
    detector = LossSpikeDetector(cfg)
    for step, loss in enumerate(curve):
        event = detector.update(step, loss)
        if event is not None:
            return event
    return None


def training_curve(n=400, noise=0.02, seed=0):
    """A falling pretraining-like curve with multiplicative noise."""
    rng = np.random.default_rng(seed)
    steps = np.arange(n)
    return (2.5 + 5.0 * np.exp(-steps / 60)) * (1 + noise * rng.standard_normal(n))


@pytest.mark.parametrize("seed", range(5))
def test_noisy_falling_curve_has_no_spike(seed):
    assert run(training_curve(seed=seed)) is None


def test_heavy_tailed_noise_single_outliers_are_ignored():
    rng = np.random.default_rng(1)
    curve = 3.0 + 0.03 * rng.standard_t(df=2, size=600)  # occasional large single blips
    assert run(curve) is None


@pytest.mark.parametrize("slope", [1e-4, 1e-3, 1e-2])
def test_slow_upward_drift_is_not_a_spike(slope):
    rng = np.random.default_rng(2)
    steps = np.arange(500)
    assert run(3.0 + slope * steps + 0.01 * rng.standard_normal(500)) is None


def test_persistent_spike_is_flagged_with_onset_and_last_healthy_step():
    curve = training_curve()
    curve[200:] = curve[200:] + 3.0  # jumps and stays up
    event = run(curve)
    assert event is not None and event.reason == "zscore"
    assert event.onset_step == 200 and event.last_healthy_step == 199
    assert event.detected_step == 200 + CFG.patience - 1
    assert event.loss == pytest.approx(curve[200]) and event.median < event.loss - 2


def test_spike_that_recovers_within_patience_is_not_flagged():
    curve = training_curve()
    curve[200:200 + CFG.patience - 1] += 3.0  # high for patience-1 steps, then back
    assert run(curve) is None
    curve[300:300 + CFG.patience] += 3.0  # one step longer: flagged
    event = run(curve)
    assert event is not None and event.onset_step == 300


def test_spike_values_do_not_poison_the_baseline():
    curve = training_curve()
    for start in (150, 200, 250):  # several recovered spikes...
        curve[start:start + 3] += 3.0
    curve[320:] += 3.0  # ...then a real one is still seen
    event = run(curve)
    assert event is not None and event.onset_step == 320


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_loss_is_an_immediate_spike(bad):
    curve = list(training_curve(100))
    curve[60] = bad
    event = run(curve)
    assert event is not None and event.reason == "nonfinite"
    assert event.onset_step == event.detected_step == 60 and event.last_healthy_step == 59


def test_nan_during_a_pending_spike_keeps_its_onset():
    curve = list(3.0 + 0.01 * np.random.default_rng(3).standard_normal(100))
    curve[60:62] = [6.0, 6.5]
    curve[62] = math.nan
    event = run(curve)
    assert (event.onset_step, event.last_healthy_step, event.detected_step) == (60, 59, 62)


def test_nan_before_any_history_reports_no_healthy_step():
    event = run([math.nan])
    assert event.onset_step == 0 and event.last_healthy_step == -1


def test_no_detection_before_min_history():
    curve = [3.0] * 5 + [30.0] * 5  # spike within the first min_history steps: baseline only
    assert run(curve, SpikeConfig(window=50, min_history=20, patience=2)) is None


def test_disabled_detector_flags_nothing():
    assert run([3.0] * 20 + [math.nan], SpikeConfig(enabled=False)) is None


def test_state_dict_round_trip_resumes_detection():
    curve = training_curve()
    curve[200:] += 3.0
    first = LossSpikeDetector(CFG)
    for step in range(202):  # stop mid-spike, as a checkpoint would
        assert first.update(step, curve[step]) is None
    resumed = LossSpikeDetector(CFG)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    events = [resumed.update(s, curve[s]) for s in range(202, 210)]
    event = next(e for e in events if e is not None)
    assert event.onset_step == 200 and event.detected_step == 204


def test_log_line_format_and_parse(tmp_path):
    curve = training_curve()
    curve[200:] += 3.0
    event = run(curve)
    line = format_spike_line(event)
    assert line.startswith("FORGEFLOW_LOSS_SPIKE onset_step=200 last_healthy_step=199 loss=")
    parsed = parse_spike_line("[rank0] " + line)
    assert parsed["onset_step"] == 200 and parsed["loss"] == pytest.approx(event.loss, rel=1e-5)
    nan_line = format_spike_line(run([3.0] * 12 + [math.nan]))
    assert "loss=nan" in nan_line and math.isnan(parse_spike_line(nan_line)["loss"])
    assert parse_spike_line("step=3 loss=2.0") is None


def test_marker_is_strict_json_and_reads_back(tmp_path):
    event = run([3.0] * 12 + [math.inf])
    path = write_spike_marker(tmp_path, event)
    assert path == tmp_path / "markers" / "loss_spike.json"
    data = json.loads(path.read_text())  # strict: no bare NaN/Infinity
    assert data["kind"] == "loss_spike" and data["loss"] is None and data["loss_repr"] == "inf"
    assert data["onset_step"] == 12 and data["last_healthy_step"] == 11
    back = runfiles.read_spike_marker(tmp_path)
    assert (back.onset_step, back.last_healthy_step, back.detected_step) == (12, 11, event.detected_step)
    assert back.loss == math.inf and back.z == math.inf and back.reason == event.reason
    assert runfiles.read_spike_marker(tmp_path, since=back.time + 60) is None  # an earlier attempt's
    assert [p.name for p in (tmp_path / "markers").iterdir()] == ["loss_spike.json"]  # no temp left
    assert runfiles.read_spike_marker(tmp_path / "elsewhere") is None
