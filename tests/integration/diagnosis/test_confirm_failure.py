"""`forgeflow diagnose LOG --confirm [ROOT_CAUSE]`: a person's diagnosis goes into the failure
memory (real Chroma, the real embedding model) and the failure agent recognises the next
occurrence without an LLM; an unrelated unknown failure stays Unknown."""

from __future__ import annotations

import json

import pytest

from flows.cli import main

# An in-house launcher's message no rule knows, twice (other run: other numbers, rank,
# node), and an unrelated failure no rule knows either.
FIRST = "[rank3]: hpcx-agent: fabric route table for plane 2 went stale (generation 8812 < 8815) on node-a07; cannot place rings"
AGAIN = "[rank11]: hpcx-agent: fabric route table for plane 5 went stale (generation 301 < 309) on node-b02; cannot place rings"
OTHER = "[rank0]: sampler drew an empty microbatch from shard 41 after 3 retries; the epoch boundary is inconsistent"


def write_log(path, culprit: str):
    lines = [f"[rank0]: 2026-11-26T10:{i // 60:02d}:{i % 60:02d}.000Z rank=0 step={i} loss=3.10 lr=1.0e-04 grad_norm=0.4 "
             "tokens_per_s=11000.0 elapsed_s=1.00" for i in range(40)]
    path.write_text("\n".join(lines + [culprit]) + "\n")
    return str(path)


def diagnose(capsys, *argv) -> tuple[int, dict | str]:
    code = main(["diagnose", *argv])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if code == 0 and "--json" in argv else err)


@pytest.fixture
def state(tmp_path, monkeypatch, embedder):
    # no LLM: the failure agent answers by its retrieval vote alone (embedder: the session's
    # model is loaded once, then shared by the CLI's memory in this process)
    for name in ("FORGEFLOW_LLM_MODEL", "FORGEFLOW_LLM_BASE_URL", "OPENAI_BASE_URL", "OPENAI_API_KEY", "FORGEFLOW_CHROMA_URL"):
        monkeypatch.delenv(name, raising=False)
    return str(tmp_path / "state")


def test_a_confirmed_failure_is_recognised_next_time_and_nothing_else_is(tmp_path, capsys, state):
    first, again, other = (write_log(tmp_path / f"{n}.log", line) for n, line in
                           (("first", FIRST), ("again", AGAIN), ("other", OTHER)))
    code, found = diagnose(capsys, first, "--json", "--state-dir", state)
    assert code == 0 and found["root_cause"] == "Unknown"  # no rule, empty memory

    code, found = diagnose(capsys, first, "--confirm", "NodeFailure", "--restart-helps", "yes", "--json", "--state-dir", state)
    assert code == 0 and found["root_cause"] == "Unknown"  # what forgeflow said ...
    confirmed = found["confirmed"]  # ... and what the person said, now remembered
    assert (confirmed["root_cause"], confirmed["kind"], confirmed["restart_helps"], confirmed["source"]) == \
        ("NodeFailure", "infrastructure", True, "person")
    assert confirmed["failure_id"] and "NodeFailure" in confirmed["mitigation"] and "restart helped" in confirmed["mitigation"]

    code, found = diagnose(capsys, again, "--json", "--state-dir", state)
    assert code == 0
    assert (found["root_cause"], found["restart_helps"], found["source"]) == ("NodeFailure", True, "retrieval")
    assert any("fabric route table" in line for line in found["culprit_lines"])

    code, found = diagnose(capsys, other, "--json", "--state-dir", state)
    assert code == 0 and (found["root_cause"], found["source"]) == ("Unknown", "none")  # not like it: no guess


def test_confirming_a_rule_diagnosis_as_it_is_keeps_its_cause_and_action(tmp_path, capsys, state):
    log = write_log(tmp_path / "oom.log", "[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
    code, found = diagnose(capsys, log, "--confirm", "--json", "--state-dir", state)
    assert code == 0 and found["root_cause"] == "OutOfMemoryError"
    assert (found["confirmed"]["root_cause"], found["confirmed"]["restart_helps"]) == ("OutOfMemoryError", found["restart_helps"])
    assert main(["diagnose", log, "--confirm", "--mitigation", "lower the micro-batch", "--state-dir", state]) == 0
    out = capsys.readouterr().out  # the terminal says what it kept
    assert "remembered : OutOfMemoryError (no restart) as failure " in out


def test_bad_confirmations_are_one_clear_error(tmp_path, capsys, state):
    unknown = write_log(tmp_path / "first.log", FIRST)
    oom = write_log(tmp_path / "oom.log", "[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
    code, err = diagnose(capsys, unknown, "--confirm", "NodeFailur", "--state-dir", state)
    assert code == 2 and "NodeFailur" in err and "NodeFailure" in err and len(err.strip().splitlines()) == 1
    code, err = diagnose(capsys, oom, "--confirm", "OSError", "--state-dir", state)  # a correction must say
    assert code == 2 and "--restart-helps" in err
    code, err = diagnose(capsys, unknown, "--confirm", "--state-dir", state)  # "as diagnosed": Unknown is no cause
    assert code == 2 and "names a root cause" in err
    code, err = diagnose(capsys, oom, "--restart-helps", "no", "--state-dir", state)
    assert code == 2 and "--confirm" in err


def test_a_confirmed_cause_behind_a_bare_exception_class_is_recognised_next_time(tmp_path, capsys, state):
    # The rules call any "RuntimeError: ..." a RuntimeError (framework: stop). A person finds
    # the node's fabric at fault; the next occurrence is that, not the class; another
    # RuntimeError nobody confirmed stays a RuntimeError.
    first, again, other = (write_log(tmp_path / f"{n}.log", f"[rank{r}]: RuntimeError: {line.split(': ', 1)[1]}")
                           for n, r, line in (("first", 3, FIRST), ("again", 11, AGAIN), ("other", 0, OTHER)))
    code, found = diagnose(capsys, first, "--json", "--state-dir", state)
    assert code == 0 and (found["root_cause"], found["restart_helps"], found["source"]) == ("RuntimeError", False, "rule")
    code, found = diagnose(capsys, first, "--confirm", "NodeFailure", "--restart-helps", "yes", "--json", "--state-dir", state)
    assert code == 0 and found["confirmed"]["root_cause"] == "NodeFailure"

    code, found = diagnose(capsys, again, "--json", "--state-dir", state)
    assert code == 0 and (found["root_cause"], found["restart_helps"], found["source"]) == ("NodeFailure", True, "retrieval")
    code, found = diagnose(capsys, other, "--json", "--state-dir", state)
    assert code == 0 and (found["root_cause"], found["source"]) == ("RuntimeError", "rule")
