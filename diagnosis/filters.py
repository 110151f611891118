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

import gc
import os
import re
import time
from bisect import bisect_left
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from itertools import compress, repeat
from operator import is_, mul, not_
from typing import Iterable, Literal, Sequence

import numpy as np
import re2
from pydantic import BaseModel, Field

from diagnosis.multi_regex import (
    DEFAULT_ENGINE,
    LineFilter,
    RegexError,
    SignalScanner,
    _re2_options,
    build_line_filter,
    compile_linear,
    is_catch_all,
    validate_regex,
)
from diagnosis.compressed import CompressedLog, CompressionStats, LogEntry, LogOrigin
from diagnosis.native import BLANK as native_BLANK, OVERFLOW as native_OVERFLOW, line_scan_for, native_failure
from diagnosis.filter_seeds import SEED_FILTER_RULES
from diagnosis.rules import DiagnosisLibrary
from diagnosis.signals import (
    ERROR_KEYWORDS, PROGRESS_PATTERN, PROGRESS_STRETCH_LINES, format_ranks, has_error_keyword, line_facts,
    parse_timestamp,
)
from diagnosis.state import read_json, safe_family_name, state_dir, write_json_atomic

RuleSource = Literal["seed", "agent", "user"]
DEFAULT_FAMILY = "default"
CHUNK_BYTES = 16 << 20
PIECE_BYTES = 1 << 20  # what _process scans at a time (see _process_pieces)
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
        native: bool | None = None,
    ):
        """``native``: use the native line pass (``diagnosis.native``, built at install)
        with the ``re2`` engine; None (default) where it was built, False never (the
        pure-Python scan, same result), True or raise ``RuntimeError`` saying why it cannot."""
        self.rules = rules or FilterRuleSet()
        if diagnosis_patterns is None:
            diagnosis_patterns = DiagnosisLibrary.load(None).patterns
        self._filter = self.rules.line_filter(engine)
        self._native = None if native is False else line_scan_for(self._filter)
        if native and self._native is None:
            raise RuntimeError(f"the native line pass is not available: {native_failure() or 'engine ' + engine}")
        # the native pass has no per-line Python lists to keep in the CPU caches: a
        # chunk of feed_file (a line completed) is one piece, not copied
        self._piece_bytes = PIECE_BYTES if self._native is None else chunk_bytes + max_line_bytes
        self._native_prints_sent = False  # entry fingerprints handed to the C pass
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
        # letter fingerprint (_NOT_PRINT) of every uncovered entry's template (see _resolve_new_keys)
        self._entry_prints: set[bytes] = set()
        self._rank_spans: dict[bytes, slice | None] = {}  # key -> where its rank sits
        self._progress: list[tuple[int, float | None]] = []  # see CompressedLog.progress
        self._last_signal_line = 0
        self._since_signal: tuple[int, float | None] | None = None  # last progress after it
        self._tail_from: int | None = None
        self._file_ends: list[int] = []
        # whose log the file being fed is (a node's, as the launcher named it): set it before
        # feeding each file; error-signal entries record it (LogEntry.origins)
        self.origin: LogOrigin | None = None
        self._origin_ends: list[tuple[int, LogOrigin | None]] = []

    # ---------------------------------------------------------------- feeding
    def feed(self, data: bytes) -> None:
        with _collector_paused():
            self._feed(data)

    def _feed(self, data: bytes) -> None:
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
            self._process_pieces(buf[: cut + 1])
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
        if not self._file_ends or self._line_no > self._file_ends[-1]:
            self._file_ends.append(self._line_no)
            self._origin_ends.append((self._line_no, self.origin))

    def finish(self) -> CompressedLog:
        """Flush the last line (even without a trailing newline) and return the result."""
        self.end_of_file()
        return self.result()

    def result(self) -> CompressedLog:
        entries = sorted(self._entries.values(), key=lambda e: e.first_line)
        return CompressedLog(entries=entries, stats=self.stats, rank_hosts=dict(self.rank_hosts),
                             progress=list(self._progress), file_ends=list(self._file_ends),
                             origin_ends=list(self._origin_ends) if any(o for _, o in self._origin_ends) else [])

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
    def _process_pieces(self, buf: bytes) -> None:
        """``_process`` a buffer of complete lines in pieces of about ``PIECE_BYTES``
        (cut at a newline): the per-line lists of one piece stay in the CPU caches,
        which pays more than the per-piece calls cost. Pieces give the same result as
        the whole buffer."""
        size = len(buf)
        pos = 0
        piece = self._piece_size()
        while size - pos > piece:
            end = buf.rfind(b"\n", pos, pos + piece) + 1
            if end <= pos:  # a line longer than a piece
                end = buf.find(b"\n", pos + piece) + 1 or size
            self._process(buf[pos:end])
            pos = end
            piece = self._piece_size()
        if pos < size:
            self._process(buf[pos:] if pos else buf)

    def _piece_size(self) -> int:
        """PIECE_BYTES; with the native pass, a whole chunk once the uncovered budget is
        spent (no per-line lists to keep in the caches; the chunk is not copied). Until
        then 1 MB pieces: where the budget runs out inside a piece, each new key after
        that point goes through Python one by one."""
        if self._native is None or self._entry_counts[False] < self.max_entries[False]:
            return PIECE_BYTES
        return self._piece_bytes

    def _process(self, buf: bytes) -> None:
        self._tail_from = None  # where the lines after buf's last signal line start
        self._scan(buf)
        # the last progress since the last signal line (CompressedLog.progress)
        if self._tail_from is None:
            self._since_signal = self._last_progress_mark(buf, 0) or self._since_signal
        else:
            self._since_signal = self._last_progress_mark(buf, self._tail_from)

    def _scan(self, buf: bytes) -> None:
        """Scan complete lines: uncovered lines from the filter, signals from the scanner.

        Uncovered lines are handled in bulk: each one's key (the line with every digit
        as ``0``) is made and looked up by C-level ``map`` calls, and the repeats of
        known messages are counted per distinct key (``Counter``), not per line. Only
        the lines whose outcome depends on their order go through Python one by one,
        in line order: error-signal lines, the first line of a key not seen before
        (it may open an entry or spend the budget), lines over ``max_line_bytes`` and
        candidates for torchrun's failure summary (``host :``/``rank :`` pairs).
        """
        if self._native is not None:
            self._scan_native(buf)
            return
        starts, ends = self._filter.uncovered_spans(buf)
        signals, rank_host_lines = self._signals.scan(buf)
        self._note_rank_hosts(buf, rank_host_lines)
        first_line = self._line_no
        stats = self.stats
        if not starts and not signals:
            lines = buf.count(b"\n")
            self._line_no += lines
            stats.lines_in += lines
            return
        newlines = np.flatnonzero(np.frombuffer(buf, dtype=np.uint8) == 10)
        total_lines = len(newlines)
        uncovered_signals: set[int] = set()
        if signals:
            signal_lines = (np.searchsorted(newlines, [s for s, _ in signals]) + first_line + 1).tolist()
            self._note_signal_progress(buf, signals, signal_lines,
                                       lambda offset, _: int(np.searchsorted(newlines, offset)))
            # Signal lines are kept by _keep (one by one); take them out of the bulk.
            drop = []
            for start, _ in signals:
                i = bisect_left(starts, start)
                if i < len(starts) and starts[i] == start:
                    drop.append(i)
                    uncovered_signals.add(start)
            if drop:
                keep_starts, keep_ends, prev = [], [], 0
                for i in drop:
                    keep_starts += starts[prev:i]
                    keep_ends += ends[prev:i]
                    prev = i + 1
                starts = keep_starts + starts[prev:]
                ends = keep_ends + ends[prev:]
        n = len(starts)
        raws = list(map(buf.__getitem__, map(slice, starts, ends)))
        keys = list(map(bytes.translate, raws, repeat(_DIGITS_TO_ZERO)))
        fast = self._fast_entries
        if len(fast) >= _MAX_FAST_KEYS:
            fast.clear()  # only a cache: memory stays bounded (never cleared mid-chunk)
            self._rank_spans.clear()
        found = list(map(fast.get, keys))
        # first line of each key not seen before: handled in order (entry or budget)
        misses = list(compress(range(n), map(not_, found)))
        first_new = dict(zip(map(keys.__getitem__, reversed(misses)), reversed(misses)))
        counts = Counter(keys)
        ordered: set[bytes] = set()  # keys whose every line goes one by one
        if n and max(map(len, keys)) > self.max_line_bytes:
            ordered.update(k for k in counts if len(k) > self.max_line_bytes)
        budget_spent = self._entry_counts[False] >= self.max_entries[False]
        deferred, one_by_one = _split_new_keys(list(counts), first_new, counts, ordered, budget_spent)
        if ordered:
            one_by_one += compress(range(n), map(ordered.__contains__, keys))
            for k in ordered:
                del counts[k]
        # ---- in line order: signal lines and the lines above
        events = sorted([(starts[i], i) for i in one_by_one] + [(start, -1 - j) for j, (start, _) in enumerate(signals)])
        if events:
            line_idx = np.searchsorted(newlines, [pos for pos, _ in events]).tolist()
        repeats, repeat_bytes, overflow = self._in_order(
            buf, events, line_idx if events else (), first_line, signals, uncovered_signals,
            raws.__getitem__, keys.__getitem__, ends.__getitem__, ordered, deferred, counts)
        if deferred:
            self._resolve_new_keys(deferred)
        # ---- in bulk: the other repeats of known keys
        if counts:
            def last_line_index(hit_keys: list[bytes]) -> list[int]:
                last = dict(zip(keys, starts))
                return np.searchsorted(newlines, list(map(last.__getitem__, hit_keys))).tolist()

            hit_keys, lines, nbytes, over = self._count_known_repeats(counts, first_line, last_line_index)
            repeats, repeat_bytes, overflow = repeats + lines, repeat_bytes + nbytes, overflow + over
            if hit_keys:
                prefixed = [k for k in hit_keys if k[:1] in _PREFIX_STARTS]
                rank_spans: dict[bytes, slice] = {}
                if prefixed:
                    span_cache = self._rank_spans
                    for k, span in zip(prefixed, map(span_cache.get, prefixed, repeat(_BLANK))):
                        if span is _BLANK:
                            span = span_cache[k] = _rank_span(k)
                        if span is not None:
                            rank_spans[k] = span
                if rank_spans:
                    # the rank of each line sits at the same offsets as in its key
                    chosen = list(compress(range(n), map(rank_spans.__contains__, keys)))
                    chosen_keys = list(map(keys.__getitem__, chosen))
                    ranks = map(bytes.__getitem__, map(raws.__getitem__, chosen), map(rank_spans.__getitem__, chosen_keys))
                    for k, rank in set(zip(chosen_keys, ranks)):
                        fast[k].ranks.add(int(rank))
        stats.lines_kept += repeats
        stats.lines_uncovered += repeats
        stats.uncovered_overflow += overflow
        stats.bytes_kept += repeat_bytes
        self._line_no = first_line + total_lines
        stats.lines_in += total_lines

    def _count_known_repeats(self, counts: dict[bytes, int], first_line: int,
                             last_line_index) -> tuple[list[bytes], int, int, int]:
        """Both scans' bulk step: the other repeats of known keys in a buffer. Each entry's
        count and last line grow (``last_line_index(keys)``: the 0-based line of each key's
        last line in the buffer); overflow keys' lines are counted. Returns (the entries' keys,
        their repeat lines, the bytes of those lines, overflow lines)."""
        fast = self._fast_entries
        distinct = list(counts)
        targets = list(map(fast.__getitem__, distinct))
        overflow = sum(compress(counts.values(), map(is_, targets, repeat(_OVERFLOW))))
        hit_keys = list(compress(distinct, map(isinstance, targets, repeat(LogEntry))))
        hit_counts = list(map(counts.__getitem__, hit_keys))
        if not all(hit_counts):  # keys whose only line here was their first (counted one by one)
            hit_keys = list(compress(hit_keys, hit_counts))
            hit_counts = list(filter(None, hit_counts))
        if not hit_keys:
            return [], 0, 0, overflow
        base = first_line + 1
        for entry, c, idx in zip(map(fast.__getitem__, hit_keys), hit_counts, last_line_index(hit_keys)):
            entry.count += c
            if base + idx > entry.last_line:
                entry.last_line = base + idx
        lines = sum(hit_counts)
        return hit_keys, lines, sum(map(mul, hit_counts, map(len, hit_keys))) + lines, overflow

    def _note_rank_hosts(self, buf: bytes, rank_host_lines: list[tuple[int, int]]) -> None:
        for start, end in rank_host_lines:
            found = _NCCL_RANK_HOST.search(buf[start:end].decode("utf-8", "replace"))
            if found:
                self.rank_hosts.setdefault(int(found.group(2)), found.group(1))

    def _note_signal_progress(self, buf: bytes, signals: list[tuple[int, int]], signal_lines: list[int],
                              line_index) -> None:
        """Progress in a long error-free stretch before each signal line
        (CompressedLog.progress); ``line_index(offset, j)``: the 0-based line of a byte of
        buf before signal line ``j``."""
        first_line = self._line_no
        prev = 0
        for j, ((start, end), line) in enumerate(zip(signals, signal_lines)):
            if line - self._last_signal_line > PROGRESS_STRETCH_LINES:
                found = _last_progress(buf, prev, start)
                mark = self._since_signal
                if found >= 0:
                    mark = (first_line + line_index(found, j) + 1, _line_timestamp(buf, found))
                if mark is not None:
                    self._progress.append(mark)
            self._last_signal_line, self._since_signal = line, None
            prev = end + 1
        self._tail_from = prev

    def _in_order(self, buf: bytes, events, line_idx, first_line: int, signals, uncovered_signals: set[int],
                  raw_of, key_of, end_of, ordered: set[bytes], deferred: list[bytes], counts: Counter) -> tuple[int, int, int]:
        """Keep the lines ``_scan`` hands over one by one, in line order: ``events`` are
        (start, i), ``i`` an uncovered line (``raw_of``/``key_of``/``end_of`` read it) or
        ``-1 - j`` signal line ``j``. Returns (repeats, their bytes, overflow) to add to
        the stats."""
        fast = self._fast_entries
        max_line = self.max_line_bytes
        repeats = repeat_bytes = overflow = 0
        for (start, i), idx in zip(events, line_idx):
            line_no = first_line + idx + 1
            if i < 0:
                _, end = signals[-1 - i]
                self._keep_line(buf, start, end, True, start not in uncovered_signals, line_no)
                continue
            raw = raw_of(i)
            if len(raw) > max_line:
                self._keep_line(buf, start, end_of(i), False, False, line_no)
                continue
            key = key_of(i)
            entry = fast.get(key)
            if entry is None:
                if key not in ordered and self._entry_counts[False] >= self.max_entries[False]:
                    deferred.append(key)  # the budget ran out in this chunk
                    counts[key] += 1
                    continue
                self._keep_uncovered(raw, key, line_no)
            elif entry is _OVERFLOW:
                overflow += 1
            elif entry is not _BLANK:
                entry.count += 1
                entry.last_line = line_no
                repeats += 1
                repeat_bytes += len(raw) + 1
                if raw[:1] in _PREFIX_STARTS:
                    self._prefix_facts(raw, key, entry, line_no)
        return repeats, repeat_bytes, overflow

    def _scan_native(self, buf: bytes) -> None:
        """``_scan`` with the native pass (``diagnosis.native``): the C++ code finds the
        uncovered lines (RE2's run-scan), keys them and counts each distinct key, so
        Python works once per distinct key of ``buf``, not once per line. The same
        steps as ``_scan`` on what it returns; the same result (tests compare both)."""
        signals, rank_host_lines = self._signals.scan(buf)
        self._note_rank_hosts(buf, rank_host_lines)
        first_line = self._line_no
        stats = self.stats
        fast = self._fast_entries
        native = self._native
        if len(fast) >= _MAX_FAST_KEYS or native.full():
            # both at once: the C pass's key statuses mirror what fast says
            fast.clear()
            self._rank_spans.clear()
            native.reset()
        budget_spent = self._entry_counts[False] >= self.max_entries[False]
        if budget_spent and not self._native_prints_sent:
            native.add_prints(self._entry_prints)  # no entry opens any more: they are final
            self._native_prints_sent = True
        found = native.scan(buf, [start for start, _ in signals], self.max_line_bytes, budget_spent)
        total_lines = found.total_lines
        stats.uncovered_overflow += found.overflow  # lines of keys known to be overflow
        n = len(found.starts)
        if not n and not signals:
            self._line_no += total_lines
            stats.lines_in += total_lines
            return
        starts, ends, line_of, ids = found.starts, found.ends, found.lines, found.ids
        uncovered_signals: set[int] = set()
        signal_line_idx = found.signal_lines.tolist()
        if signals:
            signal_lines = [first_line + 1 + i for i in signal_line_idx]
            # the progress line is the last one before the signal line: count back from it
            self._note_signal_progress(
                buf, signals, signal_lines,
                lambda offset, j: signal_line_idx[j] - buf.count(b"\n", offset, signals[j][0]))
            uncovered_signals = {signals[j][0] for j in np.flatnonzero(found.signal_uncovered).tolist()}
        id_keys = native.keys
        touched = found.touched.tolist()
        tcount = found.touched_count.tolist()
        tkeys = list(map(id_keys.__getitem__, touched))
        counts = Counter(dict(zip(tkeys, tcount)))
        known = list(map(fast.get, tkeys))
        first_new = dict(zip(compress(tkeys, map(not_, known)), compress(found.touched_first.tolist(), map(not_, known))))
        ordered: set[bytes] = set()  # keys whose every line goes one by one
        ordered_lines: list[int] = np.flatnonzero(ids < 0).tolist()  # over max_line_bytes: no key
        deferred, one_by_one = _split_new_keys(tkeys, first_new, counts, ordered, budget_spent)
        if ordered:
            ordered_ids = [i for i, k in zip(touched, tkeys) if k in ordered]
            ordered_lines += np.flatnonzero(np.isin(ids, ordered_ids)).tolist()
            for k in ordered:
                del counts[k]
        one_by_one += ordered_lines
        chosen = np.asarray(one_by_one, dtype=np.int64)
        signal_events = [(start, -1 - j) for j, (start, _) in enumerate(signals)]
        if not ordered_lines and not budget_spent and \
                len(one_by_one) <= self.max_entries[False] - self._entry_counts[False]:
            # No new key can find the budget spent, none pairs torchrun's summary and no
            # line is kept through _keep as uncovered: the first lines of new keys share
            # nothing with the signal lines (entries, budgets, summary state are apart),
            # so each kind goes in line order on its own, the new keys in one tight loop.
            chosen.sort()  # the C pass lists lines in line order
            chosen_ids = ids[chosen].tolist()
            self._open_entries(list(map(buf.__getitem__, map(slice, starts[chosen].tolist(), ends[chosen].tolist()))),
                               list(map(id_keys.__getitem__, chosen_ids)),
                               (line_of[chosen] + (first_line + 1)).tolist(),
                               list(map(found.new_templates.__getitem__, chosen_ids)))
            repeats, repeat_bytes, overflow = self._in_order(
                buf, signal_events, signal_line_idx, first_line, signals,
                uncovered_signals, None, None, None, ordered, deferred, counts)
        else:
            # ---- in line order: signal lines and the lines above
            at = dict(zip(one_by_one, zip(starts[chosen].tolist(), ends[chosen].tolist(), line_of[chosen].tolist(),
                                          ids[chosen].tolist())))
            events = sorted([(at[i][0], i) for i in one_by_one] + signal_events)
            line_idx = [at[i][2] if i >= 0 else signal_line_idx[-1 - i] for _, i in events]
            repeats, repeat_bytes, overflow = self._in_order(
                buf, events, line_idx, first_line, signals, uncovered_signals,
                lambda i: buf[at[i][0]:at[i][1]], lambda i: id_keys[at[i][3]], lambda i: at[i][1],
                ordered, deferred, counts)
        if deferred:
            self._resolve_new_keys(deferred)
        # ---- in bulk: the other repeats of known keys
        if counts:
            def last_line_index(hit_keys: list[bytes]) -> list[int]:
                return list(map(dict(zip(tkeys, found.touched_last.tolist())).__getitem__, hit_keys))

            hit_keys, lines, nbytes, over = self._count_known_repeats(counts, first_line, last_line_index)
            repeats, repeat_bytes, overflow = repeats + lines, repeat_bytes + nbytes, overflow + over
            if hit_keys:
                prefixed = [k for k in hit_keys if k[:1] in _PREFIX_STARTS]
                if prefixed:
                    self._native_ranks(buf, found, prefixed)
        # from now on the C pass counts or skips the lines of overflow and blank keys
        outcome = list(map(fast.get, tkeys))
        native.set_status(list(compress(touched, map(is_, outcome, repeat(_OVERFLOW)))), native_OVERFLOW)
        native.set_status(list(compress(touched, map(is_, outcome, repeat(_BLANK)))), native_BLANK)
        stats.lines_kept += repeats
        stats.lines_uncovered += repeats
        stats.uncovered_overflow += overflow
        stats.bytes_kept += repeat_bytes
        self._line_no = first_line + total_lines
        stats.lines_in += total_lines

    def _native_ranks(self, buf: bytes, found, prefixed: list[bytes]) -> None:
        """Add the rank of every line of the ``prefixed`` keys (hits of ``_scan_native``)
        to its entry: the rank sits at the same offsets as in its key (``_rank_span``),
        read for all lines at once."""
        fast = self._fast_entries
        span_cache = self._rank_spans
        id_of = dict(zip(map(self._native.keys.__getitem__, found.touched.tolist()), found.touched.tolist()))
        span_ids, span_lo, span_hi = [], [], []
        for k, span in zip(prefixed, map(span_cache.get, prefixed, repeat(_BLANK))):
            if span is _BLANK:
                span = span_cache[k] = _rank_span(k)
            if span is not None:
                span_ids.append(id_of[k])
                span_lo.append(span.start)
                span_hi.append(span.stop)
        if not span_ids:
            return
        ids = found.ids
        lo = np.full(self._native.n_ids + 1, -1, dtype=np.int64)  # index -1: lines without a key
        hi = lo.copy()
        lo[span_ids] = span_lo
        hi[span_ids] = span_hi
        chosen = np.flatnonzero(lo[ids] >= 0)
        chosen_ids = ids[chosen]
        offsets = found.starts[chosen] + lo[chosen_ids]
        lengths = hi[chosen_ids] - lo[chosen_ids]
        data = np.frombuffer(buf, dtype=np.uint8)
        ranks = np.zeros(len(chosen), dtype=np.int64)
        for d in range(int(lengths.max())):
            digit = data[np.minimum(offsets + d, len(data) - 1)].astype(np.int64) - 48
            ranks = np.where(d < lengths, ranks * 10 + digit, ranks)
        pairs = np.unique((chosen_ids.astype(np.int64) << 24) | ranks).tolist()
        keys = self._native.keys
        for pair in pairs:
            fast[keys[pair >> 24]].ranks.add(pair & 0xFFFFFF)

    def _last_progress_mark(self, buf: bytes, lo: int) -> tuple[int, float | None] | None:
        """(line number, timestamp) of the last training-progress line of ``buf[lo:]``
        (``buf`` just scanned: ``self._line_no`` is its last line), or None."""
        found = _last_progress(buf, lo, len(buf))
        if found < 0:
            return None
        # the lines from this one to the end of buf are the last ones scanned
        line_end = buf.find(b"\n", found)
        line = self._line_no - buf.count(b"\n", line_end if line_end >= 0 else len(buf)) + 1
        return line, _line_timestamp(buf, found)

    def _resolve_new_keys(self, keys: list[bytes]) -> None:
        """Point each new key at its entry, or mark it over budget, once the uncovered
        budget is spent (no new entry can open, so the order does not matter).

        A key whose letter fingerprint (``_NOT_PRINT``) no entry has cannot share an
        entry's template: it is over budget without working out its template."""
        fast = self._fast_entries
        prints = self._entry_prints
        # one translate over all the keys (its setup per call costs more than the bytes)
        printed = b"\n".join(keys).translate(None, _NOT_PRINT_BUT_NL).split(b"\n")
        maybe = list(map(prints.__contains__, map(bytes.strip, printed)))
        unknown = list(compress(keys, map(not_, maybe)))
        fast.update(zip(unknown, repeat(_OVERFLOW)))
        for key in compress(keys, maybe):
            if not key.strip():
                fast[key] = _BLANK
                continue
            fast[key] = self._entries.get(_uncovered_template(key)) or _OVERFLOW

    def _keep_line(self, buf: bytes, start: int, end: int, signal: bool, covered: bool, line_no: int) -> None:
        """Keep one line through ``_keep`` (signal lines, and lines over max_line_bytes)."""
        raw = buf[start:end]
        truncated = len(raw) > self.max_line_bytes
        if truncated:
            raw = raw[: self.max_line_bytes]
        text = raw.decode("utf-8", "replace").rstrip("\r")
        if not text.strip() and not signal:
            return  # blank lines carry nothing
        if truncated:
            self.stats.lines_truncated += 1
            text += f" ...[truncated: line of {end - start} bytes]"
        self._keep(text, signal, covered, truncated, line_no)

    def _open_entries(self, raws: list[bytes], keys: list[bytes], line_nos: list[int], templates: list[str]) -> None:
        """``_keep_uncovered`` for the first lines of new keys, in line order, where the
        uncovered budget cannot run out (``_scan_native``, which has their templates
        from the C pass): the same steps with the lookups hoisted out of the loop."""
        fast = self._fast_entries
        entries = self._entries
        prints = self._entry_prints
        opened = kept = kept_bytes = 0
        for raw, key, line_no, template in zip(raws, keys, line_nos, templates):
            if not raw.strip():
                fast[key] = _BLANK  # blank lines carry nothing
                continue
            entry = entries.get(template)
            if entry is None:
                opened += 1
                entry = LogEntry(text=raw.decode("utf-8", "replace").rstrip("\r"), template=template,
                                 first_line=line_no, last_line=line_no, count=0)
                entries[template] = entry
                prints.add(key.translate(None, _NOT_PRINT).strip())
            fast[key] = entry
            entry.count += 1
            entry.last_line = line_no
            kept += 1
            kept_bytes += len(raw) + 1
            if raw[:1] in _PREFIX_STARTS:
                # _prefix_facts; no key here is torchrun's summary (those go one by one)
                if raw.startswith(b"[rank"):
                    close = raw.find(b"]:", 5, 11)
                    if close > 5 and raw[5:close].isdigit():
                        entry.ranks.add(int(raw[5:close]))
                else:
                    self._prefix_facts(raw, key, entry, line_no)
        self._entry_counts[False] += opened
        self.stats.lines_kept += kept
        self.stats.lines_uncovered += kept
        self.stats.bytes_kept += kept_bytes

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
        # The template has digit runs (up to 8 long) as one "0" and drops the launcher's
        # rank prefix, so "[rank3]:" and "[rank12]:" lines merge.
        template = _uncovered_template(key)
        entry = self._entries.get(template)
        if entry is None:
            if self._entry_counts[False] >= self.max_entries[False]:
                self.stats.uncovered_overflow += 1  # budget spent: a new message
                fast[key] = _OVERFLOW  # its repeats are counted in _process without this call
                return
            self._entry_counts[False] += 1
            text = raw.decode("utf-8", "replace").rstrip("\r")
            entry = LogEntry(text=text, template=template, first_line=line_no, last_line=line_no, count=0)
            self._entries[template] = entry
            self._entry_prints.add(key.translate(None, _NOT_PRINT).strip())
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
            if not signal:
                self._entry_prints.add(facts.template.encode("ascii", "ignore").translate(None, _NOT_PRINT).strip())
        else:
            entry.count += 1
            entry.last_line = line_no
        if facts.rank is not None:
            entry.ranks.add(facts.rank)
        if self.origin is not None or facts.local_rank is not None:
            entry.origins.add((self.origin, facts.local_rank if facts.rank is None else None))
        if facts.host:
            entry.hosts.add(facts.host)
        if facts.gpu:
            entry.gpus.add(facts.gpu)
        if facts.timestamp is not None:
            if entry.earliest_ts is None or facts.timestamp < entry.earliest_ts:
                entry.earliest_ts = facts.timestamp
            if entry.latest_ts is None or facts.timestamp > entry.latest_ts:
                entry.latest_ts = facts.timestamp
        return entry


def _split_new_keys(distinct: list[bytes], first_new: dict[bytes, int], counts: Counter,
                    ordered: set[bytes], budget_spent: bool) -> tuple[list[bytes], list[int]]:
    """Both scans' split of a buffer's keys (``distinct``) by how their lines are kept.

    Adds to ``ordered`` the keys whose every line must go one by one (candidates for
    torchrun's failure summary, ``host :``/``rank : N (local_rank: L)``). Returns
    (deferred, one_by_one): once the uncovered budget is spent, the new keys not in
    ``ordered`` are order-free (``_resolve_new_keys`` settles them after the buffer);
    before that, the first line of each (``first_new``: key -> its line index) goes one
    by one, in line order, and leaves the bulk count (``counts``)."""
    distinct_text = b"\n".join(distinct)
    if b"host" in distinct_text or b"local_rank" in distinct_text:
        for word in (b"host", b"local_rank"):
            found_word = compress(distinct, map(bytes.__contains__, distinct, repeat(word)))
            ordered.update(k for k in found_word if k[:1] in _PREFIX_STARTS)
    if budget_spent:
        return ([k for k in first_new if k not in ordered] if ordered else list(first_new)), []
    one_by_one = [i for k, i in first_new.items() if k not in ordered]
    for k in first_new:
        if k not in ordered:
            counts[k] -= 1
    return [], one_by_one


@contextmanager
def _collector_paused():
    """CPython's cyclic garbage collector paused while one chunk is compressed.

    A chunk opens up to thousands of long-lived objects (entries, their sets, keys) and
    makes no reference cycles, yet every few hundred allocations the collector rescans
    the young ones and every so often all of them: ~0.07 s of the ~0.77 CPU seconds a
    100 MB varied log took (``benchmarks/filter_throughput.py``'s log). Paused, the young
    objects are scanned once after the chunk, not every few hundred allocations. The switch
    is process-wide and not coordinated across threads: another thread's allocations go
    uncollected for that chunk (~0.1 s), and a collector turned off before the chunk stays
    off, one another thread turns off during it is turned back on."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


_SCANNERS: dict[tuple[str, ...], SignalScanner] = {}
_DIGITS_TO_ZERO = bytes.maketrans(b"123456789", b"000000000")
_BLANK = object()
_OVERFLOW = object()  # fast-path marker: a message with no entry because the budget was spent
# first bytes of lines that may carry a rank prefix or torchrun's summary ("  host : X")
_PREFIX_STARTS = b"[0123456789 "
# signals._RANK_PREFIX for bytes; groups: 1 = srun label, 2 = torchrun's rank
_RANK_PREFIX_BYTES = re.compile(rb"^(?:\d{4}-\d\d-\d\dT[\d:.]+Z )?(?:(\d{1,5}): )?(?:\[(?:rank|default)(\d{1,5})\]:)?")
_KEY_PREFIXES = (b"[rank0]:", b"[default0]:", b"0: ")

# What a key's fingerprint keeps: printable ASCII and the space, less digits and the
# characters of the rank prefixes a template drops ("[rank0]:", "[default0]:", "0: ");
# the result is stripped of its end spaces. Control characters and non-ASCII bytes go
# too, so the fingerprint survives everything a template does to a key (digit runs
# collapsed, prefix dropped, decoded, end whitespace stripped): two keys with one
# template share it, and a key whose fingerprint no entry has opens no known entry.
_NOT_PRINT = bytes(b for b in range(256) if not (32 <= b <= 126) or b in b"0123456789[]:rankdefault")
_NOT_PRINT_BUT_NL = _NOT_PRINT.replace(b"\n", b"")  # keys hold no newline: it separates them


def _uncovered_template(key: bytes) -> str:
    """The template of an uncovered line from its key (digits as 0): digit runs (up to
    8 long) as one 0, without the launcher's rank prefix, so "[rank3]:" and "[rank12]:"
    lines merge."""
    body = key.replace(b"00", b"0").replace(b"00", b"0").replace(b"00", b"0")
    for prefix in _KEY_PREFIXES:
        if body.startswith(prefix):
            body = body[len(prefix):]
            break
    return "U|" + body.decode("utf-8", "replace").strip()


def _rank_span(key: bytes) -> slice | None:
    """Where the rank of a launcher prefix sits in a line with this key (digits
    masked as 0 keep their offsets), the same reading as ``_prefix_facts``."""
    if key.startswith(b"[rank"):
        close = key.find(b"]:", 5, 11)
        return slice(5, close) if close > 5 and key[5:close].isdigit() else None
    prefix = _RANK_PREFIX_BYTES.match(key)
    group = 2 if prefix.group(2) is not None else 1
    return slice(*prefix.span(group)) if prefix.group(group) is not None else None
_MAX_FAST_KEYS = 200_000
_PROGRESS = re2.compile(PROGRESS_PATTERN.encode(), _re2_options(latin1=True))  # ASCII pattern
_PROGRESS_WINDOW = 512  # first backward window of _last_progress (a few step lines)


def _last_progress(buf: bytes, lo: int, hi: int) -> int:
    """Offset of the last training-progress match in the lines of ``buf[lo:hi]`` (both
    at line starts), or -1.

    Searched backwards in growing windows cut at line starts: in a training log the
    last step line is near the end, so a piece costs a few KB of RE2 search, and a span
    without progress one pass over it. (Windows are sliced: RE2's pos/endpos arguments
    cost more than the copy.)"""
    window, start = _PROGRESS_WINDOW, -1
    while hi > lo and start < 0:
        cut = max(lo, hi - window)
        if cut > lo:
            cut = max(lo, buf.rfind(b"\n", lo, cut) + 1)
        for found in _PROGRESS.finditer(buf[cut:hi]):
            start = cut + found.start()
        hi, window = cut, window * 16
    return start


def _line_timestamp(buf: bytes, offset: int) -> float | None:
    """The timestamp of the line holding ``buf[offset]``."""
    line_start = buf.rfind(b"\n", 0, offset) + 1
    line_end = buf.find(b"\n", offset)
    line_end = len(buf) if line_end < 0 else line_end
    return parse_timestamp(buf[line_start:min(line_end, line_start + 4096)].decode("utf-8", "replace"))
_NCCL_RANK_HOST_PATTERN = r"([A-Za-z][\w.-]*):\d+:\d+ \[\d+\] NCCL INFO comm 0x[0-9a-fA-F]+ rank (\d+) nranks \d+"
_NCCL_RANK_HOST = re.compile(_NCCL_RANK_HOST_PATTERN)
_SUMMARY_HOST = re.compile(r"^(?:\S*\]:)?\s*host\s*:\s*([A-Za-z][\w.-]*)\s*$")
_SUMMARY_RANK = re.compile(r"^(?:\S*\]:)?\s*rank\s*:\s*(\d+)")


def _cached_scanner(diagnosis_patterns: tuple[str, ...]) -> SignalScanner:
    scanner = _SCANNERS.get(diagnosis_patterns)
    if scanner is None:
        patterns, caseless = signal_patterns(diagnosis_patterns)
        # NCCL's "comm ... rank N nranks" lines (rank -> host) come from the same pass
        scanner = SignalScanner(patterns, caseless, side=[_NCCL_RANK_HOST_PATTERN],
                                cache_dir=state_dir(None) / "cache")
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
