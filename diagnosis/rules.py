"""Rule-based diagnosis: an ordered library of regex → root cause rules, and the choice
of *the* root cause when a log holds several errors.

``DiagnosisLibrary`` = the learned rules that apply to the job family diagnosed (the state
database, ``diagnosis.state.LearnedRuleStore``; checked first: they exist because the seeds
got a failure wrong or missed it; the agent's apply only to the family that learned them until
an operator approves them for every job) followed by the seeds of ``rule_seeds.py``. Each line of the compressed log is named by the first rule
that matches it.

Choosing the root cause among all matched lines (``diagnose_compressed``):

1. symptoms step aside: lines of rules marked ``symptom`` (NCCL watchdog timeouts,
   remote-peer errors, SIGABRT, ChildFailedError, lost c10d store) and rules naming
   ``Unknown`` count only when no other rule matched;
2. survived errors step aside too: an error after whose last occurrence training went
   on before the log's last matched line (``CompressedLog.progress``: an error-free
   stretch of more than ``signals.PROGRESS_STRETCH_LINES`` lines with progress lines in
   it, in the same file and, where both are stamped, ``SURVIVED_AFTER_SECONDS`` later)
   is not what the job died of; it names the cause only when no error the job did not
   survive does (then with lower confidence), and still before any symptom. A cause
   logged just before its symptoms (an Xid, then NCCL timeouts as the job hangs) has no
   progress after it and keeps its precedence, and so does the last error of a log,
   whatever routine output follows it;
3. precedence: hardware (NodeFailure, ECC, NVLink, CUDA) > interconnect and services
   (network, NCCL, connections, S3) > framework > script > training signals (a loss
   spike or a hang explained by an error is that error);
4. the earliest timestamp across ranks, then the more specific rule, then the earliest
   line;
5. a rank killed by a signal explains its peers: when only symptoms matched and the named
   ones are remote-peer errors, a SIGKILL that torchrun recorded is the diagnosis (Unknown:
   a restart in place, suspects where the kill was logged), not the interconnect.

The culprit lines are the matched lines of the chosen root cause, earliest first;
suspects are the nodes, ranks and GPUs of those lines (``suspects``): the nodes whose logs
hold them when each node's log came as that node's, else the hosts the lines name (ranks
mapped to hosts through NCCL's init lines or torchrun's failure summary when the lines
carry no host).
"""

from __future__ import annotations

import functools
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from diagnosis.multi_regex import RegexError, compile_linear, is_catch_all, validate_regex
from diagnosis.compressed import CompressedLog, LogEntry
from diagnosis.rule_seeds import SEED_DIAGNOSIS_RULES
from diagnosis.state import LearnedRuleStore
from diagnosis.vocabulary import Diagnosis, Kind, RootCause, VocabularyError, kind_of

RuleSource = Literal["seed", "agent", "user"]
Review = Literal["proposed", "approved", "rejected"]
Scope = Literal["family", "global"]

# Lower is more fundamental. Hardware faults explain everything above them.
_TIER: dict[str, float] = {
    **{rc: 0 for rc in ("NodeFailure", "ECCError", "NVLinkError", "CUDAError")},
    **{rc: 1 for rc in ("NetworkError", "NCCLRemoteError", "NCCLTimeoutError", "ConnectionError", "S3StorageError")},
    "LossSpike": 4,
    "Hang": 4,
    "Unknown": 9,
}


# A rank killed by a signal (the host's OOM killer, a scheduler, a person) takes its connections
# with it: its peers' "connection closed by peer" / remote errors are that kill, seen from the
# other side, not a fault of the peers' nodes or of the interconnect.
SIGNAL_KILL_RULE = "signal-kill"
KILL_EXPLAINS = frozenset({"NCCLRemoteError"})


def precedence_tier(root_cause: str) -> float:
    if root_cause in _TIER:
        return _TIER[root_cause]
    return {"framework": 2, "script": 3}.get(kind_of(root_cause), 9)


class DiagnosisRule(BaseModel):
    """A regex that names a root cause for the lines it matches."""

    name: str
    pattern: str
    root_cause: RootCause
    restart_helps: bool
    mitigation: str = ""
    symptom: bool = False
    confidence: float = Field(default=0.9, ge=0.0, le=1.0)
    source: RuleSource = "user"
    added_at: float = Field(default_factory=time.time)
    # Who added it and where it applies (learned rules; a seed is approved for every job):
    owner: str = "seed"
    job_family: str | None = None     # the family whose failure taught it
    review: Review = "approved"
    scope: Scope = "global"
    reviewed_by: str | None = None
    reviewed_at: float | None = None

    def applies_to(self, job_family: str | None) -> bool:
        """Whether it names lines of a diagnosis of `job_family`: a proposed rule only in the
        family that learned it, an approved one in its family or (scope global) everywhere."""
        if self.review == "rejected":
            return False
        if self.review == "approved" and self.scope == "global":
            return True
        return self.job_family == job_family

    @property
    def kind(self) -> Kind:
        return kind_of(self.root_cause)

    def matches(self, line: str) -> bool:
        return _compiled(self.pattern).search(line) is not None

    @property
    def generic(self) -> bool:
        """A seed that names only the Python exception's class (``RuntimeError: ...`` ->
        RuntimeError): right when the class is the cause, which on real logs no rule had
        seen was 24 times in 37 (``benchmarks/diagnosis_blind.py``), against 100 in 103
        for the rules that name a cause."""
        return self.source == "seed" and self.name in _GENERIC_SEEDS


@functools.lru_cache(maxsize=4096)
def _compiled(pattern: str):
    return compile_linear(pattern)


# Where timestamps tell, how much later than an error training must have gone on for
# it to count as survived (see the module docstring): more than the step in flight,
# whose step lines other ranks print as the error is.
SURVIVED_AFTER_SECONDS = 30.0


# Generic exception rules match any "XError" line; learned rules are more specific.
_GENERIC_SEEDS = {"runtime", "value", "assertion", "attribute", "os", "type", "key", "index"}


def seed_rules() -> list[DiagnosisRule]:
    rules = []
    for name, pattern, root_cause, restart, mitigation, symptom in SEED_DIAGNOSIS_RULES:
        rules.append(DiagnosisRule(
            name=name, pattern=pattern, root_cause=root_cause, restart_helps=restart,
            mitigation=mitigation, symptom=symptom, source="seed", added_at=0.0,
            confidence=0.7 if name in _GENERIC_SEEDS else 0.9,
        ))
    return rules


class DiagnosisLibrary:
    """The learned rules that apply to one job family (persisted in the state database of a
    state dir) followed by the seeds.

    A rule the failure agent learns is `proposed`: it applies to diagnoses of the family that
    learned it (`job_family`), and to other jobs only once an operator approves it with scope
    global (`forgeflow rules approve NAME --global`); a rejected rule applies to none. A rule
    a person adds is approved (global, or for the family given). `store` is where learned rules
    persist; a library without one (tests, what-if trials of a candidate rule) keeps them in
    memory only.
    """

    def __init__(self, learned: list[DiagnosisRule] | None = None, path: Path | None = None,
                 store: LearnedRuleStore | None = None, job_family: str | None = None):
        self.learned: list[DiagnosisRule] = list(learned or [])
        self.path = path  # kept for callers that pass path=None for an in-memory library
        self.store = store
        self.job_family = job_family
        self._seeds = seed_rules()

    @classmethod
    def load(cls, state: str | os.PathLike | None = None, *, db_url: str | None = None,
             job_family: str | None = None) -> "DiagnosisLibrary":
        """The learned rules that apply to `job_family` (None: diagnoses named no family)."""
        store = LearnedRuleStore(state, db_url)
        return cls(_applying(_validated(store.load(), store.url), job_family), store=store, job_family=job_family)

    @property
    def rules(self) -> list[DiagnosisRule]:
        return self.learned + self._seeds

    @property
    def patterns(self) -> tuple[str, ...]:
        return tuple(r.pattern for r in self.rules)

    def first_match(self, line: str) -> DiagnosisRule | None:
        for rule in self.rules:
            if rule.matches(line):
                return rule
        return None

    def add_rule(
        self,
        pattern: str,
        root_cause: str,
        restart_helps: bool,
        mitigation: str = "",
        name: str | None = None,
        symptom: bool = False,
        source: RuleSource = "agent",
        confidence: float = 0.8,
        must_match: list[str] | tuple[str, ...] = (),
        persist: bool = True,
        owner: str | None = None,
    ) -> DiagnosisRule:
        """Adopt a learned rule; refuses invalid or catch-all regexes with ``RegexError``.

        The agent's rule (``source="agent"``) is proposed for this library's job family; a
        person's (``source="user"``, ``owner`` their name) is approved, for this library's
        family when it has one, else for every job.

        ``must_match`` are the culprit lines the rule was written for: it must match at
        least one of them when given. Checking that it does not change past diagnoses is
        the caller's job (it holds the past failures).
        """
        validate_regex(pattern)
        if is_catch_all(pattern):
            raise RegexError(f"pattern {pattern!r} is a catch-all (matches unrelated lines); make it specific")
        try:
            kind_of(root_cause)
        except VocabularyError as exc:
            raise RegexError(str(exc)) from None
        if must_match and not any(_compiled(pattern).search(line) for line in must_match):
            raise RegexError(f"pattern {pattern!r} matches none of the culprit lines it was written for")
        if any(r.pattern == pattern for r in self.learned):
            raise RegexError(f"pattern {pattern!r} is already a learned rule")

        def make(learned_count: int) -> DiagnosisRule:
            return DiagnosisRule(
                name=name or f"{source}-{root_cause}-{learned_count + 1}",
                pattern=pattern, root_cause=root_cause, restart_helps=restart_helps,
                mitigation=mitigation, symptom=symptom, source=source, confidence=confidence,
                **_review_of_new_rule(source, self.job_family, owner),
            )

        if persist and self.store is not None:
            # One transaction: rules other processes learned meanwhile are kept, and come back too.
            try:
                raw, everything = self.store.add(lambda count: make(count).model_dump())
            except ValueError as exc:
                raise RegexError(f"pattern {pattern!r}: {exc}") from None
            self.learned = _applying(_validated(everything, self.store.url), self.job_family)
            return DiagnosisRule.model_validate(raw)
        rule = make(len(self.learned))
        self.learned.insert(0, rule)  # newest first: it was learned because others missed
        return rule


def learned_rules(state: str | os.PathLike | None = None, *, db_url: str | None = None) -> list[DiagnosisRule]:
    """Every learned rule, whatever its review and family (what `forgeflow rules list` shows)."""
    store = LearnedRuleStore(state, db_url)
    return _validated(store.load(), store.url)


def _review_of_new_rule(source: str, job_family: str | None, owner: str | None) -> dict:
    if source == "user":
        return {"owner": owner or "user", "job_family": job_family, "review": "approved",
                "scope": "family" if job_family else "global", "reviewed_by": owner or "user",
                "reviewed_at": time.time()}
    return {"owner": owner or source, "job_family": job_family, "review": "proposed", "scope": "family"}


def _applying(rules: list[DiagnosisRule], job_family: str | None) -> list[DiagnosisRule]:
    return [r for r in rules if r.applies_to(job_family)]


def _validated(raw_rules: list[dict], where: str) -> list[DiagnosisRule]:
    learned = []
    for raw in raw_rules:
        try:
            rule = DiagnosisRule.model_validate(raw)
            validate_regex(rule.pattern)
        except (ValueError, RegexError) as exc:
            from infra.statedb import redact  # `where` is the database URL: never show its password

            name = raw.get("name") if isinstance(raw, dict) else None
            raise ValueError(f"{redact(where)}: learned rule {name!r} is invalid ({exc}); delete its row from "
                             "the diagnosis_rules table of that database") from None
        learned.append(rule)
    return learned


# --------------------------------------------------------------------------- choosing


@dataclass
class RuleMatch:
    rule: DiagnosisRule
    entry: LogEntry

    @property
    def sort_key(self) -> tuple[float, float, float, int]:
        # precedence tier, then the earliest timestamp across ranks, then the more
        # specific rule (generic "XError:" rules have lower confidence), then file order.
        ts = self.entry.earliest_ts if self.entry.earliest_ts is not None else math.inf
        return (precedence_tier(self.rule.root_cause), ts, -self.rule.confidence, self.entry.first_line)


@dataclass
class RuleOutcome:
    """What the rules found: a diagnosis (None when no cause was named) and all matches.

    ``symptoms_only``: the diagnosis rests on symptom rules alone. ``unexplained``:
    error-signal entries that no rule matched and no filter rule covers (an exception
    line the library does not know, say): when both hold, the real cause is probably
    among them, and ``diagnose_log`` lets the agent look before settling on the symptom.
    ``generic_only``: the diagnosis names only an exception's class (``DiagnosisRule.generic``);
    ``diagnose_log`` lets the agent look too, and the class stands if it finds nothing.
    """

    diagnosis: Diagnosis | None
    matches: list[RuleMatch] = field(default_factory=list)
    symptoms_only: bool = False
    unexplained: list[LogEntry] = field(default_factory=list)
    generic_only: bool = False


def match_entries(compressed: CompressedLog, library: DiagnosisLibrary) -> list[RuleMatch]:
    matches = []
    for entry in compressed.signal_entries():
        rule = library.first_match(entry.text)
        if rule is not None:
            matches.append(RuleMatch(rule, entry))
    return matches


@dataclass(frozen=True)
class Suspects:
    """Where the culprit lines came from: ``nodes`` (the launcher's node names where the
    log files came with origins, else the hosts the lines name), global ``ranks``, GPUs,
    and ``local_ranks`` (node -> torchrun local ranks whose global rank is unknown)."""

    nodes: list[str]
    ranks: list[int]
    gpus: list[str]
    local_ranks: dict[str, list[int]]

    def fields(self) -> dict:
        """As the Diagnosis fields ``suspect_nodes``, ``suspect_ranks``, ``suspect_gpus``,
        ``suspect_local_ranks``."""
        return {"suspect_nodes": self.nodes, "suspect_ranks": self.ranks, "suspect_gpus": self.gpus,
                "suspect_local_ranks": self.local_ranks}


def suspects(culprits: list[LogEntry], compressed: CompressedLog) -> Suspects:
    """The suspects of ``culprits`` (entries of ``compressed``).

    Where culprit lines come from logs with an origin (each node's log given as that node's),
    the suspect nodes are those nodes: a hostname a line prints is not a name the cluster
    knows. Otherwise the hosts the lines name, else those of their ranks (NCCL's init lines,
    torchrun's summary). A torchrun local rank ("[defaultN]:") becomes global through its
    node's first global rank, or stays local to that node when that is unknown; in a log
    without an origin (one node's log) it is the rank."""
    hosts: set[str] = set()
    nodes: set[str] = set()
    ranks: set[int] = set()
    gpus: set[str] = set()
    local: dict[str, set[int]] = {}
    for entry in culprits:
        hosts |= entry.hosts
        ranks |= entry.ranks
        gpus |= entry.gpus
        # an entry not kept line by line: the files of its first and last occurrences
        origins = entry.origins or {(compressed.origin_of_line(line), None) for line in
                                    (entry.first_line, entry.last_line)}
        for origin, local_rank in origins:
            if origin is not None:
                nodes.add(origin.node)
            if local_rank is None:
                continue
            if origin is None:
                ranks.add(local_rank)
            elif origin.first_global_rank is not None:
                ranks.add(origin.first_global_rank + local_rank)
            else:
                local.setdefault(origin.node, set()).add(local_rank)
    found = nodes or hosts or {compressed.rank_hosts[r] for r in ranks if r in compressed.rank_hosts}
    return Suspects(sorted(found), sorted(ranks), sorted(gpus), {n: sorted(r) for n, r in sorted(local.items())})


def diagnose_compressed(
    compressed: CompressedLog, library: DiagnosisLibrary, max_culprit_lines: int = 10
) -> RuleOutcome:
    """Name the root cause of a compressed log with the rules (see module docstring)."""
    matches = match_entries(compressed, library)
    matched = {id(m.entry) for m in matches}
    unexplained = [e for e in compressed.signal_entries() if id(e) not in matched and not e.covered]
    causes = [m for m in matches if not m.rule.symptom and m.rule.root_cause != "Unknown"]
    named = causes or [m for m in matches if m.rule.root_cause != "Unknown"]
    if not named:
        return RuleOutcome(None, matches, unexplained=unexplained)
    # errors the job went on past step aside for the ones it did not survive
    until = max(m.entry.last_line for m in matches)
    fatal = [m for m in named
             if not compressed.progress_after(m.entry, until, SURVIVED_AFTER_SECONDS)]
    pool = fatal or named
    best = min(pool, key=lambda m: m.sort_key)
    killed = [m for m in matches if m.rule.name == SIGNAL_KILL_RULE]
    if not causes and killed and all(m.rule.root_cause in KILL_EXPLAINS for m in pool):
        return _killed_rank(killed, matches, compressed, unexplained, max_culprit_lines)
    culprits = sorted(
        (m for m in pool if m.rule.root_cause == best.rule.root_cause),
        key=lambda m: (m.sort_key[1], m.entry.first_line),
    )
    culprit_entries = [m.entry for m in culprits]
    found = suspects(culprit_entries, compressed)
    confidence = best.rule.confidence
    if not causes:
        confidence *= 0.6  # only symptoms: the real cause may be outside this log
    if not fatal:
        confidence *= 0.8  # training went on past it: what ended the job may be missing
    rivals = {m.rule.root_cause for m in pool
              if not m.rule.symptom and precedence_tier(m.rule.root_cause) == precedence_tier(best.rule.root_cause)}
    if len(rivals) > 1:
        confidence *= 0.85
    diagnosis = Diagnosis(
        root_cause=best.rule.root_cause,
        kind=best.rule.kind,
        restart_helps=best.rule.restart_helps,
        confidence=round(confidence, 3),
        culprit_lines=[e.render() for e in culprit_entries[:max_culprit_lines]],
        **found.fields(),
        mitigation=best.rule.mitigation,
        source="rule",
        rule_name=best.rule.name,
    )
    return RuleOutcome(diagnosis, matches, symptoms_only=not causes, unexplained=unexplained,
                       generic_only=bool(causes) and all(m.rule.generic for m in culprits))


def _killed_rank(killed: list[RuleMatch], matches: list[RuleMatch], compressed: CompressedLog,
                 unexplained: list[LogEntry], max_culprit_lines: int) -> RuleOutcome:
    """Only symptoms matched, the peers' broken connections and a rank killed by a signal: the
    kill is what the log shows first went wrong. It names no root cause of the vocabulary (the
    log does not say who sent the signal), so it is Unknown: a restart in place, no node check,
    the breaker stops a repeat; the suspects are where the kill was logged, not the peers."""
    entries = [m.entry for m in sorted(killed, key=lambda m: (m.sort_key[1], m.entry.first_line))]
    found = suspects(entries, compressed)
    rule = killed[0].rule
    diagnosis = Diagnosis(
        root_cause="Unknown", kind="unknown", restart_helps=True,
        confidence=round(rule.confidence * 0.6, 3),  # symptoms only, as for any symptom diagnosis
        culprit_lines=[e.render() for e in entries[:max_culprit_lines]],
        **found.fields(),
        mitigation=("A rank was killed by a signal (SIGKILL: the host's OOM killer, the scheduler or a person) "
                    "and its peers lost their connections to it: restart in place; if it repeats, check the "
                    "suspect node's memory (dmesg, the job's host RAM) and who sent the signal."),
        source="rule", rule_name=rule.name,
    )
    return RuleOutcome(diagnosis, matches, symptoms_only=True, unexplained=unexplained)
