"""torchrun (`torch.distributed.run`), with its ranks forked from its agent, exiting as soon as its
ranks have.

    python -m infra.torchrun [torchrun's arguments] -m training.train JOB ...

Ranks forked from the agent. torchrun starts each rank as a new interpreter (`python -u -m
MODULE`), and each imports torch again before doing anything: 2.8 s of CPU of a tiny rank's
start here, paid again by every restart and, on a shared node, taken from the ranks already
training. The agent has imported torch already and never initialises CUDA nor runs an operator,
so a rank can start as a fork of it: torchrun's own multiprocessing start for a function entry
point (`LaunchConfig.start_method = "fork"`, elastic_launch). Measured on this 2-core box
(benchmarks/rank_start.py: configs/tiny-cpu.yaml on two ranks for five steps, medians of five
launches each, alternating): the launch took 17.6 CPU-s forked against 22.0 as new interpreters
(2.2 CPU-s less per rank), and rank 0's first step came 6.7 s after the launch against 9.4 s.

Each fork first makes itself what a new `python -u -m MODULE` under torchrun would be
(`_become_a_new_rank`): a session of its own (torchrun starts
ranks with start_new_session), the default signal handlers and no parent-death signal, none of the
agent's exit handlers, its own `random` seeds, the intra-op threads OMP_NUM_THREADS asks for
(torchrun sets it after the agent's OpenMP read the environment), unbuffered output, its own
process name. Then it runs MODULE as `python -m` does. Its command line stays the agent's (`ps`
shows the rank under its agent, with the agent's arguments); the process name tells them apart
(the agent is pt_elastic, as torchrun names it). A failed rank is reported as for a new
interpreter (its traceback in its console lines, torchrun's Root Cause with its exit code), except
that torchrun's report lists only the rank that failed first, not also the ranks it then stopped.

A world forks when it runs a module (`-m`) on a number of ranks per node under torchrun's own
rendezvous: static (as the launchers start it), c10d, or `--standalone` (c10d on localhost, as
`forgeflow train` and the offload workers start it). Anything else (`--nproc-per-node=gpu`, a
script, `--no-python`, an etcd rendezvous), or FORGEFLOW_RANK_START=exec, starts a new interpreter
per rank as torchrun does.

The fast exit: the agent imports torch, and its interpreter's teardown (module teardown, the last
garbage collection) takes a second or more of CPU after the last rank exited (measured here: the
agent left 1.7-1.8 s after its ranks, about 1 s with a fast exit). Everything that follows a job
waits that out: the reaper, the flow's watcher seeing a failed node, a restart. Same arguments,
output and exit code as torchrun: a rank's failure is printed as torchrun prints it (the "Root
Cause" report diagnosis reads) and exits 1.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import gc
import logging
import os
import random
import runpy
import signal
import sys
import uuid
from collections.abc import Callable, Mapping

from infra.fast_exit import exit_now, return_on_success
from infra.reaper import PR_SET_PDEATHSIG, prctl

RANK_START_ENV = "FORGEFLOW_RANK_START"
RANK_STARTS = ("fork", "exec")
AGENT_NAME = "pt_elastic"  # the agent's process name, as torchrun's run() sets it
PR_SET_NAME = 15
MULTIPROCESS_LOGGER = "torch.distributed.elastic.multiprocessing.api"  # torchrun's log of its ranks' processes


def rank_start(environ: Mapping[str, str] | None = None) -> str:
    """How this machine starts ranks (RANK_START_ENV): "fork" (the default) or "exec"."""
    value = (os.environ if environ is None else environ).get(RANK_START_ENV, "").strip().lower() or "fork"
    if value not in RANK_STARTS:
        raise ValueError(f"{RANK_START_ENV}={value!r}: give fork (ranks forked from torchrun's agent, the "
                         "default) or exec (a new interpreter per rank, as torchrun starts them)")
    return value


def forks_ranks(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> bool:
    """Whether torchrun's parsed `args` start a world whose ranks this agent forks (module docstring)."""
    return (bool(args.module) and not args.no_python and not args.run_path
            and (args.standalone or args.rdzv_backend in ("static", "c10d"))
            # a number: "gpu" or "auto" counts devices in the agent, which starts CUDA there, and CUDA
            # cannot start again in a process forked after its parent started it
            and str(args.nproc_per_node).isdigit()
            and getattr(args, "use_env", True) and rank_start(environ) == "fork")


def _rendezvous_as_torchrun_sets_it(args: argparse.Namespace) -> None:
    """What torchrun's run() (torch 2.13) does to its arguments before it launches: `--standalone`,
    or a static rendezvous of one node given no master port, is a c10d rendezvous on localhost under
    a fresh id; a static one of more nodes given no port takes 29500."""
    from torch.distributed.run import parse_min_max_nnodes

    if args.standalone or (args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None
                           and parse_min_max_nnodes(args.nnodes)[1] == 1):
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500


def _set_process_name(name: str) -> None:
    try:
        ctypes.CDLL(None).prctl(PR_SET_NAME, ctypes.c_char_p(name[:15].encode()), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux
        pass


def _become_a_new_rank() -> None:
    """Undo in a forked rank what it inherited from the agent and a new interpreter would not have."""
    os.setsid()
    prctl(PR_SET_PDEATHSIG, 0)  # multiprocessing's child sets SIGINT; an orphan is the reaper's to stop
    for sig in signal.valid_signals():  # the agent's handlers (torchrun's SIGTERM, SIGINT...) are not the rank's
        try:
            if callable(signal.getsignal(sig)):
                signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):  # SIGKILL, SIGSTOP
            pass
    signal.signal(signal.SIGINT, signal.default_int_handler)
    atexit._clear()  # the agent's exit handlers are the agent's
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))
    for stream in (sys.stdout, sys.stderr):  # as `python -u`
        stream.reconfigure(line_buffering=True, write_through=True)
    _set_process_name(os.path.basename(sys.executable))
    return_on_success()


def forked_rank(module: str) -> Callable[..., None]:
    """The entry point of a forked rank running `python -m module *argv`; named after the module,
    as torchrun names a rank that runs `-m module` (its failure report says which entry failed)."""

    def rank(*argv: str) -> None:
        _become_a_new_rank()
        sys.argv = [module, *argv]
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as e:  # a rank succeeds by returning (infra.fast_exit)
            if e.code not in (None, 0):
                raise
        except KeyboardInterrupt:  # as Python ends on one: the traceback, then death by SIGINT
            sys.excepthook(*sys.exc_info())
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        except Exception:  # as Python ends on one: the traceback on stderr (diagnosis reads it), exit 1
            sys.excepthook(*sys.exc_info())
            exit_now(1)

    rank.__name__ = rank.__qualname__ = module
    return rank


class _RankExitWithoutTraceback(logging.Filter):
    """torchrun logs a forked rank's failure ("failed (exitcode: 1) local_rank: 1 (pid: N) of fn:
    training.train") with the traceback of its own poll loop (ProcessExitedException), which says
    nothing the line does not and would read as one more error to diagnosis: the line stays, as
    torchrun logs it for a new interpreter, without that traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith("failed (exitcode"):
            record.exc_info, record.exc_text = None, None
        return True


def _launch_forked(args: argparse.Namespace) -> None:
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args

    _set_process_name(AGENT_NAME)
    logging.getLogger(MULTIPROCESS_LOGGER).addFilter(_RankExitWithoutTraceback())
    _rendezvous_as_torchrun_sets_it(args)
    config, _, _ = config_from_args(args)
    config.start_method = "fork"
    # The agent's objects out of the ranks' garbage collections: a collection writes to every
    # object it visits, and each page written is copied into the rank (0.5 CPU-s a rank here).
    gc.freeze()
    elastic_launch(config=config, entrypoint=forked_rank(args.training_script))(*args.training_script_args)


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.run import main as torchrun, parse_args

    try:
        rank_start()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        args = parse_args(argv)
        if forks_ranks(args):
            _launch_forked(args)
        else:
            torchrun(argv)
    except SystemExit as e:  # argparse's errors and --help; what sys.exit would make of it
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except Exception:  # a failed rank (ChildFailedError) or a signal: printed as Python would
        sys.excepthook(*sys.exc_info())
        return 1
    return 0


if __name__ == "__main__":
    exit_now(main())
