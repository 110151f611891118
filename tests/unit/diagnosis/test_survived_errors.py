"""The error a job died of names the cause; errors it went on past are context.

A long job logs errors it survives (a side process that could not start, a respawned
DataLoader worker, a batch skipped after an OOM) hours before the failure that ends it.
An error-free stretch of training progress after an error (step lines,
``signals.PROGRESS_PATTERN``) marks it survived, and a survived error gives way to the
errors at the end of the job, whatever their precedence tier. A cause logged just
before its symptoms (an Xid, then NCCL timeouts while the job hangs) has no progress
after it and still wins, and so does the last error of a log.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from diagnosis.api import compress_log, diagnose_log
from diagnosis.signals import PROGRESS_STRETCH_LINES

T0 = datetime(2026, 11, 22, 8, 0, 0)
OOM = ("[rank5]:torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.91 GiB. GPU 5 has a total "
       "capacity of 79.11 GiB of which 2.88 GiB is free. Of the allocated memory 70.12 GiB is allocated by PyTorch")
TIMEOUT = ("[rank{r}]:[E1122 {t} 2281 ProcessGroupNCCL.cpp:616] [Rank {r}] Watchdog caught collective operation "
           "timeout: WorkNCCL(SeqNum=62935, OpType=ALLREDUCE, NumelIn=52428800, NumelOut=52428800, "
           "Timeout(ms)=600000) ran for 600012 milliseconds before timing out.")


def iso(t: datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def steps(first: int, n: int, t: datetime, ranks: int = 1) -> tuple[list[str], datetime]:
    """forgeflow's per-step metric lines (and an NCCL INFO line now and then), one step per 2 s."""
    lines = []
    for step in range(first, first + n):
        t += timedelta(seconds=2)
        for r in range(ranks):
            lines.append(f"[rank{r}]:{iso(t)} rank={r} step={step} loss={3.2 - step * 1e-4:.6f} lr=3.000e-04 "
                         f"grad_norm=0.52 tokens_per_s=11234.5 elapsed_s={2.0 * step:.1f}")
        if step % 50 == 0:
            lines.append(f"node-a01:2281:2401 [0] NCCL INFO comm 0x55d1c2a0 rank 0 nranks 16 cudaDev 0 busId 1b000 - Init COMPLETE")
    return lines, t


def oom_death(t: datetime) -> list[str]:
    """Rank 5 runs out of memory; the others time out in the next all-reduce; torchrun gives up."""
    stamp = (t + timedelta(minutes=10)).strftime("%m%d %H:%M:%S.000000")
    return [
        "[rank5]:Traceback (most recent call last):",
        '[rank5]:  File "/workspace/forgeflow/training/loop.py", line 171, in train',
        "[rank5]:    loss = train_step(model, batch, optimizer)",
        OOM,
        *[TIMEOUT.format(r=r, t=stamp) for r in range(16) if r != 5],
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
        "  exitcode  : 1 (pid: 2626)",
    ]


def write(tmp_path, lines, name="job.log"):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


def test_errors_the_job_went_on_past_give_way_to_the_oom_it_died_of(tmp_path, state):
    early, t = steps(1, 400, T0)
    middle, t = steps(401, 300, t)
    late, t = steps(701, 300, t)
    path = write(tmp_path, [
        *early,
        # a sidecar built for another driver fails to start (hardware tier: CUDAError) ...
        "CUDA driver version is insufficient for CUDA runtime version",
        *middle,
        # ... and a DataLoader worker dies and is respawned; training goes on past both
        "[rank3]:   DataLoader worker (pid(s) 30863) exited unexpectedly",
        *late,
        *oom_death(t),
    ])
    d = diagnose_log(path)
    assert (d.root_cause, d.restart_helps) == ("OutOfMemoryError", False)
    assert d.culprit_lines == [OOM] and d.suspect_ranks == [5]
    assert d.confidence == 0.9  # a cause the job died of: no discount

    # without the progress after them, the same errors are part of the failure and the
    # hardware tier wins as before
    assert diagnose_log(write(tmp_path, [*early, "CUDA driver version is insufficient for CUDA runtime version",
                                         *oom_death(t)], "tight.log")).root_cause == "CUDAError"


def test_a_cause_logged_before_its_symptoms_still_wins(tmp_path, state):
    # Xid 79, then the step lines the other ranks had in flight, then the hang's timeouts
    before, t = steps(1, 400, T0)
    in_flight, _ = steps(401, 1, t, ranks=16)
    stamp = (t + timedelta(minutes=10)).strftime("%m%d %H:%M:%S.000000")
    path = write(tmp_path, [
        *before,
        f"{t:%b %d %H:%M:%S} node-a02 kernel: NVRM: Xid (PCI:0000:3b:00): 79, pid=2281, GPU has fallen off the bus.",
        *[line for line in in_flight if not line.startswith("[rank9]")],
        *[TIMEOUT.format(r=r, t=stamp) for r in range(16) if r != 9],
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
    ])
    d = diagnose_log(path)
    assert (d.root_cause, d.restart_helps, d.confidence) == ("NodeFailure", True, 0.9)


def test_a_later_node_pasted_below_is_no_progress_after_an_earlier_error(tmp_path, state):
    # two nodes' logs one after the other: node 2's step lines come later in the file
    # but earlier in time than node 1's Xid, so the Xid was not survived
    node1, t1 = steps(1, 300, T0)
    node2, t2 = steps(1, PROGRESS_STRETCH_LINES + 100, T0)
    xid = f"{iso(t1)} node-a01 kernel: NVRM: Xid (PCI:0000:3b:00): 79, pid=2281, GPU has fallen off the bus."
    oom = f"{iso(t2)} {OOM}"
    path = write(tmp_path, [*node1, xid, *node2, oom])
    compressed, _, _ = compress_log(path)
    entry = next(e for e in compressed.signal_entries() if "Xid" in e.text)
    end = compressed.stats.lines_in
    assert not compressed.progress_after(entry, end, 30.0)
    d = diagnose_log(path)
    assert (d.root_cause, d.confidence) == ("NodeFailure", 0.9)

    # the same lines with node 2 really running on after the Xid: survived
    later, t3 = steps(301, PROGRESS_STRETCH_LINES + 100, t1 + timedelta(minutes=1))
    path = write(tmp_path, [*node1, xid, *later, f"{iso(t3)} {OOM}"], "later.log")
    compressed, _, _ = compress_log(path)
    entry = next(e for e in compressed.signal_entries() if "Xid" in e.text)
    assert compressed.progress_after(entry, end, 30.0)
    assert diagnose_log(path).root_cause == "OutOfMemoryError"


def test_routine_output_printed_through_the_final_failure_is_no_progress(tmp_path, state):
    # another stack's progress lines keep coming between the final failure's error
    # lines (never a long error-free stretch), and after the last of them
    early, t = steps(1, 300, T0)
    noise = [f"{{'loss': {2.0 + i / 100:.4f}, 'learning_rate': 3e-05, 'epoch': 0.{i:02d}}}" for i in range(30)]
    failure = [
        "Nov 22 08:10:00 node-a02 kernel: NVRM: Xid (PCI:0000:3b:00): 79, pid=2281, GPU has fallen off the bus.",
        *noise[:25],
        "[rank3]: RuntimeError: CUDA error: an illegal memory access was encountered",
        *noise[:25],
        OOM,
    ]
    d = diagnose_log(write(tmp_path, [*early, *failure, *noise * 20]))
    # no survival discount; only the one for a rival hardware-tier cause (the CUDA error)
    assert (d.root_cause, d.confidence) == ("NodeFailure", round(0.9 * 0.85, 3))


def test_a_survived_cause_still_outranks_bare_symptoms_with_lower_confidence(tmp_path, state):
    # an OOM the trainer caught (batch skipped), long before a hang that left only timeouts
    early, t = steps(1, 300, T0)
    late, t = steps(301, PROGRESS_STRETCH_LINES + 100, t)
    stamp = (t + timedelta(minutes=10)).strftime("%m%d %H:%M:%S.000000")
    path = write(tmp_path, [*early, OOM, *late, *[TIMEOUT.format(r=r, t=stamp) for r in range(4)]])
    d = diagnose_log(path)
    assert d.root_cause == "OutOfMemoryError" and d.confidence < 0.9


def test_progress_in_another_file_of_the_job_is_not_progress_after_an_error(tmp_path, state):
    # torchrun's output ends in the error; the per-rank file written beside it has no
    # timestamps and merely comes second
    first, _ = steps(1, 10, T0)
    error_file = write(tmp_path, [*first, "CUDA driver version is insufficient for CUDA runtime version"], "torchrun.log")
    rank_file = write(tmp_path, [f"step={s} loss=3.1 lr=3.000e-04 grad_norm=0.5" for s in range(PROGRESS_STRETCH_LINES + 100)],
                      "rank0.log")
    compressed, _, _ = compress_log([error_file, rank_file])
    entry = next(e for e in compressed.signal_entries() if "driver version" in e.text)
    assert len(compressed.file_ends) == 2
    assert not compressed.progress_after(entry, compressed.stats.lines_in + 1, 30.0)
