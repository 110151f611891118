"""The two-round node-check algorithm over scripted worlds (which node is broken is known)."""

from __future__ import annotations

import pytest

from infra.nodecheck import WorldResult, round_one_worlds, two_round_check


def _runner(broken=(), slow=(), log=None):
    def run(worlds):
        if log is not None:
            log.append(list(worlds))
        out = []
        for w in worlds:
            ok = not (set(w) & set(broken))
            seconds = 1.0 + (5.0 if set(w) & set(slow) else 0.0)
            out.append(WorldResult(tuple(w), ok, seconds))
        return out

    return run


def test_round_one_pairs_neighbours_and_makes_one_world_of_three_when_odd():
    assert round_one_worlds(["a", "b", "c", "d"]) == [("a", "b"), ("c", "d")]
    assert round_one_worlds(["a", "b", "c", "d", "e"]) == [("a", "b"), ("c", "d", "e")]
    assert round_one_worlds(["a", "b", "c"]) == [("a", "b", "c")]


@pytest.mark.parametrize("nodes", [list("abcd"), list("abcde"), list("abcdefgh")])
def test_a_single_broken_node_is_found_and_its_partner_cleared(nodes):
    broken = nodes[1]
    log = []
    report = two_round_check(nodes, _runner(broken=[broken], log=log))
    assert report.faulty == [broken]
    assert broken not in report.healthy and len(report.healthy) == len(nodes) - 1
    assert len(log) == 2  # exactly two rounds
    assert all(broken in w or len(w) == 2 for w in log[1])


def test_all_healthy_needs_one_round():
    log = []
    report = two_round_check(list("abcd"), _runner(log=log))
    assert report.faulty == [] and report.stragglers == [] and report.healthy == list("abcd")
    assert len(log) == 1


def test_straggler_is_slow_in_both_rounds():
    report = two_round_check(list("abcdef"), _runner(slow=["e"]))
    assert report.stragglers == ["e"] and report.faulty == []


def test_two_broken_nodes_in_different_worlds():
    report = two_round_check(list("abcdef"), _runner(broken=["a", "f"]))
    assert sorted(report.faulty) == ["a", "f"]


def test_two_nodes_one_broken_round_two_checks_each_alone():
    log = []
    report = two_round_check(list("ab"), _runner(broken=["b"], log=log))
    assert log[1] == [("a",), ("b",)]  # no good partner: each suspect in a world of its own
    assert report.faulty == ["b"] and report.healthy == ["a"] and report.unresolved == []


def test_a_broken_link_between_two_good_nodes_names_no_node():
    def link_down(worlds):  # a and b each work alone; together they fail
        return [WorldResult(tuple(w), len(w) == 1, 1.0) for w in worlds]

    report = two_round_check(list("ab"), link_down)
    assert report.unresolved == ["a", "b"] and report.faulty == [] and report.healthy == []


def test_round_two_never_puts_one_node_in_two_concurrent_worlds():
    log = []
    two_round_check(list("abcdefg"), _runner(broken=["a", "c", "e"], log=log))
    for call in log[1:]:
        members = [n for w in call for n in w]
        assert len(members) == len(set(members))


def test_a_world_the_batch_system_keeps_queued_is_not_timed_out_while_it_waits(tmp_path):
    """A world waiting in Slurm or Kueue (`job.waiting()` says why) starts its deadline when it
    runs: queued longer than the check's timeout, it still passes."""
    import json
    import time as clock
    from pathlib import Path

    from infra.nodecheck import LauncherWorldRunner

    class QueuedThenDone:
        def __init__(self, request):
            self.request, self.queued_until = request, clock.monotonic() + 1.5

        def waiting(self):
            return "waiting in Kueue: quota" if clock.monotonic() < self.queued_until else None

        def poll(self):  # queued: nothing ran, nothing exited
            if self.waiting():
                return {n.node: None for n in self.request.nodes}
            result = self.request.worker_args[2].split("=", 1)[1]
            Path(result).parent.mkdir(parents=True, exist_ok=True)
            Path(result).write_text(json.dumps({"allgather_s": 0.01}))
            return {n.node: 0 for n in self.request.nodes}

        def terminate(self, grace_s=0.0):
            pass

    class Launcher:
        def start(self, request):
            return QueuedThenDone(request)

    (result,) = LauncherWorldRunner(Launcher(), tmp_path, timeout_s=0.5)([("node-a", "node-b")])
    assert result.ok, result
