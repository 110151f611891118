"""The Prefect launcher's watcher load does not grow with the node count: the states of
all node-launch runs come from one filtered read (per 200 nodes) at most every poll_s."""

from __future__ import annotations

import threading

import pytest

from infra.launch import LaunchRequest, exit_code_path, local_node_launches
from tasks.launchers import PrefectJob

NODES = 64


@pytest.fixture
def requests_sent(monkeypatch):
    """HTTP requests this thread sends through Prefect's sync client."""
    from prefect.client.base import PrefectHttpxSyncClient

    sent: list[str] = []
    original = PrefectHttpxSyncClient.send
    me = threading.current_thread()

    def send(self, request, *args, **kwargs):
        if threading.current_thread() is me:
            sent.append(f"{request.method} {request.url.path}")
        return original(self, request, *args, **kwargs)

    monkeypatch.setattr(PrefectHttpxSyncClient, "send", send)
    return sent


def _job(tmp_path, poll_s: float) -> PrefectJob:
    from prefect import flow, get_client
    from prefect.states import Running

    @flow(name="node-launch-stand-in")
    def stand_in() -> None:
        pass

    names = [f"n{i:02d}" for i in range(NODES)]
    request = LaunchRequest("load", local_node_launches(names, 8, 29500), ["-c", "pass"], tmp_path / "run")
    ids = {}
    with get_client(sync_client=True) as client:
        for name in names:
            run = client.create_flow_run(stand_in, name=f"load-{name}")
            client.set_flow_run_state(run.id, Running(), force=True)
            ids[name] = run.id
    return PrefectJob(request, ids, poll_s=poll_s)


def test_one_read_per_interval_whatever_the_node_count(prefect_api, tmp_path, requests_sent, monkeypatch):
    from prefect import get_client
    from prefect.states import Failed

    job = _job(tmp_path, poll_s=3600)  # an interval longer than the test: every poll after the first is cached
    requests_sent.clear()
    for _ in range(20):
        assert set(job.poll().values()) == {None}
    reads = [r for r in requests_sent if "flow_runs" in r]
    assert reads == ["POST /api/flow_runs/filter"], requests_sent
    assert job.api_calls == 1

    # A node whose run failed after writing torchrun's exit code: seen on the next read.
    exit_code_path(job.request, "n07").parent.mkdir(parents=True, exist_ok=True)
    exit_code_path(job.request, "n07").write_text("3")
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(job.flow_run_ids["n07"], Failed(), force=True)
    job.poll_s = 0.0
    codes = job.poll()
    assert codes["n07"] == 3 and sum(c is None for c in codes.values()) == NODES - 1
    assert job.api_calls == 2

    # Beyond a page of runs, one read per page.
    monkeypatch.setattr("tasks.launchers.READ_PAGE", 30)
    requests_sent.clear()
    job.poll()
    assert [r for r in requests_sent if "flow_runs" in r] == ["POST /api/flow_runs/filter"] * 3
