"""infra.autogroup against the kernel: a session's autogroup niceness is set through the kernel's
rate limit (one write per 100 ms machine-wide for a process without CAP_SYS_ADMIN, as a
container's root usually is), by retrying it, and not at all once it is no longer wanted."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from infra.autogroup import autogroup

# Run without CAP_SYS_ADMIN (where this process has it, capsh drops it from the shell it execs):
# the writes below meet the limit as CI's container does.
WRITES = r"""
import json, os, sys, time
from infra.autogroup import autogroup, set_autogroup_nice
pid = int(sys.argv[1])
out = {}
fd = os.open(f"/proc/{pid}/autogroup", os.O_WRONLY)

def first(value):  # another process's write (a standby test running alongside) may hold the slot
    deadline = time.monotonic() + 5
    while True:
        try:
            return os.write(fd, value)
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)

out["second_raw_write"] = "taken"
for _ in range(5):  # (a pair split by more than 100 ms of descheduling meets no limit: again)
    first(b"5")
    try:
        os.write(fd, b"6")  # at once: the kernel's limit answers EAGAIN
    except BlockingIOError:
        out["second_raw_write"] = "EAGAIN"
        break
os.close(fd)
out["retried"] = set_autogroup_nice(pid, 7, patience_s=2.0)
out["after_retry"] = autogroup(pid)[1]
out["unwanted"] = set_autogroup_nice(pid, 9, patience_s=2.0, still_wanted=lambda: False)
out["after_unwanted"] = autogroup(pid)[1]
out["gone"] = set_autogroup_nice(2**22 + 1, 3, patience_s=2.0)
print(json.dumps(out))
"""


CAP_SYS_ADMIN = 21  # linux/capability.h


def _python_without_cap_sys_admin(pid: int) -> list[str]:
    """The command that runs WRITES on `pid` without CAP_SYS_ADMIN: directly where this process
    lacks it (CI's container), else under capsh, which drops it."""
    with open("/proc/self/status") as status:
        effective = int(next(line.split()[1] for line in status if line.startswith("CapEff:")), 16)
    if not effective & (1 << CAP_SYS_ADMIN):
        return [sys.executable, "-c", WRITES, str(pid)]
    if shutil.which("capsh") is None:
        pytest.skip("capsh (libcap2-bin) is needed to drop CAP_SYS_ADMIN")
    if subprocess.run(["capsh", "--drop=cap_sys_admin", "--", "-c", "true"], capture_output=True).returncode:
        pytest.skip("capsh cannot drop CAP_SYS_ADMIN here (no CAP_SETPCAP)")
    return ["capsh", "--drop=cap_sys_admin", "--", "-c", f'exec "{sys.executable}" -c "$0" {pid}', WRITES]


def test_a_write_the_kernel_rate_limits_is_retried_and_an_unwanted_one_not_made():
    session = subprocess.Popen(["sleep", "60"], start_new_session=True)  # a group of its own
    try:
        if autogroup(session.pid) is None:  # (pytest's own may be the root group, shown as nothing)
            pytest.skip("this kernel has no autogroups (CONFIG_SCHED_AUTOGROUP)")
        done = subprocess.run(_python_without_cap_sys_admin(session.pid), capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stderr
        out = json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        session.kill()
        session.wait()
    # the limit is there (else this test would prove nothing about retrying it)...
    assert out["second_raw_write"] == "EAGAIN", out
    # ...and set_autogroup_nice gets through it; one no longer wanted is not made; a gone process
    assert out == {"second_raw_write": "EAGAIN", "retried": True, "after_retry": 7,
                   "unwanted": False, "after_unwanted": 7, "gone": False}
