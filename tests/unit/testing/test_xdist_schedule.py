"""The suite's xdist scheduler (tests/xdist_schedule.py): its units, and a real `-n 2 --dist
loadgroup` run that keeps each unit on one worker and hands out the longest first."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.xdist_schedule import SHARED_PREFECT_SERVER_GROUP, unit_of

SCHEDULER = Path(__file__).resolve().parents[2] / "xdist_schedule.py"


def test_units_follow_the_suite_layout(tmp_path):
    flows = tmp_path / "tests/integration/flows"
    flows.mkdir(parents=True)
    (flows / "test_on_server.py").write_text("def test_x(use_prefect_server): pass\n")
    (flows / "test_in_process.py").write_text("from testing.prefect_server import LocalPrefectServer\n"
                                              "def test_x(prefect_api): pass\n")
    (flows / "test_own_server.py").write_text("@pytest.fixture(scope='module')\ndef prefect_server(): ...\n"
                                              "def test_x(use_prefect_server): pass\n")
    assert unit_of("tests/integration/checkpoint/test_a.py::test_x", tmp_path) == "tests/integration/checkpoint/test_a.py"
    assert unit_of("tests/integration/checkpoint/test_a.py::test_y[1]", tmp_path) == "tests/integration/checkpoint/test_a.py"
    assert unit_of("tests/integration/slurm/test_a.py::test_x", tmp_path) == unit_of(
        "tests/integration/slurm/test_b.py::test_y", tmp_path) == "tests/integration/slurm"
    assert unit_of("tests/integration/flows/test_on_server.py::test_x", tmp_path) == SHARED_PREFECT_SERVER_GROUP
    assert unit_of("tests/integration/flows/test_in_process.py::test_x", tmp_path) == \
        "tests/integration/flows/test_in_process.py"
    assert unit_of("tests/integration/flows/test_own_server.py::test_x", tmp_path) == \
        "tests/integration/flows/test_own_server.py"
    for alone in ("tests/integration/benchmarks/test_smoke.py::test_run[a.py]", "tests/unit/test_a.py::test_x"):
        assert unit_of(alone, tmp_path) == alone


def test_a_real_xdist_run_keeps_units_together_and_starts_the_longest(tmp_path):
    """Three integration files of four tests and eight unit tests on two workers: each file on
    one worker (xdist's own loadgroup lost this with pytest 9.2), and the file the durations call
    longest is what a worker runs first, although it is collected last (in collection order the
    workers would start with the first two files)."""
    log = tmp_path / "ran.log"
    for name in ("test_a", "test_b", "test_c"):
        path = tmp_path / "tests/integration/some" / f"{name}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(_TESTS.format(log=str(log)))
    unit = tmp_path / "tests/unit/test_u.py"
    unit.parent.mkdir(parents=True)
    unit.write_text(_TESTS.format(log=str(log)))
    (tmp_path / "conftest.py").write_text(_CONFTEST.format(scheduler=str(SCHEDULER)))
    # only xdist of the installed plugins: three interpreters start, each loading what it needs
    env = dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "xdist", "-p", "no:cacheprovider", "-n", "2",
                           "--dist", "loadgroup", "tests"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ran = [line.split(" ", 1) for line in log.read_text().splitlines()]
    assert len(ran) == 20
    workers = {}
    for worker, nodeid in ran:
        workers.setdefault(nodeid.split("::")[0], set()).add(worker)
    for name in ("test_a", "test_b", "test_c"):
        assert len(workers[f"tests/integration/some/{name}.py"]) == 1, ran
    firsts = {}
    for worker, nodeid in ran:
        firsts.setdefault(worker, nodeid)
    assert "tests/integration/some/test_c.py::test_0" in firsts.values(), ran


_TESTS = '''
import os, time

def _ran(name):
    with open({log!r}, "a") as f:
        f.write(os.environ["PYTEST_XDIST_WORKER"] + " " + os.environ["PYTEST_CURRENT_TEST"].split(" ")[0] + "\\n")
    time.sleep(0.05)

''' + "".join(f"def test_{i}(): _ran({i})\n" for i in range(8))

_CONFTEST = '''
import importlib.util, sys

spec = importlib.util.spec_from_file_location("suite_xdist_schedule", {scheduler!r})
schedule = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = schedule
spec.loader.exec_module(schedule)


def pytest_collection_modifyitems(items):
    items[:] = [i for i in items if int(i.name.split("_")[1]) < (8 if "unit" in i.nodeid else 4)]


def pytest_xdist_make_scheduler(config, log):
    return schedule.GroupedScheduling(config, log, {{
        f"tests/integration/some/test_c.py::test_{{i}}": 100.0 for i in range(4)}})
'''
