"""Evaluation across two worker "nodes" on a real Prefect server: the nodes allocated by the
cluster orchestrator (held while the evaluation runs, released after), one session per node on
its work queue (the precursor preload, trials on that node's slots, the preload's removal),
metric jobs in the evaluating flow (CPU), and every preload removed at the end."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest

POOL = "forgeflow-eval-nodes"
SUITE = """
name: nodes
slots: 2
target_trial_s: 0.1
backend_options: {batch_size: 2, device: cpu, torch_threads: 1}   # 4 samples = 2 batches: 2 shards each
datasets:
  - name: arith-em
    options: {limit: 4}
  - name: capitals-mc
    options: {limit: 4}
"""


def deploy_node_work(pool: str) -> None:
    """The work pool and prefect.yaml's eval-node-work deployment, as `forgeflow deploy` creates them
    (only that deployment: `forgeflow deploy` as a whole is tested in test_prefect_deployments.py, and
    deploying all of them loads every flow module, half a minute on a busy 2-core machine)."""
    from flows.deploy import ROOT, ensure_work_pool

    ensure_work_pool(pool)
    result = subprocess.run([sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--name", "eval-node-work",
                             "--prefect-file", str(ROOT / "prefect.yaml")], cwd=ROOT, capture_output=True, text=True,
                            env=dict(os.environ, FORGEFLOW_ROOT=str(ROOT), FORGEFLOW_POOL=pool))
    assert result.returncode == 0, result.stdout + result.stderr


def test_evaluation_across_two_worker_nodes(use_prefect_server, two_node_cluster, tmp_path, monkeypatch):
    from prefect import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

    from testing.tiny_checkpoint import make_tiny_checkpoint
    from evalsuite.preload import preload_key
    from flows.deploy import ensure_cluster_registered, ensure_work_pool
    from flows.evaluate import evaluate_checkpoint
    from scheduler.orchestrator.seat import cluster_orchestrator

    started = datetime.now(timezone.utc)  # the server is shared: only this test's runs count
    monkeypatch.setenv("FORGEFLOW_STATE_DIR", str(tmp_path / "state"))   # the orchestrator's SQLite
    ensure_cluster_registered(str(two_node_cluster))

    ensure_work_pool(POOL)
    for node in ("node-a", "node-b"):   # they start while the deployment is created
        use_prefect_server.start_worker(POOL, node)
    deploy_node_work(POOL)
    ckpt = make_tiny_checkpoint(tmp_path / "ckpts" / "step-00000010")
    shutil.rmtree(ckpt / "data")
    suite = tmp_path / "suite.yaml"
    suite.write_text(SUITE)
    shm = tmp_path / "shm"

    # Two nodes from the orchestrator (each CPU node counts as one unit), not a node list.
    result = evaluate_checkpoint(str(ckpt), suite=str(suite), output_dir=str(tmp_path / "out"),
                                 preload_root=str(shm), node_count=2, cluster="two-cpu-nodes")
    assert result["failed"] == {} and set(result["results"]) == {"arith-em", "capitals-mc"}
    assert not (shm / preload_key(str(ckpt))).exists(), "a node's preload was left behind"
    allocation = cluster_orchestrator().job(1)
    assert allocation["name"].startswith("evaluate step-00000010") and allocation["state"] == "finished"

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(deployment_filter=DeploymentFilter(
            name=DeploymentFilterName(any_=["eval-node-work"])))
    runs = [run for run in runs if run.created >= started]
    assert all(r.state.is_completed() for r in runs)
    # One session per node, each on that node's own work queue: its precursor preload, its trials,
    # its preload's removal, in one run instead of a run per step.
    assert sorted((r.parameters["action"], r.work_queue_name) for r in runs) == [("serve", "node-a"),
                                                                                ("serve", "node-b")]
    # Trials ran on both nodes (2 slots each), each in the session of the node its slot belongs to.
    served = {}
    for node in ("node-a", "node-b"):
        for path in (tmp_path / "out" / "node-sessions" / node / "outbox").glob("*.json"):
            reply = json.loads(path.read_text())
            trial = json.loads((path.parent.parent / "inbox" / path.name).read_text())
            assert trial["node"] == node and reply["result"]["worker"]["node"] == node
            served[trial["trial_id"]] = node
    assert set(served.values()) == {"node-a", "node-b"} and len(served) >= 4

def test_node_submitter_sees_finished_metric_tasks_without_the_api(use_prefect_server, tmp_path):
    """A metric task of the evaluating flow is done when its local future is. Its task-run state
    on the server arrives through the client's events, which can lag or never come (in CI the
    events client was bound to another API): polling the server for it waited forever."""
    import concurrent.futures as cf
    import contextvars
    import threading
    import uuid

    from prefect.futures import PrefectConcurrentFuture

    from evalsuite.node_session import NodeSessions, SessionTrial
    from evalsuite.trials import Trial
    from tasks.eval_tasks import FlowRunSessions, NodeSubmitter, _NodeRun

    finished: cf.Future = cf.Future()
    finished.set_result("score")
    metric = PrefectConcurrentFuture(task_run_id=uuid.uuid4(), wrapped_future=finished)   # unknown to the API
    running = Trial(trial_id="t-running", shards=[], backend="transformers", output_dir=str(tmp_path), node="node-a")
    sessions = NodeSessions(tmp_path / "sessions", ["node-a"])
    # a session still running its trial: unknown to the API, never final
    sessions.runs = FlowRunSessions({"node-a": _NodeRun(uuid.uuid4(), "unused", "a session")})
    trial = SessionTrial(running, tmp_path / "no-result-yet.json", sessions)
    submitter = NodeSubmitter(sessions, poll_s=0.05)
    got: list = []
    context = contextvars.copy_context()   # this test's Prefect settings (the server's API URL)
    waiter = threading.Thread(target=lambda: got.append(context.run(submitter.wait_first, [trial, metric])),
                              daemon=True)
    waiter.start()
    waiter.join(timeout=60)
    assert got == [metric], "wait_first did not return the finished metric task"
    assert metric.result() == "score"


def test_a_node_no_worker_serves_is_one_clear_error_and_its_session_run_is_cancelled(use_prefect_server, tmp_path):
    """No worker on a node's queue: the evaluation does not wait forever for that node's session,
    it fails naming the node and the queue to start a worker on, and the session run it created
    (which nothing would ever start or end) is cancelled."""
    from prefect import get_client

    from evalsuite.errors import TrialError
    from flows.deploy import ensure_work_pool
    from tasks.eval_tasks import node_sessions

    ensure_work_pool(POOL)
    deploy_node_work(POOL)
    created: list = []
    with pytest.raises(TrialError, match=r"session\(s\) on node-nobody did not get the model preloaded within 3 s.*"
                                         r"--work-queue node-nobody"):
        with node_sessions(["node-nobody"], "file:///nowhere", str(tmp_path / "shm"), tmp_path / "sessions",
                           slots=1, ready_timeout_s=3) as sessions:
            created.append(sessions)
    with get_client(sync_client=True) as client:
        session_runs = [r for r in client.read_flow_runs() if r.parameters.get("node") == "node-nobody"]
    assert len(session_runs) == 1 and session_runs[0].state.is_cancelled()
    assert not created   # never handed to the evaluation
