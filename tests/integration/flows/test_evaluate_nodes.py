"""Evaluation across two worker "nodes" on a real Prefect server: a precursor preload on each
node's work queue, trials on both nodes' slots, metric jobs in the evaluating flow (CPU), and
every preload removed at the end."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

POOL = "forgeflow-eval-nodes"
SUITE = """
name: nodes
slots: 2
target_trial_s: 0.1
backend_options: {batch_size: 8, device: cpu, torch_threads: 1}
datasets:
  - name: arith-em
    options: {limit: 4}
  - name: capitals-mc
    options: {limit: 4}
"""


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("FORGEFLOW_TEST_MULTINODE_EVAL"),
                    reason="opt-in (FORGEFLOW_TEST_MULTINODE_EVAL=1): in a clean CI-like run the node "
                           "runs' remove-preload waited ~9 min after the metrics finished and the test "
                           "hit the 600 s timeout; passes on a warm machine. Cause not yet found (issue 13)")
def test_evaluation_across_two_worker_nodes(use_prefect_server, two_node_cluster, tmp_path, monkeypatch):
    from prefect import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

    from evalsuite.fixtures import make_tiny_checkpoint
    from evalsuite.preload import preload_key
    from flows.deploy import deploy_all
    from flows.evaluate import evaluate_checkpoint
    from tests.integration.flows.conftest import SlackReceiver

    slack = SlackReceiver()
    monkeypatch.setenv("SLACK_WEBHOOK_URL", slack.url)
    monkeypatch.setenv("FORGEFLOW_STATE_DIR", str(tmp_path / "state"))
    try:
        assert deploy_all(cluster=str(two_node_cluster), pool=POOL) == 0
    finally:
        slack.close()
    for node in ("node-a", "node-b"):
        use_prefect_server.start_worker(POOL, node)
    ckpt = make_tiny_checkpoint(tmp_path / "ckpts" / "step-00000010")
    shutil.rmtree(ckpt / "data")
    suite = tmp_path / "suite.yaml"
    suite.write_text(SUITE)
    shm = tmp_path / "shm"

    result = evaluate_checkpoint(str(ckpt), suite=str(suite), output_dir=str(tmp_path / "out"),
                                 preload_root=str(shm), nodes=["node-a", "node-b"])
    assert result["failed"] == {} and set(result["results"]) == {"arith-em", "capitals-mc"}
    assert not (shm / preload_key(str(ckpt))).exists(), "a node's preload was left behind"

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(deployment_filter=DeploymentFilter(
            name=DeploymentFilterName(any_=["eval-node-work"])))
    by_action: dict[str, list] = {}
    for run in runs:
        by_action.setdefault(run.parameters["action"], []).append(run)
    assert all(r.state.is_completed() for r in runs)
    # One precursor and one removal per node, each on that node's own work queue.
    for action in ("preload", "remove-preload"):
        assert sorted(r.work_queue_name for r in by_action[action]) == ["node-a", "node-b"]
    # Trials ran on both nodes (2 slots each), each on the queue of the node its slot belongs to.
    trials = by_action["trial"]
    assert {r.work_queue_name for r in trials} == {"node-a", "node-b"}
    assert all(r.parameters["trial"]["node"] == r.work_queue_name for r in trials)
    assert len(trials) >= 4
