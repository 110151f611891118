"""One Slack path: Prefect's Slack webhook block (prefect-slack) carries the flows' alerts
and the crash automation's notification; `forgeflow deploy` creates it from
SLACK_WEBHOOK_URL or reuses a team's own block. The webhook is a real HTTP receiver
on 127.0.0.1; the blocks live on a real (test-harness) Prefect API."""

from __future__ import annotations

import pytest

from infra.notify import Alert
from tests.integration.flows.conftest import SlackReceiver


@pytest.fixture
def receivers(prefect_api, monkeypatch):
    from prefect.variables import Variable
    from prefect_slack import SlackWebhook

    from infra.notify import DEFAULT_SLACK_BLOCK, SLACK_BLOCK_VARIABLE

    monkeypatch.delenv("SLACK_WEBHOOK_URL", raising=False)
    ours, teams = SlackReceiver(), SlackReceiver()
    try:
        yield ours, teams
    finally:
        ours.close()
        teams.close()
        # the session's API is shared: leave no block behind for other tests' flows
        Variable.unset(SLACK_BLOCK_VARIABLE)
        for name in (DEFAULT_SLACK_BLOCK, "team-alerts"):
            try:
                SlackWebhook.delete(name)
            except Exception:
                pass


def _alert() -> Alert:
    return Alert("tiny failed at step 12: CUDAError", "error", {"action": "restart"},
                 evidence=["RuntimeError: CUDA error: an illegal memory access was encountered"])


def test_deploy_saves_the_block_from_the_env_and_flow_alerts_go_through_it(receivers, monkeypatch):
    from flows.deploy import build_automation, ensure_slack_block
    from tasks.pretrain_tasks import build_notifier

    ours, _ = receivers
    assert ensure_slack_block() is None  # nothing configured: no block, no automation
    monkeypatch.setenv("SLACK_WEBHOOK_URL", ours.url)
    name, block_id = ensure_slack_block()
    assert name == "forgeflow-slack"

    monkeypatch.delenv("SLACK_WEBHOOK_URL")  # a worker: only the server knows the webhook
    notifier = build_notifier()
    assert "Prefect block 'forgeflow-slack'" in notifier.target and "SECRET" not in notifier.target
    assert notifier.send(_alert()).ok
    (message,) = ours.messages
    assert "CUDAError" in message["text"] and "illegal memory access" in str(message["blocks"])

    # The automation notifies through the very same block document.
    (action,) = build_automation(block_id).actions
    assert action.block_document_id == block_id


def test_a_teams_existing_block_is_reused_not_overwritten(receivers, monkeypatch):
    from prefect_slack import SlackWebhook

    from flows.deploy import DeployError, ensure_slack_block
    from tasks.pretrain_tasks import build_notifier

    ours, teams = receivers
    team_block_id = SlackWebhook(url=teams.url).save("team-alerts")
    monkeypatch.setenv("SLACK_WEBHOOK_URL", ours.url)  # present, but the named block wins for the server
    assert ensure_slack_block("team-alerts") == ("team-alerts", team_block_id)
    assert SlackWebhook.load("team-alerts").url.get_secret_value() == teams.url

    monkeypatch.delenv("SLACK_WEBHOOK_URL")
    assert build_notifier().send(_alert()).ok
    assert len(teams.messages) == 1 and ours.messages == []
    # What the automation's SendNotification action calls on the server: the block's notify.
    SlackWebhook.load("team-alerts").notify("pretrain run crashed", subject="forgeflow")
    assert "pretrain run crashed" in teams.texts()[-1]

    with pytest.raises(DeployError, match="Slack Incoming Webhook"):
        ensure_slack_block("no-such-block")


def test_slack_webhook_url_works_without_a_server(monkeypatch):
    """The command line with no Prefect server: SLACK_WEBHOOK_URL alone reaches Slack."""
    from tasks.pretrain_tasks import build_notifier

    receiver = SlackReceiver()
    try:
        monkeypatch.setenv("SLACK_WEBHOOK_URL", receiver.url)
        notifier = build_notifier()
        assert notifier.target.endswith("(SLACK_WEBHOOK_URL)")
        assert notifier.send(_alert()).ok and "CUDAError" in receiver.texts()[0]
    finally:
        receiver.close()
