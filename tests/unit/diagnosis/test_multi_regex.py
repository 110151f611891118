"""The linear-time engines: validation, catch-alls, the backtracking ban, engine agreement."""

from __future__ import annotations

import pytest

from diagnosis.multi_regex import (
    ENGINE_NAMES,
    RegexError,
    UnsafeEngineError,
    build_line_filter,
    compile_linear,
    is_catch_all,
    validate_regex,
)
from diagnosis.filter_seeds import SEED_FILTER_RULES


@pytest.mark.parametrize("pattern", [r"(a)\1", r"foo(?=bar)", r"(?<=x)y", r"(", ""])
def test_validate_regex_refuses_what_linear_engines_cannot_run(pattern):
    with pytest.raises(RegexError):
        validate_regex(pattern)


def test_validate_regex_names_the_reason():
    with pytest.raises(RegexError, match="backreferences"):
        validate_regex(r"(a)\1")


@pytest.mark.timeout(30)
def test_catastrophic_backtracking_pattern_runs_in_linear_time():
    # (a+)+$ takes exponential time in a backtracking engine on this input; in RE2 and
    # Hyperscan it is linear, so it is acceptable (the test would time out otherwise).
    validate_regex(r"(a+)+$")
    regex = compile_linear(r"(a+)+$")
    assert regex.search("a" * 200_000 + "b") is None
    assert regex.search("xaaaa") is not None
    lines = build_line_filter([r"(a+)+$"], engine="hyperscan")
    buf = b"a" * 50_000 + b"b\n" + b"aaaa\n"
    assert lines.uncovered_lines(buf) == [(0, 50_001)]


@pytest.mark.parametrize("pattern", [".*", ".", r"\S*", "^", r"[\s\S]*", ".+", r"\w", "(?s).*"])
def test_catch_alls_are_recognised(pattern):
    assert is_catch_all(pattern)


@pytest.mark.parametrize("pattern", [r"NCCL INFO Channel \d+", r"^\s+warnings\.warn\($", r"step=\d+ loss="])
def test_specific_patterns_are_not_catch_alls(pattern):
    assert not is_catch_all(pattern)


def test_python_engine_refuses_untrusted_rules():
    with pytest.raises(UnsafeEngineError):
        build_line_filter([r"(a+)+$"], engine="python")
    build_line_filter([r"^foo"], engine="python", trusted=True)


def test_unknown_engine_is_a_clear_error():
    with pytest.raises(RegexError, match="unknown engine"):
        build_line_filter(["x"], engine="pcre")


SAMPLE = (
    b"2026-11-22T08:00:00.123Z rank=0 step=12 loss=3.21 lr=1.000e-04 grad_norm=0.52 tokens_per_s=12.0 elapsed_s=1.0\n"
    b"node-a01:2281:2401 [3] NCCL INFO Channel 00/0 : 3[3] -> 4[4] via P2P/CUMEM/read\n"
    b"something nobody has a rule for\n"
    b"\n"
    b"[rank3]:  warnings.warn(\n"
    b"[rank3]: RuntimeError: CUDA error: an illegal memory access was encountered\n"
    b"  micro_batch_size ................................ 2\n"
    b"\xff\xfe binary \x00 garbage\n"
)


@pytest.mark.parametrize("engine", ENGINE_NAMES)
def test_engines_agree_on_uncovered_lines(engine):
    patterns = [p for _, p in SEED_FILTER_RULES]
    uncovered = build_line_filter(patterns, engine=engine, trusted=True).uncovered_lines(SAMPLE)
    texts = [SAMPLE[s:e] for s, e in uncovered]
    assert texts == [
        b"something nobody has a rule for",
        b"",
        b"[rank3]: RuntimeError: CUDA error: an illegal memory access was encountered",
        b"\xff\xfe binary \x00 garbage",
    ]


def test_compiled_filters_are_reused_until_rules_change():
    a = build_line_filter(["^foo", "bar$"])
    assert build_line_filter(["^foo", "bar$"]) is a
    assert build_line_filter(["^foo", "bar$", "baz"]) is not a


def test_signal_scanner_finds_the_same_lines_with_hyperscan_and_re2(monkeypatch):
    from diagnosis import multi_regex
    from diagnosis.filters import signal_patterns
    from diagnosis.rules import DiagnosisLibrary

    patterns, caseless = signal_patterns(DiagnosisLibrary().patterns)
    scanner = multi_regex.SignalScanner(patterns, caseless)
    if multi_regex.hyperscan is not None:
        # Where Hyperscan is installed its database must compile: a silent fallback to
        # RE2 would make this comparison RE2 against itself.
        assert scanner.engine == "hyperscan"
    with_hyperscan = scanner.signal_lines(SAMPLE)
    monkeypatch.setattr(multi_regex, "hyperscan", None)
    fallback = multi_regex.SignalScanner(patterns, caseless)
    assert fallback.engine == "re2"
    with_re2 = fallback.signal_lines(SAMPLE)
    assert with_hyperscan == with_re2
    assert [SAMPLE[s:e] for s, e in with_re2] == [
        b"[rank3]: RuntimeError: CUDA error: an illegal memory access was encountered",
    ]


def test_hyperscan_is_installed_where_it_ships():
    # Hyperscan ships x86-64 wheels; on that platform (CI) a missing module would turn
    # every Hyperscan test above into an RE2-only test without failing.
    import platform

    from diagnosis import multi_regex

    if platform.machine() in ("x86_64", "AMD64"):
        assert multi_regex.hyperscan is not None, "pip install -c constraints.txt hyperscan"


def test_engines_agree_on_varied_logs():
    """Runs of covered lines are skipped whole; the line a run stops at is taken as
    uncovered without a second match (the run is greedy): all engines must agree on
    output the seeds do not know, interleaved with what they do."""
    import random
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "data" / "failures"))
    from logsim import Job
    from varied import routine_lines

    rng = random.Random(5)
    job = Job(3, ["node-a01", "node-a02"], gpus_per_node=2)
    job.startup()
    job.train(20)
    lines = job.lines + list(routine_lines(rng, 300))
    rng.shuffle(lines)
    buf = ("\n".join(lines) + "\n").encode()
    patterns = [p for _, p in SEED_FILTER_RULES]
    results = {e: build_line_filter(patterns, engine=e, trusted=True).uncovered_lines(buf) for e in ENGINE_NAMES}
    assert results["re2"] == results["hyperscan"] == results["python"]
    assert 200 < len(results["re2"]) < len(lines)


def test_signal_database_is_reused_from_the_cache_dir(tmp_path):
    """The compiled signal database is kept in the cache dir; a cached copy finds the
    same lines, and a corrupt file is compiled anew (Hyperscan checks its CRC)."""
    from diagnosis import multi_regex
    from diagnosis.filters import signal_patterns
    from diagnosis.rules import DiagnosisLibrary

    if multi_regex.hyperscan is None:
        pytest.skip("Hyperscan is not installed on this platform")
    patterns, caseless = signal_patterns(DiagnosisLibrary().patterns)
    compiled = multi_regex.SignalScanner(patterns, caseless, cache_dir=tmp_path)
    cached_files = list(tmp_path.glob("hyperscan-*.db"))
    assert len(cached_files) == 1
    loaded = multi_regex.SignalScanner(patterns, caseless, cache_dir=tmp_path)
    assert loaded.engine == compiled.engine == "hyperscan"
    assert loaded.signal_lines(SAMPLE) == compiled.signal_lines(SAMPLE) != []
    # another pattern set gets its own file
    multi_regex.SignalScanner(patterns[:-1], caseless[:-1], cache_dir=tmp_path)
    assert len(list(tmp_path.glob("hyperscan-*.db"))) == 2
    data = cached_files[0].read_bytes()
    cached_files[0].write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])
    rebuilt = multi_regex.SignalScanner(patterns, caseless, cache_dir=tmp_path)
    assert rebuilt.engine == "hyperscan"
    assert rebuilt.signal_lines(SAMPLE) == compiled.signal_lines(SAMPLE)
    assert cached_files[0].read_bytes() == data  # rewritten whole


def test_validate_regex_still_refuses_after_a_signal_database_compiled():
    """Patterns a signal database compiled are not compiled again one by one; a
    pattern Hyperscan refuses is still refused."""
    from diagnosis import multi_regex

    if multi_regex.hyperscan is None:
        pytest.skip("Hyperscan is not installed on this platform")
    multi_regex.SignalScanner([r"worker \d+ stalled"], [False])
    assert r"worker \d+ stalled" in multi_regex._HYPERSCAN_OK
    validate_regex(r"worker \d+ stalled")
    with pytest.raises(RegexError, match="Hyperscan"):
        validate_regex(r"(?U)worker \d+ stalled")
