"""The fine-tuning job file of `forgeflow finetune` (YAML, validated; `base:` merges like job specs).

    name: ft-tiny
    model_dir: runs/tiny-cpu/hf-step-000100     # any HF LlamaForCausalLM folder (forgeflow export)
    training: {steps: 20, micro_batch_size: 1, microbatches: 4, seq_length: 64, lr: 1.0e-4}
    offload: {workers: 2, device_budget_mib: 64, checkpoint_every: 50}   # CPU: the budget is the "device"
    data: {kind: prepared, data_dir: runs/data}    # or {kind: random}
    checkpoint_url: file://runs/ft-tiny/checkpoints
    eval_suite: quick                              # evaluated through the evaluation flow; omit to skip
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from infra.yaml_config import load_yaml_mapping, validate
from training.config import ConfigError
from training.offload.executor import DataSource


class FinetuneTraining(BaseModel):
    model_config = ConfigDict(extra="forbid")

    steps: int = Field(gt=0)
    micro_batch_size: int = Field(default=1, gt=0)
    microbatches: int = Field(default=4, gt=0)
    seq_length: int = Field(gt=0)
    lr: float = Field(default=1e-4, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    grad_clip: float = Field(default=1.0, ge=0)
    seed: int = 1234


class OffloadSection(BaseModel):
    model_config = ConfigDict(extra="forbid")

    workers: int = Field(default=2, gt=0, description="processes = GPUs (CPU: worker processes)")
    device_budget_mib: float | None = Field(default=None, gt=0, description="None: the GPU's memory less a margin")
    memory_margin: float = Field(default=0.10, ge=0, lt=1)
    optimizer_on: Literal["host", "device"] = "host"
    max_stages: int | None = Field(default=None, gt=0)
    time_limit_s: float = Field(default=10.0, gt=0, description="partition MIP time limit")
    checkpoint_every: int = Field(default=0, ge=0, description="steps between resumable checkpoints of the "
                                  "host state (weights + Adam); a re-run of a killed job resumes from the "
                                  "last committed one; 0: none")


class FinetuneSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    model_dir: str
    training: FinetuneTraining
    offload: OffloadSection = Field(default_factory=OffloadSection)
    data: DataSource = Field(default_factory=DataSource)
    checkpoint_url: str | None = Field(default=None, description="default: file://<run_dir>/checkpoints")
    eval_suite: str | None = None
    run_dir: str = "runs/{name}"

    def resolved_run_dir(self) -> Path:
        return Path(self.run_dir.format(name=self.name))


def load_finetune_spec(path: str | Path) -> FinetuneSpec:
    data = load_yaml_mapping(path, kind="fine-tuning spec", needs="name, model_dir and training", error=ConfigError)
    spec = validate(FinetuneSpec, data, source=str(path), kind="fine-tuning spec", error=ConfigError)
    if not (Path(spec.model_dir) / "config.json").is_file():
        raise ConfigError(f"{path}: model_dir {spec.model_dir!r} is not a Hugging Face model folder (no config.json); "
                          f"export a checkpoint with `forgeflow export` or point at a LlamaForCausalLM folder")
    return spec
