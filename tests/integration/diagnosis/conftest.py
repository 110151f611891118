"""Fixtures for the diagnosis agents: a scripted OpenAI-compatible server, the real
embedding model (loaded once per session) and a real Chroma store per test."""

from __future__ import annotations

import pytest

from scripted_llm_server import MODEL_ID, ScriptedLLMServer


@pytest.fixture(scope="session")
def llm_server_session():
    server = ScriptedLLMServer().start()
    yield server
    server.stop()


@pytest.fixture
def llm_server(llm_server_session: ScriptedLLMServer) -> ScriptedLLMServer:
    """The session's server with an empty script and request log."""
    llm_server_session.reset()
    yield llm_server_session
    llm_server_session.reset()


@pytest.fixture
def llm_config(llm_server: ScriptedLLMServer):
    from diagnosis.llm import LLMConfig

    # Short timeout and one retry keep the failure tests quick; generous enough for
    # a loaded machine answering a local server.
    return LLMConfig(
        model=MODEL_ID, base_url=llm_server.base_url, api_key="test-key", timeout_s=5.0, max_retries=1
    )


@pytest.fixture(scope="session")
def embedder():
    from diagnosis.failure_memory import shared_embedder

    return shared_embedder()


@pytest.fixture
def memory(tmp_path, embedder):
    from diagnosis.failure_memory import FailureMemory, MemoryConfig

    return FailureMemory(MemoryConfig(path=tmp_path / "failure-memory"), embedder)
