"""StepControl (training/control.py) on 2 real gloo ranks that disagree on purpose:
a checkpoint by time is due when rank 0's clock says so, and a SIGTERM that reaches one
rank stops both after the same step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_ranks_agree_on_time_checkpoints_and_on_stopping():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", str(Path(__file__).with_name("step_control_worker.py"))],
                          cwd=REPO, env={**env, "PYTHONPATH": str(REPO)}, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    by_rank = {r: [(d["step"], d["due"], d["stop"]) for d in lines if d["rank"] == r] for r in (0, 1)}
    assert by_rank[0] == by_rank[1]  # the same decisions on every rank, step by step
    # interval_s=10 on rank 0's clock (4 s a step): due at 12 s, then 10 s after each save
    assert [s for s, due, _ in by_rank[0] if due] == [3, 6]
    # rank 1 alone got SIGTERM before step 5's agreement: both stop from step 5 on
    assert [s for s, _, stop in by_rank[0] if stop] == [5, 6, 7]
