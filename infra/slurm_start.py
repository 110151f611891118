"""Delegated Slurm: which of the job's options to submit, by when Slurm says each would finish.

The planner gives the job several options (GPU type, GPU count, layout), each with a predicted
run time. A site's Slurm knows what forgeflow does not: its queue, other users' jobs, partition
and QOS limits, reservations. So, before each delegated submission, each option is put to Slurm
with `sbatch --test-only` and exactly the options it would be submitted with
(`SlurmLauncher.submit_args`: what is tested is what is submitted), and the option with the
earliest predicted completion — Slurm's predicted start plus the option's predicted run time,
not the earliest start — is submitted. An option Slurm refuses ("Requested node configuration is
not available": more nodes or GPUs than the partition has, a GPU type it does not know) is
skipped with Slurm's reason; when Slurm refuses every option, `SlurmStartRefused` names each
with its reason.

Slurm 22.05 answers on stderr, e.g.

    sbatch: Job 8 to start at 2026-11-29T07:54:09 using 1 processors on nodes vm in partition debug
    allocation failure: Requested node configuration is not available

and prints the start in the client's local time without a zone: the test is run with TZ=UTC, and
read as UTC. `--test-only` submits nothing (it spends a job id).
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Sequence

from infra.launch import LaunchRequest, worker_environment
from infra.slurm import SlurmError, SlurmLauncher, slurm_command

_START = re.compile(r"to start at (\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)")
_PREFIXES = ("sbatch: error: ", "allocation failure: ", "sbatch: ")


class SlurmStartRefused(SlurmError):
    """Slurm would start none of the job's options; the message names each and Slurm's reason."""

    def __init__(self, message: str, options: tuple["StartOption", ...]):
        super().__init__(message)
        self.options = options


@dataclass(frozen=True)
class SlurmAnswer:
    """What `sbatch --test-only` said: the predicted start (UTC), or None when Slurm refused."""

    start: datetime | None
    said: str  # Slurm's words, one line

    @property
    def refused(self) -> bool:
        return self.start is None


def _words(text: str) -> list[str]:
    lines = []
    for line in text.splitlines():
        line = line.strip()
        for prefix in _PREFIXES:
            if line.startswith(prefix):
                line = line[len(prefix):].strip()
                break
        if line and line not in lines:
            lines.append(line)
    return lines


def parse_test_only(returncode: int, stderr: str, stdout: str = "") -> SlurmAnswer:
    """Slurm's answer to `sbatch --test-only` (printed with TZ=UTC): its start, or its refusal."""
    said = "; ".join(_words(stderr + "\n" + stdout)) or f"sbatch --test-only exited {returncode} and said nothing"
    found = _START.search(stderr + "\n" + stdout)
    if returncode != 0 or found is None:
        return SlurmAnswer(None, said if returncode != 0 else f"no start time in Slurm's answer: {said}")
    start = datetime.strptime(found.group(1), "%Y-%m-%dT%H:%M:%S").replace(tzinfo=timezone.utc)
    return SlurmAnswer(start, said)


@dataclass(frozen=True)
class StartCandidate:
    """One option as it would be submitted: its launch (nodes x ranks per node), GPU type and
    predicted run time. `label` is how people read it ("4x H100-80G dp4 tp1 pp1")."""

    label: str
    request: LaunchRequest
    gpu_type: str
    run_s: float


@dataclass(frozen=True)
class StartOption:
    """An option with Slurm's answer: predicted start and completion (None: refused), Slurm's
    words, and the sbatch options that were tested (and are submitted, if it is chosen)."""

    label: str
    run_s: float
    start: datetime | None
    completion: datetime | None
    said: str
    args: tuple[str, ...]

    @property
    def refused(self) -> bool:
        return self.start is None

    def describe(self, now: datetime | None = None) -> str:
        if self.refused:
            return f"{self.label}: refused by Slurm ({self.said})"
        wait = ""
        if now is not None:
            delay = max(0.0, (self.start - now).total_seconds())
            wait = " (now)" if delay < 60 else f" (in {_duration(delay)})"
        return (f"{self.label}: starts {self.start:%Y-%m-%d %H:%M:%S} UTC{wait}, runs ~{_duration(self.run_s)}, "
                f"completes {self.completion:%Y-%m-%d %H:%M:%S} UTC")


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


@dataclass(frozen=True)
class StartChoice:
    """Every option with Slurm's answer (in the order given: the planner's rank) and the one chosen."""

    options: tuple[StartOption, ...]
    chosen_index: int

    @property
    def chosen(self) -> StartOption:
        return self.options[self.chosen_index]

    def summary(self, now: datetime | None = None) -> str:
        """The choice and why, for the flow's log: one line per option, the chosen one marked."""
        lines = [f"Slurm's predicted starts (sbatch --test-only); submitting the earliest completion: "
                 f"{self.chosen.label}"]
        for i, option in enumerate(self.options):
            lines.append(f"  {'✓' if i == self.chosen_index else ' '} {option.describe(now)}")
        return "\n".join(lines)


def earliest_completion(options: Sequence[StartOption]) -> int:
    """The index of the option that finishes first (start + run time); on a tie the first given
    (the planner's better-ranked). ValueError when every option was refused."""
    best = None
    for i, option in enumerate(options):
        if option.refused:
            continue
        if best is None or option.completion < options[best].completion:
            best = i
    if best is None:
        raise ValueError("every option was refused")
    return best


def ask_test_only(launcher: SlurmLauncher, candidate: StartCandidate) -> StartOption:
    """Ask Slurm when `candidate` would start if submitted now with `launcher`'s options (and its
    environment: sbatch reads SBATCH_* variables from it), without submitting it."""
    args = tuple(launcher.submit_args(candidate.request, candidate.gpu_type))
    environ = {**worker_environment(), "TZ": "UTC"}  # as `start` submits; the answer's time in UTC
    try:
        # no script file yet: sbatch reads the script from stdin (it submits nothing with --test-only)
        result = _run(["sbatch", "--test-only", *args], launcher, environ)
        answer = parse_test_only(result.returncode, result.stderr, result.stdout)
    except subprocess.TimeoutExpired:
        answer = SlurmAnswer(None, "sbatch --test-only did not answer within 60 s")
    completion = None if answer.start is None else answer.start + timedelta(seconds=candidate.run_s)
    return StartOption(candidate.label, candidate.run_s, answer.start, completion, answer.said, args)


def _run(args: list[str], launcher: SlurmLauncher, environ: dict[str, str]) -> subprocess.CompletedProcess:
    return slurm_command(args, launcher.settings, check=False, environ=environ, stdin_text="#!/bin/bash\ntrue\n")


def choose_start(launcher: SlurmLauncher, candidates: Sequence[StartCandidate]) -> StartChoice:
    """`sbatch --test-only` for each candidate (in the planner's order), and the one with the
    earliest predicted completion. SlurmStartRefused, naming each option and Slurm's reason,
    when Slurm would start none."""
    if not candidates:
        raise ValueError("no option to ask Slurm about")
    options = tuple(ask_test_only(launcher, c) for c in candidates)
    try:
        return StartChoice(options, earliest_completion(options))
    except ValueError:
        job = candidates[0].request.job_name
        raise SlurmStartRefused(
            f"Slurm would start none of the {len(options)} option(s) of {job}: "
            + "; ".join(f"{o.label}: {o.said}" for o in options)
            + ". Check the cluster file's slurm: section (partition, account, qos, gres_types) against "
            "`sinfo` and `sacctmgr show assoc user=$USER`", options) from None
