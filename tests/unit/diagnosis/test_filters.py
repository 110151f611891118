"""Filter rule sets and streaming compression."""

from __future__ import annotations

import json
import os

import pytest

from diagnosis.multi_regex import RegexError
from diagnosis.filter_seeds import SEED_FILTER_RULES
from diagnosis.filters import FilterRule, FilterRuleSet, LogCompressor, compress_file
from diagnosis.rules import DiagnosisLibrary
from diagnosis.signals import has_error_keyword

STEP = "2026-11-22T08:00:{s:02d}.123Z rank={r} step={n} loss=3.2{n} lr=1.000e-04 grad_norm=0.5 tokens_per_s=1.0 elapsed_s=1.0"
NCCL = "node-a0{h}:22{r}:24{r} [{g}] NCCL INFO Channel 0{g}/0 : {r}[{g}] -> 1[1] via P2P/CUMEM/read"


def routine(n: int) -> list[str]:
    lines = []
    for i in range(n):
        lines.append(STEP.format(s=i % 60, r=i % 16, n=i))
        lines.append(NCCL.format(h=1 + i % 2, r=i % 16, g=i % 8))
    return lines


def compress_lines(lines: list[str], rules: FilterRuleSet | None = None, **kw):
    compressor = LogCompressor(rules or FilterRuleSet(), DiagnosisLibrary().patterns, **kw)
    compressor.feed(("\n".join(lines) + "\n").encode())
    return compressor.finish()


def test_at_least_fifty_seeded_routine_rules_that_cover_their_lines():
    assert len(SEED_FILTER_RULES) >= 50
    rules = FilterRuleSet()
    assert [r.name for r in rules.covers(STEP.format(s=1, r=3, n=7))] == ["forgeflow-step-metrics"]
    assert rules.covers(NCCL.format(h=1, r=3, g=3))


ERROR_LINES = [
    "2026-11-22T08:00:01.123Z rank=3 step=120 loss=nan lr=1.000e-04 grad_norm=nan tokens_per_s=1.0 elapsed_s=1.0",
    "node-a01:2281:2401 [3] NCCL INFO Channel 00/0 : error while connecting",
    "[rank3]: RuntimeError: CUDA error: an illegal memory access was encountered",
    "[rank7]: DataLoader worker (pid 4711) exited unexpectedly",  # no keyword: a diagnosis rule keeps it
    "Nov 22 08:00:01 node-a02 kernel: NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus.",
]


def test_filters_never_drop_error_lines_even_when_a_rule_covers_them():
    # A (bad) learned rule covering the diagnosis-only line must not hide it either.
    rules = FilterRuleSet(learned=[FilterRule(name="too-broad", pattern=r"DataLoader worker", source="user")])
    lines = routine(300)
    for i, err in enumerate(ERROR_LINES):
        lines.insert(50 * (i + 1), err)
    result = compress_lines(lines, rules)
    kept = [e.text for e in result.entries]
    for err in ERROR_LINES:
        assert err in kept
    assert result.stats.lines_in == len(lines)
    assert not any(STEP.format(s=1, r=1, n=1)[:20] in t and "nan" not in t for t in kept)


def test_repeats_from_512_ranks_collapse_into_one_entry_with_the_rank_list():
    lines = routine(20)
    for rank in range(512):
        lines.append(f"[rank{rank}]:[E1122 08:{rank // 60:02d}:{rank % 60:02d}.{rank:06d} {2000 + rank} ProcessGroupNCCL.cpp:616] "
                     f"[Rank {rank}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=41, OpType=ALLREDUCE) ran for {600000 + rank} milliseconds before timing out.")
    result = compress_lines(lines)
    [entry] = [e for e in result.entries if "Watchdog" in e.text]
    assert entry.count == 512
    assert entry.ranks == set(range(512))
    assert entry.render().startswith("[x512 ranks 0-511] ")
    assert len(result.entries) == 1


def test_streaming_a_file_that_is_still_being_written(tmp_path):
    path = tmp_path / "growing.log"
    head = routine(100)
    path.write_bytes(("\n".join(head) + "\n[rank5]: RuntimeError: CUDA err").encode())
    compressor = LogCompressor(FilterRuleSet(), DiagnosisLibrary().patterns, chunk_bytes=4096)
    compressor.feed_file(path)
    partial = compressor.result()
    assert partial.stats.lines_in == len(head)
    assert not partial.signal_entries()  # the unfinished line waits for its end
    with open(path, "ab") as handle:
        handle.write(b"or: an illegal memory access was encountered\n" + ("\n".join(routine(50)) + "\n").encode())
    assert compressor.feed_file(path) > 0
    assert compressor.feed_file(path) == 0  # nothing new
    result = compressor.finish()
    assert [e.text for e in result.signal_entries()] == ["[rank5]: RuntimeError: CUDA error: an illegal memory access was encountered"]
    assert result.stats.lines_in == len(head) + 1 + len(routine(50))
    assert result.entries[0].first_line == len(head) + 1


def test_binary_garbage_and_non_utf8_do_not_crash(tmp_path):
    path = tmp_path / "garbage.log"
    garbage = bytes(range(256)) * 50 + b"\n" + b"\xc3\x28 invalid utf-8 fatal error \xa0\xa1\n" + os.urandom(20_000)
    path.write_bytes(garbage)
    result = compress_file(path, FilterRuleSet(), DiagnosisLibrary().patterns)
    assert any("fatal error" in e.text for e in result.signal_entries())
    assert result.stats.bytes_in == len(garbage)
    result.render().encode("utf-8")  # always renderable


@pytest.mark.parametrize("chunk_bytes", [1 << 20, 16 << 20])
def test_a_10mb_single_line_is_kept_truncated(tmp_path, chunk_bytes):
    path = tmp_path / "long.log"
    long_line = b"x" * (10 << 20) + b" Traceback at the very end"
    path.write_bytes(STEP.format(s=1, r=0, n=1).encode() + b"\n" + long_line + b"\n" + b"[rank1]: KeyError: 'a'\n")
    compressor = LogCompressor(FilterRuleSet(), DiagnosisLibrary().patterns, chunk_bytes=chunk_bytes)
    compressor.feed_file(path)
    result = compressor.finish()
    assert result.stats.lines_in == 3
    assert result.stats.lines_truncated == 1
    [long_entry] = [e for e in result.entries if e.truncated]
    assert len(long_entry.text) < 100_000 and "truncated: line of" in long_entry.text
    assert any(e.text == "[rank1]: KeyError: 'a'" for e in result.entries)


def test_empty_file(tmp_path):
    path = tmp_path / "empty.log"
    path.write_bytes(b"")
    result = compress_file(path, FilterRuleSet(), DiagnosisLibrary().patterns)
    assert result.entries == [] and result.stats.lines_in == 0 and result.render() == ""


def test_uncovered_segments_hold_only_lines_no_rule_or_keyword_covers(tmp_path, state):
    lines = routine(40)
    lines.insert(10, "custom banner: model ready")
    lines.insert(11, "custom banner: data ready")
    lines.insert(60, "[rank2]: ValueError: bad value")
    path = tmp_path / "job.log"
    path.write_text("\n".join(lines) + "\n")
    compressed = compress_file(path, FilterRuleSet.load(None), DiagnosisLibrary.load(None).patterns)
    assert compressed.uncovered_segments() == [["custom banner: model ready", "custom banner: data ready"]]


def test_rule_sets_persist_per_job_family(state):
    rules = FilterRuleSet.load("llama-7b")
    rule = rules.add_rule(r"^custom banner: \w+ ready$", name="banner")
    saved = json.loads((state / "filters" / "llama-7b.json").read_text())
    assert [r["pattern"] for r in saved["rules"]] == [rule.pattern]
    assert any(r.name == "banner" for r in FilterRuleSet.load("llama-7b").rules)
    assert not any(r.name == "banner" for r in FilterRuleSet.load("other-job").rules)
    before = FilterRuleSet.load("llama-7b").line_filter()
    assert FilterRuleSet.load("llama-7b").line_filter() is before  # same rules: no recompile
    rules.add_rule(r"^another banner \d+$")
    assert FilterRuleSet.load("llama-7b").line_filter() is not before


@pytest.mark.parametrize("pattern, reason", [
    (".*", "catch-all"),
    (r"(a)\1", "RE2"),
    (r"Traceback", "error-signal"),
    (r"NCCL WARN", "error-signal"),
])
def test_add_rule_refuses_unsafe_patterns(state, pattern, reason):
    rules = FilterRuleSet.load("job")
    with pytest.raises(RegexError, match=reason):
        rules.add_rule(pattern)
    assert not (state / "filters" / "job.json").exists()


def test_add_rule_refuses_patterns_matching_protected_lines(state):
    with pytest.raises(RegexError, match="error-signal"):
        FilterRuleSet.load("job").add_rule(r"^worker \d+ said", protected_lines=["worker 3 said: giving up"])


def test_invalid_job_family_name(state):
    with pytest.raises(ValueError, match="job family"):
        FilterRuleSet.load("../../etc")


def test_error_keywords():
    assert has_error_keyword("lm loss: NaN |")
    assert not has_error_keyword(" number of skipped iterations:   0 | number of nan iterations:   0 |")


def test_entries_are_bounded_for_logs_no_rule_knows():
    lines = [f"unheard-of message {chr(65 + i % 26)}{'x' * (i % 97)}" for i in range(2000)]
    lines += [f"fatal error kind {'y' * i}" for i in range(50)]
    result = compress_lines(lines, max_uncovered_entries=100, max_signal_entries=10)
    assert len(result.uncovered_entries()) == 100 and len(result.signal_entries()) == 10
    assert result.stats.uncovered_overflow > 0 and result.stats.signal_overflow == 40
    assert "compression budget exceeded: 40 error-signal" in result.render()


def test_keyword_free_errors_stay_even_under_a_rule_that_covers_them():
    """Error lines without an error word (``what():``, a warning raised as an exception,
    a DataLoader worker exiting, a Slurm CANCELLED...) are signals, so a broad learned
    rule cannot hide them."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "data" / "failures"))
    import random

    from varied import KEYWORD_FREE_ERRORS, keyword_free_error

    rng = random.Random(1)
    errors = [keyword_free_error(rng, t) for t in KEYWORD_FREE_ERRORS]
    broad = FilterRule(name="broad", pattern=r"^(?:\[rank\d+\]:|[a-z]|[A-Z])", source="user")
    compressed = compress_lines(routine(50) + errors, FilterRuleSet(learned=[broad]))
    kept = "\n".join(e.text for e in compressed.signal_entries())
    for line in errors:
        assert line in kept, line


def test_repeated_uncovered_lines_collapse_with_counts_ranks_and_line_numbers():
    lines = ["[rank3]:Processing shard alpha part-00012", "[rank12]:Processing shard alpha part-7",
             "something else 1", "[rank3]:Processing shard alpha part-913"]
    compressed = compress_lines(lines)
    entries = compressed.uncovered_entries()
    assert [(e.count, sorted(e.ranks), e.first_line, e.last_line) for e in entries] == [
        (3, [3, 12], 1, 4), (1, [], 3, 3),
    ]
    assert entries[0].render().startswith("[x3 ranks 3,12] [rank3]:Processing shard alpha part-00012")
    assert compressed.stats.lines_uncovered == 4


def test_a_known_message_still_counts_once_the_uncovered_budget_is_spent():
    lines = ["job message 1", "another message", "job message 22", "third kind"]
    compressed = compress_lines(lines, max_uncovered_entries=2)
    assert [(e.text, e.count) for e in compressed.uncovered_entries()] == [("job message 1", 2), ("another message", 1)]
    assert compressed.stats.uncovered_overflow == 1


def test_a_whole_varied_log_in_one_chunk_compresses_as_fed_line_by_line():
    """The chunk path (a repeat or an over-budget message counted inline, no call per line)
    gives the same entries, counts, ranks and stats as processing one line at a time."""
    import random
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "data" / "failures"))
    from varied import KEYWORD_FREE_ERRORS, keyword_free_error, routine_lines

    rng = random.Random(5)
    lines = list(routine_lines(rng, 3000))
    for i, template in enumerate(KEYWORD_FREE_ERRORS):
        lines.insert(37 * i + 11, keyword_free_error(rng, template))
    data = ("\n".join(lines) + "\n").encode()

    def compress(chunks: list[bytes]):
        compressor = LogCompressor(FilterRuleSet(), DiagnosisLibrary().patterns, max_uncovered_entries=40)
        for chunk in chunks:
            compressor.feed(chunk)
        return compressor.finish()

    whole = compress([data])
    per_line = compress([line + b"\n" for line in data.split(b"\n")[:-1]])
    assert whole.stats.uncovered_overflow > 0 and whole.stats.lines_signal >= len(KEYWORD_FREE_ERRORS)
    assert whole.render() == per_line.render()
    stats = {k: v for k, v in vars(whole.stats).items() if k != "seconds"}
    assert stats == {k: v for k, v in vars(per_line.stats).items() if k != "seconds"}
    assert [(e.text, e.count, e.first_line, e.last_line, sorted(e.ranks)) for e in whole.entries] == [
        (e.text, e.count, e.first_line, e.last_line, sorted(e.ranks)) for e in per_line.entries
    ]


def test_bulk_paths_compress_exactly_as_line_by_line():
    """The chunk path's bulk steps (repeats counted per distinct key, ranks read at the
    key's offsets, new keys resolved in bulk once the budget runs out mid-chunk, a
    digit-length variant of a known message, torchrun's host/rank summary, an
    over-long line) give what one line at a time gives."""
    import random

    rng = random.Random(3)
    lines = []
    for i in range(4000):
        r = rng.randrange(24)
        kind = i % 7
        if kind == 0:
            lines.append(f"[rank{r}]:epoch {rng.randrange(200)} shard {rng.choice('abcdefgh')} done in {rng.random():.3f}s")
        elif kind == 1:
            lines.append(f"{r}: user print {rng.choice(['alpha', 'beta', 'gamma'])}{rng.randrange(10**rng.randrange(1, 12))}")
        elif kind == 2:
            lines.append(f"[default{r}]:words {' '.join(rng.choice('xyzuvw') * rng.randrange(1, 4) for _ in range(4))}")
        elif kind == 3:
            lines.append(f"2026-11-22T07:41:0{r % 10}.1Z {r}: [rank{r}]:metric value={rng.randrange(10**9)}")
        elif kind == 4:
            lines.append(f"[rank{r}]:   \t ")  # blank once the prefix is gone
        elif kind == 5:
            lines.append(f"unique message number {i} {rng.choice('QRSTUV') * rng.randrange(1, 9)}")
        else:
            lines.append(f"[rank{r}]:step={i} loss=nan")  # a signal under a seed rule
        if i == 1500:
            lines += ["[rank3]:  host      : node-a07", "[rank3]:  rank      : 12 (local_rank: 4)", "x" * 300]
    data = ("\n".join(lines) + "\n").encode()

    def compress(chunks: list[bytes]):
        compressor = LogCompressor(FilterRuleSet(), DiagnosisLibrary().patterns, max_uncovered_entries=300,
                                   max_line_bytes=200)
        for chunk in chunks:
            compressor.feed(chunk)
        return compressor.finish()

    whole = compress([data])
    per_line = compress([line + b"\n" for line in data.split(b"\n")[:-1]])
    assert whole.stats.uncovered_overflow > 0 and whole.stats.lines_truncated == 1
    assert whole.rank_hosts == per_line.rank_hosts == {12: "node-a07"}
    stats = {k: v for k, v in vars(whole.stats).items() if k != "seconds"}
    assert stats == {k: v for k, v in vars(per_line.stats).items() if k != "seconds"}
    assert [(e.text, e.count, e.first_line, e.last_line, sorted(e.ranks), e.signal) for e in whole.entries] == [
        (e.text, e.count, e.first_line, e.last_line, sorted(e.ranks), e.signal) for e in per_line.entries
    ]


def test_a_known_message_in_another_form_still_counts_once_the_budget_is_spent():
    """New keys met after the budget is spent are resolved in bulk, most without working
    out their template (a letter fingerprint no entry has means no entry); a key that
    differs from an entry's only in its rank prefix, digit-run lengths, end whitespace
    (a carriage return, a no-break space) or an invalid byte must still find the entry."""
    lines = [
        b"a message 1", b"caf\xff 1", b"third 1",
        b"[rank3]:a message 22", b"0: a message 7", b"  a message 12  ", b"[default4]:a message 5\r",
        b"a message 1\xc2\xa0", b"caf\xfe 333", b"fourth 1", b"[rank5]:0: a message 3",
    ]
    data = b"\n".join(lines) + b"\n"
    for chunks in ([data], [line + b"\n" for line in lines]):
        compressor = LogCompressor(FilterRuleSet(), DiagnosisLibrary().patterns, max_uncovered_entries=2)
        for chunk in chunks:
            compressor.feed(chunk)
        result = compressor.finish()
        assert [(e.count, sorted(e.ranks), e.first_line, e.last_line) for e in result.entries] == [
            (6, [0, 3, 4], 1, 8), (2, [], 2, 9),
        ]
        assert result.stats.uncovered_overflow == 3
