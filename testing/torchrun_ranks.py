"""Which processes are torchrun agents (infra.torchrun) and which are their ranks, for drills that
find a rank or an agent to kill or watch.

A rank forked from its agent (infra.torchrun's default) keeps the agent's command line, which ends
with the rank's own (`... -m training.train JOB`), so a command line alone cannot tell them apart.
The process name can: torchrun names its agent pt_elastic, and a forked rank takes the
interpreter's name back. A rank is then a child of an agent; a rank whose agent died (an orphan,
adopted by the reaper) is no longer one. The same holds for ranks started as new interpreters
(FORGEFLOW_RANK_START=exec).
"""

from __future__ import annotations

import psutil

from infra.torchrun import AGENT_NAME

AGENT_COMMAND = ["-m", "infra.torchrun"]


def running(pid: int) -> bool:
    """The process `pid` is there and not a zombie (one that exited and waits for its parent)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def is_agent(proc: psutil.Process) -> bool:
    """An infra.torchrun agent, not one of its forked ranks (False for a process that is gone)."""
    try:
        return proc.name() == AGENT_NAME and proc.cmdline()[1:3] == AGENT_COMMAND
    except psutil.Error:
        return False


def is_rank(proc: psutil.Process) -> bool:
    """A rank of a live infra.torchrun agent (False for a process that is gone)."""
    try:
        parent = proc.parent()
    except psutil.Error:
        return False
    return parent is not None and is_agent(parent)
