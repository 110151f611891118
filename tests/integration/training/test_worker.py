"""The training worker as it really runs: torchrun, gloo, megatron-core on CPU.

Every test starts real worker processes on the shared tiny prepared data
(conftest.py). Fault tests start the worker directly (`python -m training.train`,
a world of one) so the process's own exit code is seen; the others go through
torchrun with 2 ranks.
"""

from __future__ import annotations

import copy
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from infra import runfiles
from training.cli import torchrun_command
from training.runlog import read_steps

REPO = Path(__file__).resolve().parents[3]
TIMEOUT_S = 300  # generous: the machine is small and shared


def write_spec(job: dict, tmp_path: Path, name: str, **sections) -> Path:
    spec = copy.deepcopy(job)
    spec["name"] = name
    spec["run_dir"] = str(tmp_path / name)
    spec["checkpoint"] = {**spec["checkpoint"], "url": str(tmp_path / name / "ckpt"),
                          "async_save": False}
    for section, values in sections.items():
        spec[section] = {**spec.get(section, {}), **values}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def worker_env(fault: str | None = None) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("FORGEFLOW_FAULT", None)
    if fault:
        env["FORGEFLOW_FAULT"] = fault
    return env


def torchrun_cmd(spec: Path, nproc: int, *, plain: bool = False) -> list[str]:
    """The worker on `nproc` ranks as `forgeflow train` starts it (infra.torchrun, ranks forked from
    its agent), or (`plain`) under PyTorch's own torchrun, as training.train's docstring runs it."""
    cmd = torchrun_command(str(spec), nproc, [])
    if plain:
        cmd[cmd.index("infra.torchrun")] = "torch.distributed.run"
    return cmd


def torchrun(spec: Path, nproc: int, fault: str | None = None, *,
             plain: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run(torchrun_cmd(spec, nproc, plain=plain), cwd=REPO, env=worker_env(fault),
                          capture_output=True, text=True, timeout=TIMEOUT_S)


def worker(spec: Path, fault: str | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "training.train", str(spec)]
    return subprocess.run(cmd, cwd=REPO, env=worker_env(fault), capture_output=True, text=True,
                          timeout=TIMEOUT_S)


def run_dir(spec: Path) -> Path:
    return Path(yaml.safe_load(spec.read_text())["run_dir"])


def logged_losses(spec: Path, rank: int = 0) -> list[str]:
    """The exact loss text of each step line, in file order (restarts included)."""
    text = runfiles.log_path(run_dir(spec), rank).read_text()
    return re.findall(r" step=(\d+) loss=(\S+) ", text)


def checkpoint_tensors(root: Path, step: int) -> dict:
    """Every saved tensor piece of a committed step, by key and global offset."""
    from checkpoint.manifest import read_manifest
    from checkpoint.shard import read_shard
    from infra.storage import open_storage

    storage = open_storage(str(root))
    out = {}
    for record in read_manifest(storage, step).shards:
        _, state = read_shard(storage.get_bytes(record.key))
        for piece in state["pieces"]:
            if not piece["object"]:
                out[f"{piece['key']}@{tuple(piece['global_offset'])}"] = piece["data"]
    return out


def committed(root: Path) -> list[int]:
    from checkpoint.manifest import committed_checkpoints

    return [r.step for r in committed_checkpoints(str(root))]


def explain(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-6000:]}"


# --- a real 2-rank data-parallel run -------------------------------------------------------------

@pytest.fixture(scope="module")
def dp2_run(tiny_job_dict, tiny_prepared, tmp_path_factory) -> Path:
    """One plain 2-rank data-parallel run of 12 steps (checkpoints at 6 and 12), shared; under
    PyTorch's own torchrun (a new interpreter per rank), as a user may start the worker."""
    tmp = tmp_path_factory.mktemp("dp2")
    spec = write_spec(tiny_job_dict, tmp, "dp2", training={"steps": 12},
                      checkpoint={"interval": 6})
    proc = torchrun(spec, nproc=2, plain=True)
    assert proc.returncode == 0, explain(proc)
    assert "Traceback" not in proc.stderr
    return spec


def test_two_ranks_train_log_heartbeat_and_checkpoint(dp2_run):
    spec = dp2_run
    rd = run_dir(spec)
    ranks = [read_steps(runfiles.log_path(rd, r)) for r in (0, 1)]
    assert [r.step for r in ranks[0]] == list(range(1, 13))
    # the logged loss is the data-parallel mean: both ranks log the same value
    assert [r.loss for r in ranks[0]] == [r.loss for r in ranks[1]]
    losses = [r.loss for r in ranks[0]]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.1, losses
    assert all(r.tokens_per_s > 0 and r.grad_norm > 0 for r in ranks[0])
    for r in (0, 1):
        beat = runfiles.read_heartbeat(runfiles.heartbeat_path(rd, r))
        assert beat.step == 12 and beat.rank == r
    assert json.loads(runfiles.finished_marker_path(rd).read_text())["step"] == 12
    assert committed(rd / "ckpt") == [6, 12]


def test_rank0_writes_the_steps_metrics_to_tensorboard(dp2_run):
    """TensorBoard event files by default, under the run directory, from rank 0 only; read back
    with TensorBoard's EventAccumulator they match the run log step for step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logdir = run_dir(dp2_run) / "tensorboard" / "train"
    assert len(list(logdir.glob("events.out.tfevents.*"))) == 1  # one writer: rank 0's
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    logged = read_steps(runfiles.log_path(run_dir(dp2_run), 0))
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [r.step for r in logged] == list(range(1, 13))
    assert [e.value for e in loss] == pytest.approx([r.loss for r in logged], rel=1e-6)  # float32 in TB
    assert [e.value for e in acc.Scalars("train/lr")] == pytest.approx([r.lr for r in logged], rel=1e-3)
    for tag in ("train/grad_norm", "train/tokens_per_s", "memory/host_rss_gib"):
        assert len(acc.Scalars(tag)) == 12 and all(e.value > 0 for e in acc.Scalars(tag)), tag
    assert [e.step for e in acc.Scalars("checkpoint/stall_s")] == [6, 12]


# --- exact resume --------------------------------------------------------------------------------

def test_resume_after_a_kill_continues_bit_for_bit(dp2_run, tiny_job_dict, tmp_path):
    # The uninterrupted run is the module's dp2_run (12 steps, checkpoints at 6 and 12): the
    # same job as below but for its fault, so one torchrun launch less than a run of its own.
    straight = dp2_run

    # Same job, SIGKILLed right after its step-6 checkpoint; the restart keeps the same
    # FORGEFLOW_FAULT, which must not fire again (it already fired in this run directory).
    resumed = write_spec(tiny_job_dict, tmp_path, "resumed", training={"steps": 12},
                         checkpoint={"interval": 6})
    killed = torchrun(resumed, nproc=2, fault="oom_kill@6")
    assert killed.returncode != 0
    assert "Signal 9 (SIGKILL)" in killed.stderr, explain(killed)
    assert [s for s, _ in logged_losses(resumed)][-1] == "6"
    proc = torchrun(resumed, nproc=2, fault="oom_kill@6")
    assert proc.returncode == 0, explain(proc)
    assert "event=resumed step=6" in runfiles.log_path(run_dir(resumed), 0).read_text()

    expected = logged_losses(straight)
    assert len(expected) == 12
    got = logged_losses(resumed)
    assert got[:6] == expected[:6] and got[6:] == expected[6:]  # killed run, then resumed run
    for rank in (0, 1):
        assert logged_losses(resumed, rank)[6:] == logged_losses(straight, rank)[6:]

    a = checkpoint_tensors(run_dir(straight) / "ckpt", 12)
    b = checkpoint_tensors(run_dir(resumed) / "ckpt", 12)
    assert a.keys() == b.keys() and any(k.startswith("optimizer.") for k in a)
    different = [k for k in a if not (a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
                                      and bool((a[k] == b[k]).all()))]
    assert different == []  # weights and Adam moments identical to the last bit


def test_distributed_optimizer_trains_identically_and_resumes_bit_for_bit(
        dp2_run, tiny_job_dict, tmp_path):
    plain = dp2_run
    # megatron's DistributedOptimizer (Adam state sharded over the 2 data-parallel ranks),
    # SIGKILLed after its step-6 checkpoint and resumed
    sharded = write_spec(tiny_job_dict, tmp_path, "sharded",
                         training={"steps": 12, "use_distributed_optimizer": True},
                         checkpoint={"interval": 6})
    killed = torchrun(sharded, nproc=2, fault="oom_kill@6")
    assert killed.returncode != 0 and "Signal 9 (SIGKILL)" in killed.stderr, explain(killed)
    proc = torchrun(sharded, nproc=2, fault="oom_kill@6")
    assert proc.returncode == 0, explain(proc)
    assert "event=resumed step=6" in runfiles.log_path(run_dir(sharded), 0).read_text()
    # same losses to the last printed digit as the unsharded optimizer, across the resume
    assert logged_losses(sharded) == logged_losses(plain)


# --- fault injection ------------------------------------------------------------------------------

def test_cuda_error_fault_prints_pytorchs_cuda_error(tiny_job_dict, tiny_prepared, tmp_path):
    spec = write_spec(tiny_job_dict, tmp_path, "cuda", training={"steps": 10})
    proc = worker(spec, fault="cuda_error@3")
    assert proc.returncode == runfiles.EXIT_EXCEPTION, explain(proc)
    assert "Traceback (most recent call last):" in proc.stderr
    assert "CUDA error: an illegal memory access was encountered\n" in proc.stderr
    assert ("CUDA kernel errors might be asynchronously reported at some other API call, "
            "so the stacktrace below might be incorrect.") in proc.stderr
    assert "For debugging consider passing CUDA_LAUNCH_BLOCKING=1" in proc.stderr
    # torch.distributed's excepthook prefixes an uncaught exception's lines with "[rankN]: ".
    assert re.search(r"^(\[rank0\]: )?torch\.AcceleratorError: CUDA error: an illegal memory",
                     proc.stderr, re.M), proc.stderr
    assert [s for s, _ in logged_losses(spec)][-1] == "3"


def test_script_error_fault_prints_a_key_error_traceback(tiny_job_dict, tiny_prepared, tmp_path):
    spec = write_spec(tiny_job_dict, tmp_path, "script", training={"steps": 10})
    proc = worker(spec, fault="script_error@2")
    assert proc.returncode == runfiles.EXIT_EXCEPTION, explain(proc)
    assert "Traceback (most recent call last):" in proc.stderr
    assert re.search(r"^(\[rank0\]: )?KeyError: 'attention_mask'$", proc.stderr, re.M), proc.stderr


def test_oom_kill_fault_dies_by_sigkill_silently(tiny_job_dict, tiny_prepared, tmp_path):
    spec = write_spec(tiny_job_dict, tmp_path, "oom", training={"steps": 10})
    proc = worker(spec, fault="oom_kill@3")
    assert proc.returncode == -signal.SIGKILL, explain(proc)
    assert "Traceback" not in proc.stderr and "Error" not in proc.stderr
    assert [s for s, _ in logged_losses(spec)][-1] == "3"


def test_exit_mid_checkpoint_leaves_no_complete_checkpoint_and_a_restart_recovers(
        tiny_job_dict, tiny_prepared, tmp_path):
    spec = write_spec(tiny_job_dict, tmp_path, "midckpt", training={"steps": 8},
                      checkpoint={"interval": 4})
    proc = worker(spec, fault="exit_mid_checkpoint@4")
    assert proc.returncode == runfiles.EXIT_FAULT_MID_CHECKPOINT, explain(proc)
    ckpt = run_dir(spec) / "ckpt"
    assert committed(ckpt) == [] and (ckpt / "step-00000004").is_dir()  # shards, no manifest
    again = worker(spec, fault="exit_mid_checkpoint@4")  # fired once already: runs through
    assert again.returncode == 0, explain(again)
    assert committed(ckpt) == [4, 8]
    assert "event=resumed" not in runfiles.log_path(run_dir(spec), 0).read_text()


@pytest.fixture(scope="module")
def spike_run(tiny_job_dict, tiny_prepared, tmp_path_factory):
    """One worker of 16 steps (checkpoints every 4) whose logged loss is 8x from step 11 on
    (loss_spike@10): the detector trips and the worker exits. Shared by the fault test, which
    checks what the worker printed, wrote and logged (read here, before the rollback test
    resumes the same run directory), and the rollback test, which resumes it."""
    spec = write_spec(tiny_job_dict, tmp_path_factory.mktemp("spike"), "spike-skip",
                      training={"steps": 16}, checkpoint={"interval": 4},
                      spike={"enabled": True, "min_history": 5, "window": 20, "patience": 3,
                             "z_threshold": 6.0})
    proc = worker(spec, fault="loss_spike@10")
    marker = runfiles.spike_marker_path(run_dir(spec))
    return {"spec": spec, "proc": proc, "marker": marker.read_text() if marker.exists() else None,
            "logged_steps": [s for s, _ in logged_losses(spec)]}


def test_loss_spike_fault_trips_the_detector_writes_the_marker_and_exits(spike_run):
    proc = spike_run["proc"]
    assert proc.returncode == runfiles.EXIT_LOSS_SPIKE, explain(proc)
    marker = json.loads(spike_run["marker"])
    assert marker["onset_step"] == 11 and marker["last_healthy_step"] == 10
    assert re.search(r"^FORGEFLOW_LOSS_SPIKE onset_step=11 last_healthy_step=10 ", proc.stderr,
                     re.M), proc.stderr
    assert spike_run["logged_steps"][-1] == "13"  # onset + patience - 1, of 16 steps


def test_hang_fault_stops_progress_and_heartbeats(tiny_job_dict, tiny_prepared, tmp_path):
    spec = write_spec(tiny_job_dict, tmp_path, "hang", training={"steps": 100_000},
                      checkpoint={"interval": 100_000})
    beat_path = runfiles.heartbeat_path(run_dir(spec), 0)
    proc = subprocess.Popen([sys.executable, "-m", "training.train", str(spec)], cwd=REPO,
                            env=worker_env("hang@3"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while getattr(runfiles.read_heartbeat(beat_path), "step", None) != 3:
            assert proc.poll() is None, explain(subprocess.CompletedProcess([], proc.returncode,
                                                                            *proc.communicate()))
            assert time.monotonic() < deadline, "the worker never reached step 3"
            time.sleep(0.2)
        first = runfiles.read_heartbeat(beat_path)
        time.sleep(3)  # a healthy worker would do many steps in this time
        assert proc.poll() is None  # still alive ...
        assert runfiles.read_heartbeat(beat_path) == first  # ... but its heartbeat stopped
        assert [s for s, _ in logged_losses(spec)][-1] == "3"
    finally:
        proc.kill()
        out, err = proc.communicate()
    assert "Traceback" not in err


# --- tensor parallel 2 on CPU/gloo -----------------------------------------------------------------

def test_tensor_parallel_2_trains_the_same_model(tiny_job_dict, tiny_prepared, tmp_path):
    tp1 = write_spec(tiny_job_dict, tmp_path, "tp1", training={"steps": 3})
    proc = worker(tp1)
    assert proc.returncode == 0, explain(proc)
    # tp=2 also runs the fused SDPA core attention (tp=1 the unfused local kernel): each rank
    # holds half the heads, and the curve must still be tp=1's
    tp2 = write_spec(tiny_job_dict, tmp_path, "tp2", training={"steps": 10, "tensor_parallel": 2,
                                                                "attention": "sdpa"})
    proc = torchrun(tp2, nproc=2)
    assert proc.returncode == 0, explain(proc)
    losses = [r.loss for r in read_steps(runfiles.log_path(run_dir(tp2), 0))]
    rank1 = [r.loss for r in read_steps(runfiles.log_path(run_dir(tp2), 1))]
    assert len(losses) == 10 and losses == rank1
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.1, losses
    started = [line for line in runfiles.log_path(run_dir(tp2), 0).read_text().splitlines()
               if "event=started" in line]
    assert len(started) == 1 and "attention=sdpa" in started[0], started
    # Same seed, same global batches: splitting the layers over 2 ranks changes only
    # float summation order, so the curve matches tp=1 closely (not bitwise).
    reference = [r.loss for r in read_steps(runfiles.log_path(run_dir(tp1), 0))]
    assert losses[:3] == pytest.approx(reference, rel=1e-4)


# --- graceful stop ------------------------------------------------------------------------------

def test_sigterm_drill_commits_the_stop_step_and_the_next_run_resumes_bit_exact(
        dp2_run, tiny_job_dict, tmp_path):
    """SIGTERM to every rank mid-run (as the launcher's reaper, Slurm or a Prefect
    cancellation sends it): each rank finishes its step, the checkpoint of that step is
    committed, the ranks exit EXIT_STOPPED; the next run resumes there and its losses are
    the uninterrupted run's (dp2_run, same job) to the last printed digit."""
    import psutil

    spec = write_spec(tiny_job_dict, tmp_path, "stopped", training={"steps": 12},
                      checkpoint={"interval": 6})
    rd = run_dir(spec)
    # under PyTorch's torchrun: its failure table then has a row per rank (for ranks forked by
    # infra.torchrun it lists the first to exit only), so each rank's exit code is checked
    proc = subprocess.Popen(torchrun_cmd(spec, 2, plain=True), cwd=REPO, env=worker_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while getattr(runfiles.read_heartbeat(runfiles.heartbeat_path(rd, 0)), "step", 0) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, "never reached step 2"
            time.sleep(0.1)
        ranks = psutil.Process(proc.pid).children()
        assert len(ranks) == 2
        for rank in ranks:
            rank.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    stop = runfiles.read_stop_marker(rd)
    assert stop is not None and 2 <= stop.step < 12 and stop.checkpoint_step == stop.step, err[-3000:]
    assert stop.signal == "SIGTERM"
    # torchrun reports both workers' own exit code: "stopped", not a crash. Its failure
    # table has one "exitcode  : N (pid: ...)" row per rank; its agent may also log
    # "failed (exitcode: N)" once, so count the table rows and check no other code appears.
    table = re.findall(r"exitcode\s+:\s*(-?\d+) \(pid", err)
    assert sorted(table) == [str(runfiles.EXIT_STOPPED)] * 2, err[-3000:]
    assert set(re.findall(r"exitcode\s*:\s*(-?\d+)", err)) == {str(runfiles.EXIT_STOPPED)}, err[-3000:]
    for rank in (0, 1):
        log = runfiles.log_path(rd, rank).read_text()
        assert f"event=checkpoint_saved step={stop.step}" in log
        assert f"event=stopped step={stop.step}" in log
        assert [s for s, _ in logged_losses(spec, rank)][-1] == str(stop.step)  # finished its step

    proc = torchrun(spec, nproc=2)
    assert proc.returncode == 0, explain(proc)
    assert f"event=resumed step={stop.step}" in runfiles.log_path(rd, 0).read_text()
    for rank in (0, 1):
        assert logged_losses(spec, rank) == logged_losses(dp2_run, rank)


# --- loss-spike rollback aligned to the spike -------------------------------------------------------

def test_spike_rollback_replays_to_the_onset_and_never_trains_the_spikes_batches(spike_run):
    """The decision table picks the checkpoint before the onset; the worker replays the
    steps up to the onset with their own batches and skips K batches from the onset's."""
    from checkpoint.manifest import committed_checkpoints
    from diagnosis.recovery import FailureRecord, RecoveryHistory, RecoveryPolicy, next_attempt
    from diagnosis.vocabulary import Diagnosis
    from training.config import load_job_spec

    spec, first = spike_run["spec"], spike_run["proc"]  # the loss logged from step 11 on is 8x
    assert first.returncode == runfiles.EXIT_LOSS_SPIKE, explain(first)
    onset = runfiles.read_spike_marker(run_dir(spec)).onset_step
    assert onset == 11
    history = RecoveryHistory([FailureRecord("LossSpike", 13)])
    decided = next_attempt(Diagnosis("LossSpike", "training", True), 13, history,
                           RecoveryPolicy(skip_batches=3), spike_onset_step=onset,
                           committed_steps=lambda: [c.step for c in committed_checkpoints(
                               load_job_spec(spec).checkpoint)])
    assert decided.resume_from == 8 and decided.overrides.skip_from_step == 11
    # the worker arguments scheduler.worker_command.worker_args makes of these overrides
    cmd = [sys.executable, "-m", "training.train", str(spec), "--resume-from-step", "8",
           "--set", f"spike.skip_batches={decided.overrides.skip_batches}",
           "--set", f"spike.skip_from_step={decided.overrides.skip_from_step}"]
    second = subprocess.run(cmd, cwd=REPO, env=worker_env("loss_spike@10"), capture_output=True,
                            text=True, timeout=TIMEOUT_S)
    assert second.returncode == 0, explain(second)

    records = read_steps(runfiles.log_path(run_dir(spec), 0), latest_only=False)
    before, after = records[:13], records[13:]
    assert [(r.step, r.batch) for r in before] == [(s, s - 1) for s in range(1, 14)]
    spike_batches = {10, 11, 12}  # the 3 batches from the one step 11 (the onset) trained
    assert [(r.step, r.batch) for r in after] == [(9, 8), (10, 9), (11, 13), (12, 14), (13, 15),
                                                  (14, 16), (15, 17), (16, 18)]
    assert not spike_batches & {r.batch for r in after}
    # the replayed steps before the onset are the same training, to the last printed digit
    assert [r.loss for r in after[:2]] == [r.loss for r in before[8:10]]


# --- a save after a peer's failure ------------------------------------------------------------------

def test_when_a_peer_dies_mid_step_the_survivor_commits_the_last_completed_step(
        dp2_run, tiny_job_dict, tmp_path):
    # Rank 1 is SIGKILLed after step 8, between checkpoints (6 and 12); rank 0 fails in step 9's
    # gradient all-reduce, before any update: its state is step 8's, a whole replica (data
    # parallel only), so it commits step 8 alone before it exits, and the restart loses nothing.
    spec = write_spec(tiny_job_dict, tmp_path, "survivor", training={"steps": 12},
                      checkpoint={"interval": 6})
    killed = torchrun(spec, nproc=2, fault="oom_kill@8:1")
    assert killed.returncode != 0, explain(killed)
    ckpt = run_dir(spec) / "ckpt"
    assert committed(ckpt) == [6, 8], explain(killed)
    rank0 = runfiles.log_path(run_dir(spec), 0).read_text()
    assert re.search(r"event=save_after_failure step=8 saved=True why=saved", rank0), rank0[-2000:]
    assert "rank 0 committed step 8 before exiting" in killed.stderr

    from checkpoint.manifest import read_manifest
    from infra.storage import open_storage

    manifest = read_manifest(open_storage(str(ckpt)), 8)
    assert manifest.world_size == 1 and manifest.layout == {"dp": 1, "tp": 1, "pp": 1}

    proc = torchrun(spec, nproc=2, fault="oom_kill@8:1")  # fired once: runs through
    assert proc.returncode == 0, explain(proc)
    assert "event=resumed step=8" in runfiles.log_path(run_dir(spec), 0).read_text()
    # the losses and the step-12 weights and Adam moments are the uninterrupted run's, to the bit
    assert logged_losses(spec)[:8] + logged_losses(spec)[-4:] == logged_losses(dp2_run)
    a = checkpoint_tensors(run_dir(dp2_run) / "ckpt", 12)
    b = checkpoint_tensors(ckpt, 12)
    assert a.keys() == b.keys()
    assert [k for k in a if not bool((a[k] == b[k]).all())] == []


def test_of_several_survivors_the_first_to_claim_the_step_in_torchruns_store_saves_it(
        tiny_job_dict, tiny_prepared, tmp_path):
    spec = write_spec(tiny_job_dict, tmp_path, "four", training={"steps": 12}, checkpoint={"interval": 6})
    killed = torchrun(spec, nproc=4, fault="oom_kill@8:2")
    assert killed.returncode != 0, explain(killed)
    assert committed(run_dir(spec) / "ckpt") == [6, 8], explain(killed)
    outcomes = {rank: re.findall(r"event=save_after_failure step=8 saved=(\w+) why=(\w+)",
                                 runfiles.log_path(run_dir(spec), rank).read_text()) for rank in (0, 1, 3)}
    assert sorted(o for found in outcomes.values() for o in found) == [
        ("False", "another_rank_saves"), ("False", "another_rank_saves"), ("True", "saved")], outcomes


def test_no_save_after_a_failure_where_no_rank_holds_the_whole_state(tiny_job_dict, tiny_prepared, tmp_path):
    # With the distributed optimizer each rank holds half the Adam state: nobody may commit alone.
    spec = write_spec(tiny_job_dict, tmp_path, "zero", training={"steps": 12, "use_distributed_optimizer": True},
                      checkpoint={"interval": 6})
    killed = torchrun(spec, nproc=2, fault="oom_kill@8:1")
    assert killed.returncode != 0, explain(killed)
    assert committed(run_dir(spec) / "ckpt") == [6]
    rank0 = runfiles.log_path(run_dir(spec), 0).read_text()
    assert "event=save_after_failure step=8 saved=False why=no_whole_replica" in rank0, explain(killed)
