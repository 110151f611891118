"""The compressor's native line pass (``linescan.cc``), built when forgeflow is installed.

``LogCompressor`` spends most of its time on logs whose lines no filter rule covers
when each such line becomes a Python object (a ``bytes``, a key, a dict lookup).
``linescan.cc`` does the RE2 run-scan, the keying (digits as ``0``), the counting per
distinct key and the template body of each new key in one C++ pass, and counts (or
skips) the lines of keys the compressor found to be overflow (or blank) without
reporting them, so Python works once per distinct key of a buffer.

It is the extension module ``_linescan``, which the package's build (``setup.py``)
compiles against RE2's public C++ API (``re2/re2.h``), as a wheel would ship it. It
compiles the filter's run pattern with its own RE2, with the options
``diagnosis.multi_regex`` gives google-re2, and a self-test checks that it finds the lines
the Python filter finds before it is used. Where it was not built (no C++ compiler or
RE2 headers at install time: the build skips it) or was built from another
``linescan.cc`` (an editable install not rebuilt), ``line_scan_for`` returns None, the
compressor runs its pure-Python scan, which gives the same result (the tests compare
both on the varied corpus), and a warning says so once per process.
``FORGEFLOW_NATIVE=0`` turns it off without a warning.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
from pathlib import Path

import numpy as np

from diagnosis.multi_regex import _RE2_MAX_MEM

_import_error: str | None = None
try:
    _linescan = importlib.import_module("diagnosis.native._linescan")
except ImportError as exc:  # not built (or its RE2 library is gone): the Python scan runs
    _linescan = None
    _import_error = f"{type(exc).__name__}: {exc}"

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("linescan.cc")
REBUILD = ("install a C++ compiler and RE2's headers (Debian: apt-get install g++ libre2-dev), "
           "then reinstall forgeflow (make venv, or pip install -e .)")

_unusable: str | None = None  # why the module cannot be used (once checked)
_checked = False
failure: str | None = None  # why the native pass is not in use (None: it is, or was not asked for yet)
_warned = False


def linescan():
    """The extension module, or None (``failure`` says why)."""
    global _checked, _unusable, failure
    if not _checked:
        _checked = True
        if os.environ.get("FORGEFLOW_NATIVE", "1") == "0":
            _unusable = "FORGEFLOW_NATIVE=0"
        elif _linescan is None:
            _unusable = f"the native line pass is not built ({_import_error}); {REBUILD}"
        elif SOURCE.exists() and hashlib.sha256(SOURCE.read_bytes()).hexdigest() != _linescan.SOURCE_SHA256:
            # an editable install whose linescan.cc changed since it was built
            _unusable = f"the native line pass was built from another {SOURCE.name}; {REBUILD}"
    if _unusable:
        failure = _unusable
        return None
    return _linescan


def native_failure() -> str | None:
    """Why the native pass is not in use (None: it is, or was not asked for yet)."""
    return failure


def _warn_once() -> None:
    global _warned
    if not _warned and failure and failure != "FORGEFLOW_NATIVE=0":
        _warned = True
        logger.warning("%s. The log compressor runs its pure-Python scan: the same result, slower.", failure)


class ScanResult:
    """What ``LineScan.scan`` found in one buffer (numpy arrays, see ``linescan.cc``'s
    ``ff_scan``; ``new_templates``: id -> template of each new key reported)."""

    __slots__ = ("starts", "ends", "lines", "ids", "touched", "touched_count", "touched_first",
                 "touched_last", "signal_uncovered", "signal_lines", "total_lines", "overflow",
                 "new_templates")


class LineScan:
    """The C++ pass bound to one RE2 run-scan filter's pattern, with its own key table:
    key ids stay valid across buffers until ``reset`` (``keys[id]`` is the key's bytes)."""

    # the table is emptied when it holds this many keys or key bytes (memory stays bounded)
    MAX_KEYS = 200_000
    MAX_KEY_BYTES = 256 << 20

    def __init__(self, pattern):
        self._table = _linescan.Table(pattern)
        self.keys: list[bytes] = []

    @property
    def n_ids(self) -> int:
        return len(self.keys)

    def reset(self) -> None:
        """Forget every key (fingerprints stay)."""
        self._table.reset()
        self.keys = []

    def full(self) -> bool:
        return len(self.keys) >= self.MAX_KEYS or self._table.arena_bytes() >= self.MAX_KEY_BYTES

    def add_prints(self, prints) -> None:
        """Fingerprints of entry templates (``LogCompressor._entry_prints``): with the
        budget spent, a new key whose fingerprint is not among them is overflow."""
        self._table.add_prints(b"".join(p + b"\n" for p in prints))

    def set_status(self, ids: list[int], status: int) -> None:
        """Lines of these keys are from now on counted as overflow (OVERFLOW) or
        skipped (BLANK), not reported."""
        if ids:
            self._table.set_status(np.asarray(ids, dtype=np.int32).tobytes(), status)

    def scan(self, buf: bytes, signal_starts: list[int], max_line: int, budget_spent: bool) -> ScanResult:
        """The uncovered lines of ``buf`` (complete lines) other than the signal lines
        starting at ``signal_starts`` (ascending) and the lines of OVERFLOW/BLANK keys
        (``overflow`` counts the former), keyed; ``keys`` gets the new keys (None for
        those never reported), ``new_templates`` the templates of those reported while
        the budget lasts."""
        before = len(self.keys)
        (starts, ends, lines, ids, touched, touched_count, touched_first, touched_last, signal_uncovered,
         signal_lines, total, overflow, new_keys, new_bodies) = self._table.scan(
            buf, np.asarray(signal_starts, dtype=np.int64).tobytes(), max_line, budget_spent)
        i64, i32 = np.int64, np.int32
        result = ScanResult()
        result.starts, result.ends = np.frombuffer(starts, i64), np.frombuffer(ends, i64)
        result.lines, result.ids = np.frombuffer(lines, i64), np.frombuffer(ids, i32)
        result.touched, result.touched_count = np.frombuffer(touched, i32), np.frombuffer(touched_count, i64)
        result.touched_first, result.touched_last = np.frombuffer(touched_first, i64), np.frombuffer(touched_last, i64)
        result.signal_uncovered = np.frombuffer(signal_uncovered, np.int8)
        result.signal_lines = np.frombuffer(signal_lines, i64)
        result.total_lines = total
        result.overflow = overflow
        result.new_templates = {}
        added = self._table.n_ids() - before
        if added:
            keys = self.keys
            keys.extend([None] * added)
            reported = result.touched[result.touched >= before].tolist()
            if reported:
                # the C++ pass wrote these keys in order of their ids, as touched lists them
                for i, key in zip(reported, new_keys.split(b"\n")):
                    keys[i] = key
            if reported and not budget_spent:  # (entries open only until it is)
                # their templates (diagnosis.filters._uncovered_template), decoded in one go:
                # bodies hold no newline, and a sequence a newline cuts short decodes as one
                # the end of a body cuts short
                bodies = new_bodies.decode("utf-8", "replace").split("\n")
                result.new_templates = dict(zip(reported, ["U|" + body.strip() for body in bodies]))
        return result


KEEP, OVERFLOW, BLANK = 0, 1, 2  # key statuses (linescan.cc)

# Lines the self-test scans with both the C++ pass and the Python filter before the
# C++ pass is used: covered runs, uncovered lines, blank lines, a last line without "\n".
_SELF_TEST = (
    b"[rank0]: 2026-11-22T08:00:00.123Z rank=0 step=12 loss=3.21 lr=1.0e-04 grad_norm=0.5\n"
    b"hello world 12\n\n   \n"
    b"node-a01:2281:2401 [3] NCCL INFO Channel 00/02 :    0   1\n"
    b"[rank3]:  iteration      120/   500 | consumed samples: 1920\n"
    b"Traceback (most recent call last):\n"
    b"[rank1]: something else entirely\n"
    b"[rank1]: something else entirely"
)


def line_scan_for(line_filter) -> LineScan | None:
    """A ``LineScan`` for an RE2 ``RunScanFilter``, or None where the C++ pass cannot
    run (``failure`` says why; a warning once per process where it was not built):
    not built, another engine, no rules, a pattern its RE2 does not compile, or a
    self-test that disagrees with the Python filter."""
    global failure
    if getattr(line_filter, "engine", None) != "re2" or getattr(line_filter, "_empty", True):
        return None
    module = linescan()
    if module is None:
        _warn_once()
        return None
    pattern = getattr(line_filter, "_native_pattern", None)
    if pattern is None:  # once per filter (build_line_filter caches them by rule text)
        run_pattern = line_filter.run_pattern
        try:
            # Latin-1 for an ASCII pattern, as RunScanFilter compiles it for google-re2
            pattern = module.Pattern(run_pattern, run_pattern.isascii(), _RE2_MAX_MEM)
        except ValueError as exc:
            failure, pattern = str(exc), False
        else:
            found = LineScan(pattern).scan(_SELF_TEST, [], 1 << 30, False)
            expect = line_filter.uncovered_spans(_SELF_TEST)
            if (found.starts.tolist(), found.ends.tolist()) != (list(expect[0]), list(expect[1])):
                failure, pattern = "the native scan disagreed with the Python filter on the self-test", False
        if pattern is False:
            _warn_once()
        line_filter._native_pattern = pattern
    return LineScan(pattern) if pattern else None
