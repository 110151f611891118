"""Deterministic batches from a packed token file.

Samples. `PackedTokens` cuts the memmapped token file into non-overlapping
windows of ``seq_length + 1`` tokens (stride ``seq_length``): sample k is
``tokens[k*seq : k*seq + seq + 1]``; inputs are its first ``seq`` tokens and
labels the last ``seq`` (next-token prediction). Documents are packed back to
back with an end-of-text token between them, so a sample may span documents.

Order. The sample order depends only on ``(seed, data position)``:
global sample index ``i = position * global_batch_size + j`` for
``j in [0, global_batch_size)``; ``epoch = i // num_samples``; the sample read is
``perm(seed, epoch)[i % num_samples]`` where ``perm`` is a permutation drawn
from numpy's ``PCG64(SeedSequence([seed, epoch]))``. No state is carried from
step to step, so a resumed run reads exactly the batches it would have read,
and any rank can compute any batch.

Ranks. Data-parallel rank r of d takes the contiguous slice
``j in [r*G/d, (r+1)*G/d)`` of the global batch and splits it into micro
batches of ``micro_batch_size``, in order. The union over ranks and micro
batches is exactly the global batch, whatever d is: the same global batch is
trained at world size 1 and 2.

Data position vs step. The *data position* is the number of global batches
consumed before a step ("consumed_batches"). It equals the step unless batches
were skipped: after a loss spike the flow rolls back to the newest checkpoint
committed before the spike's onset and tells the worker to skip K batches from
the onset's on (``spike.skip_batches``, ``spike.skip_from_step``). With O the
onset step as logged (it trained the batch of step counter O-1), the worker
records ``skips = skips.skip_from_step(O - 1, K)``: data positions
``[position_for_step(O-1), position_for_step(O-1) + K)`` are never trained on;
the steps between the checkpoint and the onset replay their batches exactly, and
the onset step trains the first batch after the window. (Without an onset the
window starts at the resumed step.) Skips are kept as a set of data-position
ranges (merged); rolling back further than an earlier skip keeps that skip. A
retried restart from the same checkpoint starts from the skips that checkpoint
saved, so it gives the same windows; a skip applied to a checkpoint that already
records it skips K more batches (the flow sends a rollback's skip only until its
timeline commits a checkpoint: ``diagnosis.recovery``). The
worker saves ``skips.to_list()`` with its checkpoint and restores it with
``SkippedBatches.from_list``; every step line carries ``batch=`` (the position).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from training.corpus import DataError

if TYPE_CHECKING:
    import torch

META_NAME = "meta.json"


def read_meta(data_dir: str | Path) -> dict:
    """The `meta.json` that `prepare_data` writes next to the token files."""
    path = Path(data_dir) / META_NAME
    if not path.is_file():
        raise DataError(f"{path}: no prepared data here; run `forgeflow prepare CONFIG` first")
    return json.loads(path.read_text(encoding="utf-8"))


class PackedTokens:
    """Fixed-length training samples over one packed token file (numpy memmap)."""

    def __init__(self, path: str | Path, seq_length: int, dtype: str | None = None):
        self.path = Path(path)
        if not self.path.is_file():
            raise DataError(f"{self.path}: no token file; run `forgeflow prepare CONFIG` first")
        if dtype is None:
            dtype = read_meta(self.path.parent)["dtype"]
        self.seq_length = int(seq_length)
        self.tokens = np.memmap(self.path, dtype=np.dtype(dtype), mode="r")
        self.num_samples = (len(self.tokens) - 1) // self.seq_length
        if self.num_samples < 1:
            raise DataError(
                f"{self.path}: {len(self.tokens)} tokens are too few for one sample of "
                f"seq_length {self.seq_length} (+1); use a larger corpus or a shorter seq_length"
            )

    def __len__(self) -> int:
        return self.num_samples

    def samples(self, sample_ids: np.ndarray) -> np.ndarray:
        """Windows of seq_length + 1 tokens, as int64 [len(sample_ids), seq_length + 1]."""
        seq = self.seq_length
        starts = np.asarray(sample_ids, dtype=np.int64) * seq
        out = np.empty((len(starts), seq + 1), dtype=np.int64)
        for row, start in enumerate(starts):
            out[row] = self.tokens[start:start + seq + 1]
        return out


@dataclass(frozen=True)
class SkippedBatches:
    """Data positions (global batch indices) that training never uses; see module doc."""

    windows: tuple[tuple[int, int], ...] = ()  # sorted, disjoint, non-adjacent [start, end)

    def add(self, start: int, count: int) -> "SkippedBatches":
        if start < 0 or count < 0:
            raise ValueError(f"skip window needs start >= 0 and count >= 0, got {start}, {count}")
        if count == 0:
            return self
        merged: list[tuple[int, int]] = []
        for a, b in sorted(self.windows + ((start, start + count),)):
            if merged and a <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], b))
            else:
                merged.append((a, b))
        return SkippedBatches(tuple(merged))

    def position_for_step(self, step: int) -> int:
        """The data position step `step` trains on: the step-th position not skipped."""
        position = int(step)
        for start, end in self.windows:
            if start <= position:
                position += end - start
            else:
                break
        return position

    def skip_from_step(self, step: int, count: int) -> "SkippedBatches":
        """Skip the `count` batches that step `step` (and the following) would have read."""
        return self.add(self.position_for_step(step), count)

    @property
    def total(self) -> int:
        return sum(end - start for start, end in self.windows)

    def to_list(self) -> list[list[int]]:
        return [[start, end] for start, end in self.windows]

    @classmethod
    def from_list(cls, windows: Sequence[Sequence[int]] | None) -> "SkippedBatches":
        out = cls()
        for start, end in windows or ():
            out = out.add(int(start), int(end) - int(start))
        return out


@lru_cache(maxsize=4)
def _epoch_permutation(seed: int, epoch: int, num_samples: int) -> np.ndarray:
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch])))
    return rng.permutation(num_samples)


def micro_batches_per_rank(global_batch_size: int, micro_batch_size: int, dp_size: int) -> int:
    if global_batch_size % (micro_batch_size * dp_size):
        raise DataError(
            f"global_batch_size ({global_batch_size}) must be a multiple of micro_batch_size "
            f"({micro_batch_size}) x data-parallel size ({dp_size}); change training.global_batch_size"
        )
    return global_batch_size // (micro_batch_size * dp_size)


class BatchSampler:
    """Micro batches whose content depends only on (seed, step, skips); see module doc."""

    def __init__(self, dataset: PackedTokens, seed: int, skips: SkippedBatches | None = None):
        self.dataset = dataset
        self.seed = int(seed)
        self.skips = skips or SkippedBatches()

    def sample_ids(self, position: int, global_batch_size: int) -> np.ndarray:
        """Sample ids of the whole global batch at a data position, in batch order."""
        n = self.dataset.num_samples
        index = position * global_batch_size + np.arange(global_batch_size, dtype=np.int64)
        epochs, offsets = np.divmod(index, n)
        out = np.empty(global_batch_size, dtype=np.int64)
        for epoch in np.unique(epochs):
            sel = epochs == epoch
            out[sel] = _epoch_permutation(self.seed, int(epoch), n)[offsets[sel]]
        return out

    def micro_batch_ids(self, position: int, dp_rank: int, dp_size: int, micro_index: int,
                        micro_batch_size: int, global_batch_size: int) -> np.ndarray:
        per_rank = micro_batches_per_rank(global_batch_size, micro_batch_size, dp_size)
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} outside [0, {dp_size})")
        if not 0 <= micro_index < per_rank:
            raise ValueError(f"micro_index {micro_index} outside [0, {per_rank})")
        start = dp_rank * (global_batch_size // dp_size) + micro_index * micro_batch_size
        return self.sample_ids(position, global_batch_size)[start:start + micro_batch_size]

    def get_micro_batch_at(self, position: int, dp_rank: int, dp_size: int, micro_index: int,
                           micro_batch_size: int, global_batch_size: int
                           ) -> tuple["torch.Tensor", "torch.Tensor"]:
        import torch

        ids = self.micro_batch_ids(position, dp_rank, dp_size, micro_index,
                                   micro_batch_size, global_batch_size)
        windows = torch.from_numpy(self.dataset.samples(ids))
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def get_micro_batch(self, step: int, dp_rank: int, dp_size: int, micro_index: int,
                        micro_batch_size: int, global_batch_size: int
                        ) -> tuple["torch.Tensor", "torch.Tensor"]:
        """(tokens, labels), int64 [micro_batch_size, seq_length], for this rank at `step`."""
        return self.get_micro_batch_at(self.skips.position_for_step(step), dp_rank, dp_size,
                                       micro_index, micro_batch_size, global_batch_size)


def eval_batches(dataset: PackedTokens, batch_size: int, max_batches: int | None = None
                 ) -> Iterator[tuple["torch.Tensor", "torch.Tensor"]]:
    """Validation batches in file order (samples 0, 1, 2, ...): the same on every call."""
    import torch

    count = -(-dataset.num_samples // batch_size)  # the last batch may be short
    if max_batches is not None:
        count = min(count, max_batches)
    for b in range(count):
        ids = np.arange(b * batch_size, min((b + 1) * batch_size, dataset.num_samples))
        windows = torch.from_numpy(dataset.samples(ids))
        yield windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
