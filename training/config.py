"""The job spec: one typed, validated description of a pretraining job.

A job spec is a YAML file. It may name a `base:` file (relative to itself) whose
values it overrides key by key, so configs derive from each other instead of
being copied (torchtitan-style). Every field is checked by pydantic; a bad file
raises one `ConfigError` naming the file, the field and how to fix it (the loader
and the error format are infra.yaml_config's, shared by every config kind).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_serializer, model_validator

from infra.yaml_config import load_yaml_mapping, merge, validate
from training.capabilities import WORKER


class ConfigError(ValueError):
    """A job spec (or other config file) is missing, malformed or inconsistent."""


class _Section(BaseModel):
    # Unknown keys are almost always typos ("lerning_rate"); refuse them.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    """A Llama-style decoder: RoPE, RMSNorm, SwiGLU, grouped-query attention."""

    num_layers: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_query_groups: int | None = Field(
        default=None, gt=0, description="key/value heads (GQA); default = num_attention_heads"
    )
    ffn_hidden_size: int | None = Field(
        default=None, gt=0, description="SwiGLU inner size; default ~ 8/3 * hidden rounded to 64"
    )
    vocab_size: int = Field(gt=0)
    seq_length: int = Field(gt=0)
    rope_theta: float = Field(default=10000.0, gt=0)
    norm_epsilon: float = Field(default=1e-5, gt=0)
    init_method_std: float = Field(default=0.02, gt=0)
    untie_embeddings_and_output_weights: bool = True

    @model_validator(mode="after")
    def _shapes(self) -> "ModelConfig":
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                f"({self.num_attention_heads}); pick heads that divide it"
            )
        kv = self.kv_heads
        if self.num_attention_heads % kv:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                f"num_query_groups ({kv}); pick num_query_groups that divides it"
            )
        return self

    @property
    def kv_heads(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        return 64 * ((8 * self.hidden_size // 3 + 63) // 64)

    def num_parameters(self) -> int:
        """Exact parameter count of the megatron GPTModel this config builds."""
        h, f, l, v = self.hidden_size, self.ffn_size, self.num_layers, self.vocab_size
        qkv = h * (h + 2 * self.kv_heads * self.head_dim)
        per_layer = qkv + h * h + 2 * h * f + f * h + 2 * h  # attn, SwiGLU MLP, 2 RMSNorms
        embeddings = v * h * (2 if self.untie_embeddings_and_output_weights else 1)
        return l * per_layer + embeddings + h  # + final norm


Precision = Literal["fp32", "bf16", "fp16"]
Recompute = Literal["none", "selective", "full"]
Attention = Literal["auto", "local", "sdpa"]
ResolvedAttention = Literal["local", "sdpa"]


def resolve_attention(choice: Attention, precision: Precision, flash_device: bool) -> ResolvedAttention:
    """The core-attention kernel a run builds (`training.attention`).

    local: megatron-core's local layer spec, unfused (baddbmm, softmax, bmm; the s x s
    scores are materialised and saved). sdpa: the same layer spec with core attention
    done by torch's scaled_dot_product_attention, which on a GPU of compute capability
    8.0 or newer in bf16/fp16 runs a fused flash kernel (no s x s tensor, GQA without
    repeating k/v). Parameters, and so checkpoints and exports, are the same for both.
    auto: sdpa where that flash kernel exists (`flash_device`: an Ampere-or-newer GPU) in
    half precision, the faster path there (benchmarks/gpu_check.py measures both); local
    elsewhere (CPU, fp32, older GPUs, whose GQA would fall back to torch's unfused math
    kernel), where it is exact and the CPU memory model was measured on it.
    """
    if choice != "auto":
        return choice
    return "sdpa" if flash_device and precision in ("bf16", "fp16") else "local"


class TrainingConfig(_Section):
    global_batch_size: int = Field(gt=0, description="sequences per optimizer step")
    micro_batch_size: int = Field(default=1, gt=0)
    steps: int = Field(gt=0)
    lr: float = Field(default=3e-4, gt=0)
    min_lr: float = Field(default=3e-5, ge=0)
    warmup_steps: int = Field(default=0, ge=0)
    lr_decay_steps: int | None = Field(default=None, gt=0, description="default: steps")
    weight_decay: float = Field(default=0.1, ge=0)
    adam_beta1: float = Field(default=0.9, gt=0, lt=1)
    adam_beta2: float = Field(default=0.95, gt=0, lt=1)
    grad_clip: float = Field(default=1.0, ge=0, description="0 disables clipping")
    seed: int = 1234
    precision: Precision = "fp32"
    tensor_parallel: int = Field(default=1, gt=0)
    pipeline_parallel: int = Field(default=1, gt=0)
    virtual_pipeline_stages: int = Field(
        default=1, gt=0, description="model chunks per pipeline rank (>1: interleaved 1F1B)")
    pipeline_stage_layers: list[int] | None = Field(
        default=None, description="decoder layers per model chunk in layer order "
        "(pipeline_parallel x virtual_pipeline_stages entries); default: an even split, "
        "the first chunks taking any remainder")
    use_distributed_optimizer: bool = False
    recompute: Recompute = "none"
    attention: Attention = Field(
        default="auto", description="core attention kernel: local (megatron's unfused), sdpa "
        "(torch's fused scaled_dot_product_attention), auto (sdpa on Ampere-or-newer GPUs in "
        "bf16/fp16, else local)")
    log_interval: int = Field(default=1, gt=0)
    torch_threads: int | None = Field(default=None, gt=0, description="intra-op threads per rank")

    @model_validator(mode="after")
    def _lr(self) -> "TrainingConfig":
        if self.min_lr > self.lr:
            raise ValueError(
                f"min_lr ({self.min_lr}) must not exceed lr ({self.lr}); lower min_lr or raise lr"
            )
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"global_batch_size ({self.global_batch_size}) must be a multiple of "
                f"micro_batch_size ({self.micro_batch_size})"
            )
        stages = WORKER.max_pipeline_stages
        if self.pipeline_parallel > stages:
            raise ValueError(
                f"pipeline_parallel > {stages} is not supported by the training worker yet; "
                f"set pipeline_parallel: {stages} (the planner may still consider pp > {stages})"
            )
        if self.virtual_pipeline_stages > 1 and self.pipeline_parallel == 1:
            raise ValueError(
                f"virtual_pipeline_stages ({self.virtual_pipeline_stages}) needs "
                "pipeline_parallel > 1; set virtual_pipeline_stages: 1 or raise pipeline_parallel"
            )
        chunks = self.pipeline_parallel * self.virtual_pipeline_stages
        if self.pipeline_stage_layers is not None and (
                len(self.pipeline_stage_layers) != chunks or min(self.pipeline_stage_layers) < 1):
            raise ValueError(
                f"pipeline_stage_layers {self.pipeline_stage_layers} must list {chunks} positive "
                f"layer counts (pipeline_parallel x virtual_pipeline_stages), one per model chunk"
            )
        return self


class CheckpointConfig(_Section):
    interval: int = Field(default=50, gt=0, description="save every N steps")
    interval_s: float | None = Field(
        default=None, gt=0, description="also save when this many seconds passed since the "
        "last save (whichever of interval / interval_s comes first); rank 0's clock decides")
    stop_deadline_s: float = Field(
        default=120.0, gt=0, description="on SIGTERM: seconds from the signal to the committed "
        "checkpoint of the current step; launchers must give the ranks at least this long")
    url: str = Field(
        default="{run_dir}/checkpoints", description="file://PATH, a bare path, or s3://bucket/prefix; "
        "{name}, {job} and {run_dir} are replaced by the job's name, id and run directory, so each "
        "job's checkpoints are its own (s3://bucket/{name}/{job} on S3)"
    )
    keep_last: int = Field(default=3, gt=0)
    format: Literal["sharded"] = Field(
        default="sharded", description="on-storage format (checkpoint.manifest); 'sharded': "
        "tensors with global shapes and offsets, loadable onto any TP/PP/DP layout")
    async_save: bool = Field(default=True, description="persist in the background (false: "
                             "save() returns once the checkpoint is committed)")
    on_busy: Literal["wait", "skip"] = Field(
        default="wait", description="a persist still running at the next checkpoint step"
    )
    save_on_failure: bool = Field(
        default=True, description="when a peer rank fails mid-step, a surviving rank that holds a "
        "whole replica (data parallel only: no tensor or pipeline split, no distributed optimizer) "
        "commits the last completed step before it exits, so the restart loses no steps "
        "(training.checkpointing.Checkpointer.save_after_failure)")
    # S3 settings; when unset the usual AWS_* environment variables apply.
    endpoint_url: str | None = None
    region: str | None = None


class DataConfig(_Section):
    corpus: list[str] = Field(
        default_factory=lambda: ["stdlib"],
        description='"stdlib" (the running Python\'s own sources) or text/JSONL files or directories',
    )
    data_dir: str = Field(default="runs/data", description="tokenizer and packed token files")
    val_fraction: float = Field(default=0.02, gt=0, lt=0.5)
    max_corpus_mb: float | None = Field(default=None, gt=0, description="cap the corpus size")
    jsonl_text_key: str = "text"


class SpikeConfig(_Section):
    """Loss-spike detection: robust z-score of the loss against a moving median."""

    enabled: bool = True
    window: int = Field(default=50, gt=4, description="recent steps forming the baseline")
    min_history: int = Field(default=10, gt=1, description="steps before detection starts")
    z_threshold: float = Field(default=6.0, gt=0)
    patience: int = Field(default=5, gt=0, description="a spike must persist this many steps")
    skip_batches: int = Field(default=0, ge=0, description="batches to skip after a rollback")
    skip_from_step: int | None = Field(
        default=None, gt=0, description="the spike's onset step (as logged): the skipped batches "
        "start with the one that step trained, so the steps between the checkpoint and the onset "
        "replay their batches; default: the resumed step")


FaultKind = Literal["cuda_error", "hang", "oom_kill", "loss_spike", "exit_mid_checkpoint", "script_error",
                    "slow_rank", "sigterm"]


class FaultConfig(_Section):
    """Fault injection for tests; off unless set (or FORGEFLOW_FAULT=kind@step[:rank])."""

    kind: FaultKind | None = None
    at_step: int = Field(default=0, ge=0)
    rank: int = Field(default=0, ge=0)


class MetricsConfig(_Section):
    """Metrics for people (training.metrics): TensorBoard event files under the run directory by
    default; MLflow and Weights & Biases when configured here or by their standard variables
    (MLFLOW_TRACKING_URI, WANDB_PROJECT). Nothing has to be running."""

    tensorboard: bool = True
    mlflow_tracking_uri: str | None = Field(
        default=None, description="e.g. sqlite:///runs/mlflow.db, file:runs/mlruns or http://mlflow:5000")
    mlflow_experiment: str | None = Field(default=None, description="default: the job's name")
    wandb_project: str | None = None


class EvalConfig(_Section):
    suite: list[str] = Field(default_factory=list, description="dataset names to evaluate")


class JobSpec(_Section):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    model: ModelConfig
    training: TrainingConfig
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    spike: SpikeConfig = Field(default_factory=SpikeConfig)
    fault: FaultConfig = Field(default_factory=FaultConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    run_dir: str = Field(default="runs/{name}/{job}", description="logs, heartbeats, markers; "
                         "{name} and {job} are replaced by the job's name and id")
    job: str = Field(default="local", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", description=(
        "the job's id in the cluster's orchestrator, set when it is submitted (`for_job`); "
        "'local' for a run outside it (`forgeflow train`)"))
    # run_dir and checkpoint.url as written, before {name}/{job}/{run_dir} were replaced
    _path_templates: tuple[str, str] = PrivateAttr(default=("", ""))

    def model_post_init(self, context: Any) -> None:
        """Replace the placeholders once, here: every reader of run_dir and checkpoint.url sees
        this job's own paths (two jobs of one spec never share a run directory or checkpoints)."""
        templates = (self.run_dir, self.checkpoint.url)
        self._path_templates = templates
        run_dir = _fill(templates[0], "run_dir", name=self.name, job=self.job)
        url = _fill(templates[1], "checkpoint.url", name=self.name, job=self.job, run_dir=run_dir)
        self.__dict__["run_dir"] = run_dir  # (no re-validation: these are the validated values, filled in)
        if url != self.checkpoint.url:
            self.__dict__["checkpoint"] = self.checkpoint.model_copy(update={"url": url})

    @model_serializer(mode="wrap")
    def _dump_as_written(self, handler):
        """A spec not yet submitted dumps its paths as written (placeholders kept), so its content
        becomes each job's own paths when submitted; a job's spec dumps the paths it runs with."""
        data = handler(self)
        if self.job == "local" and isinstance(data, dict) and "run_dir" in data:
            data["run_dir"] = self._path_templates[0]
            if isinstance(data.get("checkpoint"), dict) and "url" in data["checkpoint"]:
                data["checkpoint"]["url"] = self._path_templates[1]
        return data

    def for_job(self, job: int | str) -> "JobSpec":
        """This spec as the job `job` of the orchestrator: {job} in its paths becomes the id."""
        job = str(job)
        if job == self.job:
            return self
        if self.job != "local":
            raise ConfigError(f"job spec {self.name!r} already belongs to job {self.job}; submit the "
                              "spec file again for a new job instead of reusing its content")
        data = self.model_dump()
        data["job"] = job
        data["run_dir"], data["checkpoint"]["url"] = self._path_templates
        return parse_job_spec(data, source=f"job spec {self.name!r} as job {job}")

    @model_validator(mode="after")
    def _pipeline_cut(self) -> "JobSpec":
        t, layers = self.training, self.model.num_layers
        chunks = t.pipeline_parallel * t.virtual_pipeline_stages
        if t.pipeline_stage_layers is not None and sum(t.pipeline_stage_layers) != layers:
            raise ValueError(
                f"training.pipeline_stage_layers {t.pipeline_stage_layers} add up to "
                f"{sum(t.pipeline_stage_layers)} layers but model.num_layers is {layers}; "
                "make them add up"
            )
        if chunks > layers:
            raise ValueError(
                f"training.pipeline_parallel x virtual_pipeline_stages = {chunks} model chunks "
                f"but model.num_layers is {layers}; every chunk needs at least one layer"
            )
        return self

    @property
    def resolved_run_dir(self) -> Path:
        return Path(self.run_dir)

    def config_hash(self) -> str:
        """Hash of what determines the trained weights (not where they are written)."""
        payload = self.model_dump(include={"model", "training", "data"})
        payload["data"].pop("data_dir", None)
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def _fill(template: str, field: str, **values: str) -> str:
    """`template` with {name}/{job}/{run_dir} replaced; ConfigError for any other placeholder."""
    if "{" not in template:
        return template
    try:
        return template.format(**values)
    except (KeyError, IndexError, ValueError) as e:
        raise ConfigError(f"{field} {template!r}: unknown placeholder {e}; use only "
                          f"{', '.join('{' + k + '}' for k in values)} (double a literal brace: {{{{)") from None


def load_job_spec(path: str | Path, overrides: dict[str, Any] | None = None) -> JobSpec:
    """Read, merge (`base:`), override and validate a job spec file."""
    path = Path(path)
    data = load_yaml_mapping(path, kind="job spec", needs="name, model and training", error=ConfigError)
    if overrides:
        data = merge(data, overrides)
    return parse_job_spec(data, source=str(path))


def parse_job_spec(data: dict[str, Any], source: str = "<job spec>") -> JobSpec:
    return validate(JobSpec, data, source=source, kind="job spec", error=ConfigError)


def as_job_spec(value: "str | Path | dict[str, Any] | JobSpec", source: str = "the job_spec parameter") -> JobSpec:
    """A flow's job_spec parameter: a YAML path on this machine, the validated spec as content
    (a dict, e.g. a checkpoint event's payload or `forgeflow submit`'s), or a JobSpec."""
    if isinstance(value, JobSpec):
        return value
    if isinstance(value, dict):
        return parse_job_spec(value, source=source)
    return load_job_spec(value)


def dotted_overrides(items: list[str]) -> dict[str, Any]:
    """Turn CLI `key.sub=value` strings into a nested override dict (values parsed as YAML)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like section.field=value")
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = _override_value(raw)
    return out


def _override_value(raw: str) -> Any:
    """A --set value as YAML (numbers, booleans, lists), except text that is not YAML or that
    only looks like a mapping because of a path placeholder ("{run_dir}/checkpoints",
    "{name}"): that stays the text it is."""
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw
    if isinstance(value, dict) and re.search(r"\{[A-Za-z_]+\}", raw):
        return raw
    return value
