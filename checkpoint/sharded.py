"""Global pieces: what makes a checkpoint loadable onto any parallel layout.

Every tensor a rank saves is a *piece* of a global tensor: its checkpoint key, the
global tensor's shape and the offset of the piece inside it (megatron's
ShardedTensor metadata: key, global_shape, global_offset; stage-local layer numbers
already mapped to global ones by megatron's `sharded_state_dict`). A piece held by
several ranks (replicated over data parallelism, or over tensor parallelism for
norms) is saved once; `assign_savers` spreads those saves evenly over the ranks
that hold a copy, so every rank writes about the same number of bytes and the
persist runs fully in parallel.

Loading asks for *requests* (the same metadata, for the pieces the new layout
holds) and `fill` assembles each one from the saved pieces that overlap it: a
TP=2 rank reads half of a TP=1 matrix, a PP stage reads only its layers. Objects
(non-tensor values, e.g. megatron's `_extra_state`) are matched by key and offset.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch


class PieceMismatch(ValueError):
    """What the loading job asks for is not in the checkpoint (another model or config)."""


@dataclass
class GlobalPiece:
    """One rank's piece of a global tensor (or a keyed object); `data` has the piece's shape."""

    key: str
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    data: Any  # a tensor whose shape is the piece's extent in every global dimension, or an object
    is_object: bool = False

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape) if not self.is_object else ()

    def descriptor(self) -> dict[str, Any]:
        """The JSON-able metadata the manifest keeps for this piece."""
        out: dict[str, Any] = {"key": self.key, "global_shape": list(self.global_shape),
                               "global_offset": list(self.global_offset)}
        if self.is_object:
            out["object"] = True
        else:
            out["shape"] = list(self.data.shape)
            out["dtype"] = str(self.data.dtype).removeprefix("torch.")
        return out

    def identity(self) -> tuple:
        """Two ranks holding pieces with the same identity hold replicas of the same data."""
        return (self.key, tuple(self.global_offset), self.shape, self.is_object)

    def nbytes(self) -> int:
        return 0 if self.is_object else self.data.numel() * self.data.element_size()


@dataclass
class PieceRequest:
    """A piece the loading rank needs: a tensor of `shape` at `global_offset`, or an object."""

    key: str
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    shape: tuple[int, ...] = ()
    dtype: torch.dtype | None = None
    is_object: bool = False


@dataclass
class SavePlan:
    """Which of this rank's pieces it saves (one copy of each piece across the job)."""

    mine: list[int]  # indices into this rank's piece list
    bytes_by_rank: list[int] = field(default_factory=list)


def assign_savers(descriptors_by_rank: list[list[tuple[tuple, int]]], rank: int) -> SavePlan:
    """Balanced de-duplication: each distinct piece is saved by exactly one of its holders.

    `descriptors_by_rank[r]` lists rank r's pieces as (identity, nbytes). Largest pieces
    are placed first, each on the holder with the fewest bytes so far (ties: lowest
    rank); every rank computes the same plan from the same gathered list.
    """
    holders: dict[tuple, list[int]] = {}
    sizes: dict[tuple, int] = {}
    for r, descriptors in enumerate(descriptors_by_rank):
        for identity, nbytes in descriptors:
            holders.setdefault(identity, []).append(r)
            sizes[identity] = nbytes
    load = [0] * len(descriptors_by_rank)
    saver: dict[tuple, int] = {}
    for identity in sorted(holders, key=lambda i: (-sizes[i], repr(i))):
        chosen = min(holders[identity], key=lambda r: (load[r], r))
        saver[identity] = chosen
        load[chosen] += max(sizes[identity], 1)
    mine = [i for i, (identity, _) in enumerate(descriptors_by_rank[rank]) if saver[identity] == rank]
    return SavePlan(mine, load)


def _overlap(a_off: tuple[int, ...], a_shape: tuple[int, ...], b_off: tuple[int, ...],
             b_shape: tuple[int, ...]) -> tuple[tuple[slice, ...], tuple[slice, ...]] | None:
    """Slices of a and of b covering their common region; None if they do not overlap."""
    in_a, in_b = [], []
    for ao, an, bo, bn in zip(a_off, a_shape, b_off, b_shape):
        lo, hi = max(ao, bo), min(ao + an, bo + bn)
        if lo >= hi:
            return None
        in_a.append(slice(lo - ao, hi - ao))
        in_b.append(slice(lo - bo, hi - bo))
    return tuple(in_a), tuple(in_b)


def overlaps(request: PieceRequest, descriptor: dict[str, Any]) -> bool:
    if descriptor["key"] != request.key:
        return False
    if request.is_object or descriptor.get("object"):
        return tuple(descriptor["global_offset"]) == tuple(request.global_offset)
    return _overlap(tuple(request.global_offset), tuple(request.shape),
                    tuple(descriptor["global_offset"]), tuple(descriptor["shape"])) is not None


def fill(request: PieceRequest, saved: list[GlobalPiece]) -> Any:
    """The requested piece assembled from the saved pieces (all of one key). Raises PieceMismatch."""
    if not saved:
        raise PieceMismatch(f"{request.key}: not in the checkpoint (a different model or optimizer?)")
    if request.is_object:
        for piece in saved:
            if piece.is_object and tuple(piece.global_offset) == tuple(request.global_offset):
                return piece.data
        raise PieceMismatch(f"{request.key}: no object at offset {request.global_offset} in the "
                            f"checkpoint (saved at {[p.global_offset for p in saved][:4]})")
    if tuple(saved[0].global_shape) != tuple(request.global_shape):
        raise PieceMismatch(f"{request.key}: the checkpoint holds global shape "
                            f"{tuple(saved[0].global_shape)}, this job needs {tuple(request.global_shape)}; "
                            "load it with the model configuration it was trained with")
    out = torch.empty(request.shape, dtype=request.dtype or saved[0].data.dtype)
    covered = 0
    for piece in saved:
        cut = _overlap(tuple(request.global_offset), tuple(request.shape),
                       tuple(piece.global_offset), tuple(piece.data.shape))
        if cut is None:
            continue
        into, take = cut
        region = piece.data[take]
        out[into] = region.to(out.dtype)
        covered += region.numel()
    if covered != math.prod(request.shape):
        raise PieceMismatch(f"{request.key}: the checkpoint covers {covered} of the "
                            f"{math.prod(request.shape)} values at offset {request.global_offset}; "
                            "it is incomplete for this layout")
    return out
