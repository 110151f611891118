"""Fast checks of what the agents accept from an LLM (no servers, no models)."""

from __future__ import annotations

import pytest

from diagnosis.failure_agent import DiagnosisReply, _verified_culprits
from diagnosis.proposals import generalise_line
from diagnosis.llm import MalformedReply, parse_json_reply
from diagnosis.log_agent import FilterReply, segment_prompt
from diagnosis.failure_memory import PastFailure, make_key, retrieval_vote
from diagnosis.proposals import diagnosis_rule_problem, filter_rule_problem
from diagnosis.multi_regex import compile_linear
from diagnosis.vocabulary import Diagnosis

SEGMENT = [f"[rank{r}]: iteration {s} | consumed samples: {s * 512} | lm loss: 3.2" for s in range(10) for r in range(4)]
ERRORS = ["[rank2]: RuntimeError: CUDA error: an illegal memory access was encountered"]


@pytest.mark.parametrize(
    "pattern, reason",
    [
        (r"^\[rank\d+\]: iteration \d+ \| consumed samples", None),
        (".*", "catch-all"),
        ("", "catch-all"),  # matches the empty line
        (r"\w", "catch-all"),
        (r"^\[rank\d+\]: ", "would drop an error line"),
        (r"Traceback", "would drop an error line"),  # a canonical error line, not in this segment
        (r"(a+)+$", "catch-all"),  # linear in RE2; matches random lines ending in "a"
        (r"^(\w+) \1", "does not compile in the linear-time engine"),
        (r"(?<=rank)\d", "does not compile in the linear-time engine"),
        (r"iteration 3 \|", "covers 4/40 lines"),
        (42, "not a string"),
    ],
)
def test_filter_rule_vetting(pattern, reason):
    problem = filter_rule_problem(pattern, SEGMENT, ERRORS, min_share=0.2)
    if reason is None:
        assert problem is None
    else:
        assert problem is not None and problem.startswith(reason), problem


def test_diagnosis_rule_vetting():
    culprit = ["[rank5]: tokenizer vocabulary mismatch: checkpoint has 32000 tokens, data has 50257"]
    assert diagnosis_rule_problem(r"tokenizer vocabulary mismatch", culprit, SEGMENT) is None
    assert "none of the culprit" in diagnosis_rule_problem(r"vocab size", culprit, SEGMENT)
    assert "routine line" in diagnosis_rule_problem(r"\d+ \| lm loss|vocabulary", culprit, SEGMENT)
    assert diagnosis_rule_problem(r".*", culprit, SEGMENT).startswith("catch-all")


@pytest.mark.parametrize(
    "line",
    [
        "[rank3]: [2026-11-22 07:41:02,123] tokenizer vocabulary mismatch: checkpoint has 32000 tokens",
        "[x8 ranks 0-7] [rank0]:E1122 07:41:02.123456 2381 store.cpp:12] lease 0x7f3a expired after 30.5 s (host node-a03)",
        "weird (line) with [brackets] and $pecial * chars + 7",
    ],
)
def test_generalised_culprit_line_is_a_safe_rule_that_matches_it(line):
    pattern = generalise_line(line)
    assert compile_linear(pattern).search(line)
    assert diagnosis_rule_problem(pattern, [line], SEGMENT) is None
    assert "2026" not in pattern and "[rank" not in pattern  # where/when is not what


def test_llm_diagnosis_must_fit_the_vocabulary():
    ok = parse_json_reply('{"root_cause": "ECCError", "kind": "infrastructure", "restart_helps": true}', DiagnosisReply)
    assert ok.root_cause == "ECCError" and ok.culprit_lines == []
    for bad in (
        '{"root_cause": "Meltdown", "kind": "infrastructure", "restart_helps": true}',
        '{"root_cause": "ECCError", "kind": "script", "restart_helps": true}',
        '{"root_cause": "ECCError", "kind": "infrastructure", "restart_helps": "yes"}',
        '{"root_cause": "ECCError", "kind": "infrastructure", "restart_helps": true, "confidence": 7}',
        '{"filters": []}',
    ):
        with pytest.raises(MalformedReply):
            parse_json_reply(bad, DiagnosisReply)


def test_filter_reply_shape():
    assert parse_json_reply('{"filters": [{"regex": "^a"}]}', FilterReply).filters[0].regex == "^a"
    with pytest.raises(MalformedReply, match="filters"):
        parse_json_reply('{"rules": ["^a"]}', FilterReply)
    with pytest.raises(MalformedReply):
        parse_json_reply('{"filters": [{"regex": ""}]}', FilterReply)


def test_culprit_lines_must_be_in_the_log():
    lines = ["[x8 ranks 0-7] [rank0]:KeyError: 'attention_mask'", "routine"]
    assert _verified_culprits(["KeyError: 'attention_mask'"], lines) == [lines[0]]
    assert _verified_culprits(["KeyError: 'labels'", "x"], lines) == []


def test_segment_prompt_shows_each_line_shape_once_with_counts():
    prompt = segment_prompt(SEGMENT, max_lines=50, max_chars=200)
    assert prompt.count("consumed samples") == 1 and "[x40]" in prompt


def test_retrieval_vote_prefers_the_much_closer_failure_over_a_crowd():
    def past(cause, kind, restart, similarity):
        return PastFailure("id", "x", Diagnosis(cause, kind, restart), similarity=similarity)

    neighbours = [
        past("Hang", "training", True, 0.90),
        past("LossSpike", "training", True, 0.70),
        past("LossSpike", "training", True, 0.69),
        past("LossSpike", "training", True, 0.68),
    ]
    vote = retrieval_vote(neighbours)
    assert (vote.root_cause, vote.source) == ("Hang", "retrieval") and vote.confidence <= 0.5
    close_crowd = [past("KeyError", "script", False, 0.80)] + [past("TypeError", "script", False, 0.79)] * 3
    assert retrieval_vote(close_crowd).root_cause == "TypeError"


def test_retrieval_key_drops_counts_prefixes_and_numbers():
    key = make_key(["[x8 ranks 0-7] [rank3]:KeyError: 'layer_17'", "[rank1]:KeyError: 'layer_9'", "other line 5"])
    assert key.splitlines() == ["KeyError: 'layer_#'", "other line #"]


def test_a_rule_and_an_agent_reply_refuse_an_unknown_cause_alike():
    # one check (vocabulary.RootCause) behind both models: the same message names the causes there are
    from pydantic import ValidationError

    from diagnosis.rules import DiagnosisRule

    with pytest.raises(ValidationError, match="unknown root_cause 'Meltdown'; use one of: NVLinkError") as rule:
        DiagnosisRule(name="r", pattern="x", root_cause="Meltdown", restart_helps=False)
    with pytest.raises(ValidationError, match="unknown root_cause 'Meltdown'; use one of: NVLinkError") as reply:
        DiagnosisReply(root_cause="Meltdown", kind="infrastructure", restart_helps=True)
    assert rule.value.errors()[0]["msg"] == reply.value.errors()[0]["msg"]
