"""The elastic policy (`scheduler.elastic`) in the live orchestrator, on SQLite and a real PostgreSQL:
a cluster registered with `policy: elastic` admits queued jobs FCFS-opportunistic."""

from __future__ import annotations

from scheduler.cluster import parse_cluster
from scheduler.orchestrator import Orchestrator, OrchestratorConfig, demand_options
from scheduler.orchestrator import double_booked
from scheduler.orchestrator.start_estimates import queue_estimates

FOUR_CPUS = {"name": "four", "policy": "elastic",
             "nodes": [{"name": "n1", "gpu_type": "cpu", "gpu_count": 4, "gpu_memory_gib": 16, "peak_tflops": 1}]}


def test_an_elastic_cluster_admits_fcfs(state_db_url):
    orch = Orchestrator(state_db_url, OrchestratorConfig(lease_s=600))
    orch.register(parse_cluster(FOUR_CPUS))
    three = demand_options(orch.cluster(), 3, duration_s=10)
    assert three["elastic"] == three["fcfs"]
    a = orch.submit("a", three)
    b = orch.submit("b", three)
    one = orch.submit("one", demand_options(orch.cluster(), 1, duration_s=10))  # opportunistic: passes B
    assert [orch.job(j)["state"] for j in (a, b, one)] == ["running", "queued", "running"]
    assert queue_estimates(orch.engine)[b].start_s is not None  # A's predicted end (its FCFS pass)
    orch.release(a)
    assert orch.job(b)["state"] == "running"
    assert double_booked(orch.engine) == 0
    config = Orchestrator(state_db_url, OrchestratorConfig(policy="elastic", lease_s=600))  # the config's literal
    c = config.submit("c", three)
    assert config.job(c)["state"] == "queued"
    config.release(b)
    assert config.job(c)["state"] == "running"
