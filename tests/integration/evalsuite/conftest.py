"""A tiny random Llama + locally trained tokenizer, built once per test session (no download)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from testing.tiny_checkpoint import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-model") / "hf")


@pytest.fixture(scope="session")
def tiny_backend(tiny_model: Path):
    from evalsuite.backends import load_backend

    return load_backend("transformers", tiny_model, {"batch_size": 8, "device": "cpu"})
