"""What a person reads about one failed attempt in the Prefect UI: the failure artifact.

``failure_markdown`` keeps its table to short facts (root cause, how sure, suspects), so
it fits the artifact's width; the long texts (the action taken, why, the suggestion and
the mitigation) are paragraphs below it, which wrap, and the culprit lines a code block
(log text: its escape sequences dropped, in a fence it cannot close: ``infra.untrusted_text``).
The same facts as the Slack alert (``diagnosis.slack_format``).
"""

from __future__ import annotations

from diagnosis.recovery import FailedAttempt
from diagnosis.slack_format import MAX_LINE_CHARS, found_by, suspect_ranks
from diagnosis.vocabulary import Diagnosis
from infra.untrusted_text import fenced, printable

MAX_EVIDENCE_LINES = 10


def _cell(text: str) -> str:
    """A table cell: one line, its pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def failure_markdown(job: str, diagnosis: Diagnosis, failure: FailedAttempt, suggestion: str = "") -> str:
    """The failure artifact of attempt ``failure.attempt`` of ``job``: a two-column table of
    short facts (the root cause its header), then the action, the reason, the suggestion and the culprit lines."""
    facts = {
        "root cause": f"{diagnosis.root_cause} ({diagnosis.kind})",
        "restart helps": "yes" if diagnosis.restart_helps else "no",
        "confidence": found_by(diagnosis),
        "watcher saw": f"{failure.status} after {failure.seconds_to_detect:g} s",
    }
    if diagnosis.suspect_nodes:
        facts["suspect nodes"] = ", ".join(diagnosis.suspect_nodes[:10])
    ranks = suspect_ranks(diagnosis)
    if ranks:
        facts["suspect ranks"] = ranks
    rows = [f"| {name} | {_cell(value)} |" for name, value in facts.items()]
    # the root cause is the table's header row: the fact a person looks for first
    lines = [f"## {job}: attempt {failure.attempt} failed at step {failure.step}", "",
             rows[0], "|---|---|", *rows[1:]]
    lines += ["", f"**Action:** {failure.action}", "", f"**Why:** {failure.reason}", ""]
    if suggestion:
        lines += [f"**Suggestion:** {suggestion}", ""]
    if diagnosis.mitigation:
        lines += [f"**Mitigation:** {printable(diagnosis.mitigation)}", ""]
    evidence = [printable(line)[:MAX_LINE_CHARS] for line in diagnosis.culprit_lines[:MAX_EVIDENCE_LINES]]
    if evidence:
        lines += ["**Culprit lines:**", "", fenced("\n".join(evidence))]
    return "\n".join(lines).rstrip() + "\n"
