"""Exit a process that imported torch without the interpreter's teardown.

The teardown (module teardown, the process groups' thread joins, the last garbage collection over
every object torch and megatron made) takes seconds of CPU on a busy machine between a process's
last useful act and its exit: a committed stop, a peer's failure, a finished node check. Whoever
follows the job waits that out (torchrun's agent, the reaper, the flow's watcher, a restart). A
process calls `exit_now` once its files are closed or committed; the exit handlers still run (the
metrics' last flush, torch's and logging's own), buffered output is flushed.

A rank that torchrun's agent forked (infra.torchrun) tells its agent it succeeded by returning
from its entry point: the agent waits for each rank's return value, and a fork that ended with 0
without one would leave it waiting. Such a rank calls `return_on_success` first, and its
`exit_now(0)` raises SystemExit(0) for the entry point to catch; the fork then ends without the
teardown all the same (multiprocessing ends its children with os._exit).
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import NoReturn

_return_on_success = False


def return_on_success() -> None:
    """Make `exit_now(0)` raise SystemExit(0) in this process (a forked rank: see the docstring)."""
    global _return_on_success
    _return_on_success = True


def exit_now(code: int) -> NoReturn:
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    if code == 0 and _return_on_success:
        raise SystemExit(0)
    os._exit(code)
