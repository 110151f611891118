"""Text forgeflow did not write (log lines, LLM answers) made safe to show.

A job's log is written by the job: whatever it printed reaches a person's terminal
(`forgeflow diagnose`), a markdown artifact in the Prefect UI and a Slack code block.

    printable(text)    drop what a terminal would act on instead of show: escape sequences
                       (CSI, OSC, DCS...), C0/C1 control characters (newline and tab stay),
                       and the bidirectional overrides that reorder what is shown
    fenced(text)       a markdown code block that ``text`` cannot close: its fence is longer
                       than any run of backticks inside
    slack_code(text)   the same for a Slack code block, whose fence is always three
                       backticks: runs of backticks in ``text`` are broken up instead
"""

from __future__ import annotations

import re

# ESC-started sequences, longest forms first: CSI (ESC [ ... final byte); the string
# commands OSC, DCS, SOS, PM, APC up to their terminator (BEL or ESC \), or the end of
# the line when unterminated; then two-byte and nF escapes (ESC, intermediates, final).
_ESCAPE = re.compile(
    r"\x1b\[[0-?]*[ -/]*[@-~]?"
    r"|\x1b[\]PX^_][^\x07\x1b\n]*(?:\x07|\x1b\\)?"
    r"|\x1b[ -/]*[0-~]?"
)
# C0 controls but tab and newline, DEL, C1 controls (U+009B is a CSI on some terminals),
# and the bidirectional embeddings, overrides and isolates ("Trojan Source").
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
_BACKTICK_RUN = re.compile(r"`+")
_ZERO_WIDTH_SPACE = "\u200b"


def printable(text: str) -> str:
    """``text`` without terminal escape sequences and control characters (newline and tab kept)."""
    return _CONTROL.sub("", _ESCAPE.sub("", text))


def fenced(text: str, info: str = "") -> str:
    """``text`` as a markdown (CommonMark/GFM) fenced code block it cannot end early:
    a closing fence must be at least as long as the opening one, so the fence is one
    backtick longer than the longest run in ``text`` (three at least)."""
    longest = max((len(run) for run in _BACKTICK_RUN.findall(text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{info}\n{text}\n{fence}"


def slack_code(text: str, max_chars: int = 3000) -> str:
    """``text`` as a Slack mrkdwn code block of at most ``max_chars`` characters (a section's
    text holds 3,000), ``text`` cut to fit: Slack's fence is always ```, so backticks next
    to each other in ``text`` (or at its ends, beside the fence) get a zero-width space
    between them."""
    text = text[: max_chars - 6]
    while len(block := _slack_block(text)) > max_chars:  # the spaces made it longer: cut by as much
        text = text[: len(text) - (len(block) - max_chars)]
    return block


def _slack_block(text: str) -> str:
    body = _BACKTICK_RUN.sub(lambda run: _ZERO_WIDTH_SPACE.join(run.group()), text)
    if body.startswith("`"):
        body = _ZERO_WIDTH_SPACE + body
    if body.endswith("`"):
        body += _ZERO_WIDTH_SPACE
    return f"```{body}```"
