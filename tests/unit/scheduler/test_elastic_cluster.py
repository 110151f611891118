"""The cluster file selects the elastic policy like the others; a misspelt policy is one clear error."""

from __future__ import annotations

import pytest

from scheduler.cluster import ClusterError, load_cluster, parse_cluster

NODES = [{"name": "n0", "gpu_type": "A100-80G", "gpu_count": 8}]


def test_the_cluster_file_selects_elastic():
    assert parse_cluster({"name": "t", "policy": "elastic", "nodes": NODES}).policy == "elastic"
    assert parse_cluster({"name": "t", "nodes": NODES}).policy == "has"  # the default is unchanged


def test_a_bad_policy_is_one_error_naming_the_field_and_the_choices(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("name: t\npolicy: elastik\nnodes:\n  - name: n0\n    gpu_type: A100-80G\n    gpu_count: 8\n")
    with pytest.raises(ClusterError) as err:
        load_cluster(path)
    message = str(err.value)
    assert "1 problem" in message and "policy" in message and "'elastic'" in message and "elastik" in message
