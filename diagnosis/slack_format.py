"""Slack message for a diagnosis: root cause, evidence lines, action taken, link.

Formatting only; sending lives with the flows (``infra.notify``). ``slack_message``
returns an incoming-webhook payload (``text`` fallback + Block Kit ``blocks``);
``to_alert`` builds the ``infra.notify.Alert`` the flows send.
"""

from __future__ import annotations

from diagnosis.vocabulary import Diagnosis
from infra.notify import Alert

MAX_EVIDENCE_LINES = 8
MAX_LINE_CHARS = 300


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _severity(diagnosis: Diagnosis) -> str:
    if diagnosis.root_cause == "Unknown":
        return "error"
    return "warning" if diagnosis.restart_helps else "error"


def summary_fields(diagnosis: Diagnosis, action: str) -> dict[str, str]:
    fields = {
        "Root cause": f"{diagnosis.root_cause} ({diagnosis.kind})",
        "Restart helps": "yes" if diagnosis.restart_helps else "no",
        "Confidence": f"{diagnosis.confidence:.0%} via {diagnosis.source}"
        + (f" rule `{diagnosis.rule_name}`" if diagnosis.rule_name else ""),
        "Action taken": action,
    }
    if diagnosis.suspect_nodes:
        fields["Suspect nodes"] = ", ".join(diagnosis.suspect_nodes[:10])
    if diagnosis.suspect_ranks:
        fields["Suspect ranks"] = ", ".join(str(r) for r in diagnosis.suspect_ranks[:16])
    if diagnosis.mitigation:
        fields["Mitigation"] = diagnosis.mitigation
    return fields


def slack_message(
    diagnosis: Diagnosis, job_name: str, action: str, link: str | None = None
) -> dict:
    """Incoming-webhook payload describing ``diagnosis`` of ``job_name``."""
    title = f"{job_name}: {diagnosis.root_cause}"
    fields = summary_fields(diagnosis, action)
    evidence = [line[:MAX_LINE_CHARS] for line in diagnosis.culprit_lines[:MAX_EVIDENCE_LINES]]
    text_lines = [title] + [f"{k}: {v}" for k, v in fields.items()]
    if evidence:
        text_lines += ["Evidence:"] + [f"  {line}" for line in evidence]
    if link:
        text_lines.append(f"Details: {link}")
    blocks: list[dict] = [
        {"type": "header", "text": {"type": "plain_text", "text": title[:150]}},
        {
            "type": "section",
            "fields": [
                {"type": "mrkdwn", "text": f"*{_escape(k)}*\n{_escape(v)}"}
                for k, v in list(fields.items())[:10]
            ],
        },
    ]
    if evidence:
        body = "\n".join(_escape(line) for line in evidence)
        blocks.append({"type": "section", "text": {"type": "mrkdwn", "text": f"```{body[:2900]}```"}})
    if link:
        blocks.append({"type": "context", "elements": [{"type": "mrkdwn", "text": f"<{link}|details>"}]})
    return {"text": "\n".join(text_lines), "blocks": blocks}


def to_alert(diagnosis: Diagnosis, job_name: str, action: str, link: str | None = None):
    """The same content as an ``infra.notify.Alert``."""

    return Alert(
        title=f"{job_name}: {diagnosis.root_cause}",
        severity=_severity(diagnosis),
        fields=summary_fields(diagnosis, action),
        evidence=[line[:MAX_LINE_CHARS] for line in diagnosis.culprit_lines[:MAX_EVIDENCE_LINES]],
        link=link,
    )
