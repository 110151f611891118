"""Which nodes of a failed attempt stopped only because a peer failed."""

from __future__ import annotations

from infra.launch import stopped_by_peer

NODES = ["node-a", "node-b", "node-c"]


def test_every_node_but_the_culprit_was_stopped_by_it():
    assert stopped_by_peer(NODES, ["node-b"], "CUDAError") == {
        "node-a": "stopped: peer node-b failed (CUDAError)", "node-c": "stopped: peer node-b failed (CUDAError)"}
    assert stopped_by_peer(NODES, ["node-c", "node-a"]) == {"node-b": "stopped: peer node-a, node-c failed"}


def test_no_node_is_cleared_without_a_culprit_among_them_or_when_all_are_suspects():
    assert stopped_by_peer(NODES, []) == {}
    assert stopped_by_peer(NODES, ["localhost"]) == {}  # a hostname is no node of the attempt
    assert stopped_by_peer(NODES, NODES) == {}
