"""Exit a process that imported torch without the interpreter's teardown.

The teardown (module teardown, the process groups' thread joins, the last garbage collection over
every object torch and megatron made) takes seconds of CPU on a busy machine between a process's
last useful act and its exit: a committed stop, a peer's failure, a finished node check. Whoever
follows the job waits that out (torchrun's agent, the reaper, the flow's watcher, a restart). A
process calls `exit_now` once its files are closed or committed; the exit handlers still run (the
metrics' last flush, torch's and logging's own), buffered output is flushed.
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import NoReturn


def exit_now(code: int) -> NoReturn:
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
