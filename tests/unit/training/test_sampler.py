"""The deterministic sampler: order from (seed, step) only, rank slicing, skipped batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from training.corpus import DataError
from training.sampler import BatchSampler, PackedTokens, SkippedBatches, eval_batches

SEQ = 8


@pytest.fixture
def dataset(tmp_path) -> PackedTokens:
    # Token k has value k, so a sample's first token tells which sample it is.
    path = tmp_path / "train.bin"
    np.arange(SEQ * 50 + 1, dtype=np.uint16).tofile(path)
    return PackedTokens(path, SEQ, dtype="uint16")


def _global_batch(sampler: BatchSampler, step: int, dp_size: int, mb: int, gb: int) -> torch.Tensor:
    parts = []
    for rank in range(dp_size):
        for micro in range(gb // (dp_size * mb)):
            tokens, _ = sampler.get_micro_batch(step, rank, dp_size, micro, mb, gb)
            parts.append(tokens)
    return torch.cat(parts)


def test_samples_are_shifted_windows(dataset):
    assert len(dataset) == 50
    tokens, labels = BatchSampler(dataset, seed=1).get_micro_batch(0, 0, 1, 0, 4, 8)
    assert tokens.dtype == labels.dtype == torch.int64 and tokens.shape == (4, SEQ)
    assert torch.equal(labels, tokens + 1)  # next-token labels
    assert torch.all(tokens[:, 0] % SEQ == 0)  # every sample starts on a window boundary


def test_order_depends_only_on_seed_and_step(dataset):
    a, b, other = BatchSampler(dataset, 7), BatchSampler(dataset, 7), BatchSampler(dataset, 8)
    # Ask in different orders: no hidden state may carry from call to call.
    first = [a.get_micro_batch(s, 0, 1, 0, 4, 4)[0] for s in (0, 1, 2, 3)]
    second = [b.get_micro_batch(s, 0, 1, 0, 4, 4)[0] for s in (3, 2, 1, 0)][::-1]
    assert all(torch.equal(x, y) for x, y in zip(first, second))
    assert not torch.equal(first[0], other.get_micro_batch(0, 0, 1, 0, 4, 4)[0])
    assert not torch.equal(first[0], first[1])


def test_epoch_visits_every_sample_once_and_epochs_differ(dataset):
    sampler = BatchSampler(dataset, 3)
    ids = np.concatenate([sampler.sample_ids(p, 10) for p in range(10)])  # 2 epochs of 50
    assert sorted(ids[:50]) == list(range(50)) and sorted(ids[50:]) == list(range(50))
    assert not np.array_equal(ids[:50], ids[50:])
    straddling = sampler.sample_ids(2, 20)  # samples 40..59: end of epoch 0, start of epoch 1
    assert np.array_equal(straddling, ids[40:60])


@pytest.mark.parametrize("dp_size,mb", [(1, 8), (2, 2), (4, 1), (2, 4)])
def test_rank_slices_make_up_the_same_global_batch(dataset, dp_size, mb):
    sampler = BatchSampler(dataset, 11)
    reference = _global_batch(sampler, 5, 1, 8, 8)
    assert torch.equal(_global_batch(sampler, 5, dp_size, mb, 8), reference)


def test_ranks_get_disjoint_slices(dataset):
    sampler = BatchSampler(dataset, 11)
    r0, _ = sampler.get_micro_batch(0, 0, 2, 0, 4, 8)
    r1, _ = sampler.get_micro_batch(0, 1, 2, 0, 4, 8)
    assert not set(r0[:, 0].tolist()) & set(r1[:, 0].tolist())


def test_bad_batch_geometry_is_refused(dataset):
    sampler = BatchSampler(dataset, 0)
    with pytest.raises(DataError, match="global_batch_size"):
        sampler.get_micro_batch(0, 0, 2, 0, 3, 8)
    with pytest.raises(ValueError, match="micro_index"):
        sampler.get_micro_batch(0, 0, 2, 2, 2, 8)


def test_skipped_batches_shift_later_steps(dataset):
    plain = BatchSampler(dataset, 5)
    skips = SkippedBatches().skip_from_step(10, 3)  # rollback to step 10, skip 3 batches
    assert skips.to_list() == [[10, 13]]
    assert [skips.position_for_step(s) for s in (0, 9, 10, 11)] == [0, 9, 13, 14]
    skipping = BatchSampler(dataset, 5, skips)
    for step, position in ((9, 9), (10, 13), (20, 23)):
        got = skipping.get_micro_batch(step, 0, 1, 0, 4, 4)[0]
        assert torch.equal(got, plain.get_micro_batch_at(position, 0, 1, 0, 4, 4)[0])


def test_skips_are_idempotent_and_compose(dataset):
    once = SkippedBatches().skip_from_step(10, 3)
    assert once.skip_from_step(10, 3) != once  # step 10 now reads position 13: a new window
    # ...but re-applying the same rollback from the checkpoint's saved skips changes nothing:
    assert SkippedBatches.from_list(once.to_list()) == once
    assert once.add(10, 3) == once and once.add(11, 1) == once
    # A later rollback to step 20 skips the batches step 20 would now read (positions 23..24).
    twice = once.skip_from_step(20, 2)
    assert twice.to_list() == [[10, 13], [23, 25]] and twice.total == 5
    assert twice.position_for_step(20) == 25
    # Rolling back before an older skip keeps it, and adjacent windows merge.
    earlier = twice.skip_from_step(8, 2)
    assert earlier.to_list() == [[8, 13], [23, 25]]
    assert earlier.position_for_step(8) == 13


def test_too_small_token_file_is_a_clear_error(tmp_path):
    path = tmp_path / "val.bin"
    np.arange(SEQ, dtype=np.uint16).tofile(path)  # needs SEQ + 1 tokens for one sample
    with pytest.raises(DataError, match="too few for one sample"):
        PackedTokens(path, SEQ, dtype="uint16")
    with pytest.raises(DataError, match="forgeflow prepare"):
        PackedTokens(tmp_path / "missing.bin", SEQ)


def test_eval_batches_cover_the_file_in_order(dataset):
    batches = list(eval_batches(dataset, 16))
    assert [b[0].shape[0] for b in batches] == [16, 16, 16, 2]
    firsts = torch.cat([b[0][:, 0] for b in batches])
    assert torch.equal(firsts, torch.arange(50) * SEQ)
    assert len(list(eval_batches(dataset, 16, max_batches=2))) == 2
