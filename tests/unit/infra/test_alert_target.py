"""Where alerts go (infra.notify.notifier_for): decided without Prefect, the block lookup handed in."""

from __future__ import annotations

from slack_sdk.webhook import WebhookClient

from infra.notify import DEFAULT_SLACK_BLOCK, notifier_for, slack_block_name

URL = "https://hooks.slack.example/services/T0/B0/secret"


def test_the_environment_variable_wins_and_the_server_is_not_asked():
    asked = []
    notifier = notifier_for({"SLACK_WEBHOOK_URL": URL}, lambda: asked.append(1))
    assert notifier.target == "slack webhook at hooks.slack.example (SLACK_WEBHOOK_URL)"
    assert asked == []
    assert "secret" not in repr(notifier)


def test_the_servers_block_next_then_the_console():
    block = notifier_for({}, lambda: ("team-alerts", WebhookClient(URL)))
    assert block.target == "slack webhook at hooks.slack.example (Prefect block 'team-alerts')"
    assert notifier_for({"SLACK_WEBHOOK_URL": ""}, lambda: None).target == "console"


def test_the_block_name_is_the_recorded_one_else_the_default():
    assert slack_block_name("team-alerts") == "team-alerts"
    assert slack_block_name(None) == slack_block_name("") == DEFAULT_SLACK_BLOCK == "forgeflow-slack"
