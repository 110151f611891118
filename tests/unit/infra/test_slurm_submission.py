"""What the Slurm launcher asks Slurm for (no Slurm needed): sbatch options from the
placement and the cluster's `slurm:` section, the srun step, node states, exit codes."""

from __future__ import annotations

from pathlib import Path

import pytest

from infra.launch import CHOOSE_ON_NODE_0, LaunchRequest, NodeLaunch
from infra.slurm import SlurmNode, SlurmSettings, batch_script, exit_code_of_state, sbatch_args
from scheduler.cluster import ClusterError, parse_cluster


def _request(tmp_path: Path, nodes=("gpu-a", "gpu-b"), nproc=4) -> LaunchRequest:
    specs = [NodeLaunch(node=n, address=n, node_rank=i, nnodes=len(nodes), nproc_per_node=nproc,
                        cuda_visible_devices="0,1,2,3", master_addr=nodes[0], master_port=CHOOSE_ON_NODE_0,
                        first_global_rank=i * nproc) for i, n in enumerate(nodes)]
    return LaunchRequest("job-x", specs, ["-m", "training.train", "job.yaml"], tmp_path / "run", attempt=3)


def test_sbatch_asks_for_the_placement_nodes_gpus_partition_account_and_time(tmp_path):
    settings = SlurmSettings(mode="pin", partition="h100", account="llm-team", time_limit="2-00:00:00",
                             extra_sbatch_args=["--qos=high"], cpus_per_gpu=6)
    args = sbatch_args(_request(tmp_path), settings, gpu_type="H100-80G")
    assert "--nodes=2" in args and "--nodelist=gpu-a,gpu-b" in args and "--ntasks-per-node=1" in args
    assert "--gpus-per-node=4" in args and "--cpus-per-task=24" in args
    assert {"--partition=h100", "--account=llm-team", "--time=2-00:00:00", "--qos=high", "--no-requeue"} <= set(args)
    assert f"--output={tmp_path / 'run' / 'logs' / 'slurm-batch.attempt-3.out'}" in args
    gres = sbatch_args(_request(tmp_path), SlurmSettings(gpu_request="gres"), gpu_type="A100-80G")
    assert "--gres=gpu:4" in gres and not any(a.startswith("--gpus-per-node") for a in gres)
    assert not any(a.startswith(("--partition", "--account", "--time")) for a in gres)


def test_cpu_ranks_ask_for_cpus_not_gpus(tmp_path):
    args = sbatch_args(_request(tmp_path, nodes=("vm",), nproc=2), SlurmSettings(), gpu_type="cpu")
    assert "--cpus-per-task=2" in args and not any("gpu" in a for a in args)


def test_the_step_runs_one_forgeflow_node_task_per_node_into_per_node_output(tmp_path):
    request = _request(tmp_path)
    script = batch_script(request, tmp_path / "request.json", grace_s=7)
    step = next(line for line in script.splitlines() if line.startswith("srun "))
    assert "--ntasks=2" in step and "--ntasks-per-node=1" in step
    assert "-m infra.slurm node" in step and str(tmp_path / "request.json") in step and "--grace=7" in step
    assert "node-%N.attempt-3.out" in step  # Slurm writes each node's console where the diagnosis reads it


@pytest.mark.parametrize("state,ok", [("idle", True), ("mixed", True), ("allocated", True), ("drained", False),
                                      ("draining", False), ("down*", False), ("idle*", False), ("fail", False),
                                      ("mixed-", True)])
def test_node_states_that_take_work(state, ok):
    assert SlurmNode("n", state).schedulable is ok


def test_exit_code_stand_ins_when_a_node_never_reported():
    assert exit_code_of_state("CANCELLED", None) == 143
    assert exit_code_of_state("NODE_FAIL", None) == 137
    assert exit_code_of_state("FAILED", 3) == 3
    assert exit_code_of_state("COMPLETED", 0) == 1  # the job ended, this node's torchrun never ran


def test_a_cluster_file_carries_the_slurm_section_and_misspellings_are_named():
    nodes = [{"name": "vm", "gpu_type": "cpu", "gpu_count": 2, "gpu_memory_gib": 4, "peak_tflops": 0.05}]
    cluster = parse_cluster({"nodes": nodes, "slurm": {"partition": "debug", "account": "a"}})
    assert cluster.slurm.partition == "debug" and cluster.slurm.drain_on_cordon
    with pytest.raises(ClusterError, match="slurm.partiton"):
        parse_cluster({"nodes": nodes, "slurm": {"partiton": "debug"}})
