"""The failure agent end to end: real Chroma, the real embedding model, a scripted
OpenAI-compatible server, and `diagnose_log`'s agent hook.

The scripted LLM is a retrieval-grounded model: it copies the culprit line from the
log excerpt in the prompt and takes the root cause, kind and restart policy from the
retrieved past failure that shares the most words with that line. It is never handed
the answer: if retrieval sent the wrong past failures (or none), its answer changes
and the tests fail (``test_the_answer_follows_what_retrieval_sent`` shows both ways).
"""

from __future__ import annotations

import json
import re

import pytest

from diagnosis.agents import AgentsConfig, DiagnosisAgents, LibraryRules
from diagnosis.api import compress_log, diagnose_log
from diagnosis.failure_agent import FailureAgent, FailureAgentConfig
from diagnosis.failure_memory import MemoryConfig
from diagnosis.rules import DiagnosisLibrary
from diagnosis.vocabulary import Diagnosis
from scripted_llm_server import Reply, retrieved_failures

NOVEL = "tokenizer vocabulary mismatch: checkpoint has 32000 tokens, data has 50257; aborting run"
RULE_REGEX = r"tokenizer vocabulary mismatch: checkpoint has \d+ tokens, data has \d+"


def write_log(path, culprit: str = NOVEL, ranks: int = 4, symptoms: bool = False):
    lines = []
    for step in range(1, 30):
        for rank in range(ranks):
            lines.append(f"[2026-11-22 07:{step:02d}:00,123] [rank{rank}] step={step} loss={3.2 - step * 0.01:.3f} lr=1.0e-04 grad_norm=0.51 tokens_per_s=12000 elapsed_s=1.0")
    lines.append(f"[rank2]: [2026-11-22 07:31:00,001] {culprit}")
    lines.append("[rank1]: data loader: shard 17 of 64 opened from /data/tokenized (2 workers)")
    if symptoms:
        lines.append("[rank0]:[E1122 07:41:02.123456 2381 ProcessGroupNCCL.cpp:616] [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=4121, OpType=ALLREDUCE) ran for 600012 milliseconds before timing out.")
        lines.append("torch.distributed.elastic.multiprocessing.errors.ChildFailedError:")
    path.write_text("\n".join(lines) + "\n")
    return path


def past(root_cause: str, kind: str, restart: bool, line: str) -> tuple[str, Diagnosis]:
    return line, Diagnosis(root_cause=root_cause, kind=kind, restart_helps=restart, culprit_lines=[line], mitigation=f"fix {root_cause}")


PAST_FAILURES = [
    past("CUDAError", "infrastructure", True, "[rank3]: RuntimeError: CUDA error: an illegal memory access was encountered"),
    past("OutOfMemoryError", "framework", False, "[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"),
    past("S3StorageError", "infrastructure", True, "botocore.exceptions.ClientError: An error occurred (SlowDown) when calling the PutObject operation"),
    past("ValueError", "framework", False, "[rank0]: tokenizer vocab size 32000 does not match the embedding table of the checkpoint (50304 rows); aborting"),
]


# The same failure as NOVEL seen before, in another run (other numbers, rank, time): what a
# team confirmed earlier, and what the retrieval vote may answer from without an LLM.
RECURRENCE = past("ValueError", "framework", False,
                  "[rank5]: [2026-11-20 03:11:42,998] tokenizer vocabulary mismatch: checkpoint has 50304 tokens, data has 32000; aborting run")

_WORD = re.compile(r"[a-z]{3,}")


def _words(text: str) -> set[str]:
    return set(_WORD.findall(text.lower()))


def careful_llm(rule_regex=RULE_REGEX, without_context: Diagnosis | None = None):
    """A scripted model that diagnoses from what the prompt shows, and proposes a rule.

    The culprit is the excerpt's line about a mismatch; the diagnosis is copied from the
    retrieved past failure sharing the most words with it (at least 3). With nothing
    retrieved it answers ``without_context`` (what a model would guess from the log
    alone) or Unknown.
    """

    def respond(request):
        text = request.text
        if "You maintain filter rules" in text:
            return json.dumps({"filters": [], "error_lines": []})
        if "Write one regular expression" in text:
            return "```json\n" + json.dumps({"regex": rule_regex, "name": "tokenizer vocab mismatch"}) + "\n```"
        if "You diagnose failed distributed" in text:
            new_log = text.split("Compressed log of the failed job")[1]
            culprit = next(line for line in new_log.splitlines() if "mismatch" in line)
            scored = [(len(_words(culprit) & _words(" ".join(p["lines"]))), p) for p in retrieved_failures(text)]
            best = max(scored, key=lambda item: item[0], default=(0, None))
            if best[0] >= 3:
                answer = best[1]
            elif without_context is not None:
                answer = {"root_cause": without_context.root_cause, "kind": without_context.kind,
                          "restart_helps": without_context.restart_helps}
            else:
                answer = {"root_cause": "Unknown", "kind": "unknown", "restart_helps": False}
            return json.dumps({
                "root_cause": answer["root_cause"], "kind": answer["kind"], "restart_helps": answer["restart_helps"],
                "culprit_lines": [culprit], "mitigation": answer.get("mitigation") or "Use the tokenizer the checkpoint was trained with.",
                "confidence": 0.8,
            })
        return Reply(status=400, content="unexpected prompt")

    return respond


def agents_for(tmp_path, llm_config, embedder, *, also=(), **failure_agent):
    config = AgentsConfig(
        llm=llm_config,
        memory=MemoryConfig(path=tmp_path / "memory"),
        failure_agent=FailureAgentConfig(**failure_agent),
    )
    agents = DiagnosisAgents(config, embedder=embedder)
    agents.memory_for(None).add_many(PAST_FAILURES + list(also))
    return agents


@pytest.mark.slow  # ~20 s on 2 cores: the embedding model, Chroma and the agent's LLM server
def test_unknown_failure_is_diagnosed_learned_and_then_known_by_rule(tmp_path, llm_server, llm_config, embedder):
    log = write_log(tmp_path / "job.log")
    state = tmp_path / "state"
    assert diagnose_log(log, state_dir=state).source == "none"  # precondition: no rule knows it

    llm_server.respond_with(careful_llm())
    agents = agents_for(tmp_path, llm_config, embedder)
    first = diagnose_log(log, job_family="llama-test", state_dir=state, agent=agents)

    assert (first.root_cause, first.kind, first.restart_helps, first.source) == ("ValueError", "framework", False, "agent")
    assert any(NOVEL in line for line in first.culprit_lines)
    assert first.suspect_ranks == [2]
    report = agents.last_report.failure_agent
    assert report.learned_pattern == RULE_REGEX and report.remembered_id
    # the LLM was shown the nearest past failures, the similar one among them
    (diagnosis_request,) = [r for r in llm_server.requests if "You diagnose failed" in r.text]
    sent = retrieved_failures(diagnosis_request.text)
    assert sent and "does not match the embedding table" in " ".join(sent[0]["lines"])  # most similar first
    assert len(agents.memory_for(None)) == len(PAST_FAILURES) + 1

    # the rule is persisted: a fresh run with no LLM at all diagnoses by rule
    llm_server.reset()
    second = diagnose_log(log, job_family="llama-test", state_dir=state, agent=None)
    assert (second.root_cause, second.source, second.rule_name) == ("ValueError", "rule", report.learned_rule)
    learned = DiagnosisLibrary.load(state, job_family="llama-test").learned[0]
    assert (learned.source, learned.review, learned.job_family) == ("agent", "proposed", "llama-test")
    # proposed: only the job family that learned it uses it until an operator approves it
    assert DiagnosisLibrary.load(state, job_family="other-job").learned == []
    assert llm_server.requests == []


def test_rule_that_would_change_a_past_diagnosis_is_refused(tmp_path, llm_server, llm_config, embedder):
    log = write_log(tmp_path / "job.log")
    state = tmp_path / "state"
    # "mismatch" alone would also fire on a stored RuntimeError failure
    llm_server.respond_with(careful_llm(rule_regex="mismatch"))
    agents = agents_for(tmp_path, llm_config, embedder)
    agents.memory_for(None).add(
        "[rank2]: RuntimeError: shape mismatch: value tensor of shape [8] cannot be broadcast",
        Diagnosis(root_cause="RuntimeError", kind="framework", restart_helps=False),
    )
    diagnosis = diagnose_log(log, state_dir=state, agent=agents)
    report = agents.last_report.failure_agent
    assert diagnosis.source == "agent"
    refused = {r.regex: r.reason for r in report.rule_rejections}
    assert "would change the diagnosis of past failure" in refused["mismatch"]
    assert "from RuntimeError to ValueError" in refused["mismatch"]
    # the fallback candidate, the culprit line generalised, is specific enough
    assert report.learned_pattern and report.learned_pattern != "mismatch"
    assert re.search(r"\\d\+", report.learned_pattern)
    learned = DiagnosisLibrary.load(state).learned
    assert [r.pattern for r in learned] == [report.learned_pattern]


def test_catch_all_rule_proposal_is_refused(tmp_path, llm_server, llm_config, embedder):
    log = write_log(tmp_path / "job.log")
    llm_server.respond_with(careful_llm(rule_regex=".*"))
    agents = agents_for(tmp_path, llm_config, embedder, rule_attempts=1)
    diagnose_log(log, state_dir=tmp_path / "state", agent=agents)
    report = agents.last_report.failure_agent
    assert report.rule_rejections[0].regex == ".*"
    assert report.rule_rejections[0].reason.startswith("catch-all")


@pytest.mark.parametrize(
    "bad_reply",
    [
        '{"root_cause": "GPUMeltdown", "kind": "infrastructure", "restart_helps": true, "culprit_lines": []}',
        '{"root_cause": "ValueError", "kind": "infrastructure", "restart_helps": false, "culprit_lines": []}',
        '{"root_cause": "ValueError", "kind": "framework", "restart_helps": "maybe"}',
        "I think it is a tokenizer problem.",
    ],
    ids=["outside-vocabulary", "wrong-kind", "non-boolean-restart", "no-json"],
)
def test_invalid_llm_diagnosis_falls_back_to_retrieval(tmp_path, llm_server, llm_config, embedder, bad_reply):
    log = write_log(tmp_path / "job.log")
    state = tmp_path / "state"
    llm_server.respond_with(lambda request: bad_reply if "You diagnose" in request.text else json.dumps({"filters": []}))
    agents = agents_for(tmp_path, llm_config, embedder, also=[RECURRENCE])
    diagnosis = diagnose_log(log, state_dir=state, agent=agents)
    report = agents.last_report.failure_agent
    assert diagnosis.source == "retrieval" and diagnosis.confidence <= 0.5
    assert diagnosis.root_cause == "ValueError"  # the nearest past failure: the same one, seen before
    assert len(report.failures) == 2  # both attempts refused, with the reason
    assert report.learned_rule is None and DiagnosisLibrary.load(state).learned == []


def test_without_llm_the_retrieval_vote_answers_with_low_confidence(tmp_path, embedder):
    log = write_log(tmp_path / "job.log")
    agents = agents_for(tmp_path, None, embedder, also=[RECURRENCE])
    diagnosis = diagnose_log(log, state_dir=tmp_path / "state", agent=agents)
    assert (diagnosis.root_cause, diagnosis.restart_helps, diagnosis.source) == ("ValueError", False, "retrieval")
    assert 0 < diagnosis.confidence <= 0.5
    assert any(NOVEL in line for line in diagnosis.culprit_lines)
    assert DiagnosisLibrary.load(tmp_path / "state").learned == []  # guesses teach no rules


def test_without_llm_a_past_failure_only_like_this_one_does_not_answer(tmp_path, embedder):
    """The nearest past failure is the same kind of trouble in other words (similarity ~0.6,
    below the floor): without an LLM to judge the analogy, its cause and restart policy
    are not taken; the log stays Unknown for a person. With the floor lowered it answers."""
    log = write_log(tmp_path / "job.log")
    agents = agents_for(tmp_path, None, embedder)
    diagnosis = diagnose_log(log, state_dir=tmp_path / "state", agent=agents)
    neighbours = agents.last_report.failure_agent.neighbours
    assert neighbours[0].diagnosis.root_cause == "ValueError"
    assert neighbours[0].similarity < FailureAgentConfig().min_similarity
    assert (diagnosis.root_cause, diagnosis.source) == ("Unknown", "none")
    lowered = agents_for(tmp_path / "lowered", None, embedder, min_similarity=0.5)
    assert diagnose_log(log, state_dir=tmp_path / "state", agent=lowered).root_cause == "ValueError"


def test_llm_timeout_falls_back_to_retrieval_without_hanging(tmp_path, llm_server, llm_config, embedder):
    log = write_log(tmp_path / "job.log")
    llm_server.respond_with(lambda request: Reply(content="{}", delay_s=30))
    config = llm_config.model_copy(update={"timeout_s": 0.5, "max_retries": 1})
    agents = agents_for(tmp_path, config, embedder, also=[RECURRENCE])
    diagnosis = diagnose_log(log, state_dir=tmp_path / "state", agent=agents)
    assert diagnosis.source == "retrieval"
    assert agents.last_report.log_agent[0].runs_answered == 0
    # one log-agent run (try + retry), then one failure-agent query (try + retry)
    assert len(llm_server.requests) == 4


def test_empty_memory_asks_the_llm_directly(tmp_path, llm_server, llm_config, embedder):
    log = write_log(tmp_path / "job.log")
    llm_server.respond_with(careful_llm(without_context=Diagnosis("ValueError", "framework", False)))
    config = AgentsConfig(llm=llm_config, memory=MemoryConfig(path=tmp_path / "empty-memory"))
    agents = DiagnosisAgents(config, embedder=embedder)
    diagnosis = diagnose_log(log, state_dir=tmp_path / "state", agent=agents)
    assert diagnosis.source == "agent" and diagnosis.root_cause == "ValueError"
    (request,) = [r for r in llm_server.requests if "You diagnose failed" in r.text]
    assert "(none recorded yet)" in request.text


def test_library_rules_replay_matches_diagnose_log(tmp_path):
    library = LibraryRules(DiagnosisLibrary(path=None))
    lines = [
        "[rank0]:[E1122 07:41:02.123456 2381 ProcessGroupNCCL.cpp:616] [Rank 0] Watchdog caught collective operation timeout",
        "[2026-11-22 07:31:00,001] [rank3] RuntimeError: CUDA error: an illegal memory access was encountered",
    ]
    assert library.diagnose_lines(lines).root_cause == "CUDAError"
    # learned rules are checked before the seeds
    candidate = library.with_candidate("t", r"illegal memory access", Diagnosis("ECCError", "infrastructure", True, culprit_lines=[lines[1]]))
    assert candidate.diagnose_lines(lines).root_cause == "ECCError"
    assert library.library.learned == []  # the trial did not touch the real library


def test_hook_runs_the_log_agent_first_and_forwards_its_error_lines(tmp_path, llm_server, llm_config, embedder):
    from diagnosis.filters import FilterRuleSet

    log = write_log(tmp_path / "job.log")
    state = tmp_path / "state"
    shard_rule = r"^\[rank\d+\]: data loader: shard \d+ of \d+ opened from "
    diagnose = careful_llm()

    def respond(request):
        if "You maintain filter rules" in request.text:
            shard_line = next(l for l in request.text.splitlines() if "data loader: shard" in l)
            return json.dumps({"filters": [{"regex": shard_rule}], "error_lines": [shard_line.split("    [x")[0]]})
        return diagnose(request)

    llm_server.respond_with(respond)
    agents = agents_for(tmp_path, llm_config, embedder)
    diagnosis = diagnose_log(log, job_family="llama-test", state_dir=state, agent=agents)
    assert diagnosis.source == "agent"
    (segment_result,) = agents.last_report.log_agent
    # the agent proposed a filter for the very line it called an error: vetting
    # refuses the filter, and the line goes to the failure agent instead
    assert segment_result.adopted == []
    assert "would drop an error line" in segment_result.rejected[0].reason
    assert agents.last_report.forwarded_error_lines == ["[rank1]: data loader: shard 17 of 64 opened from /data/tokenized (2 workers)"]
    assert shard_rule not in FilterRuleSet.load("llama-test", state).patterns
    (diagnosis_request,) = [r for r in llm_server.requests if "You diagnose failed" in r.text]
    log_part = diagnosis_request.text.split("Compressed log of the failed job")[1]
    assert log_part.splitlines()[1].startswith("[rank1]: data loader: shard 17")  # forwarded lines lead


def test_hook_adopts_log_agent_filters_for_the_job_family(tmp_path, llm_server, llm_config, embedder):
    from diagnosis.filters import FilterRuleSet

    log = write_log(tmp_path / "job.log")
    state = tmp_path / "state"
    shard_rule = r"^\[rank\d+\]: data loader: shard \d+ of \d+ opened from "
    diagnose = careful_llm()
    llm_server.respond_with(
        lambda request: json.dumps({"filters": [{"regex": shard_rule}]})
        if "You maintain filter rules" in request.text
        else diagnose(request)
    )
    agents = agents_for(tmp_path, llm_config, embedder)
    diagnose_log(log, job_family="llama-test", state_dir=state, agent=agents)
    assert [a.regex for a in agents.last_report.log_agent[0].adopted] == [shard_rule]
    assert shard_rule in FilterRuleSet.load("llama-test", state).patterns  # the family keeps it


def test_the_answer_follows_what_retrieval_sent(tmp_path, llm_server, llm_config, embedder):
    """The same log and the same model, two memories: the diagnosis is the retrieved
    past failure's, so it changes with the memory, and with no similar past failure in
    memory the model cannot name the cause."""
    log = write_log(tmp_path / "job.log")
    llm_server.respond_with(careful_llm())
    relabelled = [(line, Diagnosis("DatasetLoadingError", "framework", False, culprit_lines=[line]))
                  if d.root_cause == "ValueError" else (line, d) for line, d in PAST_FAILURES]
    config = AgentsConfig(llm=llm_config, memory=MemoryConfig(path=tmp_path / "relabelled"),
                          failure_agent=FailureAgentConfig(learn_rules=False, remember=False))
    agents = DiagnosisAgents(config, embedder=embedder)
    agents.memory_for(None).add_many(relabelled)
    diagnosis = diagnose_log(log, state_dir=tmp_path / "state-a", agent=agents)
    assert (diagnosis.root_cause, diagnosis.source) == ("DatasetLoadingError", "agent")

    unrelated = [(line, d) for line, d in PAST_FAILURES if d.root_cause != "ValueError"]
    config = config.model_copy(update={"memory": MemoryConfig(path=tmp_path / "unrelated")})
    agents = DiagnosisAgents(config, embedder=embedder)
    agents.memory_for(None).add_many(unrelated)
    llm_server.reset()
    llm_server.respond_with(careful_llm())
    diagnosis = diagnose_log(log, state_dir=tmp_path / "state-b", agent=agents)
    assert diagnosis.root_cause != "ValueError"
    (request,) = [r for r in llm_server.requests if "You diagnose failed" in r.text]
    assert not any("embedding table" in " ".join(p["lines"]) for p in retrieved_failures(request.text))


def test_a_generic_exception_answer_gets_a_second_look_for_recurrences_only(tmp_path, llm_server, llm_config, embedder):
    # The rules call "RuntimeError: <anything>" a RuntimeError. The agent may replace that
    # only with a recurrence of a failure diagnosed before; it does not ask the LLM, and a
    # past failure only like this one (above the 0.7 floor) does not answer.
    log = write_log(tmp_path / "job.log", culprit=f"RuntimeError: {NOVEL}")
    llm_server.respond_with(careful_llm(without_context=Diagnosis("CUDAError", "infrastructure", True)))
    near = past("ValueError", "framework", False,
                "[rank1]: RuntimeError: tokenizer vocabulary mismatch between the checkpoint and the dataset; aborting run")
    agents = agents_for(tmp_path, llm_config, embedder, also=[near])
    found = diagnose_log(log, state_dir=tmp_path / "state", agent=agents)
    assert (found.root_cause, found.source, found.rule_name) == ("RuntimeError", "rule", "runtime")
    nearest = agents.last_report.failure_agent.neighbours[0]
    assert "between the checkpoint and the dataset" in nearest.key and 0.7 <= nearest.similarity < 0.95, nearest
    assert llm_server.requests == []

    # an earlier run failed the same way (other numbers, rank) and a person confirmed its
    # cause, stored as `forgeflow diagnose --confirm` stores it
    earlier = write_log(tmp_path / "earlier.log", ranks=2, culprit="RuntimeError: tokenizer vocabulary mismatch: "
                        "checkpoint has 50304 tokens, data has 32000; aborting run")
    compressed, _, library = compress_log(earlier, state_dir=tmp_path / "state")
    undiagnosed = agents_for(tmp_path / "undiagnosed", llm_config, embedder)  # remembered as Unknown
    undiagnosed.remember(compressed, Diagnosis("Unknown", "unknown", False), library=library)
    agents.remember(compressed, Diagnosis("DatasetLoadingError", "framework", False), library=library)
    found = diagnose_log(log, state_dir=tmp_path / "state", agent=agents)
    assert (found.root_cause, found.restart_helps, found.source) == ("DatasetLoadingError", False, "retrieval")
    assert agents.last_report.failure_agent.neighbours[0].similarity >= 0.95
    assert 2 in found.suspect_ranks  # the culprit's rank
    # a recurrence nobody diagnosed says less than the class: the class stands
    found = diagnose_log(log, state_dir=tmp_path / "state", agent=undiagnosed)
    assert (found.root_cause, found.source) == ("RuntimeError", "rule")
    assert undiagnosed.last_report.failure_agent.neighbours[0].similarity >= 0.95
    assert llm_server.requests == []
