"""Fixtures for diagnosis unit tests: a private state dir and the labelled corpus."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

CORPUS = Path(__file__).resolve().parents[2] / "data" / "failures"


@pytest.fixture
def state(tmp_path, monkeypatch) -> Path:
    """A fresh state dir, also exported so code that reads the env sees it."""
    path = tmp_path / "state"
    monkeypatch.setenv("FORGEFLOW_STATE_DIR", str(path))
    return path


@pytest.fixture(scope="session")
def corpus_labels() -> dict:
    return json.loads((CORPUS / "labels.json").read_text())
