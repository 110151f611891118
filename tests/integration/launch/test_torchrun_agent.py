"""infra.torchrun is torchrun with its ranks forked from the agent and a fast exit: same arguments,
output and exit codes.

A launch of `-m MODULE` forks its ranks, as the launchers start one (static rendezvous) and as
`forgeflow train` does (`--standalone`); the tests of a script see torchrun's own new interpreters.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from testing.prefect_server import free_port

REPO = Path(__file__).resolve().parents[3]


def _agent(tmp_path: Path, body: str, *args: str) -> subprocess.CompletedProcess:
    script = tmp_path / "rank.py"
    script.write_text(body)
    return subprocess.run([sys.executable, "-m", "infra.torchrun", *args, "--standalone", "--nproc-per-node=2",
                           "--monitor-interval=0.1", str(script)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)


def _module_agent(tmp_path: Path, body: str, *rank_args: str, start: str | None = None,
                  standalone: bool = False) -> subprocess.CompletedProcess:
    """`python -m infra.torchrun` as the launchers run it (infra.launch.torchrun_command): a static
    rendezvous (or `--standalone`, as `forgeflow train`), two ranks running `-m probe_rank *rank_args`,
    whose code is `body`."""
    (tmp_path / "probe_rank.py").write_text(body)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO)]))
    env.pop("OMP_NUM_THREADS", None)  # torchrun sets 1 for two ranks
    if start is not None:
        env["FORGEFLOW_RANK_START"] = start
    rendezvous = (["--standalone"] if standalone else
                  ["--nnodes=1", "--node-rank=0", "--master-addr=127.0.0.1", f"--master-port={free_port()}"])
    return subprocess.run([sys.executable, "-m", "infra.torchrun", *rendezvous, "--nproc-per-node=2",
                           "--max-restarts=0", "--monitor-interval=0.1", "--tee=3",
                           f"--log-dir={tmp_path / 'logs'}", "-m", "probe_rank", *rank_args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


# What a rank reports about itself: the state a new interpreter under torchrun has.
PROBE = """
import json, os, random, signal, sys
import torch
import psutil
me, agent = psutil.Process(), psutil.Process().parent()
print("PROBE " + json.dumps({
    "rank": int(os.environ["RANK"]), "argv": sys.argv[1:], "main": __name__,
    "own_session": os.getsid(0) == os.getpid(), "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
    "sigint_python": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
    "threads": torch.get_num_threads(), "omp": os.environ.get("OMP_NUM_THREADS"), "random": random.random(),
    "name": me.name(), "agent_name": agent.name(), "agent_pid": agent.pid,
    "agent_cmdline": agent.cmdline(), "cmdline": me.cmdline(),
}), flush=True)
from infra.fast_exit import exit_now
exit_now(0)
"""


def _probes(done: subprocess.CompletedProcess) -> list[dict]:
    found = [json.loads(line.split("PROBE ", 1)[1]) for line in done.stdout.splitlines() if "PROBE " in line]
    return sorted(found, key=lambda p: p["rank"])


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


@pytest.mark.parametrize("standalone", [False, True], ids=["static", "standalone"])
def test_forked_ranks_start_as_new_interpreters_would_and_a_fast_exit_is_a_success(tmp_path, standalone):
    done = _module_agent(tmp_path, PROBE, "job.yaml", "--set", "a=1", standalone=standalone)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = _probes(done)
    assert [r["rank"] for r in ranks] == [0, 1]
    for rank in ranks:
        # forked: the agent is its parent and it has the agent's command line ...
        assert rank["agent_name"] == "pt_elastic" and rank["cmdline"] == rank["agent_cmdline"], rank
        # ... and otherwise what `python -u -m probe_rank job.yaml --set a=1` under torchrun has
        assert rank["argv"] == ["job.yaml", "--set", "a=1"] and rank["main"] == "__main__", rank
        assert rank["own_session"] and rank["sigterm_default"] and rank["sigint_python"], rank
        assert rank["omp"] == "1" and rank["threads"] == 1, rank  # torchrun's OMP_NUM_THREADS, read after the agent's
        assert rank["name"] == os.path.basename(sys.executable)[:15], rank
    assert ranks[0]["random"] != ranks[1]["random"]  # seeded each, not the agent's state twice


def test_a_forked_ranks_failure_is_reported_as_for_a_new_interpreter(tmp_path):
    raised = _module_agent(tmp_path, "import os\nif os.environ['RANK'] == '1':\n    raise KeyError('batch 7')\n")
    out = raised.stdout + raised.stderr
    assert raised.returncode == 1, out
    assert "[default1]:KeyError: 'batch 7'" in out  # the rank's traceback, in its prefixed console lines
    assert "Root Cause (first observed failure)" in out and "probe_rank FAILED" in out
    assert "exitcode  : 1" in out and "rank      : 1" in out
    assert "ProcessExitedException" not in out  # not the agent's own poll loop as one more error

    exited = _module_agent(tmp_path, "import os, sys\nif os.environ['RANK'] == '1':\n    sys.exit(3)\n")
    assert exited.returncode == 1 and "exitcode  : 3" in exited.stderr, exited.stderr[-3000:]


def test_exec_starts_new_interpreters_and_a_bad_start_is_one_error(tmp_path):
    done = _module_agent(tmp_path, PROBE, start="exec")
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in _probes(done):
        assert rank["cmdline"][1:] == ["-u", "-m", "probe_rank"], rank
    bad = _module_agent(tmp_path, PROBE, start="yes")
    assert bad.returncode == 2, bad.stderr
    assert bad.stderr.strip().splitlines() == [
        "error: FORGEFLOW_RANK_START='yes': give fork (ranks forked from torchrun's agent, the default) "
        "or exec (a new interpreter per rank, as torchrun starts them)"]
