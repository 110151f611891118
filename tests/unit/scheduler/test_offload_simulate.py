"""Mobius pipeline simulation: parameters cross PCIe about once per step (1/N of the offload baseline)."""

from __future__ import annotations

import pytest

from scheduler.offload.mapping import cross_map
from scheduler.offload.partition import solve_partition
from scheduler.offload.profile import PCIE3_X8_BYTES_PER_S, PCIE3_X16_BYTES_PER_S, OffloadHardware, analytic_profile
from scheduler.offload.simulate import simulate_gpipe, simulate_mobius, simulate_offload_data_parallel
from training.config import ModelConfig

GIB = 1024**3
RC = (0, 0, 0, 0, 1, 1, 1, 1)


def _setup(layers: int, hidden: int):
    mc = ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=hidden // 128, vocab_size=32000,
                     seq_length=1024)
    profile = analytic_profile(mc, micro_batch=1, microbatches=8, peak_tflops=80)
    hw = OffloadHardware(8, int(24 * GIB * 0.9), PCIE3_X8_BYTES_PER_S, root_complex=RC,
                         root_complex_bytes_per_s=PCIE3_X16_BYTES_PER_S)
    return profile, hw


def test_mobius_moves_parameters_once_and_beats_the_offload_baseline():
    profile, hw = _setup(32, 4096)  # 6.7B: does not fit GPipe on 8x 24 GB
    part = solve_partition(profile, hw, time_limit_s=3.0)
    mapping = cross_map(list(range(8)), RC, num_stages=part.num_stages)
    mobius = simulate_mobius(profile, hw, part.stages, mapping.gpus)
    base = simulate_offload_data_parallel(profile, hw)
    weights = profile.param_bytes
    # forward loads every stage once; backward reloads all but the last N stages
    assert weights <= mobius.param_h2d_bytes < 2 * weights
    # every GPU, forward and backward (the last layer is still there when backward starts)
    streamed = 2 * weights - profile.layers[-1].param_bytes
    assert base.param_h2d_bytes == 8 * streamed
    # its collectives through host memory (no GPU peer-to-peer): the all-gather passes (N-1)/N of
    # every streamed layer back out, the reduce-scatter moves (N-1)/N of the gradients each way
    grads = sum(l.grad_bytes for l in profile.layers)
    assert base.d2h_bytes == pytest.approx(8 * (7 / 8 * streamed + grads))
    assert base.h2d_bytes == pytest.approx(8 * (streamed + 7 / 8 * grads))
    assert mobius.param_h2d_bytes / base.param_h2d_bytes < 1 / 8
    assert mobius.step_time_s < base.step_time_s
    assert simulate_gpipe(profile, hw) is None
    # compute alone bounds the step from below
    compute = sum((l.forward_s + l.backward_s) * profile.microbatches for l in profile.layers) / 8
    assert mobius.step_time_s >= compute


def test_gpipe_runs_where_it_fits_without_parameter_traffic():
    profile, hw = _setup(8, 1024)
    gpipe = simulate_gpipe(profile, hw)
    assert gpipe is not None and gpipe.param_h2d_bytes == 0 and gpipe.step_time_s > 0
