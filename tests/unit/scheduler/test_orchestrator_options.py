"""A job's options: the GPU count a user may ask for, and whether any option fits the nodes in service."""

from __future__ import annotations

import pytest

from flows.cli import main
from scheduler.cluster import parse_cluster
from scheduler.orchestrator import OrchestratorError, job_options
from scheduler.orchestrator.options import idle_fit, require_idle_fit
from scheduler.policy import Option
from training.config import load_job_spec

TESTBED = parse_cluster({"name": "testbed", "nodes": [
    {"name": "a100", "gpu_type": "A100-80G", "gpu_count": 4},
    {"name": "a10", "gpu_type": "A10", "gpu_count": 2},
]})
TWO_SMALL = {"name": "two-small", "nodes": [
    {"name": "node-a", "gpu_type": "A10", "gpu_count": 1},
    {"name": "node-b", "gpu_type": "A10", "gpu_count": 1},
]}
GIB = 2**30


def _option(num_gpus: int, unit: int = 1, memory_gib: float = 1.0, gpu_type: str = "A10") -> Option:
    return Option(gpu_type=gpu_type, num_gpus=num_gpus, unit=unit, min_memory_bytes=int(memory_gib * GIB),
                  run_s=100.0, dp=num_gpus // unit, tp=unit)


# --- how many GPUs a user may ask for -------------------------------------------------


@pytest.mark.parametrize("gpus", [0, -1])
def test_asking_for_no_gpu_says_ask_for_at_least_one(gpus):
    with pytest.raises(OrchestratorError) as refused:
        job_options(load_job_spec("configs/tiny-cpu.yaml"), TESTBED, gpus=gpus)
    assert "ask for at least 1 GPU" in str(refused.value) and "fewer" not in str(refused.value)


def test_asking_for_too_many_gpus_still_says_ask_for_fewer():
    with pytest.raises(OrchestratorError, match="at most 4 .*ask for fewer"):
        job_options(load_job_spec("configs/tiny-cpu.yaml"), TESTBED, gpus=5)


@pytest.mark.parametrize("gpus", ["0", "-1"])
def test_cli_submit_with_no_gpu_is_one_error_and_exit_2(tmp_path, capsys, gpus):
    db = ["--db", f"sqlite:///{tmp_path / 'cli.db'}"]
    assert main(["cluster", "register", "configs/clusters/frenzy-testbed.yaml", *db]) == 0
    capsys.readouterr()
    assert main(["submit", "configs/tiny-cpu.yaml", "--gpus", gpus, *db]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: job asks for {gpus} GPU(s); ask for at least 1 GPU") and err.count("\n") == 1


# --- does any option fit the nodes in service (ignoring what other jobs hold) ----------


def test_idle_fit_ignores_what_other_jobs_hold():
    cluster = parse_cluster(TWO_SMALL)
    for node in cluster.nodes:
        node.free_gpus = []  # another job holds every GPU: it still fits once that one ends
    assert idle_fit([_option(2)], cluster) == _option(2)


def test_idle_fit_leaves_cordoned_and_drained_nodes_out():
    cluster = parse_cluster(TWO_SMALL)
    cluster.cordon("node-b")  # the orchestrator's cluster marks drained nodes cordoned too
    assert idle_fit([_option(2)], cluster) is None
    assert idle_fit([_option(2), _option(1)], cluster) == _option(1)  # the first option that fits


@pytest.mark.parametrize("option", [
    _option(2, unit=2),  # a tensor-parallel pair cannot straddle two 1-GPU nodes
    _option(1, memory_gib=48),  # an A10 has 24 GiB
    _option(1, gpu_type="A100-80G"),  # no such GPU in the cluster
])
def test_idle_fit_uses_the_placement_rules(option):
    assert idle_fit([option], parse_cluster(TWO_SMALL)) is None


def test_require_idle_fit_says_what_is_needed_what_is_left_and_how_to_fix_it():
    cluster = parse_cluster(TWO_SMALL)
    cluster.cordon("node-b")
    with pytest.raises(OrchestratorError) as refused:
        require_idle_fit([_option(4), _option(2, memory_gib=10)], cluster, job="llama",
                         out_of_service={"node-b": "cordoned: failed the node check"})
    message = str(refused.value)
    assert "job 'llama' cannot be placed on cluster 'two-small'" in message
    assert "2x A10 with 10.0 GiB each" in message  # the smallest plan
    assert "1x A10 on 1 node(s) (node-a;" in message  # what is left
    assert "node-b (cordoned: failed the node check)" in message  # what is out, and why
    assert "forgeflow cluster uncordon NODE --cluster two-small" in message and "register" in message
    assert require_idle_fit([_option(2), _option(1)], cluster, job="llama") == _option(1)


def test_require_idle_fit_with_no_node_in_service():
    cluster = parse_cluster(TWO_SMALL)
    for node in ("node-a", "node-b"):
        cluster.cordon(node)
    with pytest.raises(OrchestratorError, match="schedulable nodes hold none; out of service: node-a "):
        require_idle_fit([_option(1)], cluster, job="llama")
