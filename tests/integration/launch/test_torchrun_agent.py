"""infra.torchrun is torchrun with a fast exit: same arguments, output and exit codes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def _agent(tmp_path: Path, body: str, *args: str) -> subprocess.CompletedProcess:
    script = tmp_path / "rank.py"
    script.write_text(body)
    return subprocess.run([sys.executable, "-m", "infra.torchrun", *args, "--standalone", "--nproc-per-node=2",
                           "--monitor-interval=0.1", str(script)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)


def test_a_failed_rank_is_reported_as_torchrun_reports_it_and_exits_1(tmp_path):
    done = _agent(tmp_path, "import os, sys\n"
                            "if os.environ['RANK'] == '1':\n"
                            "    raise KeyError('batch 7')\n")
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "KeyError: 'batch 7'" in out  # the rank's own traceback
    assert "Root Cause (first observed failure)" in out and "ChildFailedError" in out  # torchrun's report
    assert "rank      : 1" in out


def test_ranks_that_finish_exit_0_and_bad_arguments_exit_2(tmp_path):
    assert _agent(tmp_path, "print('trained')\n").returncode == 0
    bad = _agent(tmp_path, "print('never')\n", "--no-such-option")
    assert bad.returncode == 2 and "unrecognized arguments" in bad.stderr
