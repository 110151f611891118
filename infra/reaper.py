"""Run a command so that none of its descendants can outlive whoever started it.

    python -m infra.reaper [--grace S] -- torchrun ...

Why this exists: torchrun starts every rank with `start_new_session=True`
(torch/distributed/elastic/multiprocessing/subprocess_handler/subprocess_handler.py,
`SubprocessHandler._popen`), so killing torchrun's process group does not reach
the ranks, and if torchrun itself is SIGKILLed its ranks are re-parented to init
and train on as orphans. Prefect's cancellation has the same blind spot for
grandchildren. The reaper closes both holes:

- it makes itself a *child subreaper* (PR_SET_CHILD_SUBREAPER), so orphaned
  ranks are re-parented to it and stay in its process tree;
- it asks the kernel to SIGTERM it when its parent dies (PR_SET_PDEATHSIG) and
  also polls `getppid()` as a second line of defence;
- its command (torchrun) gets the same parent-death SIGTERM, set in the child
  before exec (`_dies_with`), so a SIGKILLed reaper does not leave torchrun and
  its ranks training on as orphans: torchrun's agent stops its ranks gracefully
  (they commit, as on any SIGTERM) and exits; the launcher also finds what is
  left through the reaper's process group (infra.launch.LocalJob);
- on SIGTERM/SIGINT, on its parent's death, or when the command exits, it
  terminates every remaining descendant (SIGTERM, then SIGKILL after --grace s);
- with `--nice N`, the command runs at niceness N (a standby world's, infra.standby), and
  SESSION_NICE_ENV says so to the processes in sessions of their own (infra.autogroup);
- with `--lease-file PATH` (the Slurm and Kubernetes launchers), also once the job's
  lease file says its holder is gone (infra.lease_guard: the flow that renews it died
  or released the attempt); a file it cannot read stops nothing.

It exits with the command's exit code (128+signal for a signal, as a shell does).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import time

import psutil

from infra.autogroup import SESSION_NICE_ENV
from infra.lease_guard import LeaseFile, LeaseGuard, look_every_s

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def prctl(option: int, value: int) -> bool:
    """Linux prctl(2) with an integer argument; False where it failed or this is not Linux."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):  # not Linux
        return False


def _dies_with(parent_pid: int):
    """preexec_fn for the command: SIGTERM it when `parent_pid` (the reaper) dies, even by SIGKILL.
    (The checkpoint uploader ends with its rank too: checkpoint/writer.py `_end_with_parent`;
    torchrun gets SIGTERM so that its agent stops the ranks gracefully.)"""

    def set_parent_death_signal() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent_pid:  # the reaper died before the signal was set
            os._exit(128 + signal.SIGTERM)

    return set_parent_death_signal


def kill_tree(root_pid: int, grace_s: float, include_root: bool = False) -> list[int]:
    """SIGTERM every descendant of root_pid (and root if asked), SIGKILL what remains."""
    try:
        root = psutil.Process(root_pid)
        procs = root.children(recursive=True)
        if include_root:
            procs.append(root)
    except psutil.NoSuchProcess:
        return []
    stop_processes(procs, grace_s)
    return [p.pid for p in procs]


def stop_processes(procs: list[psutil.Process], grace_s: float) -> None:
    """SIGTERM each, SIGKILL what is still there after grace_s, and wait for them."""
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)


def _reap_zombies(keep: int | None = None) -> None:
    """Collect exit statuses of adopted orphans, but never of `keep` (Popen owns that one)."""
    for proc in psutil.Process().children():
        if proc.pid == keep:
            continue
        try:
            os.waitpid(proc.pid, os.WNOHANG)
        except ChildProcessError:
            pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infra.reaper")
    parser.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL")
    parser.add_argument("--poll", type=float, default=0.5)
    parser.add_argument("--lease-file", default=None,
                        help="stop the command once this lease file (infra.lease_guard) says its holder is gone")
    parser.add_argument("--nice", type=int, default=0,
                        help="run the command (and this reaper) at this niceness (os.nice): a standby "
                             "world's processes (infra.standby) start behind the training ones")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command after --")

    parent = os.getppid()
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    prctl(PR_SET_PDEATHSIG, signal.SIGTERM)

    stop_signal: list[int] = []

    def on_signal(signum, _frame):
        stop_signal.append(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    if args.nice:
        os.nice(args.nice)  # inherited by the command and everything it starts
        # and said, so that a rank torchrun starts in a session of its own sets that session's
        # autogroup to it (training.standby); an inherited niceness alone does not
        os.environ[SESSION_NICE_ENV] = str(args.nice)
    child = subprocess.Popen(command, preexec_fn=_dies_with(os.getpid()))  # no thread runs yet
    guard = None
    if args.lease_file:
        lease = LeaseFile(args.lease_file)
        every_s = look_every_s(float((lease.read() or {}).get("valid_s") or 30.0))
        guard = LeaseGuard(lease.look, every_s, lambda why: print(
            f"forgeflow reaper: {why}; stopping the ranks", file=sys.stderr, flush=True)).start()
    returncode: int | None = None
    while returncode is None:
        returncode = child.poll()
        if returncode is not None:
            break
        if stop_signal or os.getppid() != parent or (guard is not None and guard.gone_because is not None):
            kill_tree(os.getpid(), args.grace)
            returncode = child.wait()
            break
        time.sleep(args.poll)
        _reap_zombies(keep=child.pid)

    # The command is gone; anything it left behind (re-parented to us) goes too.
    if guard is not None:
        guard.close()
        if guard.gone_because is not None and returncode == 0:  # torchrun exits 0 when told to stop:
            returncode = 128 + signal.SIGTERM  # the node was stopped, it did not finish
    kill_tree(os.getpid(), args.grace)
    _reap_zombies()
    if returncode < 0:
        return 128 - returncode
    return returncode


if __name__ == "__main__":
    sys.exit(main())
