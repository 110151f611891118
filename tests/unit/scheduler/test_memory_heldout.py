"""The memory benchmark's held-out set stays what was decided before tuning (issue 17 item 2)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "memory_accuracy.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("memory_accuracy_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def _fingerprint(cases) -> str:
    rows = [[c.id, c.model, c.micro, c.global_batch, c.recompute, c.tp, c.dp, c.precision] for c in cases]
    return hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()[:16]


def test_heldout_set_is_frozen_and_covers_what_calibration_did_not(bench):
    # Changing this list after seeing results makes it a tuning set: add a new, dated set instead.
    assert _fingerprint(bench.HELDOUT_CASES) == "e08c18789a3e8b22"
    cases = bench.HELDOUT_CASES
    assert any(c.precision != "fp32" and c.tp > 1 for c in cases)
    assert any(c.precision != "fp32" and c.dp > 1 for c in cases)
    assert any(c.recompute == "full" and c.tp * c.dp > 1 for c in cases)
    assert sum(c.model["seq_length"] >= 2048 for c in cases) >= 4
    calibration = {c.id for c in bench.grid()} | {c.id for c in bench.BF16_CASES}
    assert not calibration & {c.id for c in cases}


def test_fresh_heldout_set_is_frozen_and_uses_only_new_shapes(bench):
    # Written down before the issue-26 estimator change; editing it now would make it a tuning set.
    assert _fingerprint(bench.FRESH_HELDOUT_CASES) == "1f0d1e6ce0276249"
    fresh = bench.FRESH_HELDOUT_CASES
    earlier = bench.grid() + bench.BF16_CASES + bench.HELDOUT_CASES + bench.FRENZY_CASES
    for key in ("hidden_size", "seq_length"):
        assert not {c.model[key] for c in fresh} & {c.model[key] for c in earlier}, key
    assert not ({c.micro for c in fresh} - {1}) & {c.micro for c in earlier}
    assert {(c.precision, c.recompute) for c in fresh if c.precision != "fp32"} >= {
        ("bf16", "none"), ("bf16", "selective"), ("bf16", "full"), ("fp16", "none"), ("fp16", "selective")}
    assert any(c.tp > 1 for c in fresh) and any(c.dp > 1 for c in fresh)


def test_frenzy_cases_hold_frenzys_assumptions(bench):
    from scheduler.memory_model import frenzy_estimate, frenzy_parameters

    for c in bench.FRENZY_CASES:
        m = c.model_cfg
        # GPT-style parameter count: within 0.5 % of V·h + l·(12h² + 13h); fp16; no accumulation.
        assert abs(m.num_parameters() - frenzy_parameters(m)) / frenzy_parameters(m) < 0.005, c.id
        assert c.precision == "fp16" and c.global_batch == c.micro * c.dp
        # Only the static term differs from the published formula: 6 instead of 20 bytes/parameter.
        published = frenzy_estimate(m, global_batch=c.micro * c.dp, dp=c.dp, tp=c.tp)
        assert bench.frenzy_own_assumptions(c) == pytest.approx(published - 14 * frenzy_parameters(m) / c.tp)
