"""Mobius cross mapping: which GPU runs which pipeline position, so prefetches do not contend.

Stage s runs at pipeline position s mod N; a mapping assigns positions to GPUs.
GPUs under one CPU root complex share its PCIe uplink (through a PCIe switch),
so two stages that prefetch from DRAM at about the same time slow each other
down when their GPUs share a root complex. Stages i and j prefetch close in time
when |i - j| is small, and the damage grows with how many GPUs share that root
complex. Mobius's objective, minimised here:

    contention(mapping) = sum over stage pairs i < j with j - i < N of shared(g(i), g(j)) / (j - i)
    shared(a, b)        = GPUs under the root complex of a and b if they share one, else 0

(j - i >= N pairs never overlap: stage j runs on the GPU stage i left.) The
sequential mapping (position p -> GPU p) puts neighbouring stages under one root
complex on a 2x4 server; cross mapping alternates root complexes.

Enumeration is exhaustive with symmetry pruning: GPUs under one root complex are
interchangeable, so only the sequence of root-complex labels over positions is
enumerated (8 GPUs in 2x4: 70 sequences instead of 40,320 permutations), and
root complexes of equal size are interchangeable too (35). Beyond
`EXHAUSTIVE_LIMIT` positions a greedy fill is used.

When prefetches collide, the stage that executes first gets the higher-priority
copy stream (`prefetch_priority`): on CUDA a stream created with a lower
priority number; on CPU the prefetch queue is ordered the same way.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

EXHAUSTIVE_LIMIT = 10


@dataclass(frozen=True)
class StageMapping:
    """GPU of each pipeline position, and its contention score."""

    gpus: tuple[int, ...]  # position p -> GPU index
    contention: float
    enumerated: int  # label sequences scored


def _shared(rc: tuple[int, ...], sizes: Counter, a: int, b: int) -> int:
    return sizes[rc[a]] if rc[a] == rc[b] else 0


def contention(gpus: tuple[int, ...] | list[int], root_complex: tuple[int, ...] | list[int],
               num_stages: int | None = None, stage_of_position: list[int] | None = None) -> float:
    """Mobius's contention objective of a mapping.

    `gpus[p]` is the GPU of position p. With `stage_of_position` (several positions may hold the
    same stage, e.g. its data-parallel ranks) distances are stage distances and pairs of one
    stage are skipped; otherwise stage s sits at position s mod N for `num_stages` (default 2N).
    """
    rc = tuple(root_complex)
    sizes = Counter(rc)
    n = len(gpus)
    total = 0.0
    if stage_of_position is not None:
        for i in range(n):
            for j in range(i + 1, n):
                d = abs(stage_of_position[i] - stage_of_position[j])
                if d:
                    total += _shared(rc, sizes, gpus[i], gpus[j]) / d
        return total
    stages = num_stages or 2 * n
    for i in range(stages):
        for j in range(i + 1, min(stages, i + n)):
            total += _shared(rc, sizes, gpus[i % n], gpus[j % n]) / (j - i)
    return total


def _label_sequences(counts: dict[int, int], length: int, equal_size_symmetry: bool):
    """Distinct sequences of root-complex labels with the given multiplicities.

    With `equal_size_symmetry`, labels of equal count are interchangeable: a label may first
    appear only after every smaller label of its size class has appeared (canonical form).
    """
    labels = sorted(counts)
    left = dict(counts)
    seq: list[int] = []
    seen: set[int] = set()
    by_size: dict[int, list[int]] = {}
    for lab in labels:
        by_size.setdefault(counts[lab], []).append(lab)

    def allowed(lab: int) -> bool:
        if not equal_size_symmetry or lab in seen:
            return True
        peers = by_size[counts[lab]]
        return all(p in seen for p in peers[:peers.index(lab)])

    def rec():
        if len(seq) == length:
            yield tuple(seq)
            return
        for lab in labels:
            if left[lab] and allowed(lab):
                left[lab] -= 1
                seq.append(lab)
                fresh = lab not in seen
                seen.add(lab)
                yield from rec()
                if fresh:
                    seen.discard(lab)
                seq.pop()
                left[lab] += 1

    yield from rec()


def _assign(labels: tuple[int, ...], gpus_by_rc: dict[int, list[int]]) -> tuple[int, ...]:
    queues = {rc: list(gs) for rc, gs in gpus_by_rc.items()}
    return tuple(queues[lab].pop(0) for lab in labels)


def cross_map(
    gpus: list[int],
    root_complex: list[int] | tuple[int, ...],
    *,
    num_stages: int | None = None,
    stage_of_position: list[int] | None = None,
) -> StageMapping:
    """The mapping of positions onto `gpus` with the least contention.

    `root_complex[g]` is GPU g's root complex (index = GPU index on the node, as in the
    inventory). Positions are pipeline positions (stage mod N) or, with `stage_of_position`,
    local ranks each holding a given stage.
    """
    gpus = sorted(gpus)
    rc_all = tuple(root_complex)
    gpus_by_rc: dict[int, list[int]] = {}
    for g in gpus:
        gpus_by_rc.setdefault(rc_all[g], []).append(g)
    counts = {rc: len(gs) for rc, gs in gpus_by_rc.items()}

    def score(mapping):
        return contention(mapping, rc_all, num_stages, stage_of_position)

    if len(gpus) > EXHAUSTIVE_LIMIT:
        return _greedy(gpus, rc_all, gpus_by_rc, score)
    # Relabelling equal-sized root complexes maps a sequence onto one of equal score only when
    # the whole problem is symmetric in them (which it is: shared() depends on sizes only).
    best, enumerated = None, 0
    for labels in _label_sequences(counts, len(gpus), equal_size_symmetry=True):
        enumerated += 1
        mapping = _assign(labels, gpus_by_rc)
        c = score(mapping)
        if best is None or c < best[0] - 1e-12:
            best = (c, mapping)
    return StageMapping(best[1], best[0], enumerated)


def _greedy(gpus, rc_all, gpus_by_rc, score) -> StageMapping:
    """Large nodes: fill positions one by one with the root complex that adds least contention."""
    queues = {rc: list(gs) for rc, gs in gpus_by_rc.items()}
    mapping: list[int] = []
    for _ in gpus:
        options = [rc for rc, q in queues.items() if q]
        rc = min(options, key=lambda r: (_partial(mapping, queues[r][0], rc_all), -len(queues[r]), r))
        mapping.append(queues[rc].pop(0))
    return StageMapping(tuple(mapping), score(tuple(mapping)), 0)


def _partial(prefix: list[int], gpu: int, rc_all: tuple[int, ...]) -> float:
    sizes = Counter(rc_all)
    k = len(prefix)
    return sum(_shared(rc_all, sizes, prefix[i], gpu) / (k - i) for i in range(k))


def sequential_map(gpus: list[int]) -> tuple[int, ...]:
    return tuple(sorted(gpus))


def prefetch_priority(stage: int, num_stages: int, phase: str) -> int:
    """Copy-stream priority of a stage's prefetch: 0 = highest. The stage that executes first
    wins: forward runs stages in ascending order, backward in descending order."""
    return stage if phase == "forward" else num_stages - 1 - stage
