"""The failure artifact: short facts in a narrow table, the long texts as paragraphs below."""

from __future__ import annotations

import re

from diagnosis.recovery import FailedAttempt
from diagnosis.report import failure_markdown
from diagnosis.vocabulary import Diagnosis

ACTION = ("node check, cordon faulty nodes, re-place and restart — node check: faulty=['node-b'] "
          "stragglers=- unresolved=- healthy=1; cordoned ['node-b'], re-placed on ['node-a']")


def _failure(action: str = ACTION) -> FailedAttempt:
    return FailedAttempt(0, "failed", 12, "CUDAError", "infrastructure", "rule", action,
                         "CUDAError points at hardware or interconnect", 3.4, 0.0, 0.0, 0.0)


def _diagnosis() -> Diagnosis:
    return Diagnosis("CUDAError", "infrastructure", True, confidence=0.9, rule_name="cuda-error",
                     suspect_nodes=["node-b"], suspect_ranks=[1], mitigation="check the GPU | cordon it",
                     culprit_lines=["[default0]:[rank1]: torch.AcceleratorError: CUDA error: an illegal "
                                    "memory access was encountered"])


def test_the_table_holds_only_short_facts_and_the_action_is_a_paragraph():
    markdown = failure_markdown("two-nodes", _diagnosis(), _failure(), suggestion="")
    rows = [line for line in markdown.splitlines() if line.startswith("|")]
    assert rows[0] == "| root cause | CUDAError (infrastructure) |" and rows[1] == "|---|---|"
    assert all(len(re.split(r"(?<!\\)\|", row)) == 4 for row in rows)  # two columns in every row
    assert max(len(row) for row in rows) < 60  # nothing the artifact's width cuts off
    assert "| confidence | 90% (rule: cuda-error) |" in rows
    assert "| suspect nodes | node-b |" in rows and "| suspect ranks | 1 |" in rows
    assert f"**Action:** {ACTION}" in markdown  # whole, outside the table
    assert "**Why:** CUDAError points at hardware or interconnect" in markdown
    assert "**Mitigation:** check the GPU | cordon it" in markdown
    assert "```\n[default0]:[rank1]: torch.AcceleratorError" in markdown


def test_a_pipe_in_a_fact_does_not_split_its_cell():
    diagnosis = _diagnosis()
    diagnosis.suspect_nodes = ["a|b"]
    markdown = failure_markdown("j", diagnosis, _failure(), suggestion="use 8 GPUs")
    assert "| suspect nodes | a\\|b |" in markdown and "**Suggestion:** use 8 GPUs" in markdown


def test_log_text_cannot_close_the_culprit_block_or_reach_a_terminal():
    from markdown_it import MarkdownIt

    diagnosis = _diagnosis()
    diagnosis.culprit_lines = ["```", "# Injected heading \x1b]8;;http://evil\x1b\\[link]\x1b]8;;\x1b\\", "~~~~", "````"]
    diagnosis.mitigation = "cordon it\x1b[2J"
    markdown = failure_markdown("j", diagnosis, _failure())
    assert "\x1b" not in markdown and "**Mitigation:** cordon it\n" in markdown
    tokens = MarkdownIt("commonmark").parse(markdown)
    assert not any(t.type == "heading_open" and t.markup == "#" for t in tokens)  # the log's heading stays code
    code = [t.content for t in tokens if t.type == "fence"]
    assert code == ["```\n# Injected heading [link]\n~~~~\n````\n"]
