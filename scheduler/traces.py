"""Job traces for the simulator: a typed job record, generators and CSV readers.

A trace job is either a *training* job (a model shape, a global batch and a
number of steps: the planner sizes it and its run time is steps × the
predicted step time of the plan it gets) or a *demand-only* job (a GPU count
and a duration measured on a reference GPU type, as in the Philly and Helios
traces: its run time scales with the peak TFLOP/s of the GPUs it gets).

Acme-like generator (`generate_acme_trace`). The published facts it
reproduces (Hu et al., "Characterization of Large Language Model Development
in the Datacenter", NSDI'24, §3 on the Kalos/Seren clusters; summarised in
/work/shared/PAPERS.md): evaluation jobs are ~93% of jobs but ~1% of GPU time;
pretraining jobs are ~3% of jobs but ~94% of GPU time; models range from 7B
to 123B. The paper gives shares, not full distributions, so the shapes below
are ours, chosen so that the expected shares land on the published ones
(expected GPU-time shares: pretraining ≈ 94.5%, evaluation ≈ 1%, SFT ≈ 4.5%,
debug < 0.1%; `trace_shares` measures a generated trace):

=============  =======  =============================  ==========================================
category       jobs     GPUs (user request)            duration on the reference GPU (A100-40G)
=============  =======  =============================  ==========================================
evaluation     93.0%    1: 35%, 2: 10%, 4: 20%, 8: 35%  log-normal, median 7 min, σ = 1.0 
pretrain        3.0%    64: 30%, 128: 45%, 256: 25%      log-normal, median 16 h, σ = 0.6
sft             2.0%    16: 40%, 32: 40%, 64: 20%        log-normal, median 5 h, σ = 0.6
debug           2.0%    1: 50%, 2: 25%, 4: 25%           log-normal, median 4 min, σ = 0.8
=============  =======  =============================  ==========================================

Models: pretraining/SFT jobs train one of llama-7b (35%), llama-13b (25%),
internlm-20b (20%), llama-70b (12%), mistral-large-123b (8%) with 4,096-token
sequences and global batches of 4M tokens (pretrain) or 0.5M tokens (SFT);
a request too small to hold its model is raised to the smallest
power-of-two count that does. Evaluation and debug jobs are demand-only
(inference on a 7B–123B checkpoint needs its weights on the GPUs:
`min_gpu_memory_gib` = 2 bytes × parameters / GPUs × 1.2 + 2 GiB).
Arrivals are Poisson with a rate that gives the requested offered load on the
cluster.

Frenzy-like queue (`generate_frenzy_queue`): 60 GPT-2 (125M–1.5B) and BERT
(base/large) training jobs, each asking for 1–4 GPUs, arriving over ~1 hour,
5–60 minutes each on the reference GPU — the workload mix of the Frenzy paper's
testbed experiments. BERT is modelled as a decoder of the same shape
(SwiGLU inner size 8h/3 keeps the parameter count).
"""

from __future__ import annotations

import csv
import math
import random
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Iterable

from training.config import ConfigError, ModelConfig

REFERENCE_GPU = "A100-40G"


class TraceError(ConfigError):
    """A trace file or generator request is malformed."""


def _m(layers, hidden, heads, ffn, vocab, seq, kv=None) -> ModelConfig:
    return ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                       num_query_groups=kv, ffn_hidden_size=ffn, vocab_size=vocab, seq_length=seq)


MODEL_PRESETS: dict[str, ModelConfig] = {
    "gpt2-125m": _m(12, 768, 12, 2048, 50257, 1024),
    "gpt2-350m": _m(24, 1024, 16, 2752, 50257, 1024),
    "gpt2-774m": _m(36, 1280, 20, 3392, 50257, 1024),
    "gpt2-1.5b": _m(48, 1600, 25, 4288, 50257, 1024),
    "bert-base": _m(12, 768, 12, 2048, 30522, 512),
    "bert-large": _m(24, 1024, 16, 2752, 30522, 512),
    "llama-7b": _m(32, 4096, 32, 11008, 32000, 4096),
    "llama-13b": _m(40, 5120, 40, 13824, 32000, 4096),
    "internlm-20b": _m(60, 5120, 40, 13824, 103168, 4096),
    "llama-70b": _m(80, 8192, 64, 28672, 32000, 4096, kv=8),
    "mistral-large-123b": _m(88, 12288, 96, 28672, 32768, 4096, kv=8),
}


@dataclass
class TraceJob:
    """One job of a trace."""

    job_id: str
    arrival_s: float
    num_gpus: int  # what the user (or the trace) asked for
    category: str = "other"
    # training jobs
    model_name: str | None = None
    model: ModelConfig | None = None
    global_batch: int | None = None
    steps: int | None = None
    precision: str = "bf16"
    # demand-only jobs
    duration_s: float | None = None  # on num_gpus × reference_gpu
    min_gpu_memory_gib: float = 0.0
    reference_gpu: str = REFERENCE_GPU
    # actual run time / predicted run time: schedulers see only the prediction
    # (1.0: clairvoyant; `apply_runtime_noise` draws it)
    runtime_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.num_gpus < 1:
            raise TraceError(f"job {self.job_id}: num_gpus must be >= 1 (got {self.num_gpus})")
        if not self.runtime_factor > 0:
            raise TraceError(f"job {self.job_id}: runtime_factor must be > 0 (got {self.runtime_factor})")
        if self.model is None and self.model_name is not None:
            if self.model_name not in MODEL_PRESETS:
                raise TraceError(f"job {self.job_id}: unknown model {self.model_name!r}; "
                                 f"presets: {', '.join(MODEL_PRESETS)}")
            self.model = MODEL_PRESETS[self.model_name]
        if self.model is not None:
            if not self.global_batch or not (self.steps or self.duration_s):
                raise TraceError(f"job {self.job_id}: a training job needs global_batch and steps (or duration)")
        elif self.duration_s is None or self.duration_s <= 0:
            raise TraceError(f"job {self.job_id}: a demand-only job needs a positive duration_s")

    @property
    def is_training(self) -> bool:
        return self.model is not None


# --- the Acme-like generator ----------------------------------------------------

ACME_CATEGORIES = {
    # category: (job share, {gpus: p}, median duration s, sigma)
    "evaluation": (0.93, {1: 0.35, 2: 0.10, 4: 0.20, 8: 0.35}, 7 * 60, 1.0),
    "pretrain": (0.03, {64: 0.30, 128: 0.45, 256: 0.25}, 16 * 3600, 0.6),
    "sft": (0.02, {16: 0.40, 32: 0.40, 64: 0.20}, 5 * 3600, 0.6),
    "debug": (0.02, {1: 0.50, 2: 0.25, 4: 0.25}, 4 * 60, 0.8),
}
ACME_MODELS = {"llama-7b": 0.35, "llama-13b": 0.25, "internlm-20b": 0.20,
               "llama-70b": 0.12, "mistral-large-123b": 0.08}


def _choice(rng: random.Random, weights: dict) -> object:
    return rng.choices(list(weights), weights=list(weights.values()))[0]


def _lognormal(rng: random.Random, median: float, sigma: float) -> float:
    return median * math.exp(rng.gauss(0.0, sigma))


def expected_gpu_seconds_per_job() -> float:
    """Mean GPU-seconds per job of the Acme-like mix (log-normal mean = median·e^(σ²/2))."""
    total = 0.0
    for share, gpus, median, sigma in ACME_CATEGORIES.values():
        mean_gpus = sum(g * p for g, p in gpus.items())
        total += share * mean_gpus * median * math.exp(sigma**2 / 2)
    return total


def generate_acme_trace(
    num_jobs: int,
    *,
    cluster_gpus: int,
    load: float = 0.8,
    seed: int = 0,
    step_time_s: float | None = None,
    duration_scale: float = 1.0,
) -> list[TraceJob]:
    """An Acme-like job mix arriving as a Poisson process at `load` × cluster capacity.

    Training jobs carry `duration_s` (on the reference GPU with their request);
    the simulator turns it into steps with the planner's reference step time.
    `duration_scale` shrinks every duration (e.g. for quick tests) without
    changing the mix.
    """
    if num_jobs < 1 or cluster_gpus < 1 or not 0 < load:
        raise TraceError("num_jobs and cluster_gpus must be >= 1 and load > 0")
    rng = random.Random(seed)
    mean_gpu_s = expected_gpu_seconds_per_job() * duration_scale
    rate = load * cluster_gpus / mean_gpu_s  # jobs per second
    cats = {c: v[0] for c, v in ACME_CATEGORIES.items()}
    t = 0.0
    jobs: list[TraceJob] = []
    for i in range(num_jobs):
        t += rng.expovariate(rate)
        cat = _choice(rng, cats)
        _, gpu_weights, median, sigma = ACME_CATEGORIES[cat]
        gpus = int(_choice(rng, gpu_weights))
        duration = max(30.0, _lognormal(rng, median, sigma)) * duration_scale
        model_name = str(_choice(rng, ACME_MODELS))
        if cat in ("pretrain", "sft"):
            tokens = 4 * 1024 * 1024 if cat == "pretrain" else 512 * 1024
            model = MODEL_PRESETS[model_name]
            jobs.append(TraceJob(
                job_id=f"acme-{i}", arrival_s=t, num_gpus=gpus, category=cat,
                model_name=model_name, global_batch=tokens // model.seq_length, duration_s=duration,
            ))
        else:
            params = MODEL_PRESETS[model_name].num_parameters()
            gpus = max(gpus, _inference_gpus(params))
            jobs.append(TraceJob(
                job_id=f"acme-{i}", arrival_s=t, num_gpus=gpus, category=cat, duration_s=duration,
                min_gpu_memory_gib=round(2 * params / gpus * 1.2 / 2**30 + 2, 1),
            ))
    return jobs


def _inference_gpus(params: int, gpu_gib: float = 40.0) -> int:
    """Smallest power of two of reference GPUs that holds bf16 weights with room for the KV cache."""
    n = 1
    while 2 * params / n * 1.2 / 2**30 + 2 > gpu_gib:
        n *= 2
    return n


def trace_shares(jobs: Iterable[TraceJob]) -> dict[str, dict[str, float]]:
    """Share of jobs and of requested GPU-time per category (reference durations)."""
    jobs = list(jobs)
    count: dict[str, int] = {}
    gpu_time: dict[str, float] = {}
    for j in jobs:
        count[j.category] = count.get(j.category, 0) + 1
        gpu_time[j.category] = gpu_time.get(j.category, 0.0) + j.num_gpus * (j.duration_s or 0.0)
    total_t = sum(gpu_time.values()) or 1.0
    return {c: {"jobs": count[c] / len(jobs), "gpu_time": gpu_time[c] / total_t} for c in count}


def apply_runtime_noise(jobs: Iterable[TraceJob], sigma: float, *, seed: int = 0) -> list[TraceJob]:
    """Copies of `jobs` whose actual run time is the prediction × a log-normal factor.

    factor = exp(N(0, sigma)): the prediction is the median of the actual run time
    (sigma 0.3: half the jobs within about ±20 %, one in twenty off by more than ×1.8).
    Each job's factor depends only on the seed and its position, so every policy
    replays the same surprises.
    """
    if sigma < 0:
        raise TraceError(f"runtime noise sigma must be >= 0 (got {sigma})")
    rng = random.Random(seed)
    return [replace(j, runtime_factor=math.exp(rng.gauss(0.0, sigma)) if sigma else 1.0) for j in jobs]


# --- the Frenzy-like queue ------------------------------------------------------

FRENZY_MODELS = {"gpt2-125m": 0.2, "gpt2-350m": 0.2, "gpt2-774m": 0.15, "gpt2-1.5b": 0.15,
                 "bert-base": 0.15, "bert-large": 0.15}


def generate_frenzy_queue(num_jobs: int = 60, *, seed: int = 0, span_s: float = 3600.0) -> list[TraceJob]:
    """GPT-2/BERT training jobs asking for 1–4 GPUs, arriving uniformly over `span_s`."""
    rng = random.Random(seed)
    arrivals = sorted(rng.uniform(0, span_s) for _ in range(num_jobs))
    jobs = []
    for i, t in enumerate(arrivals):
        name = str(_choice(rng, FRENZY_MODELS))
        batch = int(_choice(rng, {8: 0.25, 16: 0.35, 32: 0.25, 64: 0.15}))
        jobs.append(TraceJob(
            job_id=f"frenzy-{i}", arrival_s=t, num_gpus=int(_choice(rng, {1: 0.3, 2: 0.4, 4: 0.3})),
            category="train", model_name=name, global_batch=batch,
            duration_s=rng.uniform(5 * 60, 60 * 60),
        ))
    return jobs


# --- CSV readers ---------------------------------------------------------------

_ALIASES = {
    "job_id": ("job_id", "jobid", "id", "job", "name", "jobname"),
    "gpus": ("num_gpus", "gpu_num", "num_gpu", "gpus", "gpu_count", "gpu"),
    "submit": ("arrival_s", "submit_time", "submitted_time", "arrival", "arrival_time", "submit", "time"),
    "duration": ("duration_s", "duration", "run_time", "runtime", "elapsed"),
    "start": ("start_time", "start"),
    "end": ("end_time", "end"),
    "model": ("model", "model_name", "application"),
    "global_batch": ("global_batch", "global_batch_size", "batch_size"),
    "steps": ("steps", "iterations", "num_steps"),
    "category": ("category", "type", "job_type"),
    "state": ("state", "status"),
    "min_mem": ("min_gpu_memory_gib", "gpu_mem_gib"),
}


def _time_value(raw: str) -> float:
    raw = raw.strip()
    try:
        return float(raw)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(raw).timestamp()
    except ValueError:
        raise TraceError(f"cannot read {raw!r} as seconds or an ISO date/time") from None


def read_trace_csv(path: str | Path, *, reference_gpu: str = REFERENCE_GPU,
                   keep_states: tuple[str, ...] | None = None, limit: int | None = None) -> list[TraceJob]:
    """Read a Philly/Helios-style CSV (or forgeflow's own columns) into trace jobs.

    Recognised columns (first alias found wins): job id; GPU count
    (`gpu_num`, `num_gpus`, ...); submit time (seconds or ISO date-time);
    duration (`duration`, or `end_time` − `start_time`); optionally `model`
    (a `MODEL_PRESETS` name makes it a training job with `global_batch`; other
    names, e.g. Philly/Sia's "resnet50", are replayed as demand-only), `steps`,
    `category`, `state`. Rows with
    zero GPUs (CPU jobs in Helios) are skipped; arrivals are shifted to start
    at 0 and the rows sorted by arrival.
    """
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"{path}: no such trace file")
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        header = [h.strip().lower() for h in (reader.fieldnames or [])]
        col = {key: next((a for a in aliases if a in header), None) for key, aliases in _ALIASES.items()}
        missing = [k for k in ("gpus", "submit") if col[k] is None]
        if col["duration"] is None and (col["start"] is None or col["end"] is None):
            missing.append("duration (or start_time and end_time)")
        if missing:
            raise TraceError(f"{path}: missing column(s) {missing}; found {header}. Expected e.g. "
                             f"job_id,gpu_num,submit_time,duration (Helios) or job_id,num_gpus,arrival_s,duration_s")
        jobs: list[TraceJob] = []
        for lineno, raw_row in enumerate(reader, start=2):
            row = {(k or "").strip().lower(): (v or "").strip() for k, v in raw_row.items()}
            try:
                if keep_states and col["state"] and row[col["state"]] not in keep_states:
                    continue
                gpus = int(float(row[col["gpus"]] or 0))
                if gpus <= 0:
                    continue
                if col["duration"] and row.get(col["duration"]):
                    duration = float(row[col["duration"]])
                else:
                    duration = _time_value(row[col["end"]]) - _time_value(row[col["start"]])
                if duration <= 0:
                    continue
                model = row.get(col["model"]) if col["model"] else None
                batch = row.get(col["global_batch"]) if col["global_batch"] else None
                if model not in MODEL_PRESETS or not batch:
                    model = None  # e.g. Sia's "resnet50", or no batch size: replay it as demand-only
                jobs.append(TraceJob(
                    job_id=row.get(col["job_id"]) if col["job_id"] else f"job-{lineno}",
                    arrival_s=_time_value(row[col["submit"]]),
                    num_gpus=gpus,
                    category=(row.get(col["category"]) if col["category"] else None) or "other",
                    model_name=model or None,
                    global_batch=int(float(batch)) if model else None,
                    steps=int(float(row[col["steps"]])) if model and col["steps"] and row.get(col["steps"]) else None,
                    duration_s=duration,
                    min_gpu_memory_gib=float(row[col["min_mem"]]) if col["min_mem"] and row.get(col["min_mem"]) else 0.0,
                    reference_gpu=reference_gpu,
                ))
            except (ValueError, TraceError) as e:
                raise TraceError(f"{path}, line {lineno}: {e}") from None
            if limit and len(jobs) >= limit:
                break
    if not jobs:
        raise TraceError(f"{path}: no GPU jobs in the trace")
    start = min(j.arrival_s for j in jobs)
    for j in jobs:
        j.arrival_s -= start
    jobs.sort(key=lambda j: j.arrival_s)
    return jobs


def write_trace_csv(jobs: Iterable[TraceJob], path: str | Path) -> Path:
    """Write jobs in forgeflow's own CSV columns (readable by `read_trace_csv`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["job_id", "arrival_s", "num_gpus", "duration_s", "category", "model",
                    "global_batch", "steps", "min_gpu_memory_gib"])
        for j in jobs:
            w.writerow([j.job_id, f"{j.arrival_s:.3f}", j.num_gpus, j.duration_s or "", j.category,
                        j.model_name or "", j.global_batch or "", j.steps or "", j.min_gpu_memory_gib or ""])
    return path
