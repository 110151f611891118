"""What environment a child Python process started with, seen from inside it.

`install(folder, monkeypatch)` puts a `sitecustomize.py` first on PYTHONPATH: every Python
interpreter started from then on (torchrun, its workers, a Slurm job's step) writes the names
of its environment variables to `folder/env-<pid>.json` as it starts, if the probe's own
variable (FORGEFLOW_TEST_ENV_PROBE, a FORGEFLOW_* name a worker is given) reached it. A test
sets secrets in its own environment, starts the launcher, and reads what the children saw.
"""

from __future__ import annotations

import json
from pathlib import Path

PROBE_VAR = "FORGEFLOW_TEST_ENV_PROBE"

_SITECUSTOMIZE = f'''
import json, os
_folder = os.environ.get({PROBE_VAR!r})
if _folder:
    with open(os.path.join(_folder, f"env-{{os.getpid()}}.json"), "w") as _f:
        json.dump(sorted(os.environ), _f)
'''


def install(folder: Path, monkeypatch) -> Path:
    """Probe every Python started from now on; returns the folder its reports go to."""
    import os

    code = folder / "site"
    code.mkdir(parents=True, exist_ok=True)
    (code / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    reports = folder / "reports"
    reports.mkdir(exist_ok=True)
    old = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", str(code) + (os.pathsep + old if old else ""))
    monkeypatch.setenv(PROBE_VAR, str(reports))
    return reports


def seen(reports: Path) -> list[set[str]]:
    """The environment names each probed process started with (one set per process)."""
    return [set(json.loads(path.read_text())) for path in sorted(reports.glob("env-*.json"))]
