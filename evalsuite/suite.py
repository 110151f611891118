"""Evaluation suites: which datasets, which backend, how many slots (a YAML file).

    name: quick
    backend: transformers
    backend_options: {batch_size: 8}
    slots: 2                       # inference slots (GPUs; CPU processes on a CPU box)
    metric_workers: 2              # CPU workers for metric jobs (one reserved core each)
    task_files: [tasks/example-task.yaml]   # user JSONL tasks, relative to this file
    datasets:
      - name: humaneval
        options: {limit: 20}
      - name: perplexity           # the job's held-out split when --config is given
      - name: arith-em

`--suite` takes a file, the name of a file in configs/eval/, or a comma list of
dataset names ("humaneval,arith-em").
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from evalsuite.datasets import DatasetRef, available_datasets, register_task_file
from evalsuite.errors import EvalConfigError
from evalsuite.sandbox import SandboxLimits
from infra.yaml_config import load_yaml_mapping, validate

SUITES_DIR = Path(__file__).resolve().parents[1] / "configs" / "eval"


class DatasetEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    options: dict[str, Any] = Field(default_factory=dict)


class SuiteConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = "adhoc"
    backend: str = "transformers"
    backend_options: dict[str, Any] = Field(default_factory=dict)
    slots: int = Field(default=1, gt=0)
    devices: list[str | list[str]] | None = Field(
        default=None, description="one device set per slot: [cuda:0, cuda:1], ['cuda:0,1', 'cuda:2,3'] (two "
                                  "GPUs per slot: vLLM tensor parallel 2), [cpu, cpu] or [cpu:0, cpu:1] (pinned)")
    metric_workers: int | None = Field(default=None, gt=0, description="default: one per core")
    isolation: Literal["thread", "process"] = Field(
        default="thread", description="run each trial in a thread or a fresh process (GPUs: process)")
    target_trial_s: float | None = Field(default=None, gt=0, description="split/batch towards this trial length")
    preload_root: str | None = Field(default=None, description="default /dev/shm/forgeflow-eval")
    sandbox: SandboxLimits = Field(default_factory=SandboxLimits)
    task_files: list[str] = Field(default_factory=list)
    datasets: list[DatasetEntry] = Field(min_length=1)

    # Filled by load_suite: dataset name -> the task file that defines it.
    task_file_of: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_process_per_gpu_engine(self) -> "SuiteConfig":
        if self.backend == "vllm" and self.slots > 1 and self.isolation == "thread":
            raise ValueError("vLLM runs one engine per GPU, each in its own process: set isolation: process "
                             "and devices: [cuda:0, ...] (one per slot)")
        if self.devices is not None and len(self.devices) != self.slots:
            raise ValueError(f"devices lists {len(self.devices)} device(s) for {self.slots} slot(s); give one per slot")
        if self.backend == "vllm" and self.devices is not None and self.isolation == "thread":
            raise ValueError("vLLM sees the GPUs of its process: a slot's devices need isolation: process")
        for devices in self.slot_devices():
            bad = [d for d in devices if not (d in ("cpu", "cuda") or d.startswith(("cpu:", "cuda:")))]
            if bad:
                raise ValueError(f"devices: {bad} is not a device; use cuda:N, cpu or cpu:CORE")
            if len([d for d in devices if d.startswith("cuda")]) > 1 and self.isolation == "thread":
                raise ValueError(f"a slot with several GPUs ({devices}) runs its engine in its own process: "
                                 "set isolation: process")
        return self

    def slot_devices(self) -> list[list[str]]:
        """Each slot's device set ('cuda:0,1' -> [cuda:0, cuda:1]); [] per slot when none are given."""
        if self.devices is None:
            return [[] for _ in range(self.slots)]
        out = []
        for entry in self.devices:
            items = entry if isinstance(entry, list) else [entry]
            devices: list[str] = []
            for item in items:
                kind, _, rest = str(item).strip().partition(":")
                if kind == "cuda" and rest:
                    devices += [f"cuda:{i.strip()}" for i in rest.split(",") if i.strip()]
                else:
                    devices.append(str(item).strip())
            out.append(devices)
        return out

    def refs(self) -> list[DatasetRef]:
        return [DatasetRef(name=d.name, options=d.options, task_file=self.task_file_of.get(d.name))
                for d in self.datasets]


def load_suite(suite: str, job_spec: Any | None = None, overrides: dict[str, Any] | None = None) -> SuiteConfig:
    """A suite from a path, a name in configs/eval/, or a comma list of dataset names.

    A suite file may derive from another with `base:` (infra.yaml_config)."""
    path = Path(suite)
    if not path.is_file() and (SUITES_DIR / f"{suite}.yaml").is_file():
        path = SUITES_DIR / f"{suite}.yaml"
    if path.is_file():
        raw = load_yaml_mapping(path, kind="suite", needs="a datasets list", error=EvalConfigError)
        base, source = path.parent, str(path)
    elif suite.endswith((".yaml", ".yml")):
        raise EvalConfigError(f"{suite}: no such suite file; check the path (suites live in {SUITES_DIR})")
    else:
        raw = {"name": suite, "datasets": [{"name": n.strip()} for n in suite.split(",") if n.strip()]}
        base, source = Path.cwd(), f"suite {suite!r}"
    raw.update(overrides or {})
    config = validate(SuiteConfig, raw, source=source, kind="suite", error=EvalConfigError)
    for task_file in config.task_files:
        resolved = str((base / os.path.expanduser(task_file)).resolve())
        config.task_file_of[register_task_file(resolved)] = resolved
    known = set(available_datasets())
    unknown = [d.name for d in config.datasets if d.name not in known]
    if unknown:
        raise EvalConfigError(f"suite {config.name!r}: unknown dataset(s) {unknown}; known: {sorted(known)}. "
                              "List a task file under task_files: to add one")
    if job_spec is not None:
        _apply_job_spec(config, job_spec)
    return config


def _apply_job_spec(config: SuiteConfig, job_spec: Any) -> None:
    # Perplexity defaults to the job's own held-out split and window length.
    for entry in config.datasets:
        if entry.name == "perplexity":
            if not entry.options.get("val_path") and not entry.options.get("data_dir"):
                entry.options["data_dir"] = str(job_spec.data.data_dir)
            entry.options.setdefault("seq_len", int(job_spec.model.seq_length))
