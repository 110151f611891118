"""A Prefect server behind its API auth string (PREFECT_SERVER_API_AUTH_STRING): a request
without the credentials is refused, and forgeflow's own client side (`forgeflow deploy`, every
flow and worker) works once PREFECT_API_AUTH_STRING is set - the README's Security section."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from testing.prefect_server import LocalPrefectServer

AUTH = "forgeflow:correct-horse-battery"


@pytest.fixture
def guarded_server(tmp_path, repo_root):
    server = LocalPrefectServer(tmp_path / "prefect-home", repo_root,
                                settings={"PREFECT_SERVER_API_AUTH_STRING": AUTH})
    yield server
    server.stop()


def _get(url: str, auth: str | None) -> int:
    request = urllib.request.Request(url, data=b"{}", method="POST", headers={"Content-Type": "application/json"})
    if auth:
        request.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status
    except urllib.error.HTTPError as e:
        return e.code


def test_no_credentials_no_api_and_forgeflow_deploys_with_them(guarded_server, tmp_path):
    flows = guarded_server.url + "/flows/filter"
    assert _get(flows, None) == 401
    assert _get(flows, "forgeflow:wrong") == 401
    assert _get(flows, AUTH) == 200

    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API_AUTH")}
    env.update(PREFECT_API_URL=guarded_server.url, FORGEFLOW_STATE_DIR=str(tmp_path / "state"),
               FORGEFLOW_POOL="auth-test")
    deploy = [sys.executable, "-m", "flows.cli", "deploy", "--pool", "auth-test", "--json"]
    refused = subprocess.run(deploy, env=env, capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0 and "401" in refused.stdout + refused.stderr
    done = subprocess.run(deploy, env={**env, "PREFECT_API_AUTH_STRING": AUTH}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "pretrain/pretrain" in done.stdout
