"""infra.stop_signal: real signals to this process; a wait that never ends fails by the timeout mark."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from infra.stop_signal import StopFlag, stop_on_signals


def _in_select(tid: int) -> bool:
    """Whether thread `tid` of this process sleeps in select/poll (Linux: its wait channel)."""
    return Path(f"/proc/self/task/{tid}/wchan").read_text().startswith("poll_schedule_timeout")


@pytest.mark.timeout(30)
def test_a_signal_to_another_thread_still_ends_the_main_threads_wait():
    """The kernel may hand a process signal to any thread; then only the wakeup fd wakes the
    main thread's select (no EINTR there). Here the signal goes to a helper thread on purpose,
    once the main thread sleeps in its wait."""
    main_tid = threading.main_thread().native_id
    if not Path(f"/proc/self/task/{main_tid}/wchan").is_file():
        pytest.skip("no /proc wait channels here (Linux only)")

    def send() -> None:
        while not _in_select(main_tid):
            time.sleep(0.005)
        signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)

    with stop_on_signals(signal.SIGUSR1) as stop:
        sender = threading.Thread(target=send)
        sender.start()
        assert stop.wait() is True  # no timeout: returns only once the stop was requested
        sender.join()


@pytest.mark.timeout(30)
def test_another_signal_wakes_the_wait_but_does_not_stop_it():
    seen: list[int] = []
    previous = signal.signal(signal.SIGUSR2, lambda signum, _frame: seen.append(signum))
    try:
        with stop_on_signals(signal.SIGUSR1) as stop:
            os.kill(os.getpid(), signal.SIGUSR2)
            assert stop.wait(0.05) is False and seen == [signal.SIGUSR2]
            os.kill(os.getpid(), signal.SIGUSR1)
            assert stop.wait() is True
    finally:
        signal.signal(signal.SIGUSR2, previous)


def test_the_previous_handlers_and_wakeup_fd_are_put_back():
    before = signal.getsignal(signal.SIGUSR1)
    with stop_on_signals(signal.SIGUSR1) as stop:
        assert signal.getsignal(signal.SIGUSR1) is not before
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.wait(5)
    assert signal.getsignal(signal.SIGUSR1) is before
    assert signal.set_wakeup_fd(-1) == -1  # none was set before the block, none after


@pytest.mark.timeout(30)
def test_set_from_another_thread_ends_a_wait_and_a_closed_flag_ignores_it():
    stop = StopFlag()
    threading.Timer(0.05, stop.set).start()
    assert stop.wait() is True
    stop.close()
    late = StopFlag()
    late.close()
    late.set()  # a request after close (a timer, a late signal) is kept and writes to no fd
    assert late.is_set() and late.wait() is True
