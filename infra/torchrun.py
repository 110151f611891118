"""torchrun (`torch.distributed.run`), exiting as soon as its ranks have.

    python -m infra.torchrun [torchrun's arguments] -m training.train JOB ...

The agent imports torch, and its interpreter's teardown (module teardown, the last garbage
collection) takes a second or more of CPU after the last rank exited (measured here: the agent
left 1.7-1.8 s after its ranks, about 1 s with a fast exit). Everything that follows a job waits
that out: the reaper, the flow's watcher seeing a failed node, a restart. Same arguments, output
and exit code as torchrun: a rank's failure is printed as torchrun prints it (the "Root Cause"
report diagnosis reads) and exits 1.
"""

from __future__ import annotations

import sys

from infra.fast_exit import exit_now


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.run import main as torchrun

    try:
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
