"""What one node's torchrun (and its ranks) inherit: infra.launch.node_env."""

from __future__ import annotations

from pathlib import Path

from infra.launch import LaunchRequest, local_node_launches, node_env


def _env(monkeypatch, **environ):
    for name in ("OMP_WAIT_POLICY", "FORGEFLOW_DB_URL", "SLACK_WEBHOOK_URL"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    (node,) = local_node_launches(["node-a"], 1, 29500)
    request = LaunchRequest("job", [node], ["-m", "training.train", "job.json"], Path("/tmp/run"),
                            env={"FORGEFLOW_FAULT": "oom_kill@6"})
    return node_env(node, request)


def test_idle_openmp_threads_sleep_unless_the_launcher_says_otherwise(monkeypatch):
    assert _env(monkeypatch)["OMP_WAIT_POLICY"] == "PASSIVE"
    assert _env(monkeypatch, OMP_WAIT_POLICY="ACTIVE")["OMP_WAIT_POLICY"] == "ACTIVE"


def test_the_node_gets_the_requests_env_and_its_name_and_none_of_the_flows_secrets(monkeypatch):
    env = _env(monkeypatch, FORGEFLOW_DB_URL="postgresql://u:secret@db/x", SLACK_WEBHOOK_URL="https://hooks/x")
    assert env["FORGEFLOW_FAULT"] == "oom_kill@6" and env["FORGEFLOW_NODE_NAME"] == "node-a"
    assert "FORGEFLOW_DB_URL" not in env and "SLACK_WEBHOOK_URL" not in env
