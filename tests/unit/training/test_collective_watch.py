"""training.collective_watch: which collective a rank's main thread waits in, sampled from its stack."""

from __future__ import annotations

import os
import sys
import threading

from infra import runfiles
from training.collective_watch import CollectiveWatch, collective_of

FAKE_C10D = f"{os.sep}venv{os.sep}torch{os.sep}distributed{os.sep}distributed_c10d.py"


def _in_fake_all_reduce(inside):
    """Call `inside` from a function whose code says it is torch.distributed's all_reduce."""
    namespace: dict = {}
    exec(compile("def all_reduce(f):\n    return f()\n", FAKE_C10D, "exec"), namespace)
    return namespace["all_reduce"](inside)


def test_the_innermost_torch_distributed_frame_names_the_collective():
    assert collective_of(sys._getframe()) is None
    seen = []
    _in_fake_all_reduce(lambda: seen.append(collective_of(sys._getframe())))
    assert seen == ["all_reduce"]


def test_the_launchers_frames_under_a_forked_ranks_code_are_not_a_collective():
    """A rank forked from its torchrun agent (infra.torchrun) runs on top of the agent's frames:
    torch.distributed's run.py, launcher and elastic agent are at the bottom of its stack."""
    namespace: dict = {}
    launcher = f"{os.sep}venv{os.sep}torch{os.sep}distributed{os.sep}elastic{os.sep}multiprocessing{os.sep}api.py"
    exec(compile("def _wrap(f):\n    return f()\n", launcher, "exec"), namespace)
    seen = []
    namespace["_wrap"](lambda: seen.append(collective_of(sys._getframe())))  # the rank's own code: no collective
    namespace["_wrap"](lambda: _in_fake_all_reduce(lambda: seen.append(collective_of(sys._getframe()))))
    assert seen == [None, "all_reduce"]


def test_the_watch_samples_the_thread_that_made_it_and_keeps_since_while_the_state_holds(tmp_path):
    entered, release, samples = threading.Event(), threading.Event(), []

    def loop():  # the "training loop": makes the watch, then waits in a collective
        watch = CollectiveWatch(tmp_path, 1, interval_s=3600)  # sampled by hand below
        samples.append(watch.sample())
        holder.append(watch)

        def wait():
            entered.set()
            release.wait(30)
        _in_fake_all_reduce(wait)

    holder: list = []
    thread = threading.Thread(target=loop)
    thread.start()
    try:
        assert entered.wait(30)
        watch = holder[0]
        first, second = watch.sample(), watch.sample()
        assert samples[0]["collective"] is None
        assert first["collective"] == second["collective"] == "all_reduce"
        assert second["since"] == first["since"] <= second["time"]  # the same wait: since holds
        watch.step = 4  # a new step is a new state
        assert watch.sample()["since"] > first["since"]
        assert runfiles.read_wheres(tmp_path)[1].collective == "all_reduce"
    finally:
        release.set()
        thread.join()
