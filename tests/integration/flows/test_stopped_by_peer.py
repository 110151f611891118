"""A node stopped by another node's failure ends its node-launch run Cancelled, named
StoppedByPeer, on a real Prefect API: only the culprit's run stays a failure. (The whole
path, two workers and a fault on one node, is the deployment drill of
test_prefect_deployments.py, collected by test_prefect_on_postgres.py.)"""

from __future__ import annotations

from infra.atomic_write import atomic_write_json
from infra.launch import node_runs_path
from tasks.launchers import STOPPED_BY_PEER, mark_stopped_by_peer


def _node_runs(tmp_path):
    """Node-launch stand-ins as a failed two-node attempt leaves them: node-b failed (the
    culprit), node-a failed after it (its ranks lost the peer), node-c was cancelled by the
    watcher, node-d has not ended yet."""
    from prefect import flow, get_client
    from prefect.states import Cancelled, Failed, Running

    @flow(name="node-launch-stand-in")
    def stand_in() -> None:
        pass

    states = {"node-a": Failed(message="torchrun on node node-a exited with code 1"),
              "node-b": Failed(message="torchrun on node node-b exited with code 1"),
              "node-c": Cancelled(), "node-d": Running()}
    ids = {}
    with get_client(sync_client=True) as client:
        for node, state in states.items():
            run = client.create_flow_run(stand_in, name=f"peers-a0-{node}")
            client.set_flow_run_state(run.id, state, force=True)
            ids[node] = run.id
    atomic_write_json(node_runs_path(tmp_path / "run", 0), {node: str(i) for node, i in ids.items()})
    return ids


def test_the_runs_a_peer_stopped_say_so_and_the_culprit_stays_failed(prefect_api, tmp_path):
    from prefect import get_client

    ids = _node_runs(tmp_path)
    changed = mark_stopped_by_peer(tmp_path / "run", 0, ["node-b"], "CUDAError")
    assert changed == {"node-a": "stopped: peer node-b failed (CUDAError)",
                       "node-c": "stopped: peer node-b failed (CUDAError)"}
    with get_client(sync_client=True) as client:
        states = {node: client.read_flow_run(i).state for node, i in ids.items()}
    for node in ("node-a", "node-c"):
        assert states[node].type.value == "CANCELLED" and states[node].name == STOPPED_BY_PEER
        assert states[node].message == "stopped: peer node-b failed (CUDAError)"
    assert states["node-b"].type.value == "FAILED" and "node-b exited with code 1" in states["node-b"].message
    assert states["node-d"].type.value == "RUNNING"  # not ended: nothing to say about it yet


def test_nothing_changes_without_a_culprit_or_without_node_runs(prefect_api, tmp_path):
    from prefect import get_client

    ids = _node_runs(tmp_path)
    assert mark_stopped_by_peer(tmp_path / "run", 0, ["localhost"], "CUDAError") == {}  # no node of the attempt
    assert mark_stopped_by_peer(tmp_path / "run", 1, ["node-b"], "CUDAError") == {}  # another attempt: no runs
    with get_client(sync_client=True) as client:
        assert client.read_flow_run(ids["node-a"]).state.type.value == "FAILED"
