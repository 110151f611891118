"""Vetting of regexes an LLM proposes, before any of them is adopted as a rule.

An LLM-written regex is untrusted input. It becomes a filter rule (drop matching
lines) or a diagnosis rule (name a root cause for matching lines) only after these
checks, each of which gives a reason when it refuses:

* it compiles in the linear-time engines (RE2 and Hyperscan, `diagnosis.multi_regex`);
  Python's backtracking `re` never sees it, so `(a+)+$` cannot hang anything;
* it is not a catch-all: it matches neither the empty line nor the engine's unrelated
  probes nor any of a fixed set of random lines;
* a filter rule matches none of the error-signal lines (the segment's own error lines
  plus canonical error lines of the stacks we diagnose) and covers at least a minimum
  share of the segment it was written for;
* a diagnosis rule matches at least one culprit line and no routine line.

`generalise_line` writes the fallback diagnosis-rule candidate from a culprit line
when every LLM proposal was refused.
"""

from __future__ import annotations

import random
import re
import string
from dataclasses import dataclass
from typing import Sequence

import re2

from diagnosis.multi_regex import RegexError, compile_linear, is_catch_all

# Error lines as the stacks we diagnose print them. A filter rule that matches any
# of these would hide that kind of failure in every future log, whatever the
# current segment holds.
CANONICAL_ERROR_LINES: tuple[str, ...] = (
    "Traceback (most recent call last):",
    "RuntimeError: CUDA error: an illegal memory access was encountered",
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 3; 79.15 GiB total capacity)",
    "[rank5]:[E1122 07:31:02.123456 2381 ProcessGroupNCCL.cpp:616] [Rank 5] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=4121, OpType=ALLREDUCE, NumelIn=1, Timeout(ms)=600000) ran for 600012 milliseconds before timing out.",
    "torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:275, remote process exited or there was a network error, NCCL version 2.21.5",
    "node-a03:2281:2401 [3] NCCL WARN NET/IB : Got completion from peer 10.0.0.12<55102> with status=12 opcode=0 len=0 vendor err 129 (Recv)",
    "NVRM: Xid (PCI:0000:3b:00): 79, pid=2281, GPU has fallen off the bus.",
    "NVRM: Xid (PCI:0000:3b:00): 48, pid=2281, An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer",
    "RuntimeError: CUDA error: uncorrectable ECC error encountered",
    "NVLink error detected on GPU 2 link 5: replay errors exceeded threshold",
    "RuntimeError: DataLoader worker (pid 31337) is killed by signal: Killed.",
    "botocore.exceptions.ClientError: An error occurred (SlowDown) when calling the PutObject operation (reached max retries: 4): Please reduce your request rate.",
    "ConnectionResetError: [Errno 104] Connection reset by peer",
    "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:",
    "Fatal Python error: Aborted",
    "AssertionError: micro batch size must divide global batch size",
    "ValueError: too many values to unpack (expected 2)",
    "ZeroDivisionError: division by zero",
    "KeyError: 'model.layers.0.self_attn.q_proj.weight'",
    "FileNotFoundError: [Errno 2] No such file or directory: '/data/tokenized/train_00017.bin'",
    "PermissionError: [Errno 13] Permission denied: '/ckpt/run7/latest'",
    "ModuleNotFoundError: No module named 'flash_attn'",
    "subprocess.CalledProcessError: Command '['git', 'rev-parse', 'HEAD']' returned non-zero exit status 128.",
    "IndexError: index out of range in self",
    "Segmentation fault (core dumped)",
    "terminate called after throwing an instance of 'c10::DistBackendError'",
    "WARNING: loss spike detected at step 41200: loss 9.87 > 3.2 x running mean 2.41",
    "ERROR: heartbeat stale for 900 s; no progress since step 5100",
)


def _random_probe_lines(count: int = 64, seed: int = 20261122) -> tuple[str, ...]:
    """Lines of random characters and random words: no routine rule should match them."""
    rng = random.Random(seed)  # fixed seed: a verdict must not change between runs
    alphabet = string.ascii_letters + string.digits + string.punctuation + " "
    lines = ["".join(rng.choice(alphabet) for _ in range(rng.randint(12, 90))) for _ in range(count)]
    words = ["amber", "lattice", "quiet", "harbor", "seven", "violet", "marble", "orbit", "tundra"]
    lines += [" ".join(rng.choice(words) for _ in range(rng.randint(3, 9))) for _ in range(count // 4)]
    return tuple(lines)


RANDOM_PROBE_LINES = _random_probe_lines()


@dataclass(frozen=True)
class Rejection:
    """A proposal that was not adopted, and why (logged and returned to the caller)."""

    regex: str
    reason: str
    votes: int = 0


def compile_problem(pattern: object) -> str | None:
    """Why `pattern` cannot be used in the linear-time engines, or None if it can."""
    if not isinstance(pattern, str):
        return f"not a string but {type(pattern).__name__}"
    try:
        compile_linear(pattern)
    except RegexError as exc:
        # Hyperscan refuses patterns that match the empty string; name the real
        # problem (a catch-all) rather than the engine's complaint.
        if _re2_matches_empty(pattern):
            return "catch-all: matches the empty line"
        return f"does not compile in the linear-time engine: {exc}"
    return None


def _re2_matches_empty(pattern: str) -> bool:
    options = re2.Options()
    options.log_errors = False
    try:
        return re2.compile(pattern, options).search("") is not None
    except re2.error:
        return False


def catch_all_problem(pattern: str) -> str | None:
    """Why `pattern` is a catch-all, or None. `pattern` must already compile."""
    if is_catch_all(pattern):
        return "catch-all: matches the empty line or most unrelated probe lines"
    regex = compile_linear(pattern)
    for probe in RANDOM_PROBE_LINES:
        if regex.search(probe) is not None:
            return f"catch-all: matches the random probe line {probe!r}"
    return None


def filter_rule_problem(
    pattern: object,
    segment_lines: Sequence[str],
    error_lines: Sequence[str],
    min_share: float,
) -> str | None:
    """Why `pattern` must not become a filter rule for this segment, or None."""
    problem = compile_problem(pattern)
    if problem:
        return problem
    assert isinstance(pattern, str)
    problem = catch_all_problem(pattern)
    if problem:
        return problem
    regex = compile_linear(pattern)
    for line in list(error_lines) + list(CANONICAL_ERROR_LINES):
        if regex.search(line) is not None:
            return f"would drop an error line: {line[:160]!r}"
    lines = [line for line in segment_lines if line.strip()]
    covered = sum(1 for line in lines if regex.search(line) is not None)
    share = covered / len(lines) if lines else 0.0
    if share < min_share:
        return f"covers {covered}/{len(lines)} lines of the segment ({share:.1%}), below the minimum {min_share:.1%}"
    return None


def diagnosis_rule_problem(
    pattern: object,
    culprit_lines: Sequence[str],
    routine_lines: Sequence[str],
) -> str | None:
    """Why `pattern` must not become a diagnosis rule, or None.

    A diagnosis rule must recognise the failure (match a culprit line) and nothing
    routine (a rule that fires on metric lines would diagnose every healthy job).
    """
    problem = compile_problem(pattern)
    if problem:
        return problem
    assert isinstance(pattern, str)
    problem = catch_all_problem(pattern)
    if problem:
        return problem
    regex = compile_linear(pattern)
    if not any(regex.search(line) is not None for line in culprit_lines):
        return "matches none of the culprit lines it should recognise"
    for line in routine_lines:
        if regex.search(line) is not None:
            return f"matches a routine line: {line[:160]!r}"
    return None


# ---- a rule candidate written without the LLM

_GENERALISE = re.compile(r"(0x[0-9a-fA-F]+)|(\d+(?:\.\d+)?)")
# Launcher rank prefixes, bracketed stamps and glog headers say where, not what.
_LINE_PREFIX = re.compile(
    r"^(?:\d+: )?(?:\[(?:rank|default)\d+\]:)?\s*(?:\[[^\]]*\d[^\]]*\]\s*)*"
    r"(?:[IWEF]\d{4} [\d:.]+ +\d+ [\w./-]+:\d+\] *)?"
)
_META = re.compile(r"([\\.^$|?*+()\[\]{}])")


def generalise_line(line: str, max_chars: int = 160) -> str:
    """A regex for lines like `line`: prefixes dropped, numbers and addresses generalised.

    The fallback rule candidate when the LLM's own proposals are refused.
    """
    body = _LINE_PREFIX.sub("", line.strip())[:max_chars].rstrip()
    out: list[str] = []
    pos = 0
    for match in _GENERALISE.finditer(body):
        out.append(_META.sub(r"\\\1", body[pos : match.start()]))
        out.append(r"0x[0-9a-fA-F]+" if match.group(1) else r"\d+(?:\.\d+)?")
        pos = match.end()
    out.append(_META.sub(r"\\\1", body[pos:]))
    return "".join(out)
