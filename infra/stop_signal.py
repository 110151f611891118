"""Stop a long-running loop on SIGTERM/SIGINT without risking a deadlock in the handler.

    with stop_on_signals(signal.SIGINT, signal.SIGTERM) as stop:
        orchestrator.serve(stop=stop)      # loops `while not stop.is_set(): ... stop.wait(t)`

A Python signal handler runs in the main thread, between two bytecodes of whatever that
thread is doing. If it takes a lock the interrupted code holds, the process hangs for
good: a handler calling `threading.Event.set()` while the main thread was inside
`Event.wait()` on the same Event re-enters the Event's (non-reentrant) Condition lock.
`forgeflow cluster serve` hung that way after a SIGTERM and ignored every later one.

So the handler here only records the request: it assigns a flag and writes one byte to
a non-blocking pipe, both lock-free. `StopFlag.wait(timeout)` selects on the pipe's read
end, so a signal that arrives just before or during the wait still ends it at once. The
pipe is also the process's signal wakeup fd (`signal.set_wakeup_fd`) for the `with`
block: the C-level handler writes to it at once even when the kernel delivers the
signal to another thread, whose EINTR would not wake the main thread's select. A
StopFlag has `is_set()` and `wait()` like a threading.Event, and `set()` may also be
called from another thread.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
from typing import Iterator, Protocol


class Stop(Protocol):
    """What a loop that can be stopped needs: a threading.Event, or a StopFlag for signals."""

    def is_set(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> bool: ...


class StopFlag:
    """A stop request that a signal handler may make: a plain flag plus a wakeup pipe."""

    def __init__(self) -> None:
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)  # wait() drains it
        os.set_blocking(self._write_fd, False)  # a full pipe already wakes the loop: never block
        self._requested = False

    def set(self) -> None:
        """Request the stop (safe in a signal handler: a flag and a non-blocking write, no lock)."""
        if self._requested:
            return
        self._requested = True
        write_fd = self._write_fd
        if write_fd >= 0:
            with contextlib.suppress(OSError):  # full (already woken) or closed meanwhile
                os.write(write_fd, b"\0")

    def is_set(self) -> bool:
        return self._requested

    def wait(self, timeout: float | None = None) -> bool:
        """Sleep until the stop is requested or `timeout` seconds pass; whether it was requested."""
        if not self._requested and self._read_fd >= 0:
            if select.select([self._read_fd], [], [], timeout)[0] and not self._requested:
                self._drain()  # a byte from another signal's wakeup: wait afresh next time
        return self._requested

    def _drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self._read_fd, 512):
                pass

    def close(self) -> None:
        read_fd, write_fd = self._read_fd, self._write_fd
        self._read_fd = self._write_fd = -1  # first, so that a late set() writes nowhere
        for fd in (read_fd, write_fd):
            if fd >= 0:
                os.close(fd)


@contextlib.contextmanager
def stop_on_signals(*signums: int) -> Iterator[StopFlag]:
    """A StopFlag that each of `signums` sets, for the `with` block (main thread only, as every
    signal handler); the previous handlers and wakeup fd are put back on the way out."""
    stop = StopFlag()
    previous = {}
    previous_wakeup_fd = None
    try:
        previous_wakeup_fd = signal.set_wakeup_fd(stop._write_fd, warn_on_full_buffer=False)
        for signum in signums:
            previous[signum] = signal.signal(signum, lambda _signum, _frame: stop.set())
        yield stop
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if previous_wakeup_fd is not None:
            signal.set_wakeup_fd(previous_wakeup_fd)
        stop.close()
