"""The alert for a diagnosis: root cause, how it was found, suspects, evidence, action, link.

Formatting only; sending lives with the flows (``infra.notify``). ``to_alert`` builds the
``infra.notify.Alert`` the flows send (Slack blocks, or printed); ``summary_fields`` are its
short facts, which the failure artifact (``diagnosis.report``) shows too.
"""

from __future__ import annotations

from diagnosis.vocabulary import Diagnosis
from infra.notify import Alert
from infra.untrusted_text import printable

MAX_EVIDENCE_LINES = 8
MAX_LINE_CHARS = 300


def _severity(diagnosis: Diagnosis) -> str:
    if diagnosis.root_cause == "Unknown":
        return "error"
    return "warning" if diagnosis.restart_helps else "error"


def found_by(diagnosis: Diagnosis) -> str:
    """How sure, and who said so: '90% (rule: cuda-error)', '72% (retrieval)', '10% (no rule)'."""
    who = "no rule" if diagnosis.source == "none" else diagnosis.source
    if diagnosis.rule_name:
        who = f"{who}: {diagnosis.rule_name}"
    return f"{diagnosis.confidence:.0%} ({who})"


def suspect_ranks(diagnosis: Diagnosis, limit: int = 16) -> str:
    """Global ranks, then the local ranks whose global rank is unknown: '1, 4' or
    'local rank 0 on node-b'; empty when the culprit lines name none."""
    parts = [str(r) for r in diagnosis.suspect_ranks[:limit]]
    for node, ranks in diagnosis.suspect_local_ranks.items():
        word = "rank" if len(ranks) == 1 else "ranks"
        parts.append(f"local {word} {', '.join(map(str, ranks[:limit]))} on {node}")
    return ", ".join(parts)


def summary_fields(diagnosis: Diagnosis, action: str) -> dict[str, str]:
    fields = {
        "Root cause": f"{diagnosis.root_cause} ({diagnosis.kind})",
        "Restart helps": "yes" if diagnosis.restart_helps else "no",
        "Confidence": found_by(diagnosis),
        "Action taken": action,
    }
    if diagnosis.suspect_nodes:
        fields["Suspect nodes"] = ", ".join(diagnosis.suspect_nodes[:10])
    ranks = suspect_ranks(diagnosis)
    if ranks:
        fields["Suspect ranks"] = ranks
    if diagnosis.mitigation:
        fields["Mitigation"] = printable(diagnosis.mitigation)
    return fields


def evidence_lines(diagnosis: Diagnosis) -> list[str]:
    """The first culprit lines, cut short, without the terminal escape sequences a log may hold
    (the alert is printed when no Slack webhook is set)."""
    return [printable(line)[:MAX_LINE_CHARS] for line in diagnosis.culprit_lines[:MAX_EVIDENCE_LINES]]


def to_alert(diagnosis: Diagnosis, job_name: str, action: str, link: str | None = None) -> Alert:
    """The diagnosis of a failure of ``job_name`` and the ``action`` taken, as an alert;
    ``link``: where to read more (the flow run: ``infra.notify.flow_run_url``)."""
    return Alert(
        title=f"{job_name}: {diagnosis.root_cause}",
        severity=_severity(diagnosis),
        fields=summary_fields(diagnosis, action),
        evidence=evidence_lines(diagnosis),
        link=link,
    )
