"""Hostile HumanEval programs against the bubblewrap sandbox: real subprocesses, real bwrap.

Each program tries one escape and asserts that it worked, so a pass would mean an escape;
every one must end "failed" (or "timed out") within its limits, and the host must show
no trace of it.
"""

from __future__ import annotations

import os
import secrets
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from evalsuite.sandbox import REPORT_CAP, Sandbox, SandboxLimits, SandboxUnavailable, bwrap_available

needs_bwrap = pytest.mark.skipif(not bwrap_available(),
                                 reason="bubblewrap missing or no namespaces (make sandbox-packages installs it)")


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    return Sandbox(SandboxLimits(timeout_s=1.0, wall_slack_s=1.0, memory_mb=256, file_size_mb=1, disk_mb=8,
                                 max_processes=8))


def _alive_with(marker: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


class _Listeners:
    """A TCP port on 127.0.0.1, a Unix socket in a host directory and an abstract Unix socket,
    all accepting; `accepted` counts connections that reached any of them."""

    def __init__(self, folder: Path) -> None:
        self.tcp = socket.create_server(("127.0.0.1", 0))
        self.unix_path = str(folder / "host.sock")
        self.unix = socket.socket(socket.AF_UNIX)
        self.unix.bind(self.unix_path)
        self.abstract_name = "\0forgeflow-test-" + secrets.token_hex(8)
        self.abstract = socket.socket(socket.AF_UNIX)
        self.abstract.bind(self.abstract_name)
        self.accepted = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._serve, args=(s,), daemon=True)
                         for s in (self.tcp, self.unix, self.abstract)]
        for s, t in zip((self.tcp, self.unix, self.abstract), self._threads):
            s.listen(4)
            s.settimeout(0.1)
            t.start()

    def _serve(self, server: socket.socket) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = server.accept()
                self.accepted += 1
                conn.close()
            except OSError:
                pass

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()
        for s in (self.tcp, self.unix, self.abstract):
            s.close()


@pytest.fixture
def listeners(tmp_path):
    ls = _Listeners(tmp_path)
    yield ls
    ls.close()


def _failed(result, name):
    assert not result.passed and result.isolation == "bwrap", f"{name}: {result.result}"
    return result


@needs_bwrap
def test_a_program_cannot_forge_its_pass(sandbox):
    # What used to work: find the guard's report channel and token in a frame, gc or inspect and
    # write a pass to it. No channel or token exists now; writing to every descriptor and exiting 0
    # (or through SystemExit) is an early exit, a failure.
    forgers = {
        "frames": "import sys\nf = sys._getframe()\nwhile f:\n"
                  "    for v in list(f.f_locals.values()) + list(f.f_globals.values()):\n"
                  "        if isinstance(v, (str, bytes)) and len(v) == 32:\n            raise SystemExit(0)\n"
                  "    f = f.f_back\n"
                  "import os\nfor fd in range(64):\n    try:\n        os.write(fd, b'passed\\n')\n"
                  "    except OSError:\n        pass\nos._exit(0)",
        "gc": "import gc, os\ntags = [o for o in gc.get_objects() if isinstance(o, dict) and 'tag' in o]\n"
              "assert tags, 'no report token to forge with'\nos._exit(0)",
        "inspect": "import inspect, os\nfor frame in inspect.stack():\n"
                   "    for name in ('report', 'tag', 'passed', 'write'):\n"
                   "        assert name not in frame.frame.f_locals, name\nos._exit(0)",
        "sys.exit": "import sys\nsys.exit(0)",
        "exec true": "import os\nos.execv('/bin/true', ['true'])",
    }
    for name, program in forgers.items():
        _failed(sandbox.run(program), name)


@needs_bwrap
def test_no_host_socket_is_reachable(sandbox, listeners):
    # Path sockets (PostgreSQL's under /run or /tmp, docker's) and abstract ones, and TCP on loopback.
    host_sockets = [listeners.unix_path, "/var/run/docker.sock", "/run/postgresql/.s.PGSQL.5432",
                    *map(str, Path("/tmp").glob(".s.PGSQL.*"))]
    for path in host_sockets:
        program = f"import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({path!r})"
        _failed(sandbox.run(program), path)
        unseen = sandbox.run(f"import os\nassert not os.path.exists({path!r})")
        assert unseen.passed, f"{path} is visible in the sandbox: {unseen.result}"
    abstract = f"import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({listeners.abstract_name!r})"
    _failed(sandbox.run(abstract), "abstract socket")
    tcp = f"import socket\nsocket.create_connection(('127.0.0.1', {listeners.tcp.getsockname()[1]}), timeout=1)"
    _failed(sandbox.run(tcp), "tcp")
    assert listeners.accepted == 0
    # The same programs do reach them from outside the sandbox: the listeners work.
    socket.socket(socket.AF_UNIX).connect(listeners.abstract_name)
    time.sleep(0.3)
    assert listeners.accepted == 1


@needs_bwrap
def test_host_files_and_the_evaluator_environment_stay_unread(sandbox, tmp_path, monkeypatch):
    secret = "secret-" + secrets.token_hex(8)
    (tmp_path / "secret.txt").write_text(secret)
    monkeypatch.setenv("FORGEFLOW_TEST_SECRET", secret)
    readers = {
        "a host file": f"raise ValueError(open({str(tmp_path / 'secret.txt')!r}).read())",
        "/etc/shadow": "raise ValueError(open('/etc/shadow').read())",
        "/root": "import os\nraise ValueError(os.listdir('/root'))",
        "evaluator environ": f"raise ValueError(open('/proc/{os.getpid()}/environ').read())",
        "init environ": "raise ValueError(open('/proc/1/environ').read())",
        "every environ": "import os\nfor p in os.listdir('/proc'):\n    if p.isdigit():\n"
                         "        assert b'FORGEFLOW_TEST_SECRET' not in open(f'/proc/{p}/environ', 'rb').read()\n"
                         "raise ValueError('none held the secret')",
        "/sys": "import os\nraise ValueError(os.listdir('/sys/class/net'))",
    }
    for name, program in readers.items():
        result = _failed(sandbox.run(program), name)
        assert secret not in result.result and "FORGEFLOW_TEST_SECRET=" not in result.result, name
    assert "none held the secret" in sandbox.run(readers["every environ"]).result
    shadow = sandbox.run("import os\nassert not os.path.exists('/etc/shadow') and os.listdir('/etc') != []\n"
                         f"assert not os.path.exists({str(tmp_path)!r})")
    assert shadow.passed, shadow.result


@needs_bwrap
def test_writes_outside_fail_and_leave_no_trace(sandbox, tmp_path):
    for target in (tmp_path / "outside", Path(sys.prefix) / "pwned", Path("/usr/pwned"), Path("/pwned")):
        program = f"import io\nio.FileIO({str(target)!r}, 'w').write(b'pwned')"
        _failed(sandbox.run(program), str(target))
        assert not target.exists()


@needs_bwrap
def test_resource_bombs_are_contained(sandbox):
    fork = sandbox.run("import os, time\nfor _ in range(1000):\n    if os.fork() == 0:\n        time.sleep(60)")
    assert "BlockingIOError" in _failed(fork, "fork bomb").result    # the process limit held, not the clock
    memory = sandbox.run("chunks = []\nwhile True:\n    chunks.append(bytearray(1 << 24))")
    assert "MemoryError" in _failed(memory, "memory bomb").result
    big_file = sandbox.run("with open('big', 'wb') as f:\n    while True:\n        f.write(b'x' * (1 << 16))")
    assert "File too large" in _failed(big_file, "file size").result   # RLIMIT_FSIZE (Python ignores SIGXFSZ)
    disk = sandbox.run("i = 0\nwhile True:\n    open(f'f{i}', 'wb').write(b'x' * (1 << 19))\n    i += 1")
    assert "No space left" in _failed(disk, "disk fill").result
    _failed(sandbox.run("import os\ni = 0\nwhile True:\n    os.mkdir(f'/tmp/d{i}')\n    i += 1"), "inode fill")
    _failed(sandbox.run("open('/dev/shm/x', 'w').write('x')"), "/dev/shm")


@needs_bwrap
def test_no_process_outlives_its_program(sandbox):
    marker = "forgeflow-outlive-" + secrets.token_hex(6)
    program = (f"import os, sys\nif os.fork() == 0:\n    os.setsid()\n"
               f"    os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}])\n"
               "import time\ntime.sleep(0.5)\nraise ValueError('left a session behind')")
    _failed(sandbox.run(program), "setsid child")
    for _ in range(50):          # SIGKILL is delivered asynchronously: a bounded wait
        if not _alive_with(marker):
            break
        time.sleep(0.1)
    assert _alive_with(marker) == []


@needs_bwrap
def test_the_kernel_attack_surface_is_filtered(sandbox):
    # Each call is refused with EPERM by the seccomp filter (without it io_uring_setup(1, NULL)
    # gives EFAULT, keyctl and bpf other errors).
    program = ("import ctypes, errno\nlibc = ctypes.CDLL(None, use_errno=True)\n"
               "calls = {'io_uring_setup': (425, 1, 0), 'userfaultfd': (323, 0), 'keyctl': (250, 0, 0),\n"
               "         'bpf': (321, 0, 0, 0), 'ptrace': (101, 16, 1), 'mount': (165, 0, 0, 0, 0),\n"
               "         'unshare': (272, 0x10000000), 'perf_event_open': (298, 0, 0, 0, 0, 0)}\n"
               "for name, args in calls.items():\n"
               "    ctypes.set_errno(0)\n"
               "    assert libc.syscall(*args) == -1 and ctypes.get_errno() == errno.EPERM, name\n"
               "import threading\nt = threading.Thread(target=print)\nt.start()\nt.join()   # clone3 -> clone")
    result = sandbox.run(program)
    assert result.passed, result.result


@needs_bwrap
def test_output_over_the_cap_kills_and_fails(sandbox):
    flood = sandbox.run("import os\nwhile True:\n    os.write(2, b'x' * 65536)")
    assert _failed(flood, "stderr flood").result == f"failed: output over the cap ({REPORT_CAP >> 10} KiB)"
    printed = sandbox.run("for _ in range(100000):\n    print('x' * 100)")   # stdout is discarded, as the
    assert printed.passed, printed.result                                     # official harness does


def test_the_default_refuses_without_bubblewrap_and_the_guard_is_explicit(tmp_path, monkeypatch):
    assert SandboxLimits().isolation == "bwrap"
    monkeypatch.setenv("PATH", str(tmp_path))          # no bwrap on this PATH
    refusing = Sandbox(SandboxLimits())
    with pytest.raises(SandboxUnavailable, match=r"apt-get install bubblewrap.*isolation: python-guard"):
        refusing.run("assert True")
    trusted = Sandbox(SandboxLimits(isolation="python-guard"), workdir_root=tmp_path / "work")
    result = trusted.run("assert 1 + 1 == 2")
    assert result.passed and result.isolation == "python-guard"
    assert not trusted.run("import os\nos._exit(0)").passed
