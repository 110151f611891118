"""Shared fixtures for training integration tests: one small prepared dataset per session.

`tiny_prepared` is a real `prepare_data` run (stdlib corpus capped at 1 MB, byte-level
BPE with vocab 512) done once per session. A test that needs a job spec of its own
should start from `tiny_job_dict` (or `tiny_job_file`): its `data:` and
`model.vocab_size` match the prepared data, so `prepare_data(spec)` in that test (or
in a worker it starts) finds the files complete and returns at once.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

TINY_VOCAB = 512
TINY_SEQ = 64
# The model a CPU test can train in seconds; GQA (4 heads, 2 groups) so export covers it.
TINY_MODEL = {
    "num_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_query_groups": 2,
    "ffn_hidden_size": 128,
    "vocab_size": TINY_VOCAB,
    "seq_length": TINY_SEQ,
}
TINY_TRAINING = {"global_batch_size": 8, "micro_batch_size": 2, "steps": 20, "lr": 1.0e-3,
                 "min_lr": 1.0e-4, "warmup_steps": 2, "seed": 1234}
TINY_DATA = {"corpus": ["stdlib"], "max_corpus_mb": 1.0, "val_fraction": 0.05}


@pytest.fixture(scope="session")
def tiny_data_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny-data")


@pytest.fixture(scope="session")
def tiny_job_dict(tiny_data_dir: Path, tmp_path_factory) -> dict:
    """A job spec (as a dict) over the shared prepared data; deep-copy before changing it."""
    run_root = tmp_path_factory.mktemp("tiny-runs")
    return {
        "name": "tiny-test",
        "model": dict(TINY_MODEL),
        "training": dict(TINY_TRAINING),
        "data": {**TINY_DATA, "data_dir": str(tiny_data_dir)},
        "checkpoint": {"interval": 10, "url": str(run_root / "checkpoints"), "async_save": False},
        "run_dir": str(run_root / "{name}"),
    }


@pytest.fixture(scope="session")
def tiny_prepared(tiny_job_dict: dict):
    """The shared PreparedData (tokenizer + train.bin/val.bin + meta.json)."""
    from training.config import parse_job_spec
    from training.data import prepare_data

    return prepare_data(parse_job_spec(copy.deepcopy(tiny_job_dict)), progress=False)


@pytest.fixture
def tiny_job_file(tiny_job_dict: dict, tiny_prepared, tmp_path: Path) -> Path:
    """A YAML job spec file over the shared prepared data (data already prepared)."""
    path = tmp_path / "tiny-test.yaml"
    path.write_text(yaml.safe_dump(copy.deepcopy(tiny_job_dict), sort_keys=False))
    return path


@pytest.fixture
def two_node_request(tiny_job_dict: dict, tiny_prepared, tmp_path: Path, free_port: int):
    """make(name, steps, fault) -> the LaunchRequest of the tiny job on two local "nodes" of one
    rank each (node-a, node-b), with the fault drill on; its run directory is tmp_path/run."""
    from infra.launch import LaunchRequest, local_node_launches

    def make(name: str, steps: int, fault: str):
        spec = copy.deepcopy(tiny_job_dict)
        spec.update(name=name, run_dir=str(tmp_path / "run"))
        spec["training"]["steps"] = steps
        spec["checkpoint"] = {**spec["checkpoint"], "url": str(tmp_path / "ckpt"), "interval": 10_000}
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(spec, sort_keys=False))
        return LaunchRequest(name, local_node_launches(["node-a", "node-b"], 1, free_port),
                             ["-m", "training.train", str(path)], tmp_path / "run",
                             env={"FORGEFLOW_FAULT": fault, "OMP_NUM_THREADS": "1"})
    return make
