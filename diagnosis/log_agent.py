"""The log agent: an LLM proposes filter regexes for log lines no rule covers yet.

Acme (NSDI'24 §6.1) keeps its filter rules growing with an LLM that reads live
log segments. An LLM is not trusted with the filter, though: one bad regex could
hide the error line a diagnosis needs. So, for one segment of uncovered lines:

1. ask the LLM `runs` times (self-consistency) for filter regexes as JSON;
2. keep only regexes proposed by a strict majority of the runs asked (a failed or
   malformed run votes for nothing, so failures can only make adoption rarer);
3. vet each survivor (`diagnosis.proposals.filter_rule_problem`): linear-time
   engine only, not a catch-all, drops no error-signal line, covers a minimum share
   of the segment;
4. adopt the survivors into the job family's rule set; log every rejection with its
   reason.

Lines the LLM points out as errors are checked to be real lines of the segment and
returned, so the caller forwards them to diagnosis and protects them from filters.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

from pydantic import BaseModel, ConfigDict, Field

from diagnosis.llm import ChatLLM, LLMUnavailable, MalformedReply
from diagnosis.proposals import Rejection, filter_rule_problem

if TYPE_CHECKING:
    from diagnosis.filters import FilterRuleSet

logger = logging.getLogger(__name__)


class LogAgentConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    runs: int = Field(default=5, ge=1, le=15, description="self-consistency samples per segment")
    min_share: float = Field(
        default=0.05, gt=0, le=1, description="a filter must cover at least this share of the segment"
    )
    max_prompt_lines: int = Field(default=120, ge=5, description="distinct line shapes shown to the LLM")
    max_line_chars: int = Field(default=300, ge=40)
    temperature: float = Field(default=0.7, ge=0, le=2, description="diversity between the runs")


class FilterProposal(BaseModel):
    model_config = ConfigDict(extra="ignore")

    regex: str = Field(min_length=1, max_length=2000)
    description: str = ""


class FilterReply(BaseModel):
    """The JSON shape the log agent asks for."""

    model_config = ConfigDict(extra="ignore")

    filters: list[FilterProposal] = Field(max_length=50)
    error_lines: list[str] = Field(default_factory=list, max_length=200)


@dataclass(frozen=True)
class AdoptedFilter:
    regex: str
    votes: int
    share: float  # of the segment's lines it covers
    description: str = ""


@dataclass
class LogAgentResult:
    adopted: list[AdoptedFilter] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)
    error_lines: list[str] = field(default_factory=list)  # agent-found, verified in the segment
    runs_asked: int = 0
    runs_answered: int = 0
    failures: list[str] = field(default_factory=list)  # why runs produced no usable answer

    @property
    def runs_failed(self) -> int:
        return self.runs_asked - self.runs_answered


SYSTEM_PROMPT = """You maintain filter rules for the logs of distributed LLM pretraining jobs \
(PyTorch, torchrun, NCCL, Megatron). A filter rule is a regular expression; every log line \
it matches (search semantics, one line at a time) is dropped before diagnosis.
Write rules only for ROUTINE lines that recur: per-step metric lines, init banners, \
framework INFO chatter, recurring harmless warnings. Make each rule specific to one kind \
of line (anchor it, keep fixed words literal, generalise only numbers, hosts and paths). \
Use RE2 syntax: no backreferences, no lookahead or lookbehind.
Never write a rule that could match a line carrying an error, exception, traceback, \
timeout, failure, kill signal or hardware fault. List such lines, copied exactly, in \
"error_lines".
Answer with JSON only, in this shape:
{"filters": [{"regex": "...", "description": "..."}], "error_lines": ["..."]}"""

_DIGITS = re.compile(r"\d+")


def _shape(line: str) -> str:
    return _DIGITS.sub("0", line.strip())


def segment_prompt(lines: Sequence[str], max_lines: int, max_chars: int) -> str:
    """The segment as the LLM sees it: one example per line shape, with repeat counts."""
    counts = Counter(_shape(line) for line in lines if line.strip())
    shown: dict[str, str] = {}
    for line in lines:
        shape = _shape(line)
        if shape and shape not in shown:
            shown[shape] = line.rstrip("\r\n")[:max_chars]
            if len(shown) >= max_lines:
                break
    body = "\n".join(
        f"{text}    [x{counts[shape]}]" if counts[shape] > 1 else text for shape, text in shown.items()
    )
    return (
        f"Log segment ({len(lines)} lines not covered by any filter; one example per line "
        f"shape, [xN] = N similar lines):\n{body}"
    )


class ErrorSignals:
    """Whether a line carries an error signal: an error keyword or any diagnosis-rule match.

    The same definition compression uses to decide what it must never drop.
    """

    def __init__(self, diagnosis_patterns: Iterable[str] = ()):
        from diagnosis.multi_regex import SignalScanner
        from diagnosis.filters import signal_patterns

        patterns, caseless = signal_patterns(tuple(diagnosis_patterns))
        self._scanner = SignalScanner(patterns, caseless)

    def __call__(self, line: str) -> bool:
        return bool(self._scanner.signal_lines(line.encode("utf-8", "replace") + b"\n"))


class LogAgent:
    """Turns uncovered log segments into vetted filter rules."""

    def __init__(
        self,
        llm: ChatLLM,
        *,
        is_error_line: Callable[[str], bool] | None = None,
        config: LogAgentConfig | None = None,
    ):
        self.llm = llm
        if is_error_line is None:
            from diagnosis.rules import DiagnosisLibrary

            is_error_line = ErrorSignals(DiagnosisLibrary.load(None).patterns)
        self.is_error_line = is_error_line
        self.config = config or LogAgentConfig()

    def learn_filters(self, segment_lines: Sequence[str], rules: "FilterRuleSet") -> LogAgentResult:
        """Propose, vet and add the survivors to the job family's rule set (persisted).

        The rule set re-checks every rule itself (`FilterRuleSet.add_rule`); a rule it
        refuses is reported as rejected rather than adopted.
        """
        from diagnosis.multi_regex import RegexError

        result = self.propose_filters(segment_lines, existing=rules.patterns)
        protected = [line for line in segment_lines if line.strip() and self.is_error_line(line)]
        protected += result.error_lines
        adopted: list[AdoptedFilter] = []
        for proposal in result.adopted:
            try:
                rules.add_rule(
                    proposal.regex,
                    source="agent",
                    description=proposal.description or f"log agent, {proposal.votes}/{self.config.runs} votes",
                    protected_lines=protected,
                )
            except RegexError as exc:
                result.rejected.append(Rejection(proposal.regex, f"rule set refused it: {exc}", proposal.votes))
                logger.info("log agent: rule set refused %r: %s", proposal.regex, exc)
                continue
            adopted.append(proposal)
            logger.info("log agent: adopted filter %r for %s", proposal.regex, rules.job_family)
        result.adopted = adopted
        return result

    def propose_filters(self, segment_lines: Sequence[str], *, existing: Iterable[str] = ()) -> LogAgentResult:
        """Ask, vote and vet; adopts nothing itself (see `learn_filters` for that)."""
        config = self.config
        lines = [line.rstrip("\r\n") for line in segment_lines]
        result = LogAgentResult()
        if not any(line.strip() for line in lines):
            return result
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": segment_prompt(lines, config.max_prompt_lines, config.max_line_chars)},
        ]
        needed = config.runs // 2 + 1  # strict majority of the runs asked
        votes: Counter[str] = Counter()
        descriptions: dict[str, str] = {}
        flagged: set[str] = set()
        for _ in range(config.runs):
            result.runs_asked += 1
            try:
                reply = self.llm.chat_json(messages, FilterReply, temperature=config.temperature)
            except LLMUnavailable as exc:
                # The endpoint is down or too slow: asking again would only wait again.
                result.failures.append(str(exc))
                logger.warning("log agent: LLM unavailable, giving up on this segment: %s", exc)
                break
            except MalformedReply as exc:
                result.failures.append(str(exc))
                logger.info("log agent: run %d gave a malformed reply: %s", result.runs_asked, exc)
            else:
                result.runs_answered += 1
                # Regexes are voted on verbatim: whitespace can be part of a pattern.
                run_regexes = {p.regex for p in reply.filters if p.regex.strip()}
                votes.update(run_regexes)
                for proposal in reply.filters:
                    descriptions.setdefault(proposal.regex, proposal.description)
                flagged.update(line.strip() for line in reply.error_lines if line.strip())
            if result.runs_asked - result.runs_answered > config.runs - needed:
                break  # too many runs failed for any regex to reach a majority

        # Error lines: only what really is in the segment (an LLM may paraphrase).
        segment_set = {line.strip() for line in lines}
        result.error_lines = [line for line in dict.fromkeys(l.strip() for l in lines) if line in flagged and line in segment_set]
        error_signal_lines = [line for line in lines if line.strip() and self.is_error_line(line)]
        protected = error_signal_lines + result.error_lines

        already = set(existing)
        for regex, count in votes.most_common():
            if count < needed:
                reason = f"proposed by {count} of {config.runs} runs; a majority needs {needed}"
            elif regex in already:
                reason = "already a rule of this job family"
            else:
                reason = filter_rule_problem(regex, lines, protected, config.min_share)
            if reason:
                result.rejected.append(Rejection(regex=regex, reason=reason, votes=count))
                logger.info("log agent: rejected filter %r (%d votes): %s", regex, count, reason)
                continue
            share = _share(regex, lines)
            result.adopted.append(AdoptedFilter(regex, count, share, descriptions.get(regex, "")))
        return result


def _share(pattern: str, lines: Sequence[str]) -> float:
    from diagnosis.multi_regex import compile_linear

    regex = compile_linear(pattern)
    non_empty = [line for line in lines if line.strip()]
    return sum(1 for line in non_empty if regex.search(line) is not None) / max(len(non_empty), 1)
