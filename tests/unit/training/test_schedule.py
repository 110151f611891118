"""Warmup + cosine learning-rate schedule."""

from __future__ import annotations

import math

import pytest

from training.config import TrainingConfig
from training.schedule import apply_schedule, lr_at


def cfg(**kw) -> TrainingConfig:
    base = dict(global_batch_size=8, steps=100, lr=1e-3, min_lr=1e-4, warmup_steps=10)
    return TrainingConfig(**(base | kw))


def test_linear_warmup_reaches_the_peak_at_the_last_warmup_step():
    c = cfg()
    assert lr_at(0, c) == pytest.approx(1e-4)
    assert lr_at(4, c) == pytest.approx(5e-4)
    assert lr_at(9, c) == pytest.approx(1e-3)


def test_cosine_decays_from_peak_to_min_lr():
    c = cfg()
    assert lr_at(10, c) == pytest.approx(1e-3)
    assert lr_at(55, c) == pytest.approx(1e-4 + 0.5 * (1e-3 - 1e-4))  # half way
    values = [lr_at(s, c) for s in range(10, 100)]
    assert all(a >= b for a, b in zip(values, values[1:]))
    assert lr_at(100, c) == lr_at(1000, c) == pytest.approx(1e-4)


def test_lr_decay_steps_shortens_the_decay():
    c = cfg(lr_decay_steps=50)
    assert lr_at(50, c) == pytest.approx(1e-4)
    assert lr_at(30, c) == pytest.approx(1e-4 + (1e-3 - 1e-4) * 0.5 * (1 + math.cos(math.pi * 0.5)))


def test_no_warmup_starts_at_the_peak():
    assert lr_at(0, cfg(warmup_steps=0)) == pytest.approx(1e-3)


def test_negative_step_is_refused():
    with pytest.raises(ValueError):
        lr_at(-1, cfg())


def test_apply_schedule_honours_megatron_group_multipliers():
    class Opt:
        param_groups = [{"lr_mult": 1.0, "wd_mult": 1.0}, {"lr_mult": 0.5, "wd_mult": 0.0}, {}]

    opt = Opt()
    lr = apply_schedule(opt, 9, cfg(weight_decay=0.1))
    assert lr == pytest.approx(1e-3)
    g0, g1, g2 = opt.param_groups
    assert (g0["lr"], g0["weight_decay"]) == (pytest.approx(1e-3), pytest.approx(0.1))
    assert (g1["lr"], g1["weight_decay"]) == (pytest.approx(5e-4), 0.0)
    assert (g2["lr"], g2["weight_decay"]) == (pytest.approx(1e-3), pytest.approx(0.1))
