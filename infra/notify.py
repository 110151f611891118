"""Alerts: Slack incoming webhooks, or printed and kept when no webhook is set.

One path to Slack: slack-sdk's `WebhookClient`. On a Prefect server the flows hand
in the client of Prefect's Slack webhook block (prefect-slack's `SlackWebhook`,
which `forgeflow deploy` creates or reuses and the crash automation notifies
through too); without a server the URL comes from SLACK_WEBHOOK_URL.

The webhook URL is a credential (anyone holding it can post to the channel), so
it never appears in a log line, an exception message or an artifact: errors name
the host only.

Sending never raises: a Slack outage must not break recovery. Every alert is
also returned as a `Delivery`, so the flow can keep an artifact of what it said.

`flow_run_url` is the Prefect UI page of a flow run, for an alert's `link` (shown as a
link in Slack and printed with the alert).

`notifier_for` decides where alerts go (SLACK_WEBHOOK_URL, else the Slack webhook
block a server holds, else the console); the lookup of the block on a Prefect
server is the flows' part (`tasks.pretrain_tasks.build_notifier`).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping
from urllib.parse import urlparse

from infra.untrusted_text import slack_code

Severity = Literal["info", "success", "warning", "error"]

# The Slack webhook block (prefect-slack's SlackWebhook) the flows alert through, and the
# Prefect Variable in which `forgeflow deploy` records it when it reuses a team's own block.
DEFAULT_SLACK_BLOCK = "forgeflow-slack"
SLACK_BLOCK_VARIABLE = "forgeflow_slack_block"
_EMOJI = {"info": ":information_source:", "success": ":white_check_mark:", "warning": ":warning:", "error": ":rotating_light:"}


@dataclass
class Alert:
    title: str
    severity: Severity = "info"
    fields: dict[str, str] = field(default_factory=dict)  # short key/value facts
    evidence: list[str] = field(default_factory=list)  # log lines, shown as code
    link: str | None = None

    def text(self) -> str:
        """Plain-text form: the Slack notification fallback and the printed form."""
        parts = [f"[{self.severity.upper()}] {self.title}"]
        parts += [f"{k}: {v}" for k, v in self.fields.items()]
        if self.evidence:
            parts.append("evidence:")
            parts += [f"  {line}" for line in self.evidence]
        if self.link:
            parts.append(f"link: {self.link}")
        return "\n".join(parts)

    def blocks(self) -> list[dict]:
        blocks: list[dict] = [
            {"type": "section", "text": {"type": "mrkdwn", "text": f"{_EMOJI[self.severity]} *{_escape(self.title)}*"}}
        ]
        if self.fields:
            blocks.append(
                {
                    "type": "section",
                    "fields": [
                        {"type": "mrkdwn", "text": f"*{_escape(k)}*\n{_escape(v)}"} for k, v in list(self.fields.items())[:10]
                    ],
                }
            )
        if self.evidence:
            # Slack reads <...> as a link or mention even in a code block: escape as everywhere
            body = "\n".join(_escape(line[:300]) for line in self.evidence[:12])
            blocks.append({"type": "section", "text": {"type": "mrkdwn", "text": slack_code(body)}})
        if self.link:
            blocks.append({"type": "context", "elements": [{"type": "mrkdwn", "text": f"<{self.link}|details>"}]})
        return blocks


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


@dataclass
class Delivery:
    alert: Alert
    channel: Literal["slack", "console"]
    ok: bool
    detail: str = ""


class Notifier:
    """Posts alerts to a Slack incoming webhook; prints them when none is configured.

    `webhook_url` (default: SLACK_WEBHOOK_URL), or `client`: a slack-sdk `WebhookClient`
    such as the one Prefect's Slack webhook block gives (`block.get_client(sync_client=True)`);
    `source` names where it came from in `target` (e.g. the block's name).
    """

    def __init__(self, webhook_url: str | None = None, timeout_s: float = 10.0, retries: int = 2,
                 *, client: Any = None, source: str = ""):
        if client is not None:
            webhook_url = getattr(client, "url", None) or ""
        self._webhook_url = webhook_url if webhook_url is not None else os.environ.get("SLACK_WEBHOOK_URL")
        self._client = client
        self._source = source
        self.timeout_s = timeout_s
        self.retries = retries
        self.sent: list[Delivery] = []

    @property
    def target(self) -> str:
        """Where alerts go, safe to print (host only, never the secret path)."""
        if not self._webhook_url:
            return "console"
        via = f" ({self._source})" if self._source else ""
        return f"slack webhook at {urlparse(self._webhook_url).netloc}{via}"

    def __repr__(self) -> str:  # never leak the URL through a repr in a log
        return f"Notifier(target={self.target!r})"

    def send(self, alert: Alert) -> Delivery:
        if not self._webhook_url:
            print(alert.text(), file=sys.stderr, flush=True)
            delivery = Delivery(alert, "console", True)
        else:
            delivery = self._post(alert)
            if not delivery.ok:  # still leave a trace where a person will look
                print(f"{alert.text()}\n(slack delivery failed: {delivery.detail})", file=sys.stderr, flush=True)
        self.sent.append(delivery)
        return delivery

    def _post(self, alert: Alert) -> Delivery:
        from slack_sdk.http_retry.builtin_handlers import ConnectionErrorRetryHandler, ServerErrorRetryHandler
        from slack_sdk.webhook import WebhookClient

        retry_handlers = [
            ConnectionErrorRetryHandler(max_retry_count=self.retries),
            ServerErrorRetryHandler(max_retry_count=self.retries),
        ]
        client = self._client or WebhookClient(self._webhook_url)
        # The block's client comes without retries and with slack-sdk's 30 s timeout:
        # the same bounded patience either way, so a Slack outage cannot stall recovery.
        client.timeout = int(max(1, self.timeout_s))
        client.retry_handlers = retry_handlers
        try:
            response = client.send(text=alert.text(), blocks=alert.blocks())
        except Exception as e:  # network errors of any kind: report, never raise
            return Delivery(alert, "slack", False, f"{type(e).__name__} posting to {self.target}")
        if response.status_code == 200:
            return Delivery(alert, "slack", True)
        return Delivery(alert, "slack", False, f"HTTP {response.status_code} from {self.target}: {response.body[:200]}")


def flow_run_url(flow_run_id: object, environ: Mapping[str, str] | None = None) -> str | None:
    """The Prefect UI page of flow run `flow_run_id`: PREFECT_UI_URL, else PREFECT_API_URL less
    its `/api` (a Prefect server serves its UI at the API's root), then `/runs/flow-run/ID`.
    None without a run id, or without either setting (Prefect's ephemeral API has no UI; Prefect
    Cloud's API URL does not end in `/api`: set PREFECT_UI_URL there)."""
    env = os.environ if environ is None else environ
    if not flow_run_id:
        return None
    base = (env.get("PREFECT_UI_URL") or "").strip().rstrip("/")
    if not base:
        api = (env.get("PREFECT_API_URL") or "").strip().rstrip("/")
        if not api.endswith("/api"):
            return None
        base = api[: -len("/api")]
    return f"{base}/runs/flow-run/{flow_run_id}"


def slack_block_name(recorded: str | None) -> str:
    """The Slack webhook block to alert through: the one `forgeflow deploy` recorded, else forgeflow-slack."""
    return str(recorded or DEFAULT_SLACK_BLOCK)


def notifier_for(environ: Mapping[str, str], find_block: Callable[[], tuple[str, Any] | None]) -> Notifier:
    """Where alerts go, first found: SLACK_WEBHOOK_URL (the command line without a server); the
    Slack webhook block `find_block` returns as (its name, its slack-sdk WebhookClient), asked only
    then (what `forgeflow deploy` set up, and what the crash automation uses too); the console
    (alerts printed and kept)."""
    if environ.get("SLACK_WEBHOOK_URL"):
        return Notifier(environ["SLACK_WEBHOOK_URL"], source="SLACK_WEBHOOK_URL")
    found = find_block()
    if found is None:
        return Notifier("")
    name, client = found
    return Notifier(client=client, source=f"Prefect block {name!r}")
