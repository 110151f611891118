"""The on-disk schema of inference outputs, shared by every backend.

One shard of one dataset → one JSONL file. Each line is a record:

    {"type": "generation",    "request_id": "HumanEval/0", "sample_index": 0, "outputs": ["..."]}
    {"type": "loglikelihood", "request_id": "3:1", "sample_index": 3,
     "logprob": -4.2, "is_greedy": false, "num_tokens": 2}

and the file ends with one completion record written last:

    {"type": "complete", "dataset": ..., "shard": 0, "records": N, "backend": ..., "elapsed_s": ...}

A file without that trailing record (a trial killed mid-shard) is incomplete and
is redone from scratch on resume; a complete one is skipped. Records are only
ever appended and flushed line by line, so a crash leaves at worst a torn last
line, which the reader ignores.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

COMPLETE = "complete"


class GenerationRecord(BaseModel):
    type: Literal["generation"] = "generation"
    request_id: str
    sample_index: int
    outputs: list[str]


class LoglikelihoodRecord(BaseModel):
    type: Literal["loglikelihood"] = "loglikelihood"
    request_id: str
    sample_index: int
    logprob: float
    is_greedy: bool
    num_tokens: int


class CompletionRecord(BaseModel):
    type: Literal["complete"] = COMPLETE
    dataset: str
    shard: int
    records: int
    backend: str
    elapsed_s: float


OutputRecord = GenerationRecord | LoglikelihoodRecord


def shard_output_path(output_dir: str | Path, dataset: str, shard: int) -> Path:
    # Dataset names may hold '/' (e.g. "org/task"): keep one flat folder per dataset.
    safe = dataset.replace("/", "__")
    return Path(output_dir) / "generations" / safe / f"shard-{shard:04d}.jsonl"


def _read_lines(path: Path) -> list[dict[str, Any]]:
    out = []
    with path.open("r", encoding="utf-8") as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a torn last line from a killed writer: everything after is suspect
    return out


def read_completion(path: str | Path) -> CompletionRecord | None:
    """The completion record if the shard file is complete, else None."""
    path = Path(path)
    if not path.is_file():
        return None
    rows = _read_lines(path)
    if not rows or rows[-1].get("type") != COMPLETE:
        return None
    done = CompletionRecord.model_validate(rows[-1])
    if done.records != len(rows) - 1:
        return None  # written by a different run over the same path: do not trust it
    return done


def read_records(path: str | Path) -> list[OutputRecord]:
    """The output records of a complete shard file (raises if incomplete)."""
    path = Path(path)
    if read_completion(path) is None:
        raise FileNotFoundError(f"{path}: shard output is missing or incomplete; rerun its trial")
    rows = _read_lines(path)[:-1]
    return [
        GenerationRecord.model_validate(r) if r["type"] == "generation" else LoglikelihoodRecord.model_validate(r)
        for r in rows
    ]


class ShardWriter:
    """Appends records to a shard file; `finish()` writes the completion record last."""

    def __init__(self, path: str | Path, dataset: str, shard: int, backend: str) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.dataset, self.shard, self.backend = dataset, shard, backend
        self.count = 0
        # "w": a partial file from a killed run is thrown away, its shard redone whole.
        self._file = self.path.open("w", encoding="utf-8")

    def write(self, record: OutputRecord) -> None:
        self._file.write(record.model_dump_json() + "\n")
        self._file.flush()
        self.count += 1

    def finish(self, elapsed_s: float) -> CompletionRecord:
        done = CompletionRecord(dataset=self.dataset, shard=self.shard, records=self.count,
                                backend=self.backend, elapsed_s=elapsed_s)
        self._file.write(done.model_dump_json() + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        return done

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
