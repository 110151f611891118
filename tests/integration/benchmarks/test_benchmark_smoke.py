"""Every benchmark still runs: each benchmarks/*.py with `--smoke`, as a subprocess of this python.

A benchmark that breaks (a config it reads changed, a key it prints went missing, an option it
needs is gone) fails here, not the next time someone wants its figure. Each script is found by
listing the folder, so a new one without `--smoke` fails too; a file there that is not a
benchmark must be named in NOT_BENCHMARKS with the reason.

What each run must do: exit 0 and end its stdout with one JSON object holding every key of the
script's `HEADLINE_KEYS` tuple, the same tuple its full run prints through
`print(json.dumps(benchmarks.headline.checked_headline(...)))`: the smoke and the full run take their keys from one place.
The smoke's figures are not checked: a smoke is a few steps or jobs, not a measurement.

Each runs with idle OpenMP threads sleeping (OMP_WAIT_POLICY=PASSIVE unless set): a single-process
torch spins its intra-op threads, which on a loaded 2-core machine stalls the smoke's own other
processes (preemption's smoke: 63 s against 46 s). SCRIPT_ARGS adds a script's options the full
run also takes; SHARED_PREFECT_SERVER's smokes use one Prefect server for them all.
"""

from __future__ import annotations

import ast
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
BENCHMARKS = REPO / "benchmarks"
NOT_BENCHMARKS = {
    "headline.py": "the last-line helper every benchmark imports (checked_headline); it measures nothing",
}
# The heaviest smokes (each several worlds of torchrun ranks) go first, so that under xdist the
# light ones fill in around them and both workers finish together; the rest by name. (Once a run
# has recorded their durations, tests/xdist_schedule.py orders by those; this order is for a run
# without them.)
HEAVIEST_FIRST = ("recovery.py", "reshard.py", "train_throughput.py", "eval_makespan.py", "mobius.py")
SCRIPTS = sorted((p.name for p in BENCHMARKS.glob("*.py") if p.name not in NOT_BENCHMARKS),
                 key=lambda name: (HEAVIEST_FIRST.index(name) if name in HEAVIEST_FIRST else len(HEAVIEST_FIRST),
                                   name))
# Options after --smoke, per script. submit_latency, watcher_scale: the session's Prefect home
# (tests/conftest.py's) for the Prefect server they start (the detached runner's temporary one, a
# `prefect server start`) instead of a fresh one, so that its database migrations (~10 s on 2 cores)
# are not run again when an earlier smoke in the session has run them.
SCRIPT_ARGS = {
    "submit_latency.py": lambda: ["--prefect-home", os.environ["PREFECT_HOME"]],
    "watcher_scale.py": lambda: ["--prefect-home", os.environ["PREFECT_HOME"]],
}
# Smokes whose flows would each start Prefect's temporary server (seconds to start and to stop,
# each time): they share one instead, started for this module on the session's Prefect home and
# handed to them as PREFECT_API_URL, the way a configured server is (the same client calls).
# Not preemption: no gain measured there (one run each on a loaded box: 73.3 s on the shared
# server, 68.4 s on its own temporary one).
SHARED_PREFECT_SERVER = ("recovery.py", "control_plane_orphans.py")
# A smoke takes seconds of CPU; the wall-clock limit only stops a hung one (a loaded 2-core box
# has stretched the heaviest, recovery's three flow runs and torchrun baseline, to several minutes).
TIMEOUT_S = 1200


def _strings(node: ast.expr, names: dict[str, tuple[str, ...]], script: str) -> tuple[str, ...]:
    """A tuple of string literals, or of other module-level such tuples unpacked with `*NAME`."""
    if not isinstance(node, ast.Tuple):
        raise AssertionError(f"{script}: HEADLINE_KEYS must be a tuple of strings")
    out: list[str] = []
    for element in node.elts:
        if isinstance(element, ast.Constant) and isinstance(element.value, str):
            out.append(element.value)
        elif isinstance(element, ast.Starred) and isinstance(element.value, ast.Name) and element.value.id in names:
            out.extend(names[element.value.id])
        else:
            raise AssertionError(f"{script}: HEADLINE_KEYS holds {ast.unparse(element)}, not a string "
                                 "or *NAME of a module-level tuple of strings")
    return tuple(out)


def headline_keys(script: str) -> tuple[str, ...]:
    """The script's module-level HEADLINE_KEYS, read from its source (importing it may be heavy)."""
    tree = ast.parse((BENCHMARKS / script).read_text(), filename=script)
    names: dict[str, tuple[str, ...]] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if name == "HEADLINE_KEYS":
                return _strings(node.value, names, script)
            if isinstance(node.value, ast.Tuple):
                try:
                    names[name] = _strings(node.value, names, script)
                except AssertionError:
                    pass  # another tuple, not of strings
    raise AssertionError(f"{script} names no HEADLINE_KEYS: declare the keys its last line prints as a "
                         "module-level tuple and end with print(json.dumps(checked_headline(values, HEADLINE_KEYS)))")


def test_every_file_in_benchmarks_is_run_or_named_as_not_a_benchmark():
    present = {p.name for p in BENCHMARKS.glob("*.py")}
    assert set(NOT_BENCHMARKS) <= present, f"NOT_BENCHMARKS names files that are gone: {set(NOT_BENCHMARKS) - present}"
    assert SCRIPTS and "placement_latency.py" in SCRIPTS and "data_prepare.py" in SCRIPTS
    assert set(HEAVIEST_FIRST) <= present, f"HEAVIEST_FIRST names files that are gone: {set(HEAVIEST_FIRST) - present}"
    assert set(SCRIPT_ARGS) <= set(SCRIPTS), f"SCRIPT_ARGS names no benchmark: {set(SCRIPT_ARGS) - set(SCRIPTS)}"
    assert set(SHARED_PREFECT_SERVER) <= set(SCRIPTS), \
        f"SHARED_PREFECT_SERVER names no benchmark: {set(SHARED_PREFECT_SERVER) - set(SCRIPTS)}"


@pytest.fixture(scope="module")
def shared_prefect_api_url():
    """One Prefect server (the kind the flows' temporary one is) for SHARED_PREFECT_SERVER's smokes
    on this worker, on the session's Prefect home; started by the first of them that runs."""
    import socket

    from prefect.server.api.server import SubprocessASGIServer

    # A port of its own: SubprocessASGIServer() without one is the process's default server, which
    # is the session's test API (`prefect_api`) once that started on this worker; stopping it here
    # at module end refused every later flow test of the worker.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = SubprocessASGIServer(port=port)
    server.start(timeout=180)  # a fresh home's migrations take minutes on a loaded machine
    try:
        yield server.api_url
    finally:
        server.stop()


@pytest.mark.parametrize("script", SCRIPTS)
def test_smoke_run_ends_with_its_headline_keys(script: str, request: pytest.FixtureRequest) -> None:
    keys = headline_keys(script)
    assert keys, f"{script}: HEADLINE_KEYS is empty"
    assert len(set(keys)) == len(keys), f"{script}: HEADLINE_KEYS names a key twice"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    extra = SCRIPT_ARGS[script]() if script in SCRIPT_ARGS else []
    env = dict(os.environ)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if script in SHARED_PREFECT_SERVER and not env.get("PREFECT_API_URL"):
        env["PREFECT_API_URL"] = request.getfixturevalue("shared_prefect_api_url")
    # the benchmark's temporary files (its checkpoints, servers' data: up to a few GB) go to a
    # folder of this smoke's, removed after it: left in /tmp, every `make test` added GBs there
    # until the disk filled and the S3 server answered every PutObject with InternalError
    env["TMPDIR"] = scratch = tempfile.mkdtemp(prefix="ffb-")
    try:
        proc = subprocess.run([sys.executable, str(BENCHMARKS / script), "--smoke", *extra], cwd=REPO,
                              capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    print(f"{script} --smoke: {time.perf_counter() - started:.1f} s wall, {cpu:.1f} s CPU")
    tail = f"\n--- stdout (end) ---\n{proc.stdout[-3000:]}\n--- stderr (end) ---\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, f"{script} --smoke exited {proc.returncode}{tail}"
    lines = proc.stdout.strip().splitlines()
    assert lines, f"{script} --smoke printed nothing{tail}"
    try:
        headline = json.loads(lines[-1])
    except json.JSONDecodeError:
        raise AssertionError(f"{script} --smoke: the last line is not JSON: {lines[-1][:300]!r}{tail}") from None
    assert isinstance(headline, dict), f"{script} --smoke: the last line is JSON but not an object: {lines[-1][:300]!r}"
    missing = [k for k in keys if k not in headline]
    assert not missing, f"{script} --smoke: the last line lacks {missing} of its HEADLINE_KEYS"
