"""Filter rules and streaming log compression.

A ``FilterRuleSet`` is the list of routine-line regexes for one *job family* (e.g. the
job's config name): forgeflow's seeds (``filter_seeds.py``) plus rules learned for that
family, persisted as ``<state_dir>/filters/<family>.json`` so a resubmitted job reuses
them. ``add_rule`` is what the log agent calls after its own checks; it re-validates.

``LogCompressor`` streams a log through the rule set in large byte chunks:

* lines no rule covers are kept (``CompressedLog.uncovered_segments()`` hands them
  to the log agent);
* lines carrying an error signal (``signals.ERROR_KEYWORDS`` or any diagnosis-rule
  pattern) are always kept, even when a filter rule covers them;
* everything else is dropped;
* kept lines are collapsed by template (ranks, numbers, timestamps normalised), so the
  same message from 512 ranks is one entry with a count and the rank list.

Memory stays bounded whatever the log: the compressor holds one chunk, a partial last
line (capped at ``max_line_bytes``; longer lines are kept truncated, never scanned as
a whole) and the collapsed entries. ``feed_file`` resumes at the offset it reached, so
calling it again on a file that is still being written reads only the new bytes.

Example::

    rules = FilterRuleSet.load("llama-7b-pretrain")
    compressed = compress_file("job.log", rules)
    print(compressed.render())
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Literal, Sequence

from pydantic import BaseModel, Field

from diagnosis.engine import (
    DEFAULT_ENGINE,
    LineFilter,
    RegexError,
    SignalScanner,
    build_line_filter,
    compile_linear,
    is_catch_all,
    validate_regex,
)
from diagnosis.compressed import CompressedLog, CompressionStats, LogEntry
from diagnosis.filter_seeds import SEED_FILTER_RULES
from diagnosis.rules import DiagnosisLibrary
from diagnosis.signals import ERROR_KEYWORDS, format_ranks, has_error_keyword, line_facts
from diagnosis.state import read_json, safe_family_name, state_dir, write_json_atomic

RuleSource = Literal["seed", "agent", "user"]
DEFAULT_FAMILY = "default"
CHUNK_BYTES = 16 << 20
MAX_LINE_BYTES = 64 << 10
# Bounds on distinct (collapsed) entries, so memory stays bounded even for a log whose
# lines no rule knows. Signal entries get a far larger budget than uncovered ones.
MAX_UNCOVERED_ENTRIES = 20_000
MAX_SIGNAL_ENTRIES = 200_000


class FilterRule(BaseModel):
    """One routine-line regex. ``source`` says who wrote it (seed rules are trusted)."""

    name: str
    pattern: str
    source: RuleSource = "user"
    description: str = ""
    added_at: float = Field(default_factory=time.time)


def _seed_rules() -> list[FilterRule]:
    return [FilterRule(name=n, pattern=p, source="seed", added_at=0.0) for n, p in SEED_FILTER_RULES]


class FilterRuleSet:
    """Seed + learned filter rules of one job family; compiled lazily and cached."""

    def __init__(
        self,
        job_family: str = DEFAULT_FAMILY,
        learned: Iterable[FilterRule] = (),
        state_path: Path | None = None,
        include_seeds: bool = True,
    ):
        self.job_family = safe_family_name(job_family)
        self.rules: list[FilterRule] = (_seed_rules() if include_seeds else []) + list(learned)
        self.state_path = state_path

    # ------------------------------------------------------------- persistence
    @staticmethod
    def path_for(job_family: str, state: str | os.PathLike | None = None) -> Path:
        return state_dir(state) / "filters" / f"{safe_family_name(job_family)}.json"

    @classmethod
    def load(cls, job_family: str | None = None, state: str | os.PathLike | None = None) -> "FilterRuleSet":
        """The family's rule set: seeds plus whatever was learned and saved for it."""
        family = job_family or DEFAULT_FAMILY
        path = cls.path_for(family, state)
        data = read_json(path) or {}
        learned = []
        for i, raw in enumerate(data.get("rules", [])):
            try:
                rule = FilterRule.model_validate(raw)
                validate_regex(rule.pattern)
            except (ValueError, RegexError) as exc:
                raise ValueError(f"{path}: rule #{i} is invalid ({exc}); remove it from the file") from None
            learned.append(rule)
        return cls(family, learned, state_path=path)

    def save(self) -> None:
        if self.state_path is None:
            raise ValueError("this rule set was not loaded from a state dir; use FilterRuleSet.load()")
        learned = [r.model_dump() for r in self.rules if r.source != "seed"]
        write_json_atomic(self.state_path, {"job_family": self.job_family, "rules": learned})

    # ------------------------------------------------------------- rules
    @property
    def patterns(self) -> tuple[str, ...]:
        return tuple(r.pattern for r in self.rules)

    @property
    def trusted(self) -> bool:
        return all(r.source == "seed" for r in self.rules)

    def line_filter(self, engine: str = DEFAULT_ENGINE) -> LineFilter:
        # build_line_filter caches by rule text: recompiles only when the rules change.
        return build_line_filter(self.patterns, engine=engine, trusted=self.trusted)

    def covers(self, line: str) -> list[FilterRule]:
        """Rules that cover ``line`` (RE2, one line at a time: for tests and tools)."""
        return [r for r in self.rules if compile_linear(r.pattern).search(line) is not None]

    def add_rule(
        self,
        pattern: str,
        name: str | None = None,
        source: RuleSource = "agent",
        description: str = "",
        protected_lines: Sequence[str] = (),
        persist: bool = True,
    ) -> FilterRule:
        """Adopt a new routine-line rule after checking it cannot hide an error.

        Raises ``RegexError`` naming the reason when the pattern does not compile in the
        linear-time engines, is a catch-all, or matches an error-signal probe or any of
        ``protected_lines`` (pass the error lines of the segment it was learned from).
        """
        validate_regex(pattern)
        if is_catch_all(pattern):
            raise RegexError(f"pattern {pattern!r} is a catch-all (matches unrelated lines); make it specific")
        regex = compile_linear(pattern)
        for line in list(ERROR_PROBES) + list(protected_lines):
            if regex.search(line) is not None:
                raise RegexError(
                    f"pattern {pattern!r} matches an error-signal line {line[:120]!r}; "
                    "filter rules may only cover routine lines"
                )
        if any(r.pattern == pattern for r in self.rules):
            raise RegexError(f"pattern {pattern!r} is already in the {self.job_family!r} rule set")
        rule = FilterRule(
            name=name or f"{source}-{len(self.rules) + 1}",
            pattern=pattern,
            source=source,
            description=description,
        )
        self.rules.append(rule)
        if persist and self.state_path is not None:
            self.save()
        return rule

    def remove_rule(self, name: str, persist: bool = True) -> None:
        kept = [r for r in self.rules if not (r.name == name and r.source != "seed")]
        if len(kept) == len(self.rules):
            raise KeyError(f"no learned rule named {name!r} in {self.job_family!r}")
        self.rules = kept
        if persist and self.state_path is not None:
            self.save()


# Lines every filter must leave alone: one per error keyword family plus typical stacks.
ERROR_PROBES: tuple[str, ...] = (
    "Traceback (most recent call last):",
    "[rank3]: RuntimeError: CUDA error: an illegal memory access was encountered",
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
    "node-a03:2281:2401 [3] NCCL WARN NET/IB : Got completion with error 12",
    "[rank5]:[E1122 07:41:02.123456 ProcessGroupNCCL.cpp:616] [Rank 5] Watchdog caught collective operation timeout",
    "[2026-11-22 07:41:02,123] [rank3] step=120 loss=nan lr=1.0e-04 grad_norm=nan tokens_per_s=1200 elapsed_s=10.1",
    "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus.",
    "FORGEFLOW_LOSS_SPIKE onset_step=1200 last_healthy_step=1100",
    "Segmentation fault (core dumped)",
    "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:",
    "  exitcode  : -6 (pid: 12345)",
    # error shapes without an error word (signals.ERROR_SHAPES)
    "[rank2]:   what():  std::bad_alloc",
    "[rank4]: DataLoader worker (pid(s) 4242) exited unexpectedly",
    "[rank0]: UserWarning: Detected call of `lr_scheduler.step()` before `optimizer.step()`.",
    "slurmstepd: *** JOB 4242 ON node-a02 CANCELLED AT 2026-11-22T07:41:02 DUE TO TIME LIMIT ***",
)


# --------------------------------------------------------------------------- compressor


def signal_patterns(diagnosis_patterns: Iterable[str] = ()) -> tuple[list[str], list[bool]]:
    patterns = [p for _, p, _ in ERROR_KEYWORDS]
    caseless = [c for _, _, c in ERROR_KEYWORDS]
    for p in diagnosis_patterns:
        patterns.append(p)
        caseless.append(False)
    return patterns, caseless


class LogCompressor:
    """Streaming compressor: ``feed`` bytes (or ``feed_file``), then ``result()``."""

    def __init__(
        self,
        rules: FilterRuleSet | None = None,
        diagnosis_patterns: Iterable[str] | None = None,
        engine: str = DEFAULT_ENGINE,
        max_line_bytes: int = MAX_LINE_BYTES,
        chunk_bytes: int = CHUNK_BYTES,
        max_uncovered_entries: int = MAX_UNCOVERED_ENTRIES,
        max_signal_entries: int = MAX_SIGNAL_ENTRIES,
    ):
        self.rules = rules or FilterRuleSet()
        if diagnosis_patterns is None:
            diagnosis_patterns = DiagnosisLibrary.load(None).patterns
        self._filter = self.rules.line_filter(engine)
        self._signals = _cached_scanner(tuple(diagnosis_patterns))
        self.max_line_bytes = max_line_bytes
        self.chunk_bytes = chunk_bytes
        self.max_entries = {True: max_signal_entries, False: max_uncovered_entries}
        self._entry_counts = {True: 0, False: 0}
        self.stats = CompressionStats()
        self._entries: dict[str, LogEntry] = {}
        self._pending = b""
        self._overlong: bytearray | None = None  # head of a line longer than we buffer
        self._overlong_len = 0
        self._line_no = 0  # lines completed so far
        self._file_offsets: dict[str, int] = {}
        self.rank_hosts: dict[int, str] = {}
        self._summary_host: tuple[str, int] | None = None  # (host, line) of "host : X"
        # uncovered line with its digits zeroed -> its entry (see _process)
        self._fast_entries: dict[bytes, object] = {}

    # ---------------------------------------------------------------- feeding
    def feed(self, data: bytes) -> None:
        started = time.perf_counter()
        self.stats.bytes_in += len(data)
        if self._overlong is not None:
            nl = data.find(b"\n")
            if nl < 0:
                self._extend_overlong(data)
                self.stats.seconds += time.perf_counter() - started
                return
            self._extend_overlong(data[:nl])
            self._finish_overlong()
            data = data[nl + 1:]
        buf = self._pending + data if self._pending else data
        cut = buf.rfind(b"\n")
        if cut < 0:
            self._pending = buf
        else:
            self._pending = buf[cut + 1:]
            self._process(buf[: cut + 1])
        if len(self._pending) > max(self.chunk_bytes, self.max_line_bytes):
            # A line longer than we are willing to buffer: keep its head, skip the rest.
            self._overlong = bytearray(self._pending[: self.max_line_bytes])
            self._overlong_len = len(self._pending)
            self._pending = b""
        self.stats.seconds += time.perf_counter() - started

    def _extend_overlong(self, data: bytes) -> None:
        room = self.max_line_bytes - len(self._overlong)
        if room > 0:
            self._overlong += data[:room]
        self._overlong_len += len(data)

    def _finish_overlong(self) -> None:
        # Never scanned as a whole, so never dropped: kept (truncated) as uncovered.
        text = bytes(self._overlong).decode("utf-8", "replace")
        self._line_no += 1
        self.stats.lines_in += 1
        self.stats.lines_truncated += 1
        self._keep(text + f" ...[truncated: line of {self._overlong_len} bytes]",
                   signal=has_error_keyword(text), covered=False, truncated=True)
        self._overlong = None
        self._overlong_len = 0

    def feed_file(self, path: str | os.PathLike) -> int:
        """Read ``path`` from where the last call stopped up to its current end.

        Returns the number of new bytes. Safe on a file that is still being written:
        a trailing partial line waits for the next call (or ``finish()``).
        """
        key = os.fspath(path)
        offset = self._file_offsets.get(key, 0)
        read = 0
        with open(key, "rb") as handle:
            if os.fstat(handle.fileno()).st_size < offset:
                offset = 0  # truncated/rotated: start over
            handle.seek(offset)
            while True:
                chunk = handle.read(self.chunk_bytes)
                if not chunk:
                    break
                if not chunk.endswith(b"\n"):
                    # Finish the line here so feed() need not split and copy the chunk.
                    chunk += handle.readline(self.max_line_bytes)
                self.feed(chunk)
                read += len(chunk)
        self._file_offsets[key] = offset + read
        return read

    def end_of_file(self) -> None:
        """The current file is complete: its last line ends even without a newline
        (call between files when compressing several logs of one job)."""
        if self._overlong is not None:
            self._finish_overlong()
        if self._pending:
            pending, self._pending = self._pending, b""
            self._process(pending + b"\n")

    def finish(self) -> CompressedLog:
        """Flush the last line (even without a trailing newline) and return the result."""
        self.end_of_file()
        return self.result()

    def result(self) -> CompressedLog:
        entries = sorted(self._entries.values(), key=lambda e: e.first_line)
        return CompressedLog(entries=entries, stats=self.stats, rank_hosts=dict(self.rank_hosts))

    def _pair_summary(self, text: str, line_no: int) -> None:
        # torchrun's failure summary prints "host : X" and then "rank : N (local_rank: L)".
        host = _SUMMARY_HOST.match(text)
        if host:
            self._summary_host = (host.group(1), line_no)
            return
        rank = _SUMMARY_RANK.match(text)
        if rank and self._summary_host and line_no - self._summary_host[1] <= 3:
            self.rank_hosts.setdefault(int(rank.group(1)), self._summary_host[0])

    # ---------------------------------------------------------------- scanning
    def _process(self, buf: bytes) -> None:
        """Scan complete lines: uncovered lines from the filter, signals from the scanner."""
        uncovered = self._filter.uncovered_lines(buf)
        signals = self._signals.signal_lines(buf)
        for start, end in _RANK_HOST_SCANNER.signal_lines(buf):
            found = _NCCL_RANK_HOST.search(buf[start:end].decode("utf-8", "replace"))
            if found:
                self.rank_hosts.setdefault(int(found.group(2)), found.group(1))
        first_line = self._line_no
        if not uncovered and not signals:
            lines = buf.count(b"\n")
            self._line_no += lines
            self.stats.lines_in += lines
            return
        signal_ends = dict(signals)
        spans = uncovered
        uncovered_starts: set[int] | dict = {}
        if signal_ends:
            uncovered_starts = {start for start, _ in uncovered}
            covered_signals = [span for span in signals if span[0] not in uncovered_starts]
            if covered_signals:
                spans = sorted(uncovered + covered_signals)
        line_no = first_line
        cursor = 0
        fast_get = self._fast_entries.get
        max_line = self.max_line_bytes
        repeats = repeat_bytes = overflow = 0
        for start, end in spans:
            line_no += buf.count(b"\n", cursor, start)
            cursor = start
            raw = buf[start:end]
            signal = start in signal_ends
            if not signal and end - start <= max_line:
                # The common case, inlined: a repeat of a known uncovered message.
                key = raw.translate(_DIGITS_TO_ZERO).replace(b"00", b"0").replace(b"00", b"0").replace(b"00", b"0")
                entry = fast_get(key)
                if entry is None:
                    self._keep_uncovered(raw, key, line_no + 1)
                elif entry is _OVERFLOW:
                    overflow += 1  # a repeat of a message met after the entry budget was spent
                elif entry is not _BLANK:
                    entry.count += 1
                    entry.last_line = line_no + 1
                    repeats += 1
                    repeat_bytes += end - start + 1
                    if raw[:1] in _PREFIX_STARTS:
                        self._prefix_facts(raw, key, entry, line_no + 1)
                continue
            truncated = len(raw) > self.max_line_bytes
            if truncated:
                raw = raw[: self.max_line_bytes]
            text = raw.decode("utf-8", "replace").rstrip("\r")
            if not text.strip() and not signal:
                continue  # blank lines carry nothing
            if truncated:
                self.stats.lines_truncated += 1
                text += f" ...[truncated: line of {end - start} bytes]"
            covered = signal and start not in uncovered_starts
            self._keep(text, signal, covered, truncated, line_no + 1)
        self.stats.lines_kept += repeats
        self.stats.lines_uncovered += repeats
        self.stats.uncovered_overflow += overflow
        self.stats.bytes_kept += repeat_bytes
        # One counting pass over the buffer in all: up to each kept line, then the rest.
        lines = line_no - first_line + buf.count(b"\n", cursor)
        self._line_no = first_line + lines
        self.stats.lines_in += lines

    def _keep_uncovered(self, raw: bytes, key: bytes, line_no: int) -> None:
        """Count the first line of a message no rule covers (no error signal either).

        Such routine lines can be most of a log from a stack the seed rules do not
        know, so ``_process`` handles a repeat without any regex: the line with each
        digit run as one ``0`` (``key``) finds its entry in a dict and bumps its count.
        A new key gets a light template (the key without its rank prefix); once the
        uncovered budget is spent, a message of a new template is counted as overflow.
        Timestamps, hosts and GPUs are not parsed: diagnosis reads them from
        error-signal entries only.
        """
        fast = self._fast_entries
        if not raw.strip():
            fast[key] = _BLANK  # blank lines carry nothing
            return
        # The key already has digit runs (up to 8 long) as one "0"; the template also
        # drops the launcher's rank prefix, so "[rank3]:" and "[rank12]:" lines merge.
        body = key
        for prefix in _KEY_PREFIXES:
            if key.startswith(prefix):
                body = key[len(prefix):]
                break
        template = "U|" + body.decode("utf-8", "replace").strip()
        entry = self._entries.get(template)
        if entry is None:
            if self._entry_counts[False] >= self.max_entries[False]:
                self.stats.uncovered_overflow += 1  # budget spent: a new message
                if len(fast) >= _MAX_FAST_KEYS:
                    fast.clear()
                fast[key] = _OVERFLOW  # its repeats are counted in _process without this call
                return
            self._entry_counts[False] += 1
            text = raw.decode("utf-8", "replace").rstrip("\r")
            entry = LogEntry(text=text, template=template, first_line=line_no, last_line=line_no, count=0)
            self._entries[template] = entry
        if len(fast) >= _MAX_FAST_KEYS:
            fast.clear()  # only a cache: memory stays bounded
        fast[key] = entry
        entry.count += 1
        entry.last_line = line_no
        self.stats.lines_kept += 1
        self.stats.lines_uncovered += 1
        self.stats.bytes_kept += len(raw) + 1
        if raw[:1] in _PREFIX_STARTS:
            self._prefix_facts(raw, key, entry, line_no)

    def _prefix_facts(self, raw: bytes, key: bytes, entry: LogEntry, line_no: int) -> None:
        """The rank a launcher prefix names, and torchrun's summary pairs, of one line."""
        if raw.startswith(b"[rank"):  # torchrun's "[rank3]:", most prefixed lines: no regex
            close = raw.find(b"]:", 5, 11)
            if close > 5 and raw[5:close].isdigit():
                entry.ranks.add(int(raw[5:close]))
        else:
            prefix = _RANK_PREFIX_BYTES.match(raw)
            rank = prefix.group(2) or prefix.group(1)
            if rank is not None:
                entry.ranks.add(int(rank))
        if b"host" in key or b"local_rank" in key:  # torchrun's failure summary
            self._pair_summary(raw.decode("utf-8", "replace").rstrip("\r"), line_no)

    def _keep(
        self, text: str, signal: bool, covered: bool, truncated: bool, line_no: int | None = None
    ) -> LogEntry | None:
        """Count a kept line into its entry; ``None`` when the entry budget is spent."""
        line_no = self._line_no if line_no is None else line_no
        self.stats.lines_kept += 1
        self.stats.bytes_kept += len(text) + 1
        if signal:
            self.stats.lines_signal += 1
        elif not covered:
            self.stats.lines_uncovered += 1
        facts = line_facts(text[:4096])
        self._pair_summary(text, line_no)
        key = ("S|" if signal else "U|") + facts.template
        entry = self._entries.get(key)
        if entry is None:
            if self._entry_counts[signal] >= self.max_entries[signal]:
                if signal:
                    self.stats.signal_overflow += 1
                else:
                    self.stats.uncovered_overflow += 1
                return None
            self._entry_counts[signal] += 1
            entry = LogEntry(text=text, template=facts.template, first_line=line_no,
                             last_line=line_no, signal=signal, covered=covered, truncated=truncated)
            self._entries[key] = entry
        else:
            entry.count += 1
            entry.last_line = line_no
        if facts.rank is not None:
            entry.ranks.add(facts.rank)
        if facts.host:
            entry.hosts.add(facts.host)
        if facts.gpu:
            entry.gpus.add(facts.gpu)
        if facts.timestamp is not None and (entry.earliest_ts is None or facts.timestamp < entry.earliest_ts):
            entry.earliest_ts = facts.timestamp
        return entry


_SCANNERS: dict[tuple[str, ...], SignalScanner] = {}
_DIGITS_TO_ZERO = bytes.maketrans(b"123456789", b"000000000")
_BLANK = object()
_OVERFLOW = object()  # fast-path marker: a message with no entry because the budget was spent
# first bytes of lines that may carry a rank prefix or torchrun's summary ("  host : X")
_PREFIX_STARTS = b"[0123456789 "
# signals._RANK_PREFIX for bytes; groups: 1 = srun label, 2 = torchrun's rank
_RANK_PREFIX_BYTES = re.compile(rb"^(?:\d{4}-\d\d-\d\dT[\d:.]+Z )?(?:(\d{1,5}): )?(?:\[(?:rank|default)(\d{1,5})\]:)?")
_KEY_PREFIXES = (b"[rank0]:", b"[default0]:", b"0: ")
_MAX_FAST_KEYS = 200_000
_NCCL_RANK_HOST_PATTERN = r"([A-Za-z][\w.-]*):\d+:\d+ \[\d+\] NCCL INFO comm 0x[0-9a-fA-F]+ rank (\d+) nranks \d+"
_RANK_HOST_SCANNER = SignalScanner([_NCCL_RANK_HOST_PATTERN], [False])
_NCCL_RANK_HOST = re.compile(_NCCL_RANK_HOST_PATTERN)
_SUMMARY_HOST = re.compile(r"^(?:\S*\]:)?\s*host\s*:\s*([A-Za-z][\w.-]*)\s*$")
_SUMMARY_RANK = re.compile(r"^(?:\S*\]:)?\s*rank\s*:\s*(\d+)")


def _cached_scanner(diagnosis_patterns: tuple[str, ...]) -> SignalScanner:
    scanner = _SCANNERS.get(diagnosis_patterns)
    if scanner is None:
        patterns, caseless = signal_patterns(diagnosis_patterns)
        scanner = SignalScanner(patterns, caseless)
        if len(_SCANNERS) > 16:
            _SCANNERS.clear()
        _SCANNERS[diagnosis_patterns] = scanner
    return scanner


def compress_file(
    path: str | os.PathLike,
    rules: FilterRuleSet | None = None,
    diagnosis_patterns: Iterable[str] | None = None,
    engine: str = DEFAULT_ENGINE,
) -> CompressedLog:
    """Compress a whole log file (as far as it is written now)."""
    compressor = LogCompressor(rules, diagnosis_patterns, engine=engine)
    compressor.feed_file(path)
    result = compressor.finish()
    result.source = os.fspath(path)
    return result
