"""The recovery decision table, row by row."""

from __future__ import annotations

import pytest

from diagnosis.vocabulary import Diagnosis, kind_of
from diagnosis.recovery import (
    Action,
    AttemptOverrides,
    FailedAttempt,
    FailureRecord,
    Interruptions,
    RecoveryHistory,
    RecoveryPolicy,
    Rollback,
    after_eviction,
    decide,
    next_attempt,
    rollback_step,
)


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


def test_no_backoff_before_the_first_restart_then_doubling_for_repeats():
    first = _decide(_diag("ConnectionError"), backoff_s=2)
    history = RecoveryHistory(failures=[FailureRecord("ConnectionError", 40)])
    second = _decide(_diag("ConnectionError"), history=history, backoff_s=2)
    history = RecoveryHistory(failures=[FailureRecord("ConnectionError", 40)] * 2)
    third = _decide(_diag("ConnectionError"), history=history, backoff_s=2, breaker_count=5)
    assert (first.backoff_s, second.backoff_s, third.backoff_s) == (0, 2, 4)
    # the same cause at another step is another failure: its first restart waits for nothing
    elsewhere = RecoveryHistory(failures=[FailureRecord("ConnectionError", 12)])
    assert _decide(_diag("ConnectionError"), history=elsewhere, backoff_s=2).backoff_s == 0


@pytest.mark.parametrize("root,restart_helps", [("Unknown", True), ("DataloaderKilled", True),
                                                 ("RuntimeError", True), ("S3StorageError", True),
                                                 ("NCCLTimeoutError", True)])
def test_a_failure_that_points_at_no_hardware_restarts_at_once_without_a_node_check(root, restart_helps):
    # e.g. ranks stopped by a signal nobody asked for (infra.watch): the logs name no cause
    attempt, _ = _next(_diag(root, restart_helps=restart_helps), backoff_s=5)
    assert attempt.action is Action.RESTART and not attempt.checks_nodes and not attempt.stops
    assert attempt.backoff_s == 0 and attempt.text == "restart in place at once (first time)"


@pytest.mark.parametrize("root", ["CUDAError", "ECCError", "NVLinkError", "NodeFailure", "NetworkError",
                                  "NCCLRemoteError", "Hang"])
def test_only_hardware_or_interconnect_checks_the_nodes(root):
    attempt, _ = _next(_diag(root), backoff_s=5)
    assert attempt.checks_nodes and attempt.backoff_s == 0


def test_rollback_goes_strictly_before_the_onset():
    assert rollback_step([10, 20, 30, 40], spike_onset_step=31) == 30
    assert rollback_step([10, 20, 30, 40], spike_onset_step=30) == 20
    assert rollback_step([40], spike_onset_step=30) is None


# --- the whole next attempt ------------------------------------------------------------


def _next(diag: Diagnosis, step: int = 40, committed=(), onset=None, **policy):
    history = RecoveryHistory(failures=[FailureRecord(diag.root_cause, step)])
    listed = []

    def committed_steps():
        listed.append(True)
        return list(committed)

    attempt = next_attempt(diag, step, history, RecoveryPolicy(**policy), committed_steps=committed_steps,
                           spike_onset_step=onset, oom_suggestion="plan B")
    return attempt, bool(listed)


def test_spike_rolls_back_before_the_onset_and_skips_batches_as_a_typed_override():
    attempt, listed = _next(_diag("LossSpike"), step=31, committed=[10, 20, 30], onset=26, skip_batches=7)
    assert listed and attempt.action is Action.ROLLBACK and not attempt.stops
    assert attempt.resume_from == 20
    # the skipped batches start at the onset's, not at the checkpoint's: steps 21-25 replay
    assert attempt.overrides == AttemptOverrides(skip_batches=7, skip_from_step=26)
    assert "resume from checkpoint step 20, replay to step 25, skip 7 batches from the one step 26 trained" \
        in attempt.text


def test_spike_without_an_onset_rolls_back_before_the_failed_step():
    attempt, _ = _next(_diag("LossSpike"), step=31, committed=[10, 20, 30])
    assert attempt.resume_from == 30


def test_rollback_impossible_stops_and_says_how_to_avoid_it():
    attempt, _ = _next(_diag("LossSpike"), step=12, committed=[20], onset=8)
    assert attempt.stops and attempt.resume_from is None
    assert attempt.overrides == AttemptOverrides()  # nothing skipped: nothing runs
    assert "step 8" in attempt.reason and "nothing to roll back to" in attempt.reason
    assert "checkpoint.interval" in attempt.suggestion


def test_restart_resumes_from_the_newest_checkpoint_without_listing_storage():
    # A transient S3 fault must not be followed by a storage listing in the decision.
    attempt, listed = _next(_diag("S3StorageError"), backoff_s=3)
    assert not listed
    assert (attempt.action, attempt.resume_from, attempt.overrides) == (Action.RESTART, None, AttemptOverrides())
    assert attempt.backoff_s == 0  # the first time: at once
    history = RecoveryHistory(failures=[FailureRecord("S3StorageError", 40)] * 2)
    again = next_attempt(_diag("S3StorageError"), 40, history, RecoveryPolicy(backoff_s=3))
    assert again.backoff_s == 3 and again.text == "restart in place after 3s backoff"


def test_node_check_attempt_says_what_the_check_found():
    attempt, _ = _next(_diag("ECCError"))
    assert attempt.checks_nodes and attempt.resume_from is None
    checked = attempt.after_node_check("faulty=['node-b']", ["node-b"], ["node-a", "node-c"])
    assert checked.text.endswith("node check: faulty=['node-b']; cordoned ['node-b'], re-placed on ['node-a', 'node-c']")
    assert checked.action is attempt.action and checked.reason == attempt.reason
    assert "cordoned" not in attempt.after_node_check("healthy=2", [], ["node-a"]).text


def test_stops_carry_the_suggestion():
    attempt, _ = _next(_diag("OutOfMemoryError", restart_helps=False))
    assert attempt.stops and attempt.suggestion == "plan B" and attempt.text == "stop"


def test_failed_attempt_records_the_diagnosis_and_the_decision():
    diag = Diagnosis("CUDAError", "infrastructure", True, source="rule")
    attempt, _ = _next(diag)
    record = FailedAttempt.of(2, "failed", 40, diag, attempt, seconds_to_detect=3.14159,
                              detected_at=100.0, diagnosed_at=101.0, decided_at=102.0)
    assert (record.attempt, record.status, record.step, record.root_cause, record.kind, record.source) == (
        2, "failed", 40, "CUDAError", "infrastructure", "rule")
    assert record.action == attempt.text and record.reason == attempt.reason
    assert record.seconds_to_detect == 3.1 and record.relaunched_at is None


# --- a rollback outlives its attempt ---------------------------------------------------------------

def test_rollback_sets_aside_the_abandoned_timeline_and_is_recorded():
    attempt, _ = _next(_diag("LossSpike"), step=11, committed=[2, 4, 6, 8, 10], onset=9, skip_batches=3)
    assert attempt.resume_from == 8 and attempt.set_aside_after == 8
    assert attempt.rollback == Rollback(8, AttemptOverrides(skip_batches=3, skip_from_step=9))
    assert "checkpoints after step 8 are set aside" in attempt.text


def _after(rollback: Rollback, diag: Diagnosis, committed, step: int = 9, **policy):
    history = RecoveryHistory(failures=[FailureRecord(diag.root_cause, step)], restarts=1, rollback=rollback)
    return next_attempt(diag, step, history, RecoveryPolicy(**policy), committed_steps=lambda: list(committed))


ROLLED_BACK = Rollback(8, AttemptOverrides(skip_batches=3, skip_from_step=9))


@pytest.mark.parametrize("root", ["CUDAError", "S3StorageError", "Hang", "Unknown"])
def test_restarts_keep_skipping_until_the_rollback_commits_its_own_checkpoint(root):
    """The rollback's attempt failed before its first checkpoint: the next attempt resumes from
    the newest committed (the rollback's, once the spike's timeline is set aside) and must
    skip the spike's batches again; they live only in the attempts' arguments so far."""
    attempt = _after(ROLLED_BACK, _diag(root), committed=[2, 4, 6, 8])
    assert not attempt.stops and attempt.resume_from is None and attempt.set_aside_after is None
    assert attempt.overrides == ROLLED_BACK.overrides and attempt.rollback == ROLLED_BACK
    assert "still skipping 3 batches from the one step 9 trained" in attempt.text


def test_the_skip_ends_once_the_rollbacks_timeline_has_a_checkpoint():
    # Step 10 was committed by the rollback's attempt: its trainer state records the skip,
    # so skipping again would skip 3 more (healthy) batches.
    attempt = _after(ROLLED_BACK, _diag("CUDAError"), committed=[2, 4, 6, 8, 10], step=11)
    assert attempt.overrides == AttemptOverrides() and attempt.rollback is None


def test_after_an_eviction_the_skip_holds_exactly_as_after_a_restart():
    """An evicted attempt (its GPU lease was lost) resumes from the newest committed checkpoint:
    the rollback's skip goes again only while its timeline has committed nothing (a checkpoint
    of its own records the skip, and skipping twice drops that many healthy batches)."""
    history = RecoveryHistory(rollback=ROLLED_BACK)
    assert after_eviction(history, lambda: [2, 4, 6, 8]) == ROLLED_BACK.overrides
    assert history.rollback == ROLLED_BACK
    assert after_eviction(history, lambda: [2, 4, 6, 8, 10]) == AttemptOverrides()
    assert history.rollback is None
    assert after_eviction(RecoveryHistory(), lambda: [2]) == AttemptOverrides()


def test_an_unlistable_storage_keeps_the_skip():
    def broken():
        raise OSError("S3 list failed")

    history = RecoveryHistory(failures=[FailureRecord("S3StorageError", 9)], rollback=ROLLED_BACK)
    attempt = next_attempt(_diag("S3StorageError"), 9, history, RecoveryPolicy(), committed_steps=broken)
    assert attempt.action is Action.RESTART and attempt.overrides == ROLLED_BACK.overrides


def test_a_stop_carries_no_skip():
    attempt = _after(ROLLED_BACK, _diag("KeyError", restart_helps=False), committed=[8])
    assert attempt.stops and attempt.overrides == AttemptOverrides() and attempt.rollback is None


def test_a_second_spike_before_the_rollback_commits_skips_both_spikes_batches():
    # Rolled back to 8 skipping batches 8-10 (onset 9); the rollback's timeline spikes again at
    # onset 11 (step counter 10 read batch 13) before committing: back to 8, which holds
    # neither skip, so one window covers batches 8..15 (both spikes and the 2 between).
    history = RecoveryHistory(failures=[FailureRecord("LossSpike", 12)], rollback=ROLLED_BACK)
    attempt = next_attempt(_diag("LossSpike"), 12, history, RecoveryPolicy(skip_batches=3),
                           committed_steps=lambda: [2, 4, 6, 8], spike_onset_step=11)
    assert attempt.resume_from == 8
    assert attempt.overrides == AttemptOverrides(skip_batches=8, skip_from_step=9)
    # the same onset again (step counter 8 now reads batch 11): batches 8..13
    again = next_attempt(_diag("LossSpike"), 12, history, RecoveryPolicy(skip_batches=3),
                         committed_steps=lambda: [2, 4, 6, 8], spike_onset_step=9)
    assert again.overrides == AttemptOverrides(skip_batches=6, skip_from_step=9)
    # a spike while replaying the healthy steps before the first onset (onset 8: batch 7):
    # one window from its batch through the first spike's, batches 7..10
    early = next_attempt(_diag("LossSpike"), 12, history, RecoveryPolicy(skip_batches=3),
                         committed_steps=lambda: [2, 4, 6], spike_onset_step=8)
    assert early.resume_from == 6
    assert early.overrides == AttemptOverrides(skip_batches=4, skip_from_step=8)


def test_a_spike_after_the_rollback_committed_skips_only_its_own_batches():
    history = RecoveryHistory(failures=[FailureRecord("LossSpike", 15)], rollback=ROLLED_BACK)
    attempt = next_attempt(_diag("LossSpike"), 15, history, RecoveryPolicy(skip_batches=3),
                           committed_steps=lambda: [8, 10, 12], spike_onset_step=13)
    assert attempt.resume_from == 12  # the rollback's own checkpoint: it holds the first skip
    assert attempt.overrides == AttemptOverrides(skip_batches=3, skip_from_step=13)


def test_a_node_check_that_leaves_no_room_for_the_job_becomes_a_stop_with_the_fix():
    restart = _after(None, _diag("NodeFailure"), committed=[8])
    assert restart.checks_nodes
    why = "job 'j' cannot be placed on cluster 'c' any more ... `forgeflow cluster uncordon NODE --cluster c`"
    stop = restart.cannot_place("node-b failed", ["node-b"], why)
    assert stop.stops and stop.reason == why and stop.suggestion == why
    assert "cordoned ['node-b']" in stop.text and "no plan of the job fits the nodes left" in stop.text


def test_interruptions_stop_a_job_only_when_they_keep_it_from_committing():
    # Slurm's time limit every allocation, each after a new checkpoint: it goes on for ever
    # (test_slurm_time_limit's job), as every interruption moved the newest checkpoint on
    steady = Interruptions()
    assert [steady.record(step, "TIMEOUT") for step in (10, 20, 30, 40, 50)] == [None] * 5
    # a time limit shorter than the checkpoint interval: nothing new after the first commit
    stuck = Interruptions()
    assert stuck.record(10, "TIMEOUT") is None  # the first: it had committed step 10
    assert stuck.record(10, "TIMEOUT") is None and stuck.record(10, "PREEMPTED") is None
    reason = stuck.record(10, "Slurm ended job 7: TIMEOUT")
    assert reason is not None and "3 times in a row" in reason and "newest: step 10" in reason
    assert "Slurm ended job 7: TIMEOUT" in reason and "checkpoint.interval" in reason
    # a node that fails before anything is committed
    never = Interruptions(max_without_progress=2)
    assert never.record(None, "NODE_FAIL") is None
    assert "newest: none" in never.record(None, "NODE_FAIL")
    # progress resets the count
    again = Interruptions()
    for step in (10, 10, 10, 20, 20, 20):
        last = again.record(step, "PREEMPTED")
    assert last is None and again.in_a_row == 2
