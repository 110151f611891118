"""A session's autogroup niceness: reading it, and setting it where the kernel rate-limits that.

Where the kernel groups sessions for scheduling (/proc/sys/kernel/sched_autogroup_enabled), a
process's niceness counts only within its session's group, and the groups share the CPU by the
group's own niceness (/proc/PID/autogroup). torchrun starts every rank in a session of its own,
so a standby rank (infra.standby) put behind the training ranks by its niceness alone would still
take a full group's share: it sets its group's niceness too (training.standby), and opening the
standby sets it back.

The kernel takes such a write from a process without CAP_SYS_ADMIN at most once per 100 ms on
the whole machine and answers EAGAIN to the others (kernel/sched/autogroup.c,
`proc_sched_autogroup_set_nice`). A container's root usually lacks CAP_SYS_ADMIN, so two ranks
starting together, or an `open` right after a rank's own write, meet that limit: every write
here retries it.
"""

from __future__ import annotations

import os
import time
from typing import Callable

# Set by infra.reaper's `--nice N` for the command it runs: the niceness a process under it
# gives its session's autogroup (training.standby). Only that: a rank that merely inherited a
# niceness (a flow started under `nice`) leaves its group alone.
SESSION_NICE_ENV = "FORGEFLOW_SESSION_NICE"
RATE_LIMIT_S = 0.1  # the kernel's: one write per 100 ms machine-wide without CAP_SYS_ADMIN


def autogroup(pid: int | str = "self") -> tuple[str, int] | None:
    """(the autogroup, its niceness) of a process's session: /proc/PID/autogroup reads
    "/autogroup-70913 nice 19". None where the process is gone, the kernel has no autogroups, or
    the session is in the root group, which the kernel shows as nothing (a container's processes
    that never started a session of their own, as CI's pytest: its ranks' sessions still have
    groups, torchrun starting each in a session of its own)."""
    try:
        with open(f"/proc/{pid}/autogroup") as f:
            name, _, nice = f.read().split()
        return name, int(nice)
    except (OSError, ValueError):
        return None


def set_autogroup_nice(pid: int | str, nice: int, patience_s: float,
                       still_wanted: Callable[[], bool] = lambda: True) -> bool:
    """Set the niceness of `pid`'s autogroup, retrying the kernel's rate limit for up to
    `patience_s` while `still_wanted()`. False where it was not set: the process is gone, the
    kernel has no autogroups, the limit outlasted the patience, or it was no longer wanted."""
    try:
        fd = os.open(f"/proc/{pid}/autogroup", os.O_WRONLY)
    except OSError:  # gone, or no autogroups on this kernel
        return False
    deadline = time.monotonic() + patience_s
    try:
        while still_wanted():
            try:
                os.write(fd, str(nice).encode())
                return True
            except BlockingIOError:  # EAGAIN: another write in the last 100 ms
                if time.monotonic() >= deadline:
                    return False
            except OSError:  # gone meanwhile
                return False
            time.sleep(RATE_LIMIT_S / 5)
        return False
    finally:
        os.close(fd)
