"""The alert for a diagnosis: how it was found, its suspects, its evidence."""

from __future__ import annotations

from diagnosis.slack_format import to_alert
from diagnosis.vocabulary import Diagnosis


def sample(**changes) -> Diagnosis:
    fields = dict(confidence=0.9, suspect_nodes=["node-a03"],
                  culprit_lines=["[rank3]: RuntimeError: CUDA error: uncorrectable ECC error <encountered>"],
                  mitigation="cordon node-a03", rule_name="ecc-uncorrectable")
    return Diagnosis("ECCError", "infrastructure", True, **{**fields, **changes})


def test_alert_holds_cause_evidence_action_and_link():
    alert = to_alert(sample(), "llama-7b", "cordoned node-a03, restarted from step 4500", "http://prefect/runs/1")
    assert alert.title == "llama-7b: ECCError"
    assert alert.fields["Root cause"] == "ECCError (infrastructure)"
    assert alert.fields["Action taken"] == "cordoned node-a03, restarted from step 4500"
    assert "uncorrectable ECC error" in alert.evidence[0] and alert.link == "http://prefect/runs/1"
    body = str(alert.blocks())
    assert "&lt;encountered&gt;" in body and "<http://prefect/runs/1|details>" in body


def test_confidence_says_who_found_it_once():
    assert to_alert(sample(), "j", "restarted").fields["Confidence"] == "90% (rule: ecc-uncorrectable)"
    retrieved = sample(source="retrieval", rule_name=None, confidence=0.72)
    assert to_alert(retrieved, "j", "restarted").fields["Confidence"] == "72% (retrieval)"
    unknown = Diagnosis("Unknown", "unknown", False, confidence=0.1, source="none")
    assert to_alert(unknown, "j", "restarted").fields["Confidence"] == "10% (no rule)"


def test_suspect_ranks_are_global_or_say_which_node_they_are_local_to():
    fields = to_alert(sample(suspect_ranks=[1, 4], suspect_local_ranks={"node-b": [0]}), "j", "x").fields
    assert fields["Suspect ranks"] == "1, 4, local rank 0 on node-b"
    fields = to_alert(sample(suspect_local_ranks={"node-b": [0, 3]}), "j", "x").fields
    assert fields["Suspect ranks"] == "local ranks 0, 3 on node-b"
    assert "Suspect ranks" not in to_alert(sample(), "j", "x").fields


def test_log_text_cannot_close_the_evidence_block_or_reach_a_terminal():
    alert = to_alert(sample(culprit_lines=["ok ``` *bold* <!channel>", "\x1b]0;title\x07RuntimeError\x1b[31m boom`"],
                            mitigation="drain\x1b[2J it"), "j", "x")
    assert alert.evidence == ["ok ``` *bold* <!channel>", "RuntimeError boom`"]
    assert alert.fields["Mitigation"] == "drain it" and "\x1b" not in alert.text()
    code = alert.blocks()[2]["text"]["text"]
    assert code.startswith("```") and code.endswith("```") and "``" not in code[3:-3]
    assert "&lt;!channel&gt;" in code
