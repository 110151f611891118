"""The Python API the flows call: ``diagnose_log(path) -> Diagnosis``.

Pipeline: compress (the job family's filter rules) → diagnosis rules → optional
``agent`` → ``Unknown``.

The agent hook
--------------
``agent`` is any callable ``agent(context: DiagnosisContext) -> Diagnosis | None``. It
runs when no rule named a root cause (and no hang/spike was reported), and also when
the rules found only symptoms (NCCL timeouts, SIGABRT...) while error lines no rule
explains remain (``context.rule_outcome.unexplained``), or named only the class of a
Python exception (``RuleOutcome.generic_only``: ``RuntimeError: <anything>`` is a
RuntimeError to the rules, though the cause may be a CUDA fault or a lost node that a
person confirmed last time; ``DiagnosisAgents`` then looks only for a recurrence of a
past failure); ``context.rule_outcome.diagnosis`` then holds the rules'
answer, which stands if the agent returns ``None``. It gets the
compressed log, the rule matches that were only symptoms, the loaded rule sets and the
state dir, so it can retrieve similar past failures, ask an LLM, and learn (call
``context.library.add_rule(...)`` for a new diagnosis rule or
``context.filter_rules.add_rule(...)`` for a new filter). Returning ``None`` means "no
idea" and the result is ``Unknown`` with low confidence. An exception raised by the
agent is not swallowed where no rule answered: a broken agent must be visible, not a
silent Unknown. Where the rules did answer (the second looks above), it is logged and
the rules' answer stands.

``DiagnosisContext.excerpt()`` is the compact text to embed or send to an LLM: the
error-signal entries first (collapsed, with counts and ranks), then uncovered lines.

Example::

    from diagnosis.api import diagnose_log
    d = diagnose_log("runs/llama/logs/torchrun.log", job_family="llama-7b")
    if d.restart_helps: ...
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Protocol, Sequence, Union

from diagnosis.multi_regex import DEFAULT_ENGINE
from diagnosis.compressed import LogOrigin
from diagnosis.filters import CompressedLog, FilterRuleSet, LogCompressor
from diagnosis.rules import DiagnosisLibrary, RuleOutcome, diagnose_compressed, suspects
from diagnosis.state import state_dir as resolve_state_dir
from diagnosis.vocabulary import Diagnosis, kind_of

UNKNOWN_CONFIDENCE = 0.1
logger = logging.getLogger(__name__)
_TEACH = "forgeflow diagnose LOG --confirm ROOT_CAUSE --restart-helps yes|no"
# What a generic answer's alert adds: the class is all the rules know.
_GENERIC_HINT = ("Only the exception's class is known: if a person finds another cause (a CUDA fault, a lost "
                 f"node...), {_TEACH} makes forgeflow recognise the next occurrence.")


@dataclass
class DiagnosisContext:
    """Everything a failure agent needs about one log."""

    log_path: str
    job_family: str
    compressed: CompressedLog
    rule_outcome: RuleOutcome
    library: DiagnosisLibrary
    filter_rules: FilterRuleSet
    state_dir: Path
    log_paths: list[str] = field(default_factory=list)  # all files when several were given

    def excerpt(self, max_chars: int = 6000) -> str:
        signal = [e.render() for e in self.compressed.signal_entries()]
        uncovered = [e.render() for e in self.compressed.uncovered_entries()]
        text = "\n".join(signal + (["--- lines no rule covers ---"] + uncovered if uncovered else []))
        return text[:max_chars]


class FailureAgent(Protocol):
    def __call__(self, context: DiagnosisContext) -> Diagnosis | None: ...


LogPaths = Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]]


def _as_paths(path: LogPaths) -> list[str]:
    paths = [os.fspath(path)] if isinstance(path, (str, os.PathLike)) else [os.fspath(p) for p in path]
    if not paths:
        raise ValueError("no log file given; pass the job's log path(s)")
    for p in paths:
        if Path(p).is_dir():
            raise IsADirectoryError(f"log file {p!r} is a directory; give a log file (the job's log, not its folder)")
        if not Path(p).is_file():
            raise FileNotFoundError(f"log file {p!r} does not exist; pass the job's log path")
    return paths


def compress_log(
    path: LogPaths,
    job_family: str | None = None,
    state_dir: str | os.PathLike | None = None,
    engine: str = DEFAULT_ENGINE,
    origins: Sequence[LogOrigin | None] | None = None,
) -> tuple[CompressedLog, FilterRuleSet, DiagnosisLibrary]:
    """Compress ``path`` (or several files of one job, e.g. torchrun's output and the
    per-rank logs) with the family's filter rules; also returns the loaded rule sets.
    ``origins``: one per file, whose log it is (``LogOrigin``: a node of the launch)."""
    paths = _as_paths(path)
    if origins is not None and len(origins) != len(paths):
        raise ValueError(f"{len(origins)} log origin(s) for {len(paths)} log file(s): give one per file, "
                         "in the same order (None for a file of no known node)")
    rules = FilterRuleSet.load(job_family, state_dir)
    library = DiagnosisLibrary.load(state_dir, job_family=job_family)  # the rules that apply to this family
    compressor = LogCompressor(rules, library.patterns, engine=engine)
    for p, origin in zip(paths, origins or [None] * len(paths)):
        compressor.origin = origin
        compressor.feed_file(p)
        compressor.end_of_file()
    compressed = compressor.finish()
    compressed.source = ", ".join(paths)
    return compressed, rules, library


def diagnose_log(
    path: LogPaths,
    job_family: str | None = None,
    state_dir: str | os.PathLike | None = None,
    agent: FailureAgent | Callable[[DiagnosisContext], Diagnosis | None] | None = None,
    hang_suspected: bool = False,
    engine: str = DEFAULT_ENGINE,
    spike_suspected: bool = False,
    origins: Sequence[LogOrigin | None] | None = None,
) -> Diagnosis:
    """Diagnose one failed job's log (or the several log files of one job).

    ``origins``: one per file, the node whose console it holds (``LogOrigin``: the name the
    launcher gave the node, and its first global rank when known); the suspect nodes are then
    those names, and torchrun's local ranks become global ranks (``rules.suspects``).

    ``hang_suspected``: the caller saw the heartbeat go stale (no error may be printed
    at all); ``spike_suspected``: the worker left its loss-spike marker. When no rule
    names a cause, the result is then ``Hang`` / ``LossSpike`` instead of asking the
    agent. An error a rule names always wins (an ECC error explains a NaN spike).
    """
    paths = _as_paths(path)
    compressed, rules, library = compress_log(paths, job_family, state_dir, engine, origins)
    outcome = diagnose_compressed(compressed, library)
    second_look = (outcome.symptoms_only and outcome.unexplained) or outcome.generic_only
    if outcome.diagnosis is not None:
        if second_look and agent is not None:
            # Only symptoms matched while error lines no rule explains remain, or only an
            # exception's class was named (the agent may know this failure from before, a
            # person's confirmation say): without an answer the rules' answer stands.
            found = _second_look(agent, _context(paths, rules, compressed, outcome, library, state_dir))
            if found is not None:
                return _attributed(found, compressed)
        if outcome.generic_only:
            return replace(outcome.diagnosis, mitigation=f"{outcome.diagnosis.mitigation} {_GENERIC_HINT}")
        return outcome.diagnosis
    culprit_entries = [m.entry for m in outcome.matches]
    found_suspects = suspects(culprit_entries, compressed).fields()
    evidence = [e.render() for e in culprit_entries[:10]]
    if spike_suspected:
        return Diagnosis(
            root_cause="LossSpike", kind="training", restart_helps=True, confidence=0.8,
            culprit_lines=evidence or [e.render() for e in compressed.entries[-5:]],
            **found_suspects,
            mitigation="Roll back to the last healthy checkpoint before the spike onset and skip the batches that followed.",
            source="rule", rule_name="spike-marker",
        )
    if hang_suspected:
        return Diagnosis(
            root_cause="Hang", kind="training", restart_helps=True, confidence=0.7,
            culprit_lines=evidence or [e.render() for e in compressed.entries[-5:]],
            **found_suspects,
            mitigation="The heartbeat went stale with no error: dump stacks, kill the job, "
                       "run the node check, restart from the last checkpoint.",
            source="rule", rule_name="heartbeat-stale",
        )
    if agent is not None:
        found = agent(_context(paths, rules, compressed, outcome, library, state_dir))
        if found is not None:
            return _attributed(found, compressed)
    return Diagnosis(
        root_cause="Unknown", kind="unknown", restart_helps=False, confidence=UNKNOWN_CONFIDENCE,
        culprit_lines=evidence or [e.render() for e in compressed.signal_entries()[:10]],
        **found_suspects,
        mitigation="No rule knows this failure: a person should read the culprit lines, then teach forgeflow "
                   f"the cause they find ({_TEACH}) "
                   "or write a rule for it (forgeflow rules add).",
        source="none",
    )


def _attributed(diagnosis: Diagnosis, compressed: CompressedLog) -> Diagnosis:
    """An agent's answer, its suspects those of the entries its culprit lines are, where each
    node's log came as that node's (the agent reads lines; the entries know whose they are)."""
    if not compressed.origin_ends:
        return diagnosis
    by_line: dict[str, object] = {}
    for entry in compressed.entries:
        by_line.setdefault(entry.render(), entry)
        by_line.setdefault(entry.text, entry)
    entries = [by_line[line] for line in diagnosis.culprit_lines if line in by_line]
    if not entries:
        return diagnosis
    found = suspects(entries, compressed)
    return replace(diagnosis, suspect_nodes=found.nodes, suspect_ranks=found.ranks,
                   suspect_gpus=found.gpus or diagnosis.suspect_gpus, suspect_local_ranks=found.local_ranks)


def _second_look(agent, context: DiagnosisContext) -> Diagnosis | None:
    """The agent's answer where the rules already named one (``diagnose_log``).

    The rules' answer must survive a broken agent here (a failure memory that cannot be
    opened, an LLM that is down): the error is logged and the rules' answer stands. For a
    bare exception class the agent's answer keeps the rule's culprit lines and suspects
    where it has none (a retrieval vote names hosts only from its guessed lines), so a
    recurrence still gets its node checked and cordoned."""
    try:
        found = agent(context)
    except Exception as exc:  # noqa: BLE001 - any agent failure; the rules' answer is kept
        logger.warning("failure agent failed on a log the rules diagnosed (%s): %s; keeping %s",
                       type(exc).__name__, exc, context.rule_outcome.diagnosis.root_cause)
        return None
    if found is None or not context.rule_outcome.generic_only:
        return found
    rule = context.rule_outcome.diagnosis
    return replace(
        found,
        culprit_lines=found.culprit_lines or rule.culprit_lines,
        suspect_nodes=found.suspect_nodes or rule.suspect_nodes,
        suspect_ranks=found.suspect_ranks or rule.suspect_ranks,
        suspect_gpus=found.suspect_gpus or rule.suspect_gpus,
        suspect_local_ranks=found.suspect_local_ranks or rule.suspect_local_ranks,
    )


def confirmed_diagnosis(
    found: Diagnosis,
    root_cause: str | None = None,
    restart_helps: bool | None = None,
    mitigation: str | None = None,
) -> Diagnosis:
    """What a person says of a diagnosis ``found``: confirmed as it is (no ``root_cause``), or
    corrected to ``root_cause``. A correction must say whether a restart helps (``restart_helps``;
    a wrong default would teach the wrong action); without a ``mitigation`` it says only that.
    Raises ``VocabularyError`` for a root cause outside the vocabulary, and
    ``ValueError`` for a correction without ``restart_helps`` or to ``Unknown``."""
    cause = root_cause or found.root_cause
    kind = kind_of(cause)  # VocabularyError names the causes there are
    if cause == "Unknown":
        raise ValueError("a confirmed diagnosis names a root cause: pass the one the failure had "
                         "(forgeflow diagnose LOG --confirm ROOT_CAUSE --restart-helps yes|no)")
    changed = cause != found.root_cause
    if restart_helps is None:
        if changed:
            raise ValueError(f"--confirm {cause} corrects the diagnosis ({found.root_cause}): also say whether "
                             "a restart helps with --restart-helps yes|no (did relaunching fix it?)")
        restart_helps = found.restart_helps
    if mitigation is None:
        # a rule's mitigation speaks of its own message ("GPU fell off the bus: ..."), so a
        # correction without one says only what is known
        mitigation = found.mitigation.replace(f" {_GENERIC_HINT}", "") if not changed else (
            f"A person diagnosed a failure like this one as {cause} before"
            + ("; a restart helped: restart from the last checkpoint (cordon the suspect node first if it is the node's)."
               if restart_helps else "; a restart did not help: fix the cause before running the job again."))
    return Diagnosis(
        root_cause=cause, kind=kind, restart_helps=restart_helps, confidence=1.0,
        culprit_lines=found.culprit_lines, suspect_nodes=found.suspect_nodes, suspect_ranks=found.suspect_ranks,
        suspect_gpus=found.suspect_gpus, suspect_local_ranks=found.suspect_local_ranks, mitigation=mitigation,
        source="person",
    )


def _context(paths, rules, compressed, outcome, library, state_dir) -> DiagnosisContext:
    return DiagnosisContext(
        log_path=paths[0], job_family=rules.job_family, compressed=compressed,
        rule_outcome=outcome, library=library, filter_rules=rules,
        state_dir=resolve_state_dir(state_dir), log_paths=paths,
    )
