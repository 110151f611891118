"""Mobius cross mapping: enumeration finds the least contention and it is not the sequential mapping."""

from __future__ import annotations

import itertools

from scheduler.cluster import parse_cluster
from scheduler.offload.mapping import contention, cross_map, prefetch_priority, sequential_map
from scheduler.placement import build_placement

TWO_ROOT_COMPLEXES = [0, 0, 0, 0, 1, 1, 1, 1]  # the paper's 8x 3090-Ti server


def test_enumeration_finds_the_minimum_over_all_permutations_and_differs_from_sequential():
    best = cross_map(list(range(8)), TWO_ROOT_COMPLEXES)
    brute = min(contention(p, TWO_ROOT_COMPLEXES) for p in itertools.permutations(range(8)))
    assert abs(best.contention - brute) < 1e-9
    assert best.enumerated == 35  # 8!/(4!4!) label sequences, halved by swapping the two root complexes
    sequential = sequential_map(range(8))
    assert best.gpus != sequential
    assert best.contention < contention(sequential, TWO_ROOT_COMPLEXES)
    # neighbouring positions sit under different root complexes
    assert all(TWO_ROOT_COMPLEXES[a] != TWO_ROOT_COMPLEXES[b] for a, b in zip(best.gpus, best.gpus[1:]))


def test_uneven_root_complexes_and_stage_counts_also_match_brute_force():
    rc = [0, 0, 0, 1, 1, 2]
    for stages in (6, 9, 12):
        best = cross_map(list(range(6)), rc, num_stages=stages)
        brute = min(contention(p, rc, stages) for p in itertools.permutations(range(6)))
        assert abs(best.contention - brute) < 1e-9


def test_placement_uses_the_contention_minimising_mapping():
    cluster = parse_cluster({"name": "c", "nodes": [
        {"name": "n0", "gpu_type": "A40", "gpu_count": 8, "pcie_root_complex": TWO_ROOT_COMPLEXES}]})
    placement = build_placement(cluster, {"n0": 8}, job="j", gpu_type="A40", dp=1, tp=1, pp=8)
    gpus = list(placement.assignments[0].gpus)
    assert sorted(gpus) == list(range(8))
    assert contention(gpus, TWO_ROOT_COMPLEXES, stage_of_position=list(range(8))) == cross_map(
        list(range(8)), TWO_ROOT_COMPLEXES, stage_of_position=list(range(8))).contention
    assert placement.stage_root_complex_conflicts() == 0


def test_the_stage_that_executes_first_gets_the_higher_priority_stream():
    assert prefetch_priority(2, 8, "forward") < prefetch_priority(5, 8, "forward")
    assert prefetch_priority(5, 8, "backward") < prefetch_priority(2, 8, "backward")
