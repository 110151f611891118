"""Linear-time multi-pattern matching over whole byte buffers.

Two jobs, both done on large buffers of complete lines (never line by line in Python):

* ``LineFilter`` answers "which lines does no routine rule cover?" for a set of
  filter regexes. Three engines are selectable (``ENGINE_NAMES``):

  - ``re2`` (default): all rules are folded into one RE2 pattern that matches a *run*
    of consecutive covered lines, ``(?:(?:r1|r2|...)[^\\n]*\\n)+``, matched anchored
    at each uncovered position. RE2's forward DFA skips whole runs in C and Python only
    sees one match per run, so the Python cost is proportional to the number of *kept*
    lines, not of all lines.
  - ``hyperscan``: every rule is compiled into one Hyperscan database; Hyperscan
    reports one match per covered line, and numpy maps match offsets to lines. Fast
    scanning, but one Python callback per covered line caps its throughput.
  - ``python``: the same run pattern as ``re2`` in Python's backtracking ``re``. Kept
    for the benchmark only: it refuses any rule that did not come with forgeflow
    (``trusted=False``), because a regex an LLM wrote must never run in a
    backtracking engine.

  ``benchmarks/filter_throughput.py`` measures the three side by side.

* ``SignalScanner`` finds every line holding an error signal (error keywords and
  diagnosis-rule patterns). It uses Hyperscan when importable (GB/s on literal-rich
  patterns, few matches) and RE2 otherwise.

A rule *covers* a line when the pattern matches somewhere in it (search semantics;
anchor with ``^``/``$`` to be strict). ``validate_regex`` checks a pattern compiles in
every linear-time engine used here; ``is_catch_all`` spots patterns that would cover
everything.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
from pathlib import Path
from typing import Iterable, Protocol, Sequence

import numpy as np
import re2

try:  # Hyperscan ships x86-64 wheels only; RE2 covers every other platform.
    import hyperscan
except ImportError:  # pragma: no cover - depends on the platform
    hyperscan = None

ENGINE_NAMES: tuple[str, ...] = ("re2", "hyperscan", "python")
DEFAULT_ENGINE = "re2"
LINEAR_ENGINES: tuple[str, ...] = ("re2", "hyperscan")

# RE2 falls back to its (still linear, but slow) NFA when the DFA cache fills up; a
# large budget keeps 100+ alternations on the DFA path.
_RE2_MAX_MEM = 512 << 20
MAX_PATTERN_CHARS = 2000

# Patterns known to compile in Hyperscan in this process (a one-pattern database takes
# ~7 ms to compile: 60 diagnosis rules cost 0.4 s of every `forgeflow diagnose`). Filled
# by validate_regex and by a SignalScanner whose database compiled or loaded.
_HYPERSCAN_OK: set[str] = set()


class RegexError(ValueError):
    """A pattern that cannot be used as a rule (does not compile, or is unsafe)."""


class UnsafeEngineError(RuntimeError):
    """An untrusted (e.g. LLM-written) rule was sent to the backtracking engine."""


def _re2_options(latin1: bool) -> "re2.Options":
    options = re2.Options()
    options.max_mem = _RE2_MAX_MEM
    options.log_errors = False  # the error goes into our exception, not onto stderr
    if latin1:
        options.encoding = re2.Options.Encoding.LATIN1
    return options


def _as_bytes(pattern: str) -> bytes:
    return pattern.encode("utf-8")


def validate_regex(pattern: str) -> None:
    """Raise ``RegexError`` unless ``pattern`` compiles in every linear-time engine.

    Python's ``re`` is never used here: a pattern that only a backtracking engine
    accepts (backreferences, lookaround) is refused, and one that would backtrack
    catastrophically in ``re`` (``(a+)+$``) is fine, because RE2 and Hyperscan run it
    in linear time.
    """
    if not isinstance(pattern, str):
        raise RegexError(f"a rule pattern must be a string, got {type(pattern).__name__}")
    if not pattern:
        raise RegexError("empty pattern: a rule needs a regex that matches specific lines")
    if len(pattern) > MAX_PATTERN_CHARS:
        raise RegexError(
            f"pattern is {len(pattern)} characters; keep rules under {MAX_PATTERN_CHARS}"
        )
    if "\n" in pattern:
        raise RegexError("pattern contains a newline; rules match within one line")
    try:
        re2.compile(_as_bytes(pattern), _re2_options(latin1=False))
    except re2.error as exc:
        detail = exc.args[0].decode() if exc.args and isinstance(exc.args[0], bytes) else exc
        raise RegexError(
            f"pattern {pattern!r} does not compile in RE2 ({detail}); rules must use the "
            "linear-time subset: no backreferences, no lookahead/lookbehind"
        ) from None
    if hyperscan is not None and pattern not in _HYPERSCAN_OK:
        try:
            db = hyperscan.Database()
            # ALLOWEMPTY: whether a pattern matches empty input is is_catch_all's call.
            db.compile(
                expressions=[_as_bytes(pattern)],
                ids=[0],
                flags=hyperscan.HS_FLAG_MULTILINE | hyperscan.HS_FLAG_ALLOWEMPTY,
            )
        except hyperscan.error as exc:
            raise RegexError(
                f"pattern {pattern!r} does not compile in Hyperscan ({exc}); simplify it "
                "(no backreferences, lookaround or very large bounded repeats)"
            ) from None
        _HYPERSCAN_OK.add(pattern)


def compile_linear(pattern: str) -> "re2._Regexp":
    """A compiled RE2 object (str API) for testing one pattern against lines."""
    validate_regex(pattern)
    return re2.compile(pattern, _re2_options(latin1=False))


# Lines no sensible routine rule covers all of; a pattern covering (almost) all of them
# is a catch-all. They are deliberately unlike each other.
_CATCH_ALL_PROBES: tuple[str, ...] = (
    "",
    " ",
    "x",
    "0",
    "Traceback (most recent call last):",
    "RuntimeError: CUDA error: an illegal memory access was encountered",
    "[rank3]: torch.OutOfMemoryError: CUDA out of memory.",
    "node-a03:2281:2401 [3] NCCL WARN Call to ibv_poll_cq failed",
    "step=12 loss=3.21 lr=1.0e-04 grad_norm=0.52 tokens_per_s=1234 elapsed_s=10.1",
    "}",
    "----------------------------------------------------",
    "\tat java.lang.Thread.run(Thread.java:750)",
    "ValueError: too many values to unpack (expected 2)",
    "hello world",
    "ERROR",
    "   File \"/opt/train.py\", line 12, in <module>",
)


def is_catch_all(pattern: str, threshold: float = 0.5) -> bool:
    """True when ``pattern`` matches the empty line or at least ``threshold`` of
    deliberately unrelated probe lines (``.*``, ``.``, ``\\S``, ``^``, ``[\\s\\S]``...)."""
    regex = compile_linear(pattern)
    if regex.search("") is not None:
        return True
    hits = sum(1 for probe in _CATCH_ALL_PROBES if regex.search(probe) is not None)
    return hits >= threshold * len(_CATCH_ALL_PROBES)


# --------------------------------------------------------------------------- filters


class LineFilter(Protocol):
    """Finds the lines of a buffer that no rule covers."""

    engine: str

    def uncovered_lines(self, buf: bytes) -> list[tuple[int, int]]:
        """(start, end) of each uncovered line; ``buf`` must end with ``\\n``."""
        ...

    def uncovered_spans(self, buf: bytes) -> tuple[list[int], list[int]]:
        """The same lines as two lists: starts, ends."""
        ...


def _split_gap(buf: bytes, start: int, end: int, out: list[tuple[int, int]]) -> None:
    """Append the lines inside buf[start:end] (which ends just after a newline)."""
    pos = start
    while pos < end:
        nl = buf.find(b"\n", pos, end)
        if nl < 0:
            nl = end
        out.append((pos, nl))
        pos = nl + 1


def _run_alternative(pattern: str) -> str:
    # Search semantics inside one line: allow any prefix unless the rule anchors at ^.
    body = pattern[1:] if pattern.startswith("^") else f"[^\\n]*?(?:{pattern})"
    return f"(?:{body})[^\\n]*"


def _run_pattern(patterns: Sequence[str]) -> str:
    # Matched *anchored* at a line start (see RunScanFilter), so no leading "^" and
    # RE2 runs only its forward DFA: an unanchored finditer would also run the reverse
    # DFA over every run to find where it starts, halving throughput.
    alternation = "|".join(_run_alternative(p) for p in patterns)
    return f"(?m)(?:(?:{alternation})\\n)+"


class RunScanFilter:
    """RE2 or Python ``re``: one pattern matching a run of covered lines.

    At each uncovered position the run pattern is matched anchored; a match skips the
    whole run of covered lines in C, a miss means the line at that position is
    uncovered. Python therefore iterates once per run and once per kept line, never
    per routine line.
    """

    def __init__(self, patterns: Sequence[str], engine: str):
        self.engine = engine
        self._empty = not patterns
        if self._empty:
            return
        source = _run_pattern(patterns)
        if engine == "re2":
            ascii_only = all(p.isascii() for p in patterns)
            # Latin-1 mode lets RE2's DFA step byte by byte (faster) and match any byte
            # with '.'; UTF-8 mode is needed only for non-ASCII rule text.
            self.run_pattern = source.encode("latin-1" if ascii_only else "utf-8")
            self._regex = re2.compile(self.run_pattern, _re2_options(ascii_only))
            inner = getattr(self._regex, "_regexp", None)
            if inner is not None and hasattr(inner, "Match") and hasattr(re2, "_Anchor"):
                self._raw_match = inner.Match  # spans[0] is (-1, -1) on a miss
        elif engine == "python":
            self._regex = re.compile(source.encode("utf-8"))
        else:  # pragma: no cover - guarded by build_line_filter
            raise ValueError(engine)

    def uncovered_spans(self, buf: bytes) -> tuple[list[int], list[int]]:
        """Starts and ends of the uncovered lines, as two lists (what the compressor
        consumes in bulk; no tuple per line)."""
        raw_match = getattr(self, "_raw_match", None)
        if raw_match is None or self._empty:
            spans = self.uncovered_lines(buf)
            return [s for s, _ in spans], [e for _, e in spans]
        starts: list[int] = []
        ends: list[int] = []
        add_start, add_end = starts.append, ends.append
        find = buf.find
        pos, size = 0, len(buf)
        anchor = re2._Anchor.ANCHOR_START
        while pos < size:
            end = raw_match(anchor, buf, pos, size)[0][1]
            if end > pos:
                pos = end  # the run is maximal: the line at its end is uncovered
                if pos >= size:
                    break
            newline = find(b"\n", pos)
            if newline < 0:
                newline = size
            add_start(pos)
            add_end(newline)
            pos = newline + 1
        return starts, ends

    def uncovered_lines(self, buf: bytes) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        if self._empty:
            _split_gap(buf, 0, len(buf), out)
            return out
        find = buf.find
        pos, size = 0, len(buf)
        raw_match = getattr(self, "_raw_match", None)
        if raw_match is not None:
            # RE2's own Match on bytes: the wrapper's per-call generator and match object
            # cost more than the match itself when many lines are uncovered.
            anchor = re2._Anchor.ANCHOR_START
            while pos < size:
                end = raw_match(anchor, buf, pos, size)[0][1]
                if end > pos:
                    # The run is maximal (greedy), so the line at its end is uncovered:
                    # no second match attempt there.
                    pos = end
                    if pos >= size:
                        break
                newline = find(b"\n", pos)
                if newline < 0:
                    newline = size
                out.append((pos, newline))
                pos = newline + 1
            return out
        match = self._regex.match
        while pos < size:
            found = match(buf, pos)
            if found is not None:
                end = found.end()
                if end > pos:
                    pos = end
                    continue
            newline = find(b"\n", pos)
            if newline < 0:
                newline = size
            out.append((pos, newline))
            pos = newline + 1
        return out


class HyperscanFilter:
    """One Hyperscan database; each covered line reports once at its newline."""

    engine = "hyperscan"

    def __init__(self, patterns: Sequence[str]):
        if hyperscan is None:
            raise RegexError("the hyperscan engine is not installed on this platform; use re2")
        self._db = None
        if patterns:
            self._db = hyperscan.Database()
            self._db.compile(
                expressions=[self._expression(p) for p in patterns],
                ids=list(range(len(patterns))),
                flags=hyperscan.HS_FLAG_MULTILINE,
            )

    @staticmethod
    def _expression(pattern: str) -> bytes:
        # Matching on to the newline makes a covered line report once per rule
        # (Hyperscan reports each end offset of a pattern once). Hyperscan refuses that
        # form for patterns with an embedded "$"; those end at the line end anyway.
        wrapped = f"(?:{pattern})[^\\n]*\\n".encode("utf-8")
        try:
            hyperscan.Database().compile(expressions=[wrapped], ids=[0], flags=hyperscan.HS_FLAG_MULTILINE)
            return wrapped
        except hyperscan.error:
            return pattern.encode("utf-8")

    def uncovered_lines(self, buf: bytes) -> list[tuple[int, int]]:
        arr = np.frombuffer(buf, dtype=np.uint8)
        newlines = np.flatnonzero(arr == 10)
        covered = np.zeros(len(newlines), dtype=bool)
        if self._db is not None and len(newlines):
            ends: list[int] = []
            append = ends.append

            def on_match(_id, _from, to, _flags, _ctx):
                append(to)

            self._db.scan(buf, match_event_handler=on_match)
            if ends:
                # The last matched byte (to - 1) lies in the covered line, or is its newline.
                last_bytes = np.asarray(ends, dtype=np.int64) - 1
                covered[np.searchsorted(newlines, last_bytes)] = True
        starts = np.concatenate(([0], newlines[:-1] + 1)) if len(newlines) else newlines
        keep = np.flatnonzero(~covered)
        return [(int(starts[i]), int(newlines[i])) for i in keep]

    def uncovered_spans(self, buf: bytes) -> tuple[list[int], list[int]]:
        spans = self.uncovered_lines(buf)
        return [s for s, _ in spans], [e for _, e in spans]


@functools.lru_cache(maxsize=32)
def _cached_filter(engine: str, patterns: tuple[str, ...]) -> LineFilter:
    if engine in ("re2", "python"):
        return RunScanFilter(patterns, engine)
    if engine == "hyperscan":
        return HyperscanFilter(patterns)
    raise RegexError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINE_NAMES)}")


def build_line_filter(
    patterns: Iterable[str], engine: str = DEFAULT_ENGINE, trusted: bool = False
) -> LineFilter:
    """Compile (or reuse: compiled filters are cached by rule text) a line filter.

    ``trusted`` says every pattern shipped with forgeflow; the ``python`` engine
    accepts only trusted patterns.
    """
    patterns = tuple(patterns)
    if engine not in ENGINE_NAMES:
        raise RegexError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINE_NAMES)}")
    if engine == "python" and not trusted:
        raise UnsafeEngineError(
            "the python engine backtracks; it runs only forgeflow's seeded rules. "
            "Use engine='re2' or 'hyperscan' for learned rules"
        )
    return _cached_filter(engine, patterns)


# --------------------------------------------------------------------------- signals


class SignalScanner:
    """Lines of a buffer that match any signal pattern (error keywords, diagnosis rules).

    ``caseless`` applies per pattern. Matches are expected to be rare, so each one is
    mapped to its line with a ``rfind``/``find`` pair.
    """

    def __init__(
        self,
        patterns: Sequence[str],
        caseless: Sequence[bool],
        side: Sequence[str] = (),
        cache_dir: str | os.PathLike | None = None,
    ):
        """``side``: case-sensitive patterns whose lines ``scan`` reports apart (the
        compressor's NCCL rank/host lines), found in the same Hyperscan pass.

        ``cache_dir``: where the compiled Hyperscan database is kept between processes
        (compiling ~100 signal patterns takes ~0.25 s, loading it ~1 ms); a file that is
        missing, stale or corrupt (Hyperscan checks a CRC) is compiled anew."""
        if len(patterns) != len(caseless):
            raise ValueError("one caseless flag per pattern")
        self.patterns = tuple(patterns)
        self._db = None
        self._regex = None
        self._side = None  # a scanner of its own for the side patterns, when not in _db
        self._n_side = len(side)
        self.engine = "none"
        if not patterns:
            if side:
                self._side = SignalScanner(side, [False] * len(side))
            return
        if hyperscan is not None:
            flags = [
                hyperscan.HS_FLAG_MULTILINE | (hyperscan.HS_FLAG_CASELESS if c else 0)
                for c in caseless
            ] + [hyperscan.HS_FLAG_MULTILINE] * len(side)
            expressions = [_as_bytes(p) for p in (*patterns, *side)]
            try:
                self._db = _load_or_compile(expressions, flags, cache_dir)
                # each case-sensitive pattern compiled, so validate_regex need not redo it
                _HYPERSCAN_OK.update(p for p, c in zip(patterns, caseless) if not c)
                _HYPERSCAN_OK.update(side)
            except hyperscan.error:
                # e.g. a learned pattern Hyperscan cannot take: RE2 is slower, still linear.
                self._db = None
                if side:
                    self._side = SignalScanner(side, [False] * len(side))
        elif side:
            self._side = SignalScanner(side, [False] * len(side))
        # Which engine scans: Hyperscan unless it is missing or refused a pattern (tests
        # check a fallback does not hide a pattern Hyperscan cannot compile).
        self.engine = "hyperscan" if self._db is not None else "re2"
        if self._db is None:
            alternation = "|".join(
                f"(?i:{p})" if c else f"(?:{p})" for p, c in zip(patterns, caseless)
            )
            self._regex = re2.compile(f"(?m){alternation}".encode(), _re2_options(False))

    def signal_lines(self, buf: bytes) -> list[tuple[int, int]]:
        """(start, end) of every line holding a signal, in buffer order, no duplicates."""
        return self.scan(buf)[0]

    def scan(self, buf: bytes) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """Signal lines and side-pattern lines (as ``signal_lines``), in one pass where
        Hyperscan runs."""
        ends: list[int] = []
        side_ends: list[int] = []
        if self._db is not None:
            append = ends.append
            if self._n_side:
                first_side = len(self.patterns)
                append_side = side_ends.append

                def on_match(id_, _from, to, _flags, _ctx):
                    if id_ < first_side:
                        append(to)
                    else:
                        append_side(to)
            else:

                def on_match(_id, _from, to, _flags, _ctx):
                    append(to)

            self._db.scan(buf, match_event_handler=on_match)
        elif self._regex is not None:
            ends = [m.end() for m in self._regex.finditer(buf)]
        side_spans = self._side.signal_lines(buf) if self._side is not None else self._lines(buf, side_ends)
        return self._lines(buf, ends), side_spans

    @staticmethod
    def _lines(buf: bytes, ends: list[int]) -> list[tuple[int, int]]:
        spans: dict[int, int] = {}
        for to in ends:
            # rfind stops before ``probe``, so a match whose last byte is the newline
            # still maps to the line that newline ends.
            probe = max(to - 1, 0)
            start = buf.rfind(b"\n", 0, probe) + 1
            if start in spans:
                continue
            end = buf.find(b"\n", start)
            spans[start] = len(buf) if end < 0 else end
        return sorted(spans.items())


def _load_or_compile(expressions: list[bytes], flags: list[int], cache_dir) -> "hyperscan.Database":
    """A block-mode database of ``expressions``, from ``cache_dir`` when it holds one
    compiled from the same expressions and flags by the same Hyperscan version."""
    path = None
    if cache_dir is not None:
        digest = hashlib.sha256(repr((hyperscan.__version__, expressions, flags)).encode()).hexdigest()
        path = Path(cache_dir) / f"hyperscan-{digest[:40]}.db"
        try:
            db = hyperscan.loadb(path.read_bytes(), hyperscan.HS_MODE_BLOCK)
            db.scratch = hyperscan.Scratch(db)
            return db
        except (OSError, hyperscan.error):
            pass  # not cached yet, or unreadable: compile
    db = hyperscan.Database()
    db.compile(expressions=expressions, ids=list(range(len(expressions))), flags=flags)
    if path is not None:
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:  # best effort: a read-only state dir only costs the compile next time
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(hyperscan.dumpb(db))
            os.replace(tmp, path)
        except (OSError, hyperscan.error):
            tmp.unlink(missing_ok=True)
    return db


__all__ = [
    "DEFAULT_ENGINE",
    "ENGINE_NAMES",
    "LINEAR_ENGINES",
    "LineFilter",
    "RegexError",
    "SignalScanner",
    "UnsafeEngineError",
    "build_line_filter",
    "compile_linear",
    "is_catch_all",
    "validate_regex",
]
