"""Hyperscan is installed on x86-64 only (a platform marker in pyproject.toml); every
other node (aarch64 such as GH200) runs the RE2 path. Both must give the same verdicts.

Each side runs in its own interpreter: one as installed here, one where `import
hyperscan` fails exactly as it does on a platform without the wheel.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
FAILURES = ROOT / "tests" / "data" / "failures"

_DIAGNOSE_ALL = """
import json, sys, tempfile
if sys.argv[1] == "no-hyperscan":
    sys.modules["hyperscan"] = None  # `import hyperscan` now raises ImportError
from pathlib import Path
from diagnosis import multi_regex
from diagnosis.api import diagnose_log
state = tempfile.mkdtemp()
verdicts = {}
for log in sorted(Path(sys.argv[2]).glob("*.log")):
    d = diagnose_log(log, state_dir=state)
    verdicts[log.name] = [d.root_cause, d.kind, d.restart_helps, sorted(d.culprit_lines)]
print(json.dumps({"hyperscan": multi_regex.hyperscan is not None, "verdicts": verdicts}))
"""


def _verdicts(mode: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", _DIAGNOSE_ALL, mode, str(FAILURES)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_re2_path_gives_the_same_verdicts_as_hyperscan():
    pytest.importorskip("hyperscan", reason="this platform has no hyperscan wheel: only the RE2 path exists")
    with_hyperscan, re2_only = _verdicts("as-installed"), _verdicts("no-hyperscan")
    assert with_hyperscan["hyperscan"] is True and re2_only["hyperscan"] is False
    assert len(with_hyperscan["verdicts"]) >= 50
    known = [v for v in with_hyperscan["verdicts"].values() if v[0] != "Unknown"]
    assert len(known) >= 40  # the corpus exercises the rules, not only the fallbacks
    assert re2_only["verdicts"] == with_hyperscan["verdicts"]
