"""What a trial's Slurm job asks for (evalsuite.slurm_trials): its slot's GPUs or cores, the
cluster file's partition and account; and how the trial sees its devices inside the job."""

from __future__ import annotations

from pathlib import Path

from evalsuite.datasets import DatasetRef
from evalsuite.slurm_trials import batch_script, job_trial, sbatch_args
from evalsuite.trials import ShardSpec, Trial
from infra.slurm import SlurmSettings


def _trial(devices: list[str], node: str = "") -> Trial:
    return Trial(trial_id="t001-humaneval", backend="vllm", output_dir="/shared/out", devices=devices, node=node,
                 shards=[ShardSpec(dataset=DatasetRef(name="humaneval"), shard=0, start=0, stop=8)])


def test_a_gpu_slot_asks_slurm_for_its_gpu_count_in_the_cluster_partition_and_account():
    settings = SlurmSettings(partition="h100", account="llm-team", time_limit="01:00:00", cpus_per_gpu=4,
                             extra_sbatch_args=["--qos=eval"], mode="pin")
    args = sbatch_args(_trial(["cuda:2", "cuda:3"], node="gpu-07"), settings, Path("/shared/out/t.out"))
    assert "--gpus-per-node=2" in args and "--cpus-per-task=8" in args
    assert {"--partition=h100", "--account=llm-team", "--time=01:00:00", "--nodelist=gpu-07"} <= set(args)
    # delegated (the default): the same request, and Slurm chooses the node
    delegated = sbatch_args(_trial(["cuda:2", "cuda:3"], node="gpu-07"), settings.model_copy(update={"mode": "delegate"}),
                            Path("/shared/out/t.out"))
    assert delegated == [a for a in args if a != "--nodelist=gpu-07"]
    assert args[-1] == "--qos=eval" and "--job-name=forgeflow-eval-t001-humaneval" in args
    gres = sbatch_args(_trial(["cuda:0"]), SlurmSettings(gpu_request="gres"), Path("o"))
    assert "--gres=gpu:1" in gres and not any(a.startswith(("--gpus", "--partition", "--nodelist")) for a in gres)


def test_a_cpu_slot_asks_for_its_cores_and_hides_gpus():
    trial = _trial(["cpu:0,1,2"])
    args = sbatch_args(trial, SlurmSettings(), Path("o"))
    assert "--cpus-per-task=3" in args and not any("gpu" in a for a in args)
    assert "export CUDA_VISIBLE_DEVICES=" in batch_script(trial, Path("t.json"), Path("r.json")).splitlines()
    assert job_trial(trial).devices == ["cpu"]   # Slurm picked the cores: no pinning to the slot's


def test_in_the_job_the_slots_gpus_are_slurms_numbered_from_zero():
    assert job_trial(_trial(["cuda:2", "cuda:3"])).devices == ["cuda:0", "cuda:1"]
    assert job_trial(_trial(["cuda:5"])).devices == ["cuda"]
    assert "CUDA_VISIBLE_DEVICES=" not in batch_script(_trial(["cuda:5"]), Path("t"), Path("r")).replace(
        "${CUDA_VISIBLE_DEVICES:-none}", "")
