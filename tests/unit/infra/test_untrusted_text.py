"""Log and LLM text made safe to show: no terminal escapes, no fence it can close."""

from __future__ import annotations

import re

import pytest
from markdown_it import MarkdownIt

from infra.untrusted_text import fenced, printable, slack_code

HOSTILE = [
    "```\n# not code any more\n```",
    "````\nfour\n",
    "a line ending in a backtick`",
    "`" * 9 + " nine",
    "~~~\ntilde fence\n~~~",
]


@pytest.mark.parametrize(("raw", "shown"), [
    ("\x1b[31mred\x1b[0m", "red"),                                         # SGR colour
    ("a\x1b[2J\x1b[Hb", "ab"),                                              # clear screen, cursor home
    ("x\x1b]0;new title\x07y", "xy"),                                       # OSC window title, BEL-terminated
    ("\x1b]8;;http://evil\x1b\\click\x1b]8;;\x1b\\", "click"),              # OSC 8 hyperlink, ST-terminated
    ("\x1b]52;c;cHduZWQ=\x07copied", "copied"),                             # OSC 52: write the clipboard
    ("q\x1bPdevice control\x1b\\r", "qr"),                                  # DCS
    ("\x1b(0box\x1b7\x1b8", "box"),                                         # charset, save/restore cursor
    ("good\rbad\bX\x00\x07\x7f", "goodbadX"),                               # CR overwrite, backspace, NUL, BEL, DEL
    ("\x9b2J c1", "2J c1"),                                                 # the 8-bit CSI
    ("user\u202etxt.exe", "usertxt.exe"),                                   # right-to-left override
    ("unterminated \x1b]0;title", "unterminated "),
    ("dangling\x1b", "dangling"),
    ("tab\tand\nnewline stay", "tab\tand\nnewline stay"),
])
def test_printable_drops_what_a_terminal_would_act_on(raw, shown):
    assert printable(raw) == shown


@pytest.mark.parametrize("text", HOSTILE)
def test_a_fenced_block_holds_all_of_its_text(text):
    tokens = MarkdownIt("commonmark").parse("before\n\n" + fenced(text) + "\n\nafter")
    blocks = [t for t in tokens if t.type == "fence"]
    assert len(blocks) == 1 and blocks[0].content == text + "\n"
    assert [t.content for t in tokens if t.type == "inline"] == ["before", "after"]


def test_a_fence_is_three_backticks_when_the_text_has_none_and_keeps_its_info():
    assert fenced('{"a": 1}', "json") == '```json\n{"a": 1}\n```'


@pytest.mark.parametrize("text", HOSTILE)
def test_a_slack_code_block_has_no_fence_inside(text):
    block = slack_code(text)
    assert block.startswith("```") and block.endswith("```")
    body = block[3:-3]
    assert not re.search("``", body) and not body.startswith("`") and not body.endswith("`")
    assert body.replace("\u200b", "") == text


def test_a_slack_code_block_fits_its_limit_whatever_it_holds():
    assert len(slack_code("`" * 5000)) <= 3000 and len(slack_code("x" * 5000)) == 3000
    assert len(slack_code("x" * 5000, max_chars=100)) <= 100
