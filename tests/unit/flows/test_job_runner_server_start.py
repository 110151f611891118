"""The detached runner starts its temporary Prefect server holding the Prefect home's start lock
(two runners on a fresh home must not migrate its database at once), and none with a server set."""

from __future__ import annotations

import fcntl

import pytest
from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

from flows import job_runner


class FakeServer:
    starts: list[bool] = []  # whether the start lock was held by someone else at each start

    def start(self, timeout=None):
        with open(PREFECT_HOME.value() / job_runner.START_LOCK, "a") as other:
            try:
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                FakeServer.starts.append(True)
            else:
                FakeServer.starts.append(False)


@pytest.fixture
def fake_server(monkeypatch):
    import prefect.server.api.server as server

    FakeServer.starts = []
    monkeypatch.setattr(server, "SubprocessASGIServer", FakeServer)
    return FakeServer


def test_the_temporary_server_starts_under_the_homes_lock(fake_server, tmp_path):
    with temporary_settings(updates={PREFECT_API_URL: None, PREFECT_HOME: tmp_path / "home"}):
        job_runner.start_temporary_server()
    assert fake_server.starts == [True]


def test_no_temporary_server_with_a_server_configured(fake_server, tmp_path):
    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:1/api", PREFECT_HOME: tmp_path / "home"}):
        job_runner.start_temporary_server()
    assert fake_server.starts == []
