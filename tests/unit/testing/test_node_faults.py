"""NodeLoss kills exactly the lost node's processes started under the drill, and keeps it dead."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

from testing.node_faults import SCOPE_VAR, NodeLoss

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def _start(node: str, extra_env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(SLEEPER, env=dict(os.environ, FORGEFLOW_NODE_NAME=node, **(extra_env or {})))


def _gone(proc: subprocess.Popen, within_s: float = 10.0) -> bool:
    try:
        proc.wait(timeout=within_s)
    except subprocess.TimeoutExpired:
        return False
    return True


def test_the_lost_node_dies_from_its_trigger_on_and_stays_dead():
    outside = _start("node-b")  # node-b of someone else's job: started before the drill, no scope
    armed = threading.Event()
    try:
        with NodeLoss("node-b", trigger=armed.is_set, poll_s=0.05) as lost:
            victim, bystander = _start("node-b"), _start("node-a")
            time.sleep(0.3)
            assert victim.poll() is None and lost.lost_at is None  # not before the trigger
            armed.set()
            assert _gone(victim) and victim.returncode == -9
            later = _start("node-b")  # a process placed on the dead node later dies too
            assert _gone(later) and later.returncode == -9
            assert bystander.poll() is None and outside.poll() is None
            assert lost.lost_at is not None and victim.pid in lost.killed
        assert SCOPE_VAR not in os.environ
    finally:
        for proc in (outside, bystander):
            proc.kill()
            proc.wait()


def test_lost_now_kills_at_once():
    with NodeLoss("node-c", trigger=lambda: False) as lost:
        victim = _start("node-c")
        time.sleep(0.2)
        lost.lost_now()
        assert _gone(victim, 5.0)
