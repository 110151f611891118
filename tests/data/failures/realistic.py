"""Noisier variants of the labelled corpus: what a real terminal or log collector makes
of the same failure.

``generate.py`` writes each case from templates, and the seed rules were written with
those templates in view, so scoring the rules on them says little. ``realistic_variant``
keeps a case's failure (its label does not change) but rewrites everything around it
and some of it:

* routine output of other stacks (``varied.routine_lines``: HF Trainer, DeepSpeed,
  vLLM, tqdm/Lightning bars redrawn with carriage returns, ANSI colours) is mixed in,
  ``noise_lines`` of it, optionally padded to ``pad_mb`` MB (100 MB-scale logs);
* lines of different ranks interleave mid-line (a line cut short, its rest later);
* some lines get ANSI colour codes, some a log collector's timestamp;
* C++ stack frames follow C++ exceptions (``terminate called``, ``what():``);
* messages are rewritten into the wording of other library versions (torch 1.x / 2.x
  OOM, old and new ProcessGroupNCCL prefixes, NCCL's older ``NET/IB`` wording).

Seeded: one (case, seed) pair always gives the same bytes.
"""

from __future__ import annotations

import random
import re
from typing import Iterator

from varied import ANSI, RESET, routine_lines

# (pattern, replacements): each match is rewritten into one of the replacements, as the
# message reads in another torch / NCCL version.
VERSION_WORDING: tuple[tuple[re.Pattern, tuple[str, ...]], ...] = (
    (re.compile(r"torch\.OutOfMemoryError: CUDA out of memory\. Tried to allocate ([\d.]+ [GM]iB)[^\n]*"),
     (r"torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate \1 (GPU 0; 79.15 GiB total capacity; 76.02 GiB already allocated; 1.06 GiB free; 77.30 GiB reserved in total by PyTorch) If reserved memory is >> allocated memory try setting max_split_size_mb to avoid fragmentation.",
      r"RuntimeError: CUDA out of memory. Tried to allocate \1 (GPU 0; 79.15 GiB total capacity; 76.02 GiB already allocated; 1.06 GiB free; 77.30 GiB reserved in total by PyTorch)",
      r"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate \1. GPU 0 has a total capacity of 79.15 GiB of which 1.06 GiB is free. Including non-PyTorch memory, this process has 78.08 GiB memory in use.")),
    (re.compile(r"\[PG 0 \(default_pg\) Rank (\d+)\]"),
     (r"[PG ID 0 PG GUID 0(default_pg) Rank \1]", r"[PG 0 Rank \1]", r"[Rank \1]")),
    (re.compile(r"\[E(\d{4}) ([\d:.]+) (\d+) ProcessGroupNCCL\.cpp:(\d+)\]"),
     (r"[E ProcessGroupNCCL.cpp:\4]", r"[E\1 \2 \3 ProcessGroupNCCL.cpp:\4]", r"[E\1 \2 \3 ProcessGroupNCCL.cpp:1785]")),
    (re.compile(r"NCCL WARN NET/IB : Got completion from peer (\S+) with status=(\d+) opcode=\d+ len=\d+ vendor err (\d+)"),
     (r"NCCL WARN NET/IB : Got completion from peer \1 with error \2, opcode 32564, len 32564, vendor err \3",
      r"NCCL WARN NET/IB : Got completion from peer \1 with status=\2 opcode=0 len=0 vendor err \3 (Recv) localGid ::ffff:10.0.0.12 remoteGids::ffff:10.0.0.13")),
)

CPP_FRAMES = (
    "Exception raised from c10_cuda_check_implementation at ../c10/cuda/CUDAException.cpp:43 (most recent call first):",
    "frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x96 (0x7f2d9a36c446 in /opt/venv/lib/python3.11/site-packages/torch/lib/libc10.so)",
    "frame #1: c10::detail::torchCheckFail(char const*, char const*, unsigned int, std::string const&) + 0x64 (0x7f2d9a3166e4 in /opt/venv/lib/python3.11/site-packages/torch/lib/libc10.so)",
    "frame #2: c10d::ProcessGroupNCCL::WorkNCCL::checkTimeout(std::optional<std::chrono::duration<long, std::ratio<1l, 1000l> > >) + 0x1d2 (0x7f2d9b6a1772 in /opt/venv/lib/python3.11/site-packages/torch/lib/libtorch_cuda.so)",
    "frame #3: <unknown function> + 0xdc253 (0x7f2de8a4b253 in /lib/x86_64-linux-gnu/libstdc++.so.6)",
    "frame #4: <unknown function> + 0x94ac3 (0x7f2dec6ccac3 in /lib/x86_64-linux-gnu/libc.so.6)",
    "frame #5: clone + 0x44 (0x7f2dec75da04 in /lib/x86_64-linux-gnu/libc.so.6)",
)


def _reword(line: str, rng: random.Random) -> str:
    for pattern, choices in VERSION_WORDING:
        if pattern.search(line) and rng.random() < 0.7:
            line = pattern.sub(rng.choice(choices), line)
    return line


def _decorate(line: str, rng: random.Random) -> str:
    roll = rng.random()
    if roll < 0.05:
        return f"{rng.choice(ANSI)}{line}{RESET}"  # a coloured handler
    if roll < 0.08:
        return f"2026-11-22T07:{rng.randint(10, 59)}:{rng.randint(10, 59)}.{rng.randint(0, 999999):06d}Z {line}"
    return line


def realistic_variant(text: str, seed: int, noise_lines: int = 3000, pad_mb: float = 0.0) -> Iterator[str]:
    """Chunks of a noisier version of ``text`` (a corpus case's log), same failure."""
    rng = random.Random(seed)
    lines = [_reword(line, rng) for line in text.splitlines()]
    out: list[str] = []
    for line in lines:
        out.append(_decorate(line, rng))
        if ("terminate called after throwing" in line or "what():" in line) and rng.random() < 0.8:
            out.extend(CPP_FRAMES[: rng.randint(3, len(CPP_FRAMES))])
    # Routine output of other stacks, mixed in at random places.
    noise = list(routine_lines(rng, noise_lines))
    slots = sorted(rng.randrange(len(out) + 1) for _ in noise)
    merged: list[str] = []
    prev = 0
    for slot, extra in zip(slots, noise):
        merged.extend(out[prev:slot])
        merged.append(extra)
        prev = slot
    merged.extend(out[prev:])
    # Two ranks on one pipe: a few lines are cut and finished two lines later.
    for _ in range(max(1, len(merged) // 400)):
        i = rng.randrange(len(merged) - 3)
        line = merged[i]
        if len(line) > 20:
            cut = rng.randint(10, len(line) - 5)
            merged[i] = line[:cut] + merged[i + 1]
            merged[i + 1] = merged[i + 2]
            merged[i + 2] = line[cut:]
    if pad_mb > 0:
        # 100 MB-scale: most of the log is routine output written before the failure.
        target, written = int(pad_mb * 1e6), 0
        while written < target:
            chunk = "\n".join(routine_lines(rng, 20_000)) + "\n"
            written += len(chunk)
            yield chunk
    yield "\n".join(merged) + "\n"
