"""The Slack message for a diagnosis."""

from __future__ import annotations

from diagnosis.slack_format import slack_message, to_alert
from diagnosis.vocabulary import Diagnosis


def sample() -> Diagnosis:
    return Diagnosis("ECCError", "infrastructure", True, confidence=0.9, suspect_nodes=["node-a03"],
                     culprit_lines=["[rank3]: RuntimeError: CUDA error: uncorrectable ECC error <encountered>"],
                     mitigation="cordon node-a03", rule_name="ecc-uncorrectable")


def test_slack_message_holds_cause_evidence_action_and_link():
    msg = slack_message(sample(), "llama-7b", "cordoned node-a03, restarted from step 4500", "http://prefect/runs/1")
    assert "llama-7b: ECCError" in msg["text"]
    assert "cordoned node-a03, restarted from step 4500" in msg["text"]
    assert "uncorrectable ECC error" in msg["text"] and "http://prefect/runs/1" in msg["text"]
    body = str(msg["blocks"])
    assert "&lt;encountered&gt;" in body and "<http://prefect/runs/1|details>" in body


def test_alert_for_infra_notify():
    alert = to_alert(sample(), "llama-7b", "restarted")
    assert alert.fields["Root cause"] == "ECCError (infrastructure)" and alert.evidence
