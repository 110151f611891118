"""The log agent against a real OpenAI-compatible HTTP server that the test scripts.

Every scripted misbehaviour (disagreement, malformed JSON, unsafe or over-broad
regexes, timeouts, HTTP 500) must end in a clear result: nothing hangs, and nothing
that could hide an error line is adopted.
"""

from __future__ import annotations

import json

import pytest

from diagnosis.llm import ChatLLM
from diagnosis.log_agent import LogAgent, LogAgentConfig
from diagnosis.signals import has_error_keyword
from scripted_llm_server import Reply

METRIC = r"^\[rank\d+\]: iteration\s+\d+/\s*\d+ \| consumed samples"
NCCL_INFO = r"^[\w.-]+:\d+:\d+ \[\d+\] NCCL INFO "
WARNING = r"UserWarning: TypedStorage is deprecated"
BOMB_LINE = "a" * 40 + "!"  # `(a+)+$` backtracks exponentially on this in Python's re
ERROR_LINE = "[rank3]: RuntimeError: CUDA error: an illegal memory access was encountered"


def routine_segment() -> list[str]:
    lines = []
    for step in range(1, 9):
        for rank in range(8):
            lines.append(
                f"[rank{rank}]: iteration {step:>6}/  100000 | consumed samples: {step * 512:>9} "
                f"| elapsed time per iteration (ms): {812.4 + rank:.1f} | learning rate: 1.000E-04 "
                f"| lm loss: {3.2 - step * 0.01:.6E} | grad norm: 0.512 |"
            )
        lines.append(f"node-a0{step % 4}:2281:2401 [{step % 8}] NCCL INFO Channel 0{step % 4}/32 : 0[0] -> 1[1] via P2P/CUMEM")
        lines.append(
            "/opt/conda/lib/python3.11/site-packages/torch/_utils.py:831: UserWarning: TypedStorage is "
            "deprecated. It will be removed in the future and UntypedStorage will be the only storage class."
        )
    lines.insert(40, ERROR_LINE)
    lines.append(BOMB_LINE)
    return lines


def filters_reply(*regexes: str, error_lines: tuple[str, ...] = ()) -> str:
    payload = {"filters": [{"regex": r, "description": "routine"} for r in regexes], "error_lines": list(error_lines)}
    return json.dumps(payload)


def make_agent(llm_config, runs: int = 5) -> LogAgent:
    return LogAgent(ChatLLM(llm_config), is_error_line=has_error_keyword, config=LogAgentConfig(runs=runs))


def test_majority_regexes_are_adopted_minority_rejected(llm_server, llm_config):
    llm_server.script(
        [filters_reply(METRIC, NCCL_INFO)] * 3
        + [f"```json\n{filters_reply(METRIC, WARNING)}\n```"] * 2
    )
    result = make_agent(llm_config).propose_filters(routine_segment())

    adopted = {a.regex: a for a in result.adopted}
    assert set(adopted) == {METRIC, NCCL_INFO}
    assert adopted[METRIC].votes == 5 and adopted[NCCL_INFO].votes == 3
    assert adopted[METRIC].share > 0.5
    minority = {r.regex: r.reason for r in result.rejected}
    assert "majority" in minority[WARNING]
    assert result.runs_asked == result.runs_answered == 5
    assert len(llm_server.requests) == 5 and llm_server.unscripted == 0
    # the prompt shows the segment, one example per line shape
    assert "NCCL INFO Channel" in llm_server.requests[0].text


def test_disagreeing_runs_adopt_nothing(llm_server, llm_config):
    candidates = [METRIC, NCCL_INFO, WARNING, r"consumed samples", r"^node-a\d+:"]
    llm_server.script([filters_reply(c) for c in candidates])
    result = make_agent(llm_config).propose_filters(routine_segment())
    assert result.adopted == []
    assert {r.regex for r in result.rejected} == set(candidates)
    assert all("majority needs 3" in r.reason for r in result.rejected)


def test_malformed_replies_are_counted_not_fatal(llm_server, llm_config):
    llm_server.script(
        [
            "Sure! Here are some rules: METRIC lines",  # no JSON at all
            '{"filters": "^\\\\[rank"}',  # JSON of the wrong shape
            filters_reply(METRIC),
            "```json\n" + filters_reply(METRIC) + "\n```",
            "Here you go:\n" + filters_reply(METRIC) + "\nHope this helps.",
        ]
    )
    llm = ChatLLM(llm_config)
    agent = LogAgent(llm, is_error_line=has_error_keyword, config=LogAgentConfig(runs=5))
    result = agent.propose_filters(routine_segment())
    assert [a.regex for a in result.adopted] == [METRIC]
    assert result.runs_answered == 3 and result.runs_failed == 2
    assert llm.stats.malformed == 2 and llm.stats.replies == 5
    assert any("no JSON" in f for f in result.failures)
    assert any("does not fit FilterReply" in f for f in result.failures)


def test_all_malformed_stops_once_majority_is_out_of_reach(llm_server, llm_config):
    llm_server.respond_with(lambda request: '{"filters": [{"regex": 42}]')  # truncated JSON
    result = make_agent(llm_config).propose_filters(routine_segment())
    assert result.adopted == [] and result.rejected == []
    # with 5 runs a majority needs 3: after 3 failures no regex can reach it
    assert result.runs_asked == 3 and len(llm_server.requests) == 3


@pytest.mark.timeout(60)
def test_catastrophic_backtracking_regex_cannot_hang(llm_server, llm_config):
    segment = routine_segment() + [BOMB_LINE] * 20
    llm_server.script([filters_reply("(a+)+$", METRIC)] * 5)
    result = make_agent(llm_config).propose_filters(segment)
    # RE2/Hyperscan evaluate it in linear time (Python's re would not return);
    # it matches any line ending in "a", so vetting refuses it
    assert [a.regex for a in result.adopted] == [METRIC]
    (rejected,) = [r for r in result.rejected if r.regex == "(a+)+$"]
    assert rejected.reason.startswith("catch-all"), rejected.reason


def test_catch_all_and_error_dropping_regexes_are_rejected(llm_server, llm_config):
    over_broad = [".*", r"\S", r"^.{0,400}$", r"[a-z]"]
    drops_errors = [r"^\[rank\d+\]: ", r"CUDA", r"illegal memory"]
    llm_server.script([filters_reply(*over_broad, *drops_errors, NCCL_INFO)] * 5)
    result = make_agent(llm_config).propose_filters(routine_segment())
    assert [a.regex for a in result.adopted] == [NCCL_INFO]
    reasons = {r.regex: r.reason for r in result.rejected}
    for regex in over_broad:
        assert reasons[regex].startswith("catch-all"), (regex, reasons[regex])
    for regex in drops_errors:
        assert reasons[regex].startswith("would drop an error line"), (regex, reasons[regex])


def test_regex_outside_linear_subset_is_rejected(llm_server, llm_config):
    backreference = r"^(\w+) \1$"
    lookahead = r"^(?=\[rank)\[rank\d+\]: iteration"
    llm_server.script([filters_reply(backreference, lookahead)] * 5)
    result = make_agent(llm_config).propose_filters(routine_segment())
    assert result.adopted == []
    reasons = {r.regex: r.reason for r in result.rejected}
    assert "linear-time engine" in reasons[backreference]
    assert "linear-time engine" in reasons[lookahead]


def test_error_lines_found_by_the_agent_are_verified_and_protected(llm_server, llm_config):
    silent_error = "[rank5]: step 4 skipped: gradient overflow detected in 3 buckets"  # no error keyword
    segment = routine_segment() + [silent_error] * 8
    hallucinated = "[rank9]: RuntimeError: something that is not in the log"
    skipped = r"step \d+ skipped: gradient overflow"
    llm_server.script([filters_reply(skipped, METRIC, error_lines=(silent_error, hallucinated))] * 5)
    result = make_agent(llm_config).propose_filters(segment)
    assert result.error_lines == [silent_error]
    assert [a.regex for a in result.adopted] == [METRIC]
    (rejected,) = [r for r in result.rejected if r.regex == skipped]
    assert "would drop an error line" in rejected.reason


def test_timeouts_give_up_after_bounded_retries(llm_server, llm_config):
    config = llm_config.model_copy(update={"timeout_s": 0.5, "max_retries": 1})
    llm_server.respond_with(lambda request: Reply(content=filters_reply(METRIC), delay_s=30))
    result = make_agent(config).propose_filters(routine_segment())
    assert result.adopted == []
    assert result.runs_answered == 0 and len(result.failures) == 1
    assert "did not answer within 0.5 s" in result.failures[0]
    assert len(llm_server.requests) == 2  # first try + one retry, then the agent stops asking


def test_http_500_everywhere_is_unavailable_not_a_crash(llm_server, llm_config):
    llm_server.respond_with(lambda request: Reply(status=500, content="model crashed"))
    result = make_agent(llm_config).propose_filters(routine_segment())
    assert result.adopted == [] and "HTTP 500" in result.failures[0]
    assert len(llm_server.requests) == 2


def test_transient_500_is_retried(llm_server, llm_config):
    calls = {"n": 0}

    def flaky(request):
        calls["n"] += 1
        return Reply(status=500) if calls["n"] == 1 else filters_reply(METRIC)

    llm_server.respond_with(flaky)
    result = make_agent(llm_config, runs=3).propose_filters(routine_segment())
    assert [a.regex for a in result.adopted] == [METRIC]
    assert result.runs_answered == 3 and len(llm_server.requests) == 4


def test_existing_rules_are_not_proposed_again(llm_server, llm_config):
    llm_server.script([filters_reply(METRIC, NCCL_INFO)] * 3)
    result = make_agent(llm_config, runs=3).propose_filters(routine_segment(), existing=[METRIC])
    assert [a.regex for a in result.adopted] == [NCCL_INFO]
    assert {r.regex: r.reason for r in result.rejected}[METRIC] == "already a rule of this job family"


def test_adopted_filters_join_the_job_family_rule_set_and_keep_errors(llm_server, llm_config, tmp_path):
    from diagnosis.filters import FilterRuleSet, LogCompressor

    custom = r"^\[rank\d+\]: tokens/sec/gpu: \d+"
    segment = [f"[rank{r}]: tokens/sec/gpu: {3000 + r} (window 100 steps)" for r in range(8)] * 4
    segment.insert(5, ERROR_LINE)
    llm_server.script([filters_reply(custom, r"\d+")] * 3)
    rules = FilterRuleSet.load("llama-7b-pretrain", state=tmp_path)
    result = make_agent(llm_config, runs=3).learn_filters(segment, rules)
    assert [a.regex for a in result.adopted] == [custom]
    # persisted for the family: a resubmitted job loads it
    reloaded = FilterRuleSet.load("llama-7b-pretrain", state=tmp_path)
    assert custom in reloaded.patterns
    assert [r.source for r in reloaded.rules if r.pattern == custom] == ["agent"]
    compressor = LogCompressor(reloaded, diagnosis_patterns=())
    compressor.feed(("\n".join(segment) + "\n").encode())
    kept = [entry.text for entry in compressor.finish().entries]
    assert kept == [ERROR_LINE]
