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

# Run without CAP_SYS_ADMIN (capsh drops it from the bounding and inheritable sets of the shell it
# execs): the writes below meet the limit where CI's container does.
WRITES = r"""
import json, os, sys
from infra.autogroup import autogroup, set_autogroup_nice
pid = int(sys.argv[1])
out = {}
fd = os.open(f"/proc/{pid}/autogroup", os.O_WRONLY)
os.write(fd, b"5")
try:
    os.write(fd, b"6")  # at once: the kernel's limit answers EAGAIN
    out["second_raw_write"] = "taken"
except BlockingIOError:
    out["second_raw_write"] = "EAGAIN"
os.close(fd)
out["retried"] = set_autogroup_nice(pid, 7, patience_s=2.0)
out["after_retry"] = autogroup(pid)[1]
out["unwanted"] = set_autogroup_nice(pid, 9, patience_s=2.0, still_wanted=lambda: False)
out["after_unwanted"] = autogroup(pid)[1]
out["gone"] = set_autogroup_nice(2**22 + 1, 3, patience_s=2.0)
print(json.dumps(out))
"""


def test_a_write_the_kernel_rate_limits_is_retried_and_an_unwanted_one_not_made():
    if autogroup() is None:
        pytest.skip("this kernel has no autogroups (sched_autogroup_enabled)")
    if shutil.which("capsh") is None:
        pytest.skip("capsh (libcap2-bin) is needed to drop CAP_SYS_ADMIN")
    session = subprocess.Popen(["sleep", "60"], start_new_session=True)  # a group of its own
    try:
        done = subprocess.run(
            ["capsh", "--drop=cap_sys_admin", "--",
             "-c", f'exec "{sys.executable}" -c "$0" {session.pid}', WRITES],
            capture_output=True, text=True, timeout=60)
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
