"""The pretrain flow against real torchrun training, a real Prefect API and a real HTTP Slack receiver.

Recoverable faults must end in a finished run whose final weights equal those of an
uninterrupted run (for the spike rollback: one that skips the same batches);
unrecoverable ones must stop with the diagnosis alerted.
"""

from __future__ import annotations

import re
import shutil
import socket
from pathlib import Path

import psutil
import pytest
import torch
import yaml

from flows.pretrain import pretrain
from infra.launch import LaunchRequest, LocalLauncher, local_node_launches
from scheduler.cluster import load_inventory
from scheduler.worker_command import plan_overrides
from infra.runfiles import log_path
from training.config import load_job_spec
from training.runlog import events


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model_tensors(job_path, step: int) -> dict[str, torch.Tensor]:
    """The whole model's weights in the job's checkpoint at `step`, whatever layout wrote it
    (the sharded format is read through the export's loader)."""
    from checkpoint.manifest import step_dir
    from training.checkpoint_reader import locate_checkpoint, read_model_state_dict

    spec = load_job_spec(job_path)
    location = locate_checkpoint(f"{spec.checkpoint.url.rstrip('/')}/{step_dir(step)}", spec)
    state, _ = read_model_state_dict(location, spec)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def _assert_same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys() and want
    different = [name for name in want if not torch.equal(got[name], want[name])]
    assert different == []  # bit for bit


def _run_worker(job_path, tmp_path, sets: list[str], nproc: int, extra: list[str] = ()) -> int:
    args = ["-m", "training.train", str(job_path)]
    for item in sets:
        args += ["--set", item]
    request = LaunchRequest("reference", local_node_launches(["ref"], nproc, _port()), args + list(extra),
                            tmp_path / "reference-launch")
    job = LocalLauncher().start(request)
    try:
        return job.wait(timeout=600)["ref"]
    finally:
        job.terminate()


def _plan_sets(spec) -> tuple[list[str], int]:
    """The layout the flow's planner picks for this job on this machine."""
    from scheduler.placement import place_plans
    from scheduler.planner import plan_job, worker_planner_config

    cluster = load_inventory("local")
    placement = place_plans(plan_job(spec, cluster, worker_planner_config(cluster)), cluster, job=spec.name)
    return plan_overrides(placement), placement.world_size


@pytest.fixture(scope="module")
def uninterrupted(tiny_data_dir, tmp_path_factory) -> Path:
    """The reference both bit-exact tests compare with, run once for the module: the tiny
    job on the layout the flow's planner picks, 40 steps, no fault, every 10-step
    checkpoint kept. (TINY_JOB fixes lr_decay_steps, so its step-20 checkpoint is also
    where a run cut at step 20 ends.)"""
    from tests.integration.flows.conftest import TINY_JOB
    from tests.tiny_job import write_tiny_job

    where = tmp_path_factory.mktemp("uninterrupted")
    job = write_tiny_job(TINY_JOB, tiny_data_dir, where, "reference-uninterrupted")
    sets, world = _plan_sets(load_job_spec(job))
    assert _run_worker(job, where, sets, world) == 0
    return job


def _same_layout(job_path, reference) -> tuple[list[str], int]:
    """The layout the planner picks for this job, which must be the reference's."""
    sets, world = _plan_sets(load_job_spec(job_path))
    assert (sets, world) == _plan_sets(load_job_spec(reference))
    return sets, world


def test_infrastructure_error_then_loss_spike_recover_bit_exact(prefect_api, make_job, tmp_path, monkeypatch,
                                                                 uninterrupted):
    from tests.integration.flows.conftest import SlackReceiver

    failing_slack = SlackReceiver(status=500)  # a broken webhook must not break recovery
    monkeypatch.setenv("SLACK_WEBHOOK_URL", failing_slack.url)
    job = make_job("drills")
    try:
        # warm: the rollback's relaunch (resume from step 20, skip the spike's batches) reaches the
        # ranks that waited through their gate
        result = pretrain(str(job), drill_faults=["cuda_error@12:1", "loss_spike@26"], backoff_s=0.5,
                          hang_timeout_s=120, skip_batches=5, warm_standby=True)
    finally:
        failing_slack.close()
    assert result.finished and result.final_step == 40, result
    run_dir = load_job_spec(job).resolved_run_dir
    assert [f["warm"] for f in events(log_path(run_dir, 0), "started")] == ["False", "True", "True"]
    causes = [(f.root_cause, f.step) for f in result.failures]
    assert causes[0] == ("CUDAError", 12)
    assert causes[1][0] == "LossSpike"
    assert "resume from checkpoint step 20" in result.failures[1].action
    assert len(failing_slack.messages) >= 3  # two failures + completion were attempted

    # Reference: the same layout, uninterrupted up to step 20 (the module's uninterrupted run's
    # checkpoint), then skipping the same 5 batches from the spike's onset on (loss_spike@26
    # spikes the loss logged at step 27); steps 21-26 replay theirs.
    from checkpoint.manifest import step_dir

    sets, world = _same_layout(job, uninterrupted)
    ref_job = make_job("reference")
    source = Path(load_job_spec(uninterrupted).checkpoint.url) / step_dir(20)
    shutil.copytree(source, Path(load_job_spec(ref_job).checkpoint.url) / step_dir(20))
    assert _run_worker(ref_job, tmp_path, sets + ["spike.skip_batches=5", "spike.skip_from_step=27"], world, ["--resume-from-step", "20"]) == 0
    _assert_same_weights(_model_tensors(job, 40), _model_tensors(ref_job, 40))


def test_script_error_stops_and_alerts_the_diagnosis(prefect_api, make_job, slack):
    job = make_job("script-bug")
    result = pretrain(str(job), drill_faults=["script_error@5"], backoff_s=0.5)
    assert not result.finished and result.attempts == 1
    assert result.failures[0].root_cause == "KeyError"
    assert "deterministic" in result.stopped_because
    texts = "\n".join(slack.texts())
    assert "KeyError" in texts and "stop" in texts
    assert "SECRET" not in texts

    # A drill is scoped to its flow run: the job's next flow run (same run directory, where the
    # first run's "fired" record stays) drills again instead of silently training through.
    again = pretrain(str(job), drill_faults=["script_error@5"], backoff_s=0.5)
    assert not again.finished and again.failures[0].root_cause == "KeyError" and again.final_step == 5
    fired = sorted(p.name for p in (load_job_spec(job).resolved_run_dir / "markers").glob("fault_fired.*"))
    assert len(fired) == 2 and all(re.fullmatch(r"fault_fired\.script_error@5\.rank0\.[0-9a-f-]{36}", f) for f in fired)


def test_hang_oom_kill_and_kill_mid_checkpoint_recover_bit_exact(prefect_api, make_job, uninterrupted):
    job = make_job("hang-and-kill")
    # A healthy rank beats after every step (~0.05 s here; at most ~0.3 s between two beats,
    # checkpoints included, at a load of 5): 6 s of silence is a hang. Restarts are warm: each
    # attempt's world is started while the one before trains (on this 2-core box only when asked).
    result = pretrain(str(job), drill_faults=["hang@8", "oom_kill@14:1", "exit_mid_checkpoint@20"],
                      backoff_s=0.5, hang_timeout_s=6, warm_standby=True)
    assert result.finished and result.final_step == 40, result
    # every restart ran in the world that waited for it (the node check found both nodes healthy:
    # same placement), on every rank; and no standby is left once the flow has ended
    run_dir = load_job_spec(job).resolved_run_dir
    for rank in range(result.placements[0]["world_size"]):
        started = [fields["warm"] for fields in events(log_path(run_dir, rank), "started")]
        assert started == ["False", "True", "True", "True"], (rank, started)
    assert [p.pid for p in psutil.process_iter(["cmdline"])
            if "training.standby" in (p.info["cmdline"] or []) and str(run_dir) in " ".join(p.info["cmdline"])] == []
    hang, killed, mid_checkpoint = result.failures
    assert hang.root_cause == "Hang" and hang.status == "hang"
    assert "node check" in hang.action
    # The host OOM killer's SIGKILL prints nothing of the rank's own; torchrun records the
    # signal, and the surviving rank's "connection closed by peer" is that kill seen from the
    # other side: a restart in place, no node check (nothing points at hardware).
    assert killed.status == "failed" and (killed.root_cause, killed.kind) == ("Unknown", "unknown")
    assert killed.action.startswith("restart in place") and "node check" not in killed.action
    assert mid_checkpoint.status == "failed"

    # Every attempt resumed from a committed checkpoint: the result equals an uninterrupted run.
    _same_layout(job, uninterrupted)
    _assert_same_weights(_model_tensors(job, 40), _model_tensors(uninterrupted, 40))


TWO_NODES = {  # its own name: a cordon it left must not meet other tests' two-node clusters
    "name": "warm-check-two-nodes",
    "inter_node_bandwidth_gbps": 10,
    "nodes": [{"name": name, "gpu_type": "cpu", "gpu_count": 1, "gpu_memory_gib": 4, "peak_tflops": 0.05,
               "address": "127.0.0.1"} for name in ("node-a", "node-b")],
}


def test_a_cuda_errors_node_check_runs_in_the_standby_world_and_the_restart_is_warm(prefect_api, make_job,
                                                                                     tmp_path):
    """A CUDA error on node-b points at hardware: the node check runs, in the ranks of the standby
    world already waiting on both nodes (no torchrun world of its own), finds both healthy, and
    the same ranks then train the restart."""
    cluster = tmp_path / "two-nodes.yaml"
    cluster.write_text(yaml.safe_dump(TWO_NODES, sort_keys=False))
    job = make_job("warm-check", training={"steps": 12, "lr_decay_steps": 12}, checkpoint={"interval": 4})
    result = pretrain(str(job), cluster=str(cluster), drill_faults=["cuda_error@6:1"], backoff_s=0.5,
                      hang_timeout_s=60, warm_standby=True)
    assert result.finished and result.final_step == 12, result
    (failure,) = result.failures
    assert failure.root_cause == "CUDAError" and "node check" in failure.action, failure
    assert "healthy=2" in failure.action and [p["nodes"] for p in result.placements] == [["node-a", "node-b"]] * 2
    run_dir = load_job_spec(job).resolved_run_dir
    # its one round ran in the standby's ranks (results: standby-round-1; a launched world's
    # would be world-001-node-a-node-b), which then trained attempt 1 on both nodes
    assert sorted(p.name for p in (run_dir / "nodecheck" / "attempt-0").iterdir()) == ["standby-round-1"]
    for rank in range(2):
        assert [f["warm"] for f in events(log_path(run_dir, rank), "started")] == ["False", "True"], rank
