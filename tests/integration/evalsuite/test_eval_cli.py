"""`forgeflow eval` end to end in a subprocess, as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.tiny_suite import write_tiny_suite

REPO = Path(__file__).resolve().parents[3]


def test_forgeflow_eval_cli(tiny_model, tmp_path):
    # each trial in a fresh interpreter, as on GPU nodes
    suite = write_tiny_suite(tmp_path / "suite.yaml", tiny_model, "cli", isolation="process")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "flows.cli", "eval", str(tiny_model), "--suite", str(suite),
                           "--output", str(tmp_path / "out"), "--no-progress", "--json"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # --json: the plan and report go to stderr, stdout is one object (results.json + its path)
    assert "evaluation plan:" in proc.stderr and "predicted" in proc.stderr
    printed = json.loads(proc.stdout)
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert printed == {**results, "results_path": str(tmp_path / "out" / "results.json")}
    assert set(results["results"]) == {"capitals-mc", "perplexity"} and results["failed"] == {}

    bad = subprocess.run([sys.executable, "-m", "flows.cli", "eval", str(tiny_model), "--suite", "no-such-ds"],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert bad.returncode == 2 and "unknown dataset(s) ['no-such-ds']" in bad.stderr
