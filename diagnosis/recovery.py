"""What to do after a failed attempt: the on-call engineer's decision table.

| what happened                                          | action                          |
|--------------------------------------------------------|---------------------------------|
| restart budget spent                                   | stop                            |
| same root cause at the same step `breaker_count` times | stop (circuit breaker)          |
| loss spike (marker or LossSpike diagnosis)             | roll back before the onset, skip the spike's batches, set aside the checkpoints after the one resumed from |
|   ... but no checkpoint was committed before the onset  | stop                            |
| hang (stale heartbeats)                                | node check, then restart        |
| transient infrastructure fault (connection, S3, NCCL   | restart in place                |
|   timeout) with no suspect node                        |                                 |
| any other infrastructure fault (hardware, interconnect)| node check, cordon, re-place, restart |
| out of memory                                          | stop; suggest the next plan     |
| script / framework error that a restart cannot fix     | stop                            |
| framework error the diagnosis says a restart fixes     | restart in place                |
| unknown (e.g. a stop nobody asked for: infra.watch; a  | restart in place (the breaker stops a repeat) |
|   rank killed by a signal, its peers' broken links)    |                                 |

Act only as much as the diagnosis needs: the node check runs only for a hang or an
infrastructure fault that points at hardware or the interconnect (a software failure
goes straight to the restart), the job is re-placed only when the check cordoned a node
(the flow's part), and a restart in place waits no backoff the first time its failure
happens: `backoff_s` only before a repeat of the same failure at the same step (then
doubling), when the first restart did not fix it.

`decide` is a pure function of the diagnosis, the attempt and the history, so the
table is unit-tested without launching anything. `next_attempt` turns the decision
into the whole next attempt (`NextAttempt`: which checkpoint to resume from, what the
worker runs differently, which checkpoints to set aside first, the text the alert
shows); the flow only carries it out and records each failure as a `FailedAttempt`.

A rollback outlives its own attempt. The checkpoints committed after the one it resumes
from belong to the abandoned (post-spike) timeline: they are set aside before the
relaunch, so "the newest committed checkpoint" that any later restart resumes from is the
rollback's. And its skipped batches live only in the attempts' arguments until the
rollback's timeline commits a checkpoint of its own (whose trainer state records them):
until then every later attempt keeps skipping them (`RecoveryHistory.rollback`).
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
    backoff_s: float = 5.0  # backoff before the first repeat of a failure; doubles per repeat after
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
    rollback: "Rollback | None" = None  # the spike rollback in force (NextAttempt.rollback)

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
    """None the first time this failure happens (a restart usually fixes it: waiting only delays
    the resume); `backoff_s` before its first repeat, doubling on each later one."""
    earlier = history.repeats(record) - 1
    if earlier <= 0:
        return 0.0
    return min(policy.max_backoff_s, policy.backoff_s * (2 ** (earlier - 1)))


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
class Rollback:
    """A spike rollback in force: the checkpoint step it resumed from and what it skips."""

    from_step: int
    overrides: AttemptOverrides


def _covering_window(earlier: Rollback, spike: AttemptOverrides) -> AttemptOverrides:
    """One skip window over the batches of both spikes, for a rollback to a checkpoint that
    predates the rollback in force (so holds neither skip; AttemptOverrides has one window).

    In the earlier rollback's timeline, step counters from its window on read the batches
    after it, so the new spike's batches sit that many positions later. Skipping the few
    healthy batches between the windows costs nothing; training a spike's batch again may
    spike again."""
    first_start = earlier.overrides.skip_from_step - 1
    first_end = first_start + earlier.overrides.skip_batches
    second_start = spike.skip_from_step - 1
    if second_start >= first_start:
        second_start += earlier.overrides.skip_batches
    start = min(first_start, second_start)
    end = max(first_end, second_start + spike.skip_batches)
    return AttemptOverrides(skip_batches=end - start, skip_from_step=start + 1)


def _still_in_force(rollback: Rollback | None, committed_steps: Callable[[], Sequence[int]]) -> Rollback | None:
    """The rollback, while its timeline has no checkpoint after the one it resumed from."""
    if rollback is None:
        return None
    try:
        own = [s for s in committed_steps() if s > rollback.from_step]
    except Exception:  # noqa: BLE001 - listing touches storage, which may be what just failed
        # Keep skipping: if its timeline did commit, at worst a few more healthy batches are
        # skipped; dropping the skip could train the spike's batches again.
        return rollback
    return None if own else rollback


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
    # Before relaunching, set aside every checkpoint committed after this step (a rollback:
    # they are the abandoned timeline's). checkpoint.manifest.set_aside_after does it.
    set_aside_after: int | None = None
    rollback: Rollback | None = None  # the rollback in force for this attempt and later ones

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

    def cannot_place(self, summary: str, cordoned: Sequence[str], why: str) -> "NextAttempt":
        """A stop instead: the node check cordoned `cordoned` and no plan of the job fits the
        nodes left in service (`why`: the orchestrator's refusal, which says how to fix it)."""
        return NextAttempt(Action.STOP, why, f"{Action.STOP.value} — node check: {summary}; cordoned "
                           f"{list(cordoned)}; no plan of the job fits the nodes left", suggestion=why)


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
    """The next attempt after this failure (`history` must already include it, and the
    rollback in force, `history.rollback`, is the one the failed attempt ran under).

    `committed_steps` lists the job's committed checkpoint steps; it is called only for a
    rollback or while one is in force (listing touches storage, which may be the thing
    that just failed)."""
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
        overrides = AttemptOverrides(skip_batches=policy.skip_batches, skip_from_step=onset)
        earlier = history.rollback
        if earlier is not None and resume <= earlier.from_step:
            # Back to a checkpoint from before the rollback in force: it skips neither spike.
            overrides = _covering_window(earlier, overrides)
        return NextAttempt(
            action, decision.reason,
            f"{action.value} — resume from checkpoint step {resume}, replay to step "
            f"{overrides.skip_from_step - 1}, skip {overrides.skip_batches} batches from the one step "
            f"{overrides.skip_from_step} trained; checkpoints after step {resume} are set aside",
            resume_from=resume, overrides=overrides, set_aside_after=resume,
            rollback=Rollback(resume, overrides),
        )
    if action is Action.STOP:
        return NextAttempt(action, decision.reason, action.value, suggestion=decision.suggestion)
    rollback = _still_in_force(history.rollback, committed_steps)
    overrides = rollback.overrides if rollback is not None else AttemptOverrides()
    text = action.value
    if action is Action.RESTART:
        text = (f"{action.value} after {decision.backoff_s:.0f}s backoff" if decision.backoff_s > 0
                else f"{action.value} at once (first time)")
    if rollback is not None:
        text += (f" — still skipping {overrides.skip_batches} batches from the one step "
                 f"{overrides.skip_from_step} trained (the rollback to step {rollback.from_step} "
                 "has committed no checkpoint of its own yet)")
    return NextAttempt(action, decision.reason, text, backoff_s=decision.backoff_s,
                       overrides=overrides, rollback=rollback)


@dataclass
class Interruptions:
    """Attempts ended from outside the job (Slurm's time limit, preemption or node failure; its
    lease lost): not failures, and no restart is spent on them, since each resumes from the newest
    committed checkpoint. But a job interrupted again and again before it commits anything new
    never finishes: a time limit shorter than the checkpoint interval, a node that keeps failing
    under it. `max_without_progress` interruptions in a row with no new committed checkpoint
    stop the job, with the reason and the fix."""

    max_without_progress: int = 3
    in_a_row: int = 0  # interruptions since the newest committed checkpoint last moved
    committed: int | None = None  # the newest committed step at the last interruption

    def record(self, newest_committed: int | None, why: str) -> str | None:
        """Count one interruption (`why`: what ended it; `newest_committed`: the job's newest
        committed checkpoint step now, None for none); the reason to stop, or None to go on.
        Progress is a checkpoint newer than at the previous interruption (at the first, any)."""
        moved = newest_committed is not None and (self.committed is None or newest_committed > self.committed)
        self.in_a_row = 0 if moved else self.in_a_row + 1
        if newest_committed is not None:
            self.committed = newest_committed
        if self.in_a_row < self.max_without_progress:
            return None
        newest = "none" if self.committed is None else f"step {self.committed}"
        return (f"interrupted {self.in_a_row} times in a row with no new checkpoint committed (newest: {newest}; "
                f"the last: {why}): it would never finish. Give each allocation time to commit (a longer time "
                "limit, or a shorter checkpoint.interval), or exclude the node that keeps failing")


def after_eviction(history: RecoveryHistory, committed_steps: Callable[[], Sequence[int]]) -> AttemptOverrides:
    """The overrides of the attempt after an eviction (the job's GPU lease was lost; nothing
    failed): the rollback in force's skip while its timeline has committed nothing of its own,
    as after any restart; none once it has (its checkpoints record the skip, and applying a
    skip again would skip that many more healthy batches). Updates `history.rollback`."""
    history.rollback = _still_in_force(history.rollback, committed_steps)
    return history.rollback.overrides if history.rollback is not None else AttemptOverrides()


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
    culprit: str = ""  # the diagnosis's first culprit line (a hang: who did not join which collective)
    suspect_nodes: list[str] = field(default_factory=list)
    suspect_ranks: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, attempt: int, status: str, step: int, diagnosis: Diagnosis, next_: NextAttempt, *,
           seconds_to_detect: float, detected_at: float, diagnosed_at: float, decided_at: float) -> "FailedAttempt":
        return cls(attempt, status, step, diagnosis.root_cause, diagnosis.kind, diagnosis.source, next_.text,
                   next_.reason, round(seconds_to_detect, 1), detected_at, diagnosed_at, decided_at,
                   culprit=(diagnosis.culprit_lines or [""])[0], suspect_nodes=list(diagnosis.suspect_nodes),
                   suspect_ranks=list(diagnosis.suspect_ranks))
