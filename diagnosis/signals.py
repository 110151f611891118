"""What counts as an error signal, and how kept lines are normalised for collapsing.

``ERROR_KEYWORDS`` is the fixed list of patterns that mark a line as possibly carrying
an error: ``ERROR_WORDS`` (error, failed, timeout, ...) and ``ERROR_SHAPES``, the forms
of real error lines that hold none of those words (``what():``, ``exited
unexpectedly``, a warning raised as an exception, a Slurm ``CANCELLED``...). Compression never drops such a line (nor any line a diagnosis rule matches),
even when a filter rule covers it, and the log agent must never propose a filter that
matches one. The list is deliberately broad: a false positive costs one kept line
(repeats collapse anyway), a false negative can hide a root cause.

The helpers below turn a kept line into a *template* (rank prefixes, timestamps,
addresses and numbers replaced) so that the same message printed by 512 ranks
collapses into one entry with a count and the rank list, and pull out the rank, host,
GPU and timestamp a line carries.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# (name, pattern, caseless). Linear-time syntax only: compiled by Hyperscan/RE2.
ERROR_WORDS: tuple[tuple[str, str, bool], ...] = (
    ("error", r"error", True),
    ("exception", r"exception", True),
    ("traceback", r"traceback", True),
    ("failed", r"fail(?:ed|ure|ing)?\b", True),
    ("fatal", r"fatal", True),
    ("killed", r"killed", True),
    ("timeout", r"time(?:d)?[ _-]?out", True),
    # "loss=nan", "lm loss: nan", "Loss is NaN", "NaN or Inf found" — but not megatron's
    # routine "number of nan iterations: 0".
    ("nan", r"[:=]\s*-?nan\b|\bnan (?:or|and|/) ?inf\b|\b(?:is|got|detected|found|encountered|produced) nan\b|\bnan (?:detected|found|encountered|loss|value|gradient)", True),
    ("inf", r"[:=]\s*-?inf\b", True),
    ("oom", r"\boom\b|out of memory", True),
    ("segfault", r"segfault|segmentation fault|core dumped", True),
    ("abort", r"abort", True),
    ("signal", r"\bSIG(?:ABRT|SEGV|KILL|BUS|ILL|FPE|TERM)\b", False),
    ("exitcode", r"exit ?code\s*[:=]?\s*-?[1-9]", True),
    ("xid", r"\bxid\b", True),
    ("ecc", r"\becc\b", True),
    ("nccl_warn", r"NCCL WARN", False),
    ("refused", r"refused|reset by peer|broken pipe|unreachable", True),
    ("no_such_file", r"no such file|permission denied", True),
    ("panic", r"panic", True),
    ("loss_spike", r"FORGEFLOW_LOSS_SPIKE", False),
    ("hang", r"FORGEFLOW_HANG", False),
)

ERROR_SHAPES: tuple[tuple[str, str, bool], ...] = (
    # Error *shapes* that hold none of the words above. Without them such a line is kept
    # only while no filter rule covers it and the uncovered-entry budget lasts; a log
    # full of unfamiliar routine output spends that budget early.
    # An exception line (python -W error turns warnings into these; torch._dynamo's
    # "exc.Unsupported"): a dotted name at the line start, not "path.py:12: UserWarning:".
    ("exception_line", r"^(?:\S*\]:|\d+: )?\s*(?:[A-Za-z_]\w*\.)*\w*(?:Warning|Unsupported|Interrupt|Exit)(?::|\s*$)", False),
    ("cpp_abort", r"what\(\):|std::bad_alloc|terminate called|^\S*\s*frame #\d+: ", False),
    ("glibc_abort", r"free\(\): invalid|double free or corruption|corrupted (?:size|double-linked)|malloc\(\): |stack smashing detected|Illegal instruction|Floating point exception|Aborted \(core", False),
    ("died", r"exited unexpectedly|(?:unexpectedly|prematurely) (?:exited|terminated|died)|\bdied\b|\bgot stuck\b|without making progress", True),
    ("cancelled", r"\bCANCELL?ED\b|DUE TO (?:TIME LIMIT|PREEMPTION|NODE FAILURE)|\bPREEMPTED\b", False),
    ("cuda_environment", r"driver version is insufficient|no CUDA-capable device|CUDA capability sm_\d+ is not compatible", True),
    ("loss_scale_floor", r"loss scale (?:already )?at minimum|cannot decrease (?:loss )?scale", True),
)

ERROR_KEYWORDS: tuple[tuple[str, str, bool], ...] = ERROR_WORDS + ERROR_SHAPES

_KEYWORD_RE = re.compile(
    "|".join(f"(?i:{p})" if caseless else f"(?:{p})" for _, p, caseless in ERROR_KEYWORDS)
)


def has_error_keyword(line: str) -> bool:
    """True when ``line`` holds one of ``ERROR_KEYWORDS`` (trusted patterns only)."""
    return _KEYWORD_RE.search(line) is not None


# Lines saying training moved on: a step or iteration printed with a finite loss, in the
# shapes common trainers use (forgeflow's "step=12 loss=3.2", Megatron's "iteration
# 12/ 500 |", HF Trainer's "{'loss': 3.2", DeepSpeed's "step=12, skipped=0" and
# "global_step=12", Lightning/tqdm bars with "it/s, loss=3.2", and any "step 12 ...
# loss 3.2"). An error followed by a long error-free stretch holding such lines was
# survived: the compressor records those stretches (``CompressedLog.progress``) so that
# diagnosis can tell the error the job died of from the ones it went on past. Matched
# in bytes by RE2, within one line.
PROGRESS_PATTERN = (
    r"\bstep=\d+ loss=\d"
    r"|\biteration\s+\d+/\s*\d+ \|"
    r"|\{'(?:train_)?loss': \d"
    r"|\bstep=\d+, skipped=\d+|\bglobal_step=\d+"
    r"|(?:it/s|s/it), (?:train_)?loss=\d"
    r"|(?i:\b(?:step|iter|iteration)\b[ =:]*\d+\b[^\n]{0,200}?\bloss\b[ =:]*\d)"
)
# An error-free stretch longer than this (lines between two error-signal lines) with
# progress in it shows the job ran on past the errors before it. A job's final failure
# prints its error lines closer together than that, whatever else is printed between.
PROGRESS_STRETCH_LINES = 200


# ----------------------------------------------------------------- line anatomy

# Prefixes launchers put in front of each rank's output: torchrun --tee/--redirects
# ("[default3]:", "[rank3]:"), srun --label ("3: ").
# A log collector's timestamp (kubectl logs --timestamps) may come first.
# Groups: 1 = srun label, 2 = "rank" or "default", 3 = its number.
_RANK_PREFIX = re.compile(
    r"^(?:\d{4}-\d\d-\d\dT[\d:.]+Z )?(?:(\d{1,5}): )?(?:\[(rank|default)(\d{1,5})\]:)?"
)
# torchrun's "[default3]:" is the *local* rank on the node whose log it is; PyTorch's own
# "[rank11]:" (its distributed excepthook and c10 logging) after it is the global rank.
_GLOBAL_RANK_AFTER_LOCAL = re.compile(r"\[rank(\d{1,5})\]:")
# NCCL's own prefix: host:pid:tid [local GPU]
_NCCL_PREFIX = re.compile(r"^([A-Za-z][\w.-]*):(\d+):(\d+) \[(\d+)\]")
_RANK_IN_TEXT = re.compile(
    r"\[Rank (\d+)\]|\bglobal_rank\s*[:=]\s*(\d+)|^\s*rank\s*:\s*(\d+)|\brank (\d+) nranks|"
    r"\bon rank (\d+)\b",
    re.IGNORECASE,
)
_HOST = r"([A-Za-z][\w-]*\d[\w-]*(?:\.[\w-]+)*)"
_HOST_IN_TEXT = re.compile(
    r"(?:\bhost(?:name)?\s*[:=]\s*|\bon host\s+|Node failure on |srun: error: |\bnode\s*[:=]\s*)"
    + _HOST + r"|\b" + _HOST + r" kernel:",
    re.IGNORECASE,
)
_GPU_IN_TEXT = re.compile(
    r"\bGPU\s*#?(\d+)\b|\bcuda:(\d+)\b|\bcudaDev (\d+)\b|\bdevice (\d+)\b|"
    r"\bXid \(PCI:([0-9a-fA-F:.]+)\)",
)

_TIMESTAMP_ISO = re.compile(
    r"(\d{4})-(\d\d)-(\d\d)[T ](\d\d):(\d\d):(\d\d)(?:[.,](\d+))?"
)
# glog/c10d style: "[W1122 07:41:02.123456 ..." or "E1122 07:41:02.123000 2281 ..."
_TIMESTAMP_GLOG = re.compile(r"\b[IWEF](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)\.(\d+)")
# syslog/dmesg style used in kernel messages: "Nov 22 07:41:02"
_TIMESTAMP_SYSLOG = re.compile(
    r"\b(Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) +(\d{1,2}) (\d\d):(\d\d):(\d\d)\b"
)
_MONTHS = {m: i for i, m in enumerate(
    ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"), 1
)}

# One pass: timestamps first (so they become one token), then hex, then numbers.
_NORMALISE = re.compile(
    r"(?P<ts>\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(?:[.,]\d+)?Z?|\b[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+)"
    r"|(?P<hex>0x[0-9a-fA-F]+)|(?P<num>\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)"
)
_REPLACEMENT = {"ts": "<ts>", "hex": "0x#", "num": "#"}


def _normalise(match: re.Match) -> str:
    return _REPLACEMENT[match.lastgroup]


@dataclass(frozen=True)
class LineFacts:
    """What one kept line says about where it came from."""

    template: str
    rank: int | None  # the global rank the line names (never torchrun's local "[defaultN]")
    host: str | None
    gpu: str | None
    timestamp: float | None
    # torchrun's "[defaultN]:" when the line names no global rank: a rank local to the node
    # whose log holds the line (diagnosis.rules.suspects turns it into a global rank)
    local_rank: int | None = None


def _seconds_in_year(month: int, day: int, hour: int, minute: int, sec: int, frac: str) -> float:
    # Only the order matters (earliest error across ranks), and glog/syslog stamps carry
    # no year, so every form is mapped onto seconds since 1 January.
    fraction = float(f"0.{frac}") if frac else 0.0
    return ((((month * 31 + day) * 24 + hour) * 60 + minute) * 60 + sec) + fraction


def parse_timestamp(line: str) -> float | None:
    m = _TIMESTAMP_ISO.search(line)
    if m:
        _, mo, d, h, mi, s, frac = m.groups()
        return _seconds_in_year(int(mo), int(d), int(h), int(mi), int(s), frac or "")
    m = _TIMESTAMP_GLOG.search(line)
    if m:
        mo, d, h, mi, s, frac = m.groups()
        return _seconds_in_year(int(mo), int(d), int(h), int(mi), int(s), frac)
    m = _TIMESTAMP_SYSLOG.search(line)
    if m:
        mon, d, h, mi, s = m.groups()
        return _seconds_in_year(_MONTHS[mon], int(d), int(h), int(mi), int(s), "")
    return None


def _first_group(match: re.Match | None) -> str | None:
    if match is None:
        return None
    return next((g for g in match.groups() if g is not None), None)


def line_facts(line: str) -> LineFacts:
    """Template, rank, host, GPU and timestamp of one line (and torchrun's local rank
    when the line names no global one)."""
    rest = line
    rank: int | None = None
    local_rank: int | None = None
    prefix = _RANK_PREFIX.match(rest)
    if prefix and prefix.group(0):
        label, kind, number = prefix.groups()
        rest = rest[prefix.end():]
        if kind == "default":
            explicit = _GLOBAL_RANK_AFTER_LOCAL.match(rest)
            if explicit:
                rank = int(explicit.group(1))
            else:
                local_rank = int(number)
        else:
            found = number or label
            rank = int(found) if found is not None else None
    host = gpu = None
    nccl = _NCCL_PREFIX.match(rest.lstrip())
    if nccl:
        host, gpu = nccl.group(1), nccl.group(4)
    # The substring checks skip the (slow, alternation-heavy) searches on the many lines
    # that cannot match them.
    if rank is None and ("ank" in rest):
        found = _first_group(_RANK_IN_TEXT.search(rest))
        rank = int(found) if found is not None else None
    if host is None and any(k in rest for k in _HOST_HINTS):
        host = _first_group(_HOST_IN_TEXT.search(rest))
    if gpu is None and any(k in rest for k in _GPU_HINTS):
        gpu = _first_group(_GPU_IN_TEXT.search(rest))
    template = " ".join(_NORMALISE.sub(_normalise, rest).split())
    return LineFacts(template, rank, host, gpu, parse_timestamp(line), local_rank)


_HOST_HINTS = ("ost", "ode", "srun", "kernel:", "ON ")
_GPU_HINTS = ("GPU", "cuda", "device", "Xid")


def format_ranks(ranks: list[int] | set[int]) -> str:
    """Compact rank list: [0,1,2,3,7] -> '0-3,7'."""
    ordered = sorted(set(ranks))
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)
