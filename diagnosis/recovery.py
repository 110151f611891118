"""What to do after a failed attempt: the on-call engineer's decision table.

| what happened                                          | action                          |
|--------------------------------------------------------|---------------------------------|
| restart budget spent                                   | stop                            |
| same root cause at the same step `breaker_count` times | stop (circuit breaker)          |
| loss spike (marker or LossSpike diagnosis)             | roll back before the onset, skip the spike's batches |
|   ... but no checkpoint was committed before the onset  | stop                            |
| hang (stale heartbeats)                                | node check, then restart        |
| transient infrastructure fault (connection, S3, NCCL   | restart in place after backoff  |
|   timeout) with no suspect node                        |                                 |
| any other infrastructure fault                         | node check, cordon, re-place, restart |
| out of memory                                          | stop; suggest the next plan     |
| script / framework error that a restart cannot fix     | stop                            |
| framework error the diagnosis says a restart fixes     | restart in place after backoff  |
| unknown                                                | restart in place after backoff (the breaker stops a repeat) |

`decide` is a pure function of the diagnosis, the attempt and the history, so the
table is unit-tested without launching anything. `next_attempt` turns the decision
into the whole next attempt (`NextAttempt`: which checkpoint to resume from, what the
worker runs differently, the text the alert shows); the flow only carries it out and
records each failure as a `FailedAttempt`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Callable, Sequence

from diagnosis.vocabulary import Diagnosis

TRANSIENT_ROOT_CAUSES = frozenset({"ConnectionError", "S3StorageError", "NCCLTimeoutError"})


class Action(str, Enum):
    RESTART = "restart in place"
    NODE_CHECK_RESTART = "node check, cordon faulty nodes, re-place and restart"
    ROLLBACK = "roll back before the spike and skip its batches"
    STOP = "stop"


@dataclass(frozen=True)
class RecoveryPolicy:
    max_restarts: int = 5
    breaker_count: int = 3  # the same failure at the same step this many times → stop
    backoff_s: float = 5.0  # first backoff of a restart in place; doubles per repeat
    max_backoff_s: float = 300.0
    skip_batches: int = 10  # batches skipped after a spike rollback (PaLM skipped ~200-500)


@dataclass(frozen=True)
class FailureRecord:
    root_cause: str
    step: int


@dataclass
class Decision:
    action: Action
    reason: str
    backoff_s: float = 0.0
    suggestion: str = ""  # for a stop: what a person should change


@dataclass
class RecoveryHistory:
    failures: list[FailureRecord] = field(default_factory=list)
    restarts: int = 0

    def repeats(self, record: FailureRecord) -> int:
        return sum(1 for f in self.failures if f == record)


def decide(
    diagnosis: Diagnosis,
    failed_step: int,
    history: RecoveryHistory,
    policy: RecoveryPolicy,
    oom_suggestion: str = "",
) -> Decision:
    """Choose the action for this failure. `history` must already include it."""
    record = FailureRecord(diagnosis.root_cause, failed_step)
    if history.restarts >= policy.max_restarts:
        return Decision(Action.STOP, f"restart budget spent ({history.restarts}/{policy.max_restarts})")
    if history.repeats(record) >= policy.breaker_count:
        return Decision(
            Action.STOP,
            f"circuit breaker: {diagnosis.root_cause} at step {failed_step} happened "
            f"{history.repeats(record)} times; restarting again would repeat it",
        )
    root = diagnosis.root_cause
    if root == "LossSpike":
        return Decision(Action.ROLLBACK, "the loss spiked and did not recover")
    if root == "Hang":
        return Decision(Action.NODE_CHECK_RESTART, "no progress from some ranks: a node or link may be stuck")
    if root == "OutOfMemoryError":
        return Decision(
            Action.STOP,
            "out of memory: the same plan would fail again",
            suggestion=oom_suggestion or "use more GPUs, recompute activations or a smaller micro batch",
        )
    if diagnosis.kind == "infrastructure":
        if root in TRANSIENT_ROOT_CAUSES and not diagnosis.suspect_nodes:
            return Decision(Action.RESTART, f"transient {root} with no faulty node named", _backoff(history, record, policy))
        return Decision(Action.NODE_CHECK_RESTART, f"{root} points at hardware or interconnect")
    if diagnosis.kind == "unknown":
        return Decision(Action.RESTART, "unknown failure: one restart is cheap; the breaker stops a repeat",
                        _backoff(history, record, policy))
    if diagnosis.restart_helps:
        return Decision(Action.RESTART, f"{root} is expected to pass on a retry", _backoff(history, record, policy))
    return Decision(
        Action.STOP,
        f"{root} ({diagnosis.kind} error) is deterministic: a restart would fail the same way",
        suggestion=diagnosis.mitigation,
    )


def _backoff(history: RecoveryHistory, record: FailureRecord, policy: RecoveryPolicy) -> float:
    earlier = max(0, history.repeats(record) - 1)
    return min(policy.max_backoff_s, policy.backoff_s * (2**earlier))


def rollback_step(committed_steps: list[int], spike_onset_step: int) -> int | None:
    """The newest committed checkpoint taken strictly before the spike began."""
    before = [s for s in committed_steps if s < spike_onset_step]
    return max(before) if before else None


@dataclass(frozen=True)
class AttemptOverrides:
    """What the next attempt's worker runs differently from the job spec, typed.

    `tasks.pretrain_tasks.worker_args` is the one place that turns it into worker arguments."""

    skip_batches: int = 0  # batches skipped after a spike rollback ...
    skip_from_step: int | None = None  # ... from the one the spike's onset step trained


@dataclass(frozen=True)
class NextAttempt:
    """The whole next attempt, as the decision table chose it."""

    action: Action
    reason: str
    text: str  # what is done, for the alert and the failure record
    resume_from: int | None = None  # checkpoint step; None = the newest committed one
    overrides: AttemptOverrides = AttemptOverrides()
    backoff_s: float = 0.0
    suggestion: str = ""  # for a stop: what a person should change

    @property
    def stops(self) -> bool:
        return self.action is Action.STOP

    @property
    def checks_nodes(self) -> bool:
        """Run the node check (and cordon what it finds faulty) before relaunching."""
        return self.action is Action.NODE_CHECK_RESTART

    def after_node_check(self, summary: str, cordoned: Sequence[str], nodes: Sequence[str]) -> "NextAttempt":
        """The same attempt, its text saying what the node check found and where the job now runs."""
        text = f"{self.text} — node check: {summary}"
        if cordoned:
            text += f"; cordoned {list(cordoned)}, re-placed on {list(nodes)}"
        return replace(self, text=text)


def next_attempt(
    diagnosis: Diagnosis,
    failed_step: int,
    history: RecoveryHistory,
    policy: RecoveryPolicy,
    *,
    committed_steps: Callable[[], Sequence[int]] = lambda: (),
    spike_onset_step: int | None = None,
    oom_suggestion: str = "",
) -> NextAttempt:
    """The next attempt after this failure (`history` must already include it).

    `committed_steps` lists the job's committed checkpoint steps; it is called only for a
    rollback (listing touches storage, which may be the thing that just failed)."""
    decision = decide(diagnosis, failed_step, history, policy, oom_suggestion=oom_suggestion)
    action = decision.action
    if action is Action.ROLLBACK:
        onset = failed_step if spike_onset_step is None else spike_onset_step
        resume = rollback_step(list(committed_steps()), onset)
        if resume is None:
            return NextAttempt(
                Action.STOP,
                f"the loss spiked at step {onset} and no checkpoint was committed before it: "
                "there is nothing to roll back to",
                Action.STOP.value,
                suggestion="checkpoint more often (checkpoint.interval) or relax the spike detector (spike.*)",
            )
        # Replay the healthy steps after the checkpoint, then skip from the onset's batch on:
        # skipping from the checkpoint instead would train the spike's batches again.
        return NextAttempt(
            action, decision.reason,
            f"{action.value} — resume from checkpoint step {resume}, replay to step {onset - 1}, "
            f"skip {policy.skip_batches} batches from the one step {onset} trained",
            resume_from=resume,
            overrides=AttemptOverrides(skip_batches=policy.skip_batches, skip_from_step=onset),
        )
    if action is Action.RESTART:
        return NextAttempt(action, decision.reason, f"{action.value} after {decision.backoff_s:.0f}s backoff",
                           backoff_s=decision.backoff_s)
    return NextAttempt(action, decision.reason, action.value, backoff_s=decision.backoff_s,
                       suggestion=decision.suggestion)


@dataclass
class FailedAttempt:
    """One failed attempt of a pretrain flow and what was done about it (`PretrainResult.failures`)."""

    attempt: int
    status: str  # the watcher's verdict: failed, hang, spike (infra.watch.Status)
    step: int  # newest step any rank reported
    root_cause: str
    kind: str
    source: str  # who diagnosed it: rule, llm, retrieval, ...
    action: str  # NextAttempt.text
    reason: str
    seconds_to_detect: float  # launch to detection
    detected_at: float  # wall-clock (time.time()) timestamps, for benchmarks/recovery.py
    diagnosed_at: float
    decided_at: float
    relaunched_at: float | None = None  # set when the next attempt launches

    @classmethod
    def of(cls, attempt: int, status: str, step: int, diagnosis: Diagnosis, next_: NextAttempt, *,
           seconds_to_detect: float, detected_at: float, diagnosed_at: float, decided_at: float) -> "FailedAttempt":
        return cls(attempt, status, step, diagnosis.root_cause, diagnosis.kind, diagnosis.source, next_.text,
                   next_.reason, round(seconds_to_detect, 1), detected_at, diagnosed_at, decided_at)
