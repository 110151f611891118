"""The compressor's native line pass (``linescan.c``), built on first use.

``LogCompressor`` spends most of its time on logs whose lines no filter rule covers
when each such line becomes a Python object (a ``bytes``, a key, a dict lookup).
``linescan.c`` does the RE2 run-scan, the keying (digits as ``0``), the counting per
distinct key and the template body of each new key in one C pass, and counts (or skips)
the lines of keys the compressor found to be overflow (or blank) without reporting
them, so Python works once per distinct key of a buffer.

It is compiled with cffi the first time it is needed and kept in
``$FORGEFLOW_NATIVE_CACHE`` (default ``$XDG_CACHE_HOME/forgeflow/native``, else
``~/.cache/forgeflow/native``), one file per source/interpreter/cffi version; the
build runs in a subprocess, so compiler output never reaches the caller's stdout. When
it cannot be built or loaded (no C compiler, no Python headers, a read-only cache, a
platform whose RE2 is not libstdc++'s) ``linescan()`` returns None and the compressor
runs its pure-Python scan, which gives the same result (the tests compare both on the
varied corpus). ``FORGEFLOW_NATIVE=0`` turns it off.

The filter's regex is matched by RE2 itself: the C pass calls ``re2::RE2::Match``
(exported by google-re2's extension module) on the very RE2 object the Python filter
compiled. ``re2_binding`` finds both and checks the object before any call: the
pybind11 instance's value and holder pointers agree, and the object's first member
points to the compiled pattern's text.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path

import numpy as np

SOURCE = Path(__file__).with_name("linescan.c")
CDEF = """
typedef struct ff_table ff_table;
ff_table *ff_new(void);
void ff_free(ff_table *t);
void ff_reset(ff_table *t);
int32_t ff_n_ids(ff_table *t);
int64_t ff_arena_bytes(ff_table *t);
void ff_outputs(ff_table *t, int64_t **o_start, int64_t **o_end, int64_t **o_line, int32_t **o_id,
                int32_t **t_id, int64_t **t_count, int64_t **t_first, int64_t **t_last);
int ff_add_prints(ff_table *t, const char *joined, int64_t size);
void ff_set_status(ff_table *t, const int32_t *ids, int64_t n, int8_t status);
int64_t ff_new_keys(ff_table *t, const char **keys);
int64_t ff_new_bodies(ff_table *t, const char **bodies);
int ff_scan(ff_table *t, uintptr_t match_addr, uintptr_t re_addr, const char *buf, int64_t size,
            int64_t max_line, int budget_spent, const int64_t *sig, int64_t n_sig, int8_t *sig_uncovered,
            int64_t *sig_line, int64_t *out);
"""
# re2::RE2::Match(std::string_view, size_t, size_t, RE2::Anchor, std::string_view*, int) const
_RE2_MATCH_SYMBOL = "_ZNK3re23RE25MatchESt17basic_string_viewIcSt11char_traitsIcEEmmNS0_6AnchorEPS4_i"
_BUILD_TIMEOUT_S = 300

_module = None
_tried = False
failure: str | None = None  # why linescan() is None (for tests and `forgeflow` debugging)


def cache_dir() -> Path:
    explicit = os.environ.get("FORGEFLOW_NATIVE_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "forgeflow" / "native"


def _module_name() -> str:
    import _cffi_backend  # cffi's C part (its version is cffi's), quicker to import than cffi

    digest = hashlib.sha256(
        repr((SOURCE.read_bytes(), CDEF, sys.implementation.cache_tag, sys.platform,
              os.uname().machine, _cffi_backend.__version__)).encode()
    ).hexdigest()
    return f"_ff_linescan_{digest[:16]}"


_BUILD_SCRIPT = """
import sys, cffi
name, source, cdef, tmp = sys.argv[1:5]
ffi = cffi.FFI()
ffi.cdef(cdef)
ffi.set_source(name, open(source).read(), extra_compile_args=["-O3"])
print(ffi.compile(tmpdir=tmp))
"""


def _load_built(path: Path, name: str):
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _build() -> object:
    import shutil
    import subprocess
    import sysconfig
    import tempfile

    name = _module_name()
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    cache = cache_dir()
    target = cache / f"{name}{suffix}"
    if not target.exists():
        # the usual reasons a build cannot work, found without spawning one
        compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
        if shutil.which(compiler) is None:
            raise RuntimeError(f"no C compiler ({compiler}) to build {SOURCE.name}")
        if not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
            raise RuntimeError(f"no Python headers (Python.h) to build {SOURCE.name}")
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache, prefix=".build-") as tmp:
            done = subprocess.run(
                [sys.executable, "-c", _BUILD_SCRIPT, name, str(SOURCE), CDEF, tmp],
                capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S,
            )
            if done.returncode != 0:
                tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
                raise RuntimeError(f"building {SOURCE.name} failed: {' | '.join(tail)}")
            built = Path(done.stdout.strip().splitlines()[-1])
            os.replace(built, target)  # atomic: a process building beside us wins or loses whole
    return _load_built(target, name)


def linescan():
    """The built module (``.ffi``, ``.lib``), or None (``failure`` says why)."""
    global _module, _tried, failure
    if _tried:
        return _module
    _tried = True
    if os.environ.get("FORGEFLOW_NATIVE", "1") == "0":
        failure = "FORGEFLOW_NATIVE=0"
        return None
    if sys.platform != "linux":
        failure = f"not built on {sys.platform} (RE2's ABI is libstdc++'s on Linux only)"
        return None
    try:
        _module = _build()
    except Exception as exc:  # any build or load problem: the Python scan runs instead
        failure = f"{type(exc).__name__}: {exc}"
        _module = None
    return _module


def native_failure() -> str | None:
    """Why the native pass is not in use (None: it is, or was not asked for yet)."""
    return failure


_match_address: int | None = None


def _re2_match_address() -> int:
    global _match_address
    if _match_address is None:
        from re2 import _re2

        _match_address = ctypes.cast(getattr(ctypes.CDLL(_re2.__file__), _RE2_MATCH_SYMBOL), ctypes.c_void_p).value
    return _match_address


def re2_binding(regex, pattern: bytes) -> tuple[int, int] | None:
    """(address of ``re2::RE2::Match``, address of the RE2 object) of a compiled
    ``re2`` regex, or None when the object does not look as expected.

    ``regex._regexp`` is google-re2's pybind11 instance holding the RE2 object in a
    ``unique_ptr``: its value pointer and holder sit side by side after the object
    header and must agree; the RE2 object's first member (``const std::string*
    pattern_``) must point to ``pattern``."""
    inner = getattr(regex, "_regexp", None)
    if inner is None or type(inner).__basicsize__ < 48:
        return None
    base = id(inner) + 16  # after ob_refcnt and ob_type
    value = ctypes.c_void_p.from_address(base).value
    holder = ctypes.c_void_p.from_address(base + 8).value
    if not value or value != holder:
        return None
    string = ctypes.c_void_p.from_address(value).value  # libstdc++: data pointer, then size
    if not string:
        return None
    text = ctypes.c_void_p.from_address(string).value
    size = ctypes.c_size_t.from_address(string + 8).value
    if not text or size != len(pattern) or ctypes.string_at(text, size) != pattern:
        return None
    try:
        return _re2_match_address(), value
    except (OSError, AttributeError):
        return None


class ScanResult:
    """What ``LineScan.scan`` found in one buffer (numpy arrays, see ``linescan.c``;
    ``new_templates``: id -> template of each new key reported)."""

    __slots__ = ("starts", "ends", "lines", "ids", "touched", "touched_count", "touched_first",
                 "touched_last", "signal_uncovered", "signal_lines", "total_lines", "overflow",
                 "new_templates")


class LineScan:
    """The C pass bound to one RE2 run-scan filter, with its own key table: key ids
    stay valid across buffers until ``reset`` (``keys[id]`` is the key's bytes)."""

    # the table is emptied when it holds this many keys or key bytes (memory stays bounded)
    MAX_KEYS = 200_000
    MAX_KEY_BYTES = 256 << 20

    def __init__(self, module, binding: tuple[int, int], regex):
        self._ffi, self._lib = module.ffi, module.lib
        self._match, self._re = binding
        self._regex = regex  # keeps the RE2 object alive while the C code holds its address
        self._table = self._ffi.gc(self._lib.ff_new(), self._lib.ff_free)
        self.keys: list[bytes] = []
        # where ff_outputs puts the addresses of the last scan's arrays
        self._where = [self._ffi.new(f"{kind} **") for kind in ("int64_t",) * 3 + ("int32_t",) * 2 + ("int64_t",) * 3]

    @property
    def n_ids(self) -> int:
        return len(self.keys)

    def reset(self) -> None:
        """Forget every key (fingerprints stay)."""
        self._lib.ff_reset(self._table)
        self.keys = []

    def full(self) -> bool:
        return len(self.keys) >= self.MAX_KEYS or self._lib.ff_arena_bytes(self._table) >= self.MAX_KEY_BYTES

    def add_prints(self, prints) -> None:
        """Fingerprints of entry templates (``LogCompressor._entry_prints``): with the
        budget spent, a new key whose fingerprint is not among them is overflow."""
        joined = b"".join(p + b"\n" for p in prints)
        if self._lib.ff_add_prints(self._table, joined, len(joined)) != 0:
            raise MemoryError("the native line scan ran out of memory")

    def set_status(self, ids: list[int], status: int) -> None:
        """Lines of these keys are from now on counted as overflow (OVERFLOW) or
        skipped (BLANK), not reported."""
        if ids:
            array = np.asarray(ids, dtype=np.int32)
            self._lib.ff_set_status(self._table, self._ffi.from_buffer("int32_t[]", array), len(array), status)

    def scan(self, buf: bytes, signal_starts: list[int], max_line: int, budget_spent: bool) -> ScanResult:
        """The uncovered lines of ``buf`` (complete lines) other than the signal lines
        starting at ``signal_starts`` (ascending) and the lines of OVERFLOW/BLANK keys
        (``overflow`` counts the former), keyed; ``keys`` gets the new keys (None for
        those never reported), ``new_templates`` the templates of those reported while
        the budget lasts. The arrays returned are valid until the next call."""
        ffi = self._ffi
        signals = np.asarray(signal_starts, dtype=np.int64)
        signal_uncovered = np.zeros(len(signals), dtype=np.int8)
        signal_lines = np.zeros(len(signals), dtype=np.int64)
        out = np.zeros(4, dtype=np.int64)

        def ptr(array, kind):
            return ffi.from_buffer(kind, array)

        before = len(self.keys)
        status = self._lib.ff_scan(
            self._table, self._match, self._re, ffi.from_buffer(buf), len(buf), max_line, int(budget_spent),
            ptr(signals, "int64_t[]"), len(signals), ptr(signal_uncovered, "int8_t[]"), ptr(signal_lines, "int64_t[]"),
            ptr(out, "int64_t[]"),
        )
        if status != 0:
            raise MemoryError("the native line scan ran out of memory")
        n, m, total, overflow = out.tolist()
        where = self._where
        self._lib.ff_outputs(self._table, *where)

        def view(i: int, count: int, dtype) -> np.ndarray:
            size = count * np.dtype(dtype).itemsize
            return np.frombuffer(ffi.buffer(where[i][0], size), dtype=dtype) if count else np.empty(0, dtype=dtype)

        result = ScanResult()
        result.starts, result.ends = view(0, n, np.int64), view(1, n, np.int64)
        result.lines, result.ids = view(2, n, np.int64), view(3, n, np.int32)
        result.touched, result.touched_count = view(4, m, np.int32), view(5, m, np.int64)
        result.touched_first, result.touched_last = view(6, m, np.int64), view(7, m, np.int64)
        result.signal_uncovered, result.signal_lines = signal_uncovered, signal_lines
        result.total_lines = total
        result.overflow = overflow
        result.new_templates = {}
        added = self._lib.ff_n_ids(self._table) - before
        if added:
            keys = self.keys
            keys.extend([None] * added)
            reported = result.touched[result.touched >= before].tolist()
            if reported:
                # the C pass wrote these keys in order of their ids, as touched lists them
                text = ffi.new("const char **")
                size = self._lib.ff_new_keys(self._table, text)
                new_keys = ffi.buffer(text[0], size)[:].split(b"\n")
                for i, key in zip(reported, new_keys):
                    keys[i] = key
            if reported and not budget_spent:  # (entries open only until it is)
                # their templates (diagnosis.filters._uncovered_template), decoded in one go:
                # bodies hold no newline, and a sequence a newline cuts short decodes as one
                # the end of a body cuts short
                size = self._lib.ff_new_bodies(self._table, text)
                bodies = ffi.buffer(text[0], size)[:].decode("utf-8", "replace").split("\n")
                result.new_templates = dict(zip(reported, ["U|" + body.strip() for body in bodies]))
        return result


KEEP, OVERFLOW, BLANK = 0, 1, 2  # key statuses (linescan.c)

# Lines the self-test scans with both the C pass and the Python filter before the C
# pass is used: covered runs, uncovered lines, blank lines, a last line without "\n".
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
    """A ``LineScan`` for an RE2 ``RunScanFilter``, or None where the C pass cannot run
    (``failure`` says why): not built, another engine, no rules, an RE2 object that
    does not look as expected, or a self-test that disagrees with the Python filter."""
    global failure
    regex = getattr(line_filter, "_regex", None)
    if getattr(line_filter, "engine", None) != "re2" or getattr(line_filter, "_empty", True) or regex is None:
        return None
    module = linescan()
    if module is None:
        return None
    binding = getattr(line_filter, "_native_binding", None)
    if binding is None:
        binding = re2_binding(regex, line_filter.run_pattern)
        if binding is None:
            failure = "the RE2 object does not look as expected (google-re2 changed?)"
            binding = False
        else:
            probe = LineScan(module, binding, regex)
            found = probe.scan(_SELF_TEST, [], 1 << 30, False)
            expect = line_filter.uncovered_spans(_SELF_TEST)
            if (found.starts.tolist(), found.ends.tolist()) != (list(expect[0]), list(expect[1])):
                failure = "the native scan disagreed with the Python filter on the self-test"
                binding = False
        line_filter._native_binding = binding
    return LineScan(module, binding, regex) if binding else None
