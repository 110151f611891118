"""The compressor's native line pass (diagnosis.native) against its pure-Python scan."""

from __future__ import annotations

import logging
import os
import random
import shutil
import sys
import sysconfig
from pathlib import Path

import pytest

from diagnosis import native
from diagnosis.filters import FilterRule, FilterRuleSet, LogCompressor
from diagnosis.rules import DiagnosisLibrary

FAILURES = Path(__file__).resolve().parents[2] / "data" / "failures"
sys.path.insert(0, str(FAILURES))

from logsim import Job  # noqa: E402
from varied import KEYWORD_FREE_ERRORS, keyword_free_error, routine_lines  # noqa: E402


def _unbuilt() -> str | None:
    """Why the native pass is not in use here, or None when it is. It is an optional part of
    the build: where g++ and RE2's headers (libre2-dev) are present, `make` builds it."""
    if native.linescan() is None:
        return native.native_failure()
    return None


def varied_log(lines_wanted: int, seed: int = 17) -> bytes:
    """What benchmarks/filter_throughput.py's varied log holds, smaller: forgeflow,
    megatron and NCCL traffic (covered runs) with 35 % other stacks' output and
    keyword-free error lines, interleaved."""
    rng = random.Random(seed)
    out: list[str] = []
    segment = 0
    while len(out) < lines_wanted:
        job = Job(seed * 1000 + segment, ["node-a01", "node-a02"])
        job.startup()
        job.step = segment * 2000
        for _ in range(10):
            job.train(50)
            block = job.lines
            extra = list(routine_lines(rng, int(len(block) * 0.35 / 0.65), start_step=job.step))
            extra.append(keyword_free_error(rng, rng.choice(KEYWORD_FREE_ERRORS)))
            slots = sorted(rng.randrange(len(block) + 1) for _ in extra)
            prev = 0
            for slot, line in zip(slots, extra):
                out.extend(block[prev:slot])
                out.append(line)
                prev = slot
            out.extend(block[prev:])
            job.lines = []
        segment += 1
    return ("\n".join(out) + "\n").encode()


def compress(data: bytes, native_pass: bool, chunks: int = 1, rules: FilterRuleSet | None = None, **kw):
    compressor = LogCompressor(rules or FilterRuleSet(), DiagnosisLibrary().patterns, native=native_pass, **kw)
    step = len(data) // chunks + 1
    for i in range(0, len(data), step):
        compressor.feed(data[i:i + step])
    return compressor, compressor.finish()


def assert_same(a, b) -> None:
    assert a.render() == b.render()
    assert {k: v for k, v in vars(a.stats).items() if k != "seconds"} == {
        k: v for k, v in vars(b.stats).items() if k != "seconds"}
    assert a.entries == b.entries  # text, template, counts, ranks, hosts, line numbers, timestamps
    assert (a.rank_hosts, a.progress, a.file_ends) == (b.rank_hosts, b.progress, b.file_ends)


needs_native = pytest.mark.skipif(_unbuilt() is not None, reason=str(_unbuilt()))


def _buildable() -> str | None:
    """Why the build could not make the extension here, or None when it could: a C++
    compiler and RE2's headers (what setup.py needs)."""
    if sys.platform != "linux":
        return f"not checked on {sys.platform}"
    compiler = (sysconfig.get_config_var("CXX") or "c++").split()[0]
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler})"
    if not any((Path(d) / "re2" / "re2.h").exists() for d in ("/usr/include", "/usr/local/include")):
        return "no RE2 headers (re2/re2.h: Debian's libre2-dev)"
    return None


@pytest.mark.skipif(_buildable() is not None, reason=str(_buildable()))
def test_the_native_pass_is_in_use_where_it_can_be_built():
    """Where the install had what the extension needs, it was built and is used (a build
    that broke would otherwise only skip the comparisons below)."""
    if os.environ.get("FORGEFLOW_NATIVE") == "0":
        pytest.skip("FORGEFLOW_NATIVE=0")
    compressor = LogCompressor(FilterRuleSet(), DiagnosisLibrary().patterns)
    assert compressor._native is not None, native.native_failure()
    assert native.linescan() is not None


@needs_native
@pytest.mark.parametrize("budget,chunks", [(20_000, 1), (1_500, 1), (1_500, 7), (60, 3)])
def test_native_and_python_compress_the_varied_corpus_alike(budget, chunks):
    """Budgets spent early, late or never, and chunk cuts anywhere (a piece boundary
    inside the opening of entries, the budget running out inside a piece)."""
    data = varied_log(60_000)
    compressor, fast = compress(data, True, chunks, max_uncovered_entries=budget)
    assert compressor._native is not None and compressor._native.n_ids > 1000  # the C++ pass did the keying
    _, slow = compress(data, False, chunks, max_uncovered_entries=budget)
    assert fast.stats.lines_signal > 0 and fast.stats.lines_uncovered > 10_000
    if budget < 20_000:
        assert fast.stats.uncovered_overflow > 0 and compressor._native_prints_sent
    assert_same(fast, slow)


@needs_native
def test_native_and_python_agree_on_the_bulk_paths_corner_cases():
    """Blank lines under a rank prefix, a digit-length variant of a known message,
    torchrun's host/rank summary, lines over max_line_bytes, invalid UTF-8, carriage
    returns and no trailing newline: each alike once the budget is spent and before."""
    rng = random.Random(3)
    lines = []
    for i in range(6000):
        r = rng.randrange(24)
        kind = i % 8
        if kind == 0:
            lines.append(f"[rank{r}]:epoch {rng.randrange(200)} shard {rng.choice('abcdefgh')} done in {rng.random():.3f}s")
        elif kind == 1:
            lines.append(f"{r}: user print {rng.choice(['alpha', 'beta', 'gamma'])}{rng.randrange(10**rng.randrange(1, 12))}")
        elif kind == 2:
            lines.append(f"[default{r}]:words {' '.join(rng.choice('xyzuvw') * rng.randrange(1, 4) for _ in range(4))}\r")
        elif kind == 3:
            lines.append(f"2026-11-22T07:41:0{r % 10}.1Z {r}: [rank{r}]:metric value={rng.randrange(10**9)}")
        elif kind == 4:
            lines.append(f"[rank{r}]:   \t ")
        elif kind == 5:
            lines.append(f"unique message number {i} {rng.choice('QRSTUV') * rng.randrange(1, 9)} caf\udcff")
        elif kind == 6:
            lines.append(f"[rank{r}]:step={i} loss=nan")
        else:
            lines.append("")
        if i % 1500 == 700:
            lines += ["[rank3]:  host      : node-a07", "[rank3]:  rank      : 12 (local_rank: 4)", "x" * 300]
    data = "\n".join(lines).encode("utf-8", "surrogateescape")  # no newline at the end
    for budget in (40, 300, 100_000):
        for chunks in (1, 5):
            _, fast = compress(data, True, chunks, max_uncovered_entries=budget, max_line_bytes=200)
            _, slow = compress(data, False, chunks, max_uncovered_entries=budget, max_line_bytes=200)
            assert fast.stats.lines_truncated == 4
            if budget == 100_000:  # (the summary pairs are read from kept lines only)
                assert fast.rank_hosts == {12: "node-a07"}
            assert_same(fast, slow)


@needs_native
def test_learned_rules_and_a_backtracking_shape_run_alike_and_linear():
    """A learned rule goes into the run pattern the C++ pass compiles; a pattern that
    backtracks exponentially elsewhere stays linear (RE2)."""
    rules = FilterRuleSet(learned=[
        FilterRule(name="shards", pattern=r"^\[rank\d+\]:epoch \d+ shard", source="agent"),
        FilterRule(name="evil", pattern=r"^(a+)+$", source="agent"),
    ])
    data = varied_log(20_000) + (b"a" * 50_000 + b"b\n") * 20 + b"[rank1]:epoch 3 shard x\n"
    compressor, fast = compress(data, True, 2, rules=rules)
    assert compressor._native is not None
    _, slow = compress(data, False, 2, rules=rules)
    assert_same(fast, slow)


def test_without_the_native_pass_the_python_scan_runs(monkeypatch, caplog):
    """An install that could not build the extension (no compiler, no RE2 headers) leaves
    the Python scan, says so once per process, and native=True says why."""
    monkeypatch.setattr(native, "_linescan", None)
    monkeypatch.setattr(native, "_import_error", "ModuleNotFoundError: No module named 'diagnosis.native._linescan'")
    monkeypatch.setattr(native, "_checked", False)
    monkeypatch.setattr(native, "_unusable", None)
    monkeypatch.setattr(native, "failure", None)
    monkeypatch.setattr(native, "_warned", False)
    monkeypatch.delenv("FORGEFLOW_NATIVE", raising=False)
    with caplog.at_level(logging.WARNING, logger="diagnosis.native"):
        compressor = LogCompressor(FilterRuleSet(), DiagnosisLibrary().patterns)
        LogCompressor(FilterRuleSet(), DiagnosisLibrary().patterns)
    assert compressor._native is None and "not built" in native.native_failure()
    warnings = [r.getMessage() for r in caplog.records if r.name == "diagnosis.native"]
    assert len(warnings) == 1 and "libre2-dev" in warnings[0] and "pure-Python scan" in warnings[0]
    with pytest.raises(RuntimeError, match="not built"):
        LogCompressor(FilterRuleSet(), DiagnosisLibrary().patterns, native=True)
    compressor.feed(b"hello 1\n[rank2]:hello 22\n")
    assert [(e.count, sorted(e.ranks)) for e in compressor.finish().uncovered_entries()] == [(2, [2])]


@needs_native
def test_a_build_of_another_source_is_not_used(monkeypatch, tmp_path):
    """An editable install whose linescan.cc changed since it was built runs the Python
    scan until it is rebuilt (a stale build could scan differently)."""
    edited = tmp_path / "linescan.cc"
    edited.write_bytes(native.SOURCE.read_bytes() + b"\n/* edited */\n")
    monkeypatch.setattr(native, "SOURCE", edited)
    monkeypatch.setattr(native, "_checked", False)
    monkeypatch.setattr(native, "_unusable", None)
    monkeypatch.setattr(native, "_warned", True)
    assert native.linescan() is None and "built from another linescan.cc" in native.native_failure()


def test_off_by_environment(monkeypatch):
    monkeypatch.setenv("FORGEFLOW_NATIVE", "0")
    monkeypatch.setattr(native, "_checked", False)
    monkeypatch.setattr(native, "_unusable", None)
    assert LogCompressor(FilterRuleSet(), DiagnosisLibrary().patterns)._native is None
    assert native.native_failure() == "FORGEFLOW_NATIVE=0"


def test_other_engines_never_take_the_native_pass():
    with pytest.raises(RuntimeError, match="not available"):
        LogCompressor(FilterRuleSet(), DiagnosisLibrary().patterns, engine="python", native=True)


@needs_native
def test_a_pattern_its_re2_cannot_compile_is_refused():
    """The extension compiles the run pattern itself; an error names RE2's reason."""
    with pytest.raises(ValueError, match="missing \\)"):
        native.linescan().Pattern(b"(?:abc", True, 1 << 20)
    with pytest.raises(TypeError):
        native.linescan().Table(b"not a pattern")


@needs_native
def test_the_table_checks_its_arguments():
    line_filter = FilterRuleSet().line_filter("re2")
    table = native.line_scan_for(line_filter)._table
    with pytest.raises(ValueError, match="int64"):
        table.scan(b"x\n", b"123", 100, False)
    with pytest.raises(ValueError, match="int32"):
        table.set_status(b"12345", 1)


@needs_native
def test_the_c_pass_makes_the_templates_python_makes():
    """The C++ pass hands over the template body of each new key (digit runs collapsed,
    a launcher prefix dropped), decoded in one go: the same as _uncovered_template."""
    from diagnosis.filters import _uncovered_template

    rng = random.Random(9)
    pieces = [b"[rank12]:", b"[default3]:", b"7: ", b"0: ", b"step ", b"123456789012", b"00", b" ", b"\t",
              b"\r", b"caf\xc3\xa9", b"\xff", b"\xe2\x82", b"\xf0\x90\x80", b"\xc2\xa0", b"\xc2\x85", b"\x1c",
              b"\x0b", b"x", b"[rank", b"]:", b"[default", b"0:", b":", b""]
    lines = [b"".join(rng.choice(pieces) for _ in range(rng.randrange(1, 7))) for _ in range(20_000)]
    line_filter = FilterRuleSet(include_seeds=False, learned=[
        FilterRule(name="never", pattern=r"^zzzz-never-printed", source="user")]).line_filter("re2")
    scan = native.line_scan_for(line_filter)
    found = scan.scan(b"\n".join(lines) + b"\n", [], 1 << 20, False)
    assert len(found.new_templates) > 5000
    for i, template in found.new_templates.items():
        assert template == _uncovered_template(scan.keys[i]), scan.keys[i]
