"""The `finetune` flow: fine-tune a model larger than GPU memory with Mobius's offloaded pipeline.

The runbook it replaces:

    1. plan       does the model fit a device? (it must not, or plain training is the better tool)
    2. profile    time and size one layer on the device the workers will use
    3. partition  the MIP: how many stages, which layers each
    4. map        stage positions onto GPUs so prefetches do not share a root complex
    5. run        W workers under torchrun; stages swapped through the devices; every
                  `offload.checkpoint_every` steps a resumable checkpoint (a re-run of a
                  killed job resumes from the last committed one, with its partition)
    6. checkpoint the fine-tuned weights, through the checkpoint package (manifest last)
    7. evaluate   through the evaluation flow, on the fine-tuned HF folder

Run: `forgeflow finetune JOB.yaml` or `python -m flows.finetune JOB.yaml`.

A run created through Prefect's API (the `finetune` deployment: whoever can create a flow run
chooses `spec_path`) reads and writes one orchestrator job's files only (issue 29): the spec file
must be in a job's run directory (symlinks resolved; no `base:`), and the folders it names —
`model_dir`, `data.data_dir`, `run_dir` — inside that same run directory, `checkpoint_url` in it
or in the job's checkpoint prefix, `eval_suite` a suite name of this checkout
(`evalsuite.job_scope`). Each refusal is one `ConfigError` before anything else is read. A
direct Python call (the CLI, tests) is not checked: its caller already runs code as forgeflow.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE


@task(name="offload-profile", cache_policy=NO_CACHE)
def profile_model(model_dir: str, micro_batch: int, seq_length: int, microbatches: int, device: str):
    from scheduler.offload.measure import measure_copy_bandwidth, measure_profile

    profile = measure_profile(model_dir, micro_batch=micro_batch, seq_length=seq_length,
                              microbatches=microbatches, device=device)
    return profile, measure_copy_bandwidth(device)


@task(name="offload-partition", cache_policy=NO_CACHE)
def partition_model(profile, hardware, max_stages, time_limit_s):
    from scheduler.offload.partition import solve_partition

    return solve_partition(profile, hardware, max_stages=max_stages, time_limit_s=time_limit_s)


@task(name="offload-run", cache_policy=NO_CACHE)
def run_workers(run_config, workers: int) -> list[dict]:
    from training.offload.launch import run_local

    return run_local(run_config, workers)


@task(name="offload-checkpoint", cache_policy=NO_CACHE)
def checkpoint_weights(model_folder: str, url: str, step: int) -> str:
    """The fine-tuned weights as a committed checkpoint (snapshot, persist, manifest last)."""
    from safetensors.torch import load_file

    from checkpoint.engine import CheckpointEngine

    engine = CheckpointEngine(url, async_save=False, preflight=False)
    try:
        engine.save(step, {"model": load_file(str(Path(model_folder) / "model.safetensors"))},
                    common={"format": "hf-llama", "source": model_folder}, blocking=True)
        engine.wait()
    finally:
        engine.close()
    return url


def _confined_to_a_job(spec_path: str) -> None:
    """A fine-tuning run through the API touches one job's run directory (and checkpoint prefix)
    only; ConfigError naming the field otherwise, before the spec's folders are looked at."""
    import yaml

    from evalsuite import job_scope
    from infra.yaml_config import validate
    from scheduler.orchestrator.seat import cluster_orchestrator
    from training.config import ConfigError
    from training.offload.spec import FinetuneSpec

    scope = job_scope.job_holding(cluster_orchestrator().engine, spec_path)
    if scope is None:
        raise ConfigError(f"spec_path {spec_path} is in no job's run directory: a fine-tuning run through the API "
                          "reads its spec from a job's run directory (write it there, or run `forgeflow finetune`)")
    where = f"job {scope.job_id}'s run directory ({scope.run_dir})"
    try:
        data = yaml.safe_load(Path(spec_path.removeprefix("file://")).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"spec_path {spec_path}: not a readable YAML file ({type(e).__name__})") from None
    if not isinstance(data, dict) or "base" in data:
        raise ConfigError(f"spec_path {spec_path}: a fine-tuning spec through the API is one YAML mapping "
                          "without 'base:' (a base file is another file to read); merge it in")
    spec = validate(FinetuneSpec, data, source=spec_path, kind="fine-tuning spec", error=ConfigError)
    folders = {"model_dir": spec.model_dir, "run_dir": str(spec.resolved_run_dir())}
    if spec.data.data_dir is not None:
        folders["data.data_dir"] = spec.data.data_dir
    for field, folder in folders.items():
        if not job_scope.within(folder, str(scope.run_dir)):
            raise ConfigError(f"{spec_path}: {field} {folder} is outside {where}; a fine-tuning run through the API "
                              "reads and writes only its job's folders")
    if spec.checkpoint_url is not None and not scope.holds_checkpoint(spec.checkpoint_url):
        raise ConfigError(f"{spec_path}: checkpoint_url {spec.checkpoint_url} is outside {where} and its checkpoint "
                          f"prefix ({scope.checkpoint_root}); leave it unset (<run_dir>/checkpoints)")
    if spec.eval_suite is not None:
        try:
            job_scope.check_suite(spec.eval_suite)
        except job_scope.EvalScopeError as e:
            raise ConfigError(f"{spec_path}: eval_{e}") from None


@flow(name="finetune", log_prints=True)
def finetune(spec_path: str, evaluate: bool = True) -> dict:
    import torch

    from flows.evaluate import created_through_the_api
    from scheduler.offload.mapping import cross_map
    from scheduler.offload.profile import OffloadHardware
    from training.offload.executor import OffloadRunConfig, committed_checkpoint
    from training.offload.spec import load_finetune_spec

    if created_through_the_api():   # spec_path is whoever could create a flow run's: one job's files only
        _confined_to_a_job(spec_path)
    spec = load_finetune_spec(spec_path)
    t, o = spec.training, spec.offload
    run_dir = spec.resolved_run_dir()
    run_dir.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"

    # 1. Plan: the device memory each worker may use, against what the model needs.
    if o.device_budget_mib is not None:
        budget = int(o.device_budget_mib * 2**20)
    elif cuda:
        budget = int(torch.cuda.get_device_properties(0).total_memory * (1 - o.memory_margin))
    else:
        raise ValueError("on CPU give offload.device_budget_mib: it stands for one GPU's memory")

    # 2. Profile one decoder layer (all are alike) on this device, and the copy bandwidth.
    profile, bandwidth = profile_model(spec.model_dir, t.micro_batch_size, t.seq_length, t.microbatches, device)
    model_bytes = profile.param_bytes
    print(f"model {model_bytes / 2**20:.1f} MiB of weights (+ grads + Adam in host memory); device budget "
          f"{budget / 2**20:.1f} MiB per worker; host->device {bandwidth / 1e9:.2f} GB/s")

    # 3. Partition for W devices of that budget.
    root_complexes = None
    if cuda:
        from scheduler.cluster import detect_local_cluster

        node = detect_local_cluster().nodes[0]
        root_complexes = tuple(node.pcie_root_complex[:o.workers]) if node.pcie_root_complex else None
    hardware = OffloadHardware(o.workers, budget, bandwidth, root_complex=root_complexes)
    # A killed run of this job left a committed checkpoint: resume with its partition (the MIP
    # under a time limit need not find the same one again, and the saved state is per stage).
    resume = committed_checkpoint(run_dir / "offload", spec.model_dir, o.workers)
    if resume is not None:
        from scheduler.offload.partition import partition_of

        part = partition_of(profile, hardware, [tuple(r) for r in resume["stages"]], solver="checkpoint")
        print(f"resuming from the checkpoint of step {resume['step']} with its partition")
    else:
        part = partition_model(profile, hardware, o.max_stages, o.time_limit_s)
    print(f"partition: {part.num_stages} stages {part.stage_sizes}, predicted step {part.step.total_s:.3f} s "
          f"({'optimal' if part.optimal else part.note})")

    # 4. Map positions onto GPUs (root complexes known only on a real GPU server).
    gpus = list(range(o.workers))
    mapping = cross_map(gpus, root_complexes, num_stages=part.num_stages).gpus if root_complexes else tuple(gpus)

    # 5. Run.
    run_config = OffloadRunConfig(
        model_dir=spec.model_dir, stages=part.stages, steps=t.steps, micro_batch_size=t.micro_batch_size,
        microbatches=t.microbatches, seq_length=t.seq_length, lr=t.lr, weight_decay=t.weight_decay,
        grad_clip=t.grad_clip, seed=t.seed, device_budget_bytes=budget, optimizer_on=o.optimizer_on,
        data=spec.data, gpu_of_rank=list(mapping), out_dir=str(run_dir / "offload"),
        checkpoint_every=o.checkpoint_every,
    )
    reports = run_workers(run_config, o.workers)
    losses = reports[0]["losses"]
    peaks = [r["device_peak_bytes"] for r in reports]
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; device peak per worker {[round(p / 2**20, 2) for p in peaks]} MiB")
    tuned = str(run_dir / "offload" / "model")

    # 6. Checkpoint through the checkpoint package.
    url = spec.checkpoint_url or f"file://{(run_dir / 'checkpoints').resolve()}"
    checkpoint_weights(tuned, url, t.steps)

    result = {
        "name": spec.name, "model_bytes": model_bytes, "device_budget_bytes": budget, "device_peak_bytes": peaks,
        "partition": part.to_dict(), "gpu_of_position": list(mapping), "losses": losses,
        "step_times_s": reports[0]["step_times_s"], "finetuned_model": tuned, "checkpoint_url": url,
    }
    create_markdown_artifact(
        key=f"finetune-{spec.name}".lower().replace("_", "-").replace(".", "-"),
        markdown=(f"### Fine-tuning {spec.name} (Mobius offload)\n\n| | |\n|---|---|\n"
                  f"| stages | {part.num_stages} {part.stage_sizes} |\n| predicted step | {part.step.total_s:.3f} s |\n"
                  f"| measured step (median) | {sorted(reports[0]['step_times_s'])[len(losses) // 2]:.3f} s |\n"
                  f"| loss | {losses[0]:.4f} → {losses[-1]:.4f} |\n"
                  f"| device peak / budget | {max(peaks) / 2**20:.2f} / {budget / 2**20:.2f} MiB |\n"),
        description="offloaded fine-tuning")

    # 7. Evaluate the fine-tuned folder through the evaluation flow.
    if evaluate and spec.eval_suite:
        from flows.evaluate import evaluate_checkpoint

        result["evaluation"] = evaluate_checkpoint(tuned, suite=spec.eval_suite,
                                                   output_dir=str(run_dir / "eval"))
    (run_dir / "finetune.json").write_text(json.dumps(result, indent=1, default=str))
    return result


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m flows.finetune JOB.yaml   (or: forgeflow finetune JOB.yaml)")
    print(json.dumps(finetune(sys.argv[1]), default=str)[-2000:])
