"""The cluster inventory: loading, catalogue defaults, every inconsistency error, mutations."""

from __future__ import annotations

from pathlib import Path

import pytest

from scheduler.cluster import ClusterError, Node, detect_local_cluster, load_cluster, parse_cluster
from scheduler.gpus import gpu_spec, lookup_gpu, match_device_name

REPO = Path(__file__).resolve().parents[3]


def _cluster(*nodes: dict, **top) -> dict:
    return {"name": "t", "nodes": list(nodes), **top}


def test_frenzy_testbed_matches_the_paper():
    cluster = load_cluster(REPO / "configs/clusters/frenzy-testbed.yaml")
    assert cluster.total_gpus == 2 + 1 + 4 + 2 * 2
    assert cluster.total_gpus_by_type() == {"A100-40G": 3, "A800-80G": 4, "A100-80G": 4}
    a800 = cluster.node("a800-80g-x4")
    assert a800.intra_link == "NVLink" and a800.gpu_memory_gib == 80
    pcie = cluster.node("a100-80g-pcie-1")  # expanded from `replicas: 2`
    assert pcie.intra_link == "PCIe" and pcie.intra_bandwidth_gbps < a800.intra_bandwidth_gbps
    assert pcie.pcie_root_complex == [0, 1]


def test_crius_cluster_has_1280_gpus_of_four_types():
    cluster = load_cluster(REPO / "configs/clusters/crius-sim.yaml")
    assert cluster.total_gpus == 1280
    assert set(cluster.gpu_types()) == {"A100-40G", "A40", "A10", "V100-32G"}
    # Crius Table 1's node shapes: A100 80 x 4, A40 160 x 2, A10 160 x 2, V100 20 x 16.
    shapes: dict[str, set[tuple[int, str]]] = {}
    for n in cluster.nodes:
        assert n.pcie_root_complex is not None and len(n.pcie_root_complex) == n.gpu_count
        shapes.setdefault(n.gpu_type, set()).add((n.gpu_count, n.intra_link))
    assert shapes == {"A100-40G": {(4, "NVLink")}, "A40": {(2, "PCIe")}, "A10": {(2, "PCIe")},
                      "V100-32G": {(16, "NVLink")}}
    assert cluster.total_gpus_by_type() == {"A100-40G": 320, "A40": 320, "A10": 320, "V100-32G": 320}
    assert len({n.name for n in cluster.nodes}) == 80 + 160 + 160 + 20


def test_catalogue_fills_defaults_and_explicit_values_win():
    cluster = parse_cluster(_cluster(
        {"name": "n0", "gpu_type": "a100-80g", "gpu_count": 2},
        {"name": "n1", "gpu_type": "A100-80G", "gpu_count": 1, "gpu_memory_gib": 79.2},
    ))
    n0, n1 = cluster.nodes
    assert n0.gpu_type == "A100-80G"  # canonical spelling
    assert (n0.gpu_memory_gib, n0.peak_tflops, n0.intra_link) == (80, 312, "NVLink")
    assert n1.gpu_memory_gib == 79.2
    assert n0.free_gpus == [0, 1]
    assert cluster.gpu_memory_gib("A100-80G") == 79.2  # the smallest, for safe sizing


def test_gpu_types_sorted_fastest_first_and_v100_has_no_bf16():
    cluster = parse_cluster(_cluster(
        {"name": "v", "gpu_type": "V100-32G", "gpu_count": 1},
        {"name": "h", "gpu_type": "H100-80G", "gpu_count": 1},
        {"name": "a", "gpu_type": "A10", "gpu_count": 1},
    ))
    assert cluster.gpu_types() == ["H100-80G", "A10", "V100-32G"]
    assert cluster.node("v").supports_bf16 is False


def test_driver_names_map_to_catalogue_entries():
    assert match_device_name("NVIDIA A100-SXM4-80GB", 79.2).name == "A100-80G"
    assert match_device_name("NVIDIA A100-PCIE-40GB", 39.4).name == "A100-40G"
    assert match_device_name("NVIDIA A10", 22.5).name == "A10"  # not an A100
    assert match_device_name("Tesla V100-SXM2-16GB", 15.8).name == "V100-16G"
    assert match_device_name("Some New Accelerator", 10) is None
    assert lookup_gpu("nonexistent") is None
    with pytest.raises(KeyError, match="known types"):
        gpu_spec("nonexistent")


@pytest.mark.parametrize(
    ("nodes", "top", "message"),
    [
        ([{"name": "a", "gpu_type": "A10", "gpu_count": 1}] * 2, {}, "duplicate node name"),
        ([{"name": "a", "gpu_type": "A10", "gpu_count": 2, "free_gpus": [0, 2]}], {}, r"free_gpus \[2\] out of range"),
        ([{"name": "a", "gpu_type": "A10", "gpu_count": 2, "free_gpus": [1, 1]}], {}, "more than once"),
        ([{"name": "a", "gpu_type": "A10", "gpu_count": 4, "pcie_root_complex": [0, 1]}], {},
         "pcie_root_complex has 2 entries but gpu_count is 4"),
        ([{"name": "a", "gpu_type": "A10", "gpu_count": 1, "pcie_root_complex": [-1]}], {}, ">= 0"),
        ([{"name": "a", "gpu_type": "MysteryGPU", "gpu_count": 1}], {},
         "not in the GPU catalogue, so gpu_memory_gib and peak_tflops must be given"),
        ([{"name": "a", "gpu_type": "MysteryGPU", "gpu_count": 1, "gpu_memory_gib": 16}], {},
         "peak_tflops must be given"),
        ([{"name": "a", "gpu_type": "A10", "gpu_count": 0}], {}, "gpu_count"),
        ([{"name": "a", "gpu_type": "A10", "gpu_count": 1, "gpu_memory_gib": -1}], {}, "gpu_memory_gib"),
        ([{"name": "a", "gpu_type": "A10", "gpu_count": 1, "intra_link": "Infiniband"}], {}, "intra_link"),
        ([{"name": "a", "gpu_type": "A10", "gpu_count": 1, "gpu_cuont": 2}], {}, "gpu_cuont"),
        ([{"name": "a", "gpu_type": "A10", "gpu_count": 1}], {"inter_node_bandwidth_gbps": 0}, "inter_node_bandwidth"),
        ([], {}, "nodes"),
        ([{"name": "a", "gpu_type": "A10", "gpu_count": 1, "replicas": 0}], {}, "replicas must be"),
    ],
)
def test_inconsistent_inventories_get_one_clear_error(nodes, top, message):
    with pytest.raises(ClusterError, match=message):
        parse_cluster(_cluster(*nodes, **top), source="inv.yaml")


def test_error_names_the_node_not_its_index():
    with pytest.raises(ClusterError) as info:
        parse_cluster(_cluster(
            {"name": "good", "gpu_type": "A10", "gpu_count": 1},
            {"name": "bad-node", "gpu_type": "A10", "gpu_count": 2, "free_gpus": [5]},
        ), source="inv.yaml")
    text = str(info.value)
    assert text.startswith("inv.yaml: invalid cluster inventory")
    assert "nodes['bad-node']" in text


def test_file_errors(tmp_path):
    with pytest.raises(ClusterError, match="no such cluster file"):
        load_cluster(tmp_path / "missing.yaml")
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    with pytest.raises(ClusterError, match="empty"):
        load_cluster(empty)
    broken = tmp_path / "broken.yaml"
    broken.write_text("nodes: [\n")
    with pytest.raises(ClusterError, match="not valid YAML at line"):
        load_cluster(broken)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42\n")
    with pytest.raises(ClusterError, match="mapping"):
        load_cluster(scalar)


def test_cordon_hides_idle_gpus_and_blocks_allocation():
    cluster = parse_cluster(_cluster(
        {"name": "a", "gpu_type": "A100-40G", "gpu_count": 4},
        {"name": "b", "gpu_type": "A100-40G", "gpu_count": 2},
    ))
    assert cluster.free_gpus_by_type() == {"A100-40G": 6}
    cluster.cordon("a")
    assert cluster.free_gpus_by_type() == {"A100-40G": 2}
    assert cluster.node("a").idle_gpus == [] and cluster.schedulable_nodes() == [cluster.node("b")]
    assert [n.name for n in cluster.nodes_of_type("A100-40G")] == ["b"]
    with pytest.raises(ClusterError, match="cordoned"):
        cluster.allocate("a", [0])
    cluster.uncordon("a")
    assert cluster.free_gpus_by_type() == {"A100-40G": 6}
    with pytest.raises(ClusterError, match="no node named 'zzz'"):
        cluster.cordon("zzz")


def test_allocate_and_release_keep_the_free_list_exact():
    cluster = parse_cluster(_cluster({"name": "a", "gpu_type": "A40", "gpu_count": 4}))
    before = cluster.copy_state()
    cluster.allocate("a", [1, 3])
    assert cluster.node("a").free_gpus == [0, 2]
    assert before.node("a").free_gpus == [0, 1, 2, 3]  # the copy is independent
    with pytest.raises(ClusterError, match="not free"):
        cluster.allocate("a", [1])
    with pytest.raises(ClusterError, match="duplicates"):
        cluster.allocate("a", [0, 0])
    with pytest.raises(ClusterError, match="already free"):
        cluster.release("a", [0])
    with pytest.raises(ClusterError, match="out of range"):
        cluster.release("a", [7])
    cluster.release("a", [3, 1])
    assert cluster.node("a").free_gpus == [0, 1, 2, 3]


def test_bandwidth_units_convert_to_bytes():
    node = Node(name="n", gpu_type="A100-40G", gpu_count=1)
    assert node.intra_bandwidth_bytes_per_s == pytest.approx(600e9)  # NVLink3: 4800 Gbit/s
    cluster = parse_cluster(_cluster({"name": "n", "gpu_type": "A10", "gpu_count": 1},
                                     inter_node_bandwidth_gbps=200))
    assert cluster.inter_node_bandwidth_bytes_per_s == pytest.approx(25e9)
    assert node.root_complex_of(0) is None


def test_yaml_round_trip():
    cluster = load_cluster(REPO / "configs/clusters/frenzy-testbed.yaml")
    import yaml

    again = parse_cluster(yaml.safe_load(cluster.to_yaml()))
    assert again == cluster


def test_detect_local_cpu_cluster():
    cluster = detect_local_cluster(force_cpu=True, cpu_workers=2, cpu_memory_fraction=0.5)
    (node,) = cluster.nodes
    assert node.gpu_type == "cpu" and node.gpu_count == 2 and node.intra_link == "host"
    assert node.gpu_memory_gib > 0 and node.host_ram_gib >= node.gpu_memory_gib * 2
    assert node.free_gpus == [0, 1]
    default = detect_local_cluster(force_cpu=True)
    assert default.nodes[0].gpu_count >= 1
    with pytest.raises(ClusterError, match="cpu_memory_fraction"):
        detect_local_cluster(force_cpu=True, cpu_memory_fraction=1.5)


def test_copy_state_is_independent_of_the_original():
    cluster = parse_cluster({"name": "c", "nodes": [{"name": "n", "replicas": 2, "gpu_type": "A100-80G",
                                                    "gpu_count": 4}]})
    copy = cluster.copy_state()
    copy.allocate("n-0", [0, 1])
    copy.node("n-1").cordoned = True
    assert cluster.node("n-0").free_gpus == [0, 1, 2, 3] and copy.node("n-0").free_gpus == [2, 3]
    assert not cluster.node("n-1").cordoned
    assert copy.node("n-0") is copy.nodes[0] and cluster.node("n-0") is cluster.nodes[0]
    cluster.allocate("n-0", [3])
    assert copy.node("n-0").free_gpus == [2, 3]  # and the other way round


@pytest.mark.parametrize(("nodes", "message"), [
    # counted before any node is made: ten million replicas is an error at once, not a hang
    ([{"name": "a", "gpu_type": "A10", "gpu_count": 8, "replicas": 10_000_000}],
     "node 'a': replicas 10,000,000 brings the cluster over the cap of 100,000 nodes"),
    ([{"name": "a", "gpu_type": "A10", "gpu_count": 8, "replicas": 60_000},
      {"name": "b", "gpu_type": "A10", "gpu_count": 8, "replicas": 40_000},
      {"name": "c", "gpu_type": "A10", "gpu_count": 8}],
     "the nodes list brings the cluster over the cap of 100,000 nodes"),
    ([{"name": "a", "gpu_type": "A10", "gpu_count": 1_025}], "gpu_count 1025 is over the cap of 1,024 GPUs per node"),
])
@pytest.mark.timeout(60)  # before the cap, ten million replicas were expanded one by one
def test_counts_no_real_cluster_reaches_are_refused_with_the_cap(nodes, message):
    with pytest.raises(ClusterError, match=message):
        parse_cluster(_cluster(*nodes), source="inv.yaml")


def test_a_cluster_at_the_caps_loads():
    assert parse_cluster(_cluster({"name": "a", "gpu_type": "A10", "gpu_count": 1_024})).total_gpus == 1_024
    cluster = parse_cluster(_cluster({"name": "a", "gpu_type": "A10", "gpu_count": 1, "replicas": 99_999},
                                     {"name": "b", "gpu_type": "A10", "gpu_count": 1}))
    assert len(cluster.nodes) == 100_000 and cluster.node("a-99998")


@pytest.mark.parametrize("name", ["../x", "a/b", "a\nb", "a\n", ".hidden", "-opt", "", "x" * 201, "名前"])
def test_cluster_and_node_names_are_plain_words(name):
    with pytest.raises(ClusterError, match=r"^inv.yaml: invalid cluster inventory \(1 problem\(s\)\)\n  - name: "):
        parse_cluster({"name": name, "nodes": [{"name": "n", "gpu_type": "A10", "gpu_count": 1}]}, source="inv.yaml")
    with pytest.raises(ClusterError, match=r"\(1 problem\(s\)\)\n  - nodes\["):
        parse_cluster(_cluster({"name": name, "gpu_type": "A10", "gpu_count": 1}), source="inv.yaml")
    assert parse_cluster({"name": "lab-2.gpu_a", "nodes": [{"name": "n", "gpu_type": "A10", "gpu_count": 1}]})
