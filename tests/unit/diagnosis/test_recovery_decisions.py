"""The recovery decision table, row by row."""

from __future__ import annotations

import pytest

from diagnosis.vocabulary import Diagnosis, kind_of
from diagnosis.recovery import Action, FailureRecord, RecoveryHistory, RecoveryPolicy, decide, rollback_step


def _diag(root: str, restart_helps: bool = True, suspects=(), mitigation: str = "") -> Diagnosis:
    return Diagnosis(root, kind_of(root), restart_helps, suspect_nodes=list(suspects), mitigation=mitigation)


def _decide(diag: Diagnosis, step: int = 40, history: RecoveryHistory | None = None, **policy):
    history = history or RecoveryHistory()
    history.failures.append(FailureRecord(diag.root_cause, step))
    return decide(diag, step, history, RecoveryPolicy(**policy), oom_suggestion="plan B: 4xA100-80G tp=2")


@pytest.mark.parametrize(
    "root,suspects,action",
    [
        ("CUDAError", ["node-b"], Action.NODE_CHECK_RESTART),
        ("ECCError", [], Action.NODE_CHECK_RESTART),
        ("NVLinkError", [], Action.NODE_CHECK_RESTART),
        ("NodeFailure", [], Action.NODE_CHECK_RESTART),
        ("NCCLRemoteError", [], Action.NODE_CHECK_RESTART),
        ("ConnectionError", [], Action.RESTART),
        ("S3StorageError", [], Action.RESTART),
        ("NCCLTimeoutError", [], Action.RESTART),
        ("NCCLTimeoutError", ["node-c"], Action.NODE_CHECK_RESTART),
        ("Hang", [], Action.NODE_CHECK_RESTART),
        ("LossSpike", [], Action.ROLLBACK),
        ("Unknown", [], Action.RESTART),
    ],
)
def test_recoverable_faults(root, suspects, action):
    assert _decide(_diag(root, suspects=suspects)).action is action


@pytest.mark.parametrize("root", ["KeyError", "SyntaxError", "ImportError", "ValueError", "AssertionError"])
def test_deterministic_errors_stop_with_the_mitigation(root):
    decision = _decide(_diag(root, restart_helps=False, mitigation="fix the script"))
    assert decision.action is Action.STOP and decision.suggestion == "fix the script"


def test_framework_error_that_a_retry_fixes_restarts():
    assert _decide(_diag("DataloaderKilled", restart_helps=True)).action is Action.RESTART


def test_oom_stops_and_suggests_the_next_plan():
    decision = _decide(_diag("OutOfMemoryError", restart_helps=False))
    assert decision.action is Action.STOP and "plan B" in decision.suggestion


def test_restart_budget():
    history = RecoveryHistory(restarts=3)
    assert _decide(_diag("CUDAError"), history=history, max_restarts=3).action is Action.STOP


def test_circuit_breaker_counts_same_failure_same_step_only():
    history = RecoveryHistory(failures=[FailureRecord("CUDAError", 40), FailureRecord("CUDAError", 40)])
    assert _decide(_diag("CUDAError"), step=40, history=history, breaker_count=3).action is Action.STOP
    other_step = RecoveryHistory(failures=[FailureRecord("CUDAError", 40), FailureRecord("CUDAError", 40)])
    assert _decide(_diag("CUDAError"), step=60, history=other_step, breaker_count=3).action is not Action.STOP


def test_backoff_doubles_for_repeats():
    first = _decide(_diag("ConnectionError"), backoff_s=2)
    history = RecoveryHistory(failures=[FailureRecord("ConnectionError", 40)])
    second = _decide(_diag("ConnectionError"), history=history, backoff_s=2)
    assert (first.backoff_s, second.backoff_s) == (2, 4)


def test_rollback_goes_strictly_before_the_onset():
    assert rollback_step([10, 20, 30, 40], spike_onset_step=31) == 30
    assert rollback_step([10, 20, 30, 40], spike_onset_step=30) == 20
    assert rollback_step([40], spike_onset_step=30) is None
