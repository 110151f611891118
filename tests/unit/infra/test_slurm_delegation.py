"""Delegated mode (the default for a `slurm:` section): what is asked of Slurm, and how a node's
task builds its launch from Slurm's environment (no Slurm needed; the real one: tests/integration/slurm/)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from infra.launch import CHOOSE_ON_NODE_0, LaunchRequest, NodeLaunch
from infra.slurm import (SlurmSettings, batch_script, node_launch_from_slurm, placed_first_ranks,
                         read_node_placements, sbatch_args,
                         signalled_path, write_node_placement)
from scheduler.cluster import parse_cluster


def _request(tmp_path: Path, nodes=("plan-a", "plan-b"), nproc=4) -> LaunchRequest:
    specs = [NodeLaunch(node=n, address=n, node_rank=i, nnodes=len(nodes), nproc_per_node=nproc,
                        cuda_visible_devices="4,5,6,7", master_addr=nodes[0], master_port=CHOOSE_ON_NODE_0,
                        first_global_rank=i * nproc) for i, n in enumerate(nodes)]
    return LaunchRequest("job-x", specs, ["-m", "training.train", "job.yaml"], tmp_path / "run", attempt=2)


def test_a_slurm_section_delegates_by_default_and_pin_keeps_the_nodelist():
    nodes = [{"name": "vm", "gpu_type": "cpu", "gpu_count": 2, "gpu_memory_gib": 4, "peak_tflops": 0.05}]
    assert parse_cluster({"nodes": nodes, "slurm": {}}).slurm.mode == "delegate"
    assert parse_cluster({"nodes": nodes, "slurm": {"mode": "pin"}}).slurm.mode == "pin"
    with pytest.raises(Exception, match="mode"):
        parse_cluster({"nodes": nodes, "slurm": {"mode": "pinned"}})


@pytest.mark.parametrize("gpu_type", ["H100-80G", "cpu"])
def test_delegated_sbatch_never_names_nodes(tmp_path, gpu_type):
    settings = SlurmSettings(partition="gpu", account="llm-team", qos="normal", signal_s=90)
    args = sbatch_args(_request(tmp_path), settings, gpu_type=gpu_type, exclude=["bad-2", "bad-1"])
    assert not any(a.startswith(("--nodelist", "-w")) for a in args)
    assert {"--nodes=2", "--ntasks-per-node=1", "--partition=gpu", "--account=llm-team", "--qos=normal",
            "--signal=B:TERM@90", "--exclude=bad-1,bad-2"} <= set(args)
    assert any(a.startswith("--gpus-per-node") for a in args) == (gpu_type != "cpu")
    pinned = sbatch_args(_request(tmp_path), SlurmSettings(mode="pin"), gpu_type=gpu_type, exclude=["bad-1"])
    assert "--nodelist=plan-a,plan-b" in pinned and not any(a.startswith(("--signal", "--exclude")) for a in pinned)


def test_typed_gpu_requests_name_slurms_gpu_type(tmp_path):
    settings = SlurmSettings(gres_types={"H100-80G": "h100"})
    assert "--gpus-per-node=h100:4" in sbatch_args(_request(tmp_path), settings, gpu_type="H100-80G")
    gres = SlurmSettings(gpu_request="gres", gres_types={"H100-80G": "h100"})
    assert "--gres=gpu:h100:4" in sbatch_args(_request(tmp_path), gres, gpu_type="H100-80G")
    assert "--gres=gpu:4" in sbatch_args(_request(tmp_path), gres, gpu_type="A100-80G")  # not listed: untyped
    assert not any("--signal" in a for a in sbatch_args(_request(tmp_path), SlurmSettings(signal_s=0), "cpu"))


def test_each_node_builds_its_launch_from_slurms_environment(tmp_path):
    request = _request(tmp_path)
    first = node_launch_from_slurm(request, {"SLURM_NODEID": "0", "SLURM_JOB_GPUS": "2,3,4,5",
                                             "CUDA_VISIBLE_DEVICES": "0,1,2,3"}, "gpu-17")
    second = node_launch_from_slurm(request, {"SLURM_NODEID": "1"}, "gpu-03")
    assert (first.node, first.node_rank, first.master_addr, first.cuda_visible_devices) == ("gpu-17", 0, "gpu-17", "0,1,2,3")
    assert (second.node, second.node_rank, second.first_global_rank, second.nproc_per_node) == ("gpu-03", 1, 4, 4)
    assert second.cuda_visible_devices == ""  # Slurm bound no GPUs here: the planned indices mean nothing on gpu-03
    assert read_node_placements(request) is None
    write_node_placement(request, second)
    assert read_node_placements(request) is None  # node rank 0 has not reported yet
    write_node_placement(request, first)
    assert [n.node for n in read_node_placements(request)] == ["gpu-17", "gpu-03"]
    assert placed_first_ranks(request.run_dir, request.attempt) == {}  # gathered by the watcher's SlurmJob
    with pytest.raises(ValueError, match="SLURM_NODEID=2"):
        node_launch_from_slurm(request, {"SLURM_NODEID": "2"}, "gpu-99")


def test_the_batch_script_passes_slurms_signal_on_and_records_it(tmp_path):
    """The script's trap, run by bash with a stand-in for srun: SIGTERM to the script reaches the
    step, the marker says Slurm asked, and the script exits with the step's code."""
    request = _request(tmp_path)
    script = batch_script(request, tmp_path / "request.json", grace_s=7, delegated=True)
    assert "--delegated" in next(line for line in script.splitlines() if line.startswith("srun "))
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "srun").write_text("#!/bin/bash\ntrap 'echo step-got-term; exit 42' TERM\n"
                               "touch \"$READY\"\nwhile true; do sleep 0.1; done\n")
    (fake / "srun").chmod(0o755)
    signalled_path(request).parent.mkdir(parents=True)
    (tmp_path / "job.sbatch").write_text(script)
    ready = tmp_path / "ready"
    proc = subprocess.Popen(["bash", str(tmp_path / "job.sbatch")], stdout=subprocess.PIPE, text=True,
                            env={"PATH": f"{fake}:/usr/bin:/bin", "READY": str(ready)})
    while not ready.exists():
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.05)
    proc.terminate()
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 42, out
    assert "Slurm signalled the job" in out and "step-got-term" in out and "srun exited with 42" in out
    assert signalled_path(request).read_text().strip().isdigit()


def test_excluded_nodes_accumulate_over_node_checks(tmp_path):
    from infra.slurm import exclude_nodes, excluded_nodes

    assert excluded_nodes(tmp_path / "run") == []
    exclude_nodes(tmp_path / "run", ["gpu-9"])
    assert exclude_nodes(tmp_path / "run", ["gpu-2", "gpu-9"]) == ["gpu-2", "gpu-9"] == excluded_nodes(tmp_path / "run")


def test_a_node_check_names_the_nodes_it_checks_even_when_training_delegates():
    from tasks.launchers import make_launcher, node_check_launcher

    nodes = [{"name": "vm", "gpu_type": "cpu", "gpu_count": 2, "gpu_memory_gib": 4, "peak_tflops": 0.05}]
    cluster = parse_cluster({"nodes": nodes, "slurm": {"partition": "gpu"}})
    assert make_launcher("slurm", cluster=cluster).settings.mode == "delegate"
    check = node_check_launcher("slurm", cluster=cluster)
    assert check.settings.mode == "pin" and check.settings.partition == "gpu"
    assert cluster.slurm.mode == "delegate"  # the training launcher's settings are not changed


def test_the_watchers_job_names_slurms_nodes_once_every_node_reported(tmp_path):
    """Exit codes and logs are found by the nodes Slurm gave; placement.json says where it ran."""
    from infra.launch import exit_code_path
    from infra.slurm import SlurmJob

    request = _request(tmp_path)
    job = SlurmJob(request, "4711", SlurmSettings())
    for rank, name in enumerate(["gpu-17", "gpu-03"]):
        spec = node_launch_from_slurm(request, {"SLURM_NODEID": str(rank)}, name)
        write_node_placement(request, spec)
        exit_code_path(request, name).parent.mkdir(parents=True, exist_ok=True)
        exit_code_path(request, name).write_text(str(rank))  # both ended: no need to ask Slurm
    assert job.poll() == {"gpu-17": 0, "gpu-03": 1}
    assert set(job.log_paths()) == {"gpu-17", "gpu-03", "slurm-batch"}
    assert placed_first_ranks(request.run_dir, request.attempt) == {"gpu-17": 0, "gpu-03": 4}
