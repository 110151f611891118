"""SIGKILL of the reaper (infra/reaper.py, which supervises torchrun for the local launcher) ends
with the job finished and no process of the killed attempt left behind (issue 33).

Before, torchrun and its ranks outlived a SIGKILLed reaper: they trained on to the end and wrote
the finished marker while the flow read the node's -9 as a failure and restarted, so two sets of
ranks trained (and checkpointed) the same job. Now torchrun dies with the reaper (its
parent-death SIGTERM: its agent stops the ranks, which commit the step they are on) and the
launcher ends whatever is left through the reaper's process group. The flow sees a failure,
restarts once from the committed step, and every step is trained exactly once.

Real torchrun (gloo, the tiny job), a real Prefect API and state database; the kill is the one
thing injected."""

from __future__ import annotations

import os
import signal
import threading

import psutil

from flows.pretrain import pretrain
from infra import runfiles
from testing.node_faults import after_step
from training.config import load_job_spec
from training.runlog import event_steps, read_steps

KILL_AFTER, STEPS = 10, 40


def _kill_the_reaper_after(run_dir, step: int, killed: dict[int, list[int]], done: threading.Event) -> None:
    """SIGKILL the reaper (this process's descendant `python -m infra.reaper`) once a rank reports
    `step`; `killed`: reaper pid -> the pids of its tree (torchrun and ranks) at that moment."""
    reached = after_step(run_dir, step)
    while not done.wait(0.02):
        if not reached():
            continue
        for proc in psutil.Process().children(recursive=True):
            try:
                if proc.cmdline()[1:3] == ["-m", "infra.reaper"]:
                    tree = [p.pid for p in proc.children(recursive=True)]
                    os.kill(proc.pid, signal.SIGKILL)
                    killed[proc.pid] = tree
            except (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError):
                continue
        if killed:
            return



def test_a_sigkilled_reaper_is_a_failure_recovered_from_with_no_process_left_behind(prefect_api, make_job):
    job = make_job("reaper-killed", training={"steps": STEPS, "lr_decay_steps": STEPS})
    run_dir = load_job_spec(job).resolved_run_dir
    killed: dict[int, list[int]] = {}
    done = threading.Event()
    killer = threading.Thread(target=_kill_the_reaper_after, args=(run_dir, KILL_AFTER, killed, done), daemon=True)
    killer.start()
    try:
        result = pretrain(str(job), backoff_s=30)
    finally:
        done.set()
        killer.join()
    assert len(killed) == 1, "the reaper was never killed"
    (tree,) = killed.values()
    assert len(tree) >= 2, tree  # torchrun and its rank(s)
    alive = [p for p in tree if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"processes of the killed attempt outlived it: {alive}"

    # a failure (the node's -9), not a finish by orphans: restarted once, finished by attempt 1
    assert result.finished and result.final_step == STEPS and result.attempts == 2, result
    (failure,) = result.failures
    assert failure.status == "failed", failure
    log = runfiles.log_path(run_dir, 0)
    stopped, resumed = event_steps(log, "stopped"), event_steps(log, "resumed")
    assert len(stopped) == 1 and stopped[0] >= KILL_AFTER and resumed == stopped, (stopped, resumed)
    # every step trained exactly once: no orphaned ranks trained on beside the restart
    assert [r.step for r in read_steps(log, latest_only=False)] == list(range(1, STEPS + 1))
    assert event_steps(log, "finished") == [STEPS]
