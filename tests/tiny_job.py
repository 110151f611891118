"""One tiny job shape shared by the flow and Slurm integration tests.

Its data is prepared once per session (the `tiny_data_dir` fixture of tests/conftest.py):
the model's vocabulary and sequence length are the same for every such job, so the same
packed tokens serve them all.
"""

from __future__ import annotations

import copy
from pathlib import Path

import yaml

TINY_MODEL = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
              "ffn_hidden_size": 128, "vocab_size": 512, "seq_length": 64}
TINY_DATA = {"corpus": ["stdlib"], "max_corpus_mb": 1.0, "val_fraction": 0.05}


def prepare_tiny_data(data_dir: Path) -> Path:
    from training.config import parse_job_spec
    from training.data import prepare_data

    job = {"name": "tiny-data", "model": dict(TINY_MODEL), "data": {**TINY_DATA, "data_dir": str(data_dir)},
           "training": {"global_batch_size": 8, "micro_batch_size": 2, "steps": 1}}  # data ignores it
    prepare_data(parse_job_spec(job), progress=False)
    return data_dir


def write_tiny_job(base: dict, data_dir: Path, where: Path, name: str, **sections) -> Path:
    """Write `base` plus the tiny model and data as `where/NAME.yaml`, with its own run dir and
    checkpoints under `where/NAME/`; `sections` update the spec's sections."""
    job = copy.deepcopy({**base, "model": TINY_MODEL, "data": {**TINY_DATA, "data_dir": str(data_dir)}})
    job["name"] = name
    job["checkpoint"]["url"] = str(where / name / "checkpoints")
    job["run_dir"] = str(where / name / "run")
    for section, values in sections.items():
        job.setdefault(section, {}).update(values)
    path = where / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path
