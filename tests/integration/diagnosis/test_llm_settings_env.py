"""One resolution of the LLM settings for both agents.

With only the standard OPENAI_BASE_URL / OPENAI_API_KEY (plus forgeflow's model
name) in the environment, the log agent (openai client) and the failure agent
(llama-index's OpenAILike query engine) must both reach the same local server over
real HTTP, with the key; before, the failure agent fell back to api.openai.com.
"""

from __future__ import annotations

from diagnosis.agents import AgentsConfig, DiagnosisAgents
from diagnosis.api import diagnose_log
from diagnosis.llm import PUBLIC_BASE_URL, LLMConfig
from diagnosis.failure_memory import MemoryConfig
from scripted_llm_server import MODEL_ID
from test_failure_agent_rag import PAST_FAILURES, careful_llm, write_log


def _standard_env_only(monkeypatch, base_url: str) -> None:
    for name in ("FORGEFLOW_LLM_BASE_URL", "OPENAI_BASE_URL", "OPENAI_API_KEY", "FORGEFLOW_LLM_MODEL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OPENAI_BASE_URL", base_url)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-standard-env")
    monkeypatch.setenv("FORGEFLOW_LLM_MODEL", MODEL_ID)


def test_both_agents_reach_the_server_named_by_the_standard_variables(tmp_path, monkeypatch, llm_server, embedder):
    _standard_env_only(monkeypatch, llm_server.base_url)
    llm_server.respond_with(careful_llm())
    agents = DiagnosisAgents(AgentsConfig.from_env(memory=MemoryConfig(path=tmp_path / "memory")), embedder=embedder)
    # a non-empty memory sends the failure agent through llama-index's query engine
    agents.memory_for(None).add_many(PAST_FAILURES)

    diagnosis = diagnose_log(write_log(tmp_path / "job.log"), job_family="env-test", state_dir=tmp_path / "state", agent=agents)

    assert diagnosis.source == "agent" and diagnosis.root_cause == "ValueError"
    assert not agents.last_report.failure_agent.failures  # no fallback to retrieval
    log_agent = [r for r in llm_server.requests if "You maintain filter rules" in r.text]
    failure_agent = [r for r in llm_server.requests if "You diagnose failed" in r.text]
    assert log_agent and failure_agent
    for request in log_agent + failure_agent:
        assert request.headers["authorization"] == "Bearer sk-standard-env"
        assert request.body["model"] == MODEL_ID


def test_endpoint_resolution_order(monkeypatch):
    for name in ("FORGEFLOW_LLM_BASE_URL", "OPENAI_BASE_URL", "FORGEFLOW_LLM_MODEL"):
        monkeypatch.delenv(name, raising=False)
    assert LLMConfig(model="m").endpoint == PUBLIC_BASE_URL
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:1/v1")
    assert LLMConfig.from_env() is None  # a standard URL alone does not switch the agents on
    assert LLMConfig(model="m").endpoint == "http://127.0.0.1:1/v1"
    monkeypatch.setenv("FORGEFLOW_LLM_BASE_URL", "http://127.0.0.1:2/v1")
    assert LLMConfig(model="m").endpoint == "http://127.0.0.1:2/v1"  # forgeflow's own wins
    assert LLMConfig(model="m", base_url="http://127.0.0.1:3/v1").endpoint == "http://127.0.0.1:3/v1"
