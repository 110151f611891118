"""Measured offload profiles: bytes read off the real model, one decoder layer standing for all."""

from __future__ import annotations

import torch

from scheduler.cluster import parse_cluster
from scheduler.offload.measure import hardware_for, measure_copy_bandwidth, measure_profile
from scheduler.offload.partition import solve_partition, uniform_blocks
from scheduler.offload.profile import OffloadHardware


def test_profile_of_a_tiny_llama_folder(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False))
    model.save_pretrained(tmp_path)
    profile = measure_profile(tmp_path, micro_batch=2, seq_length=8, microbatches=2)
    assert profile.num_layers == 5 and uniform_blocks(profile)
    assert profile.param_bytes == sum(p.numel() * 4 for p in model.parameters())
    layer = profile.layers[1]
    assert layer.forward_s > 0 and layer.backward_s > 0 and layer.activation_bytes > 0
    assert layer.output_bytes == 2 * 8 * 32 * 4
    assert layer.optimizer_bytes == 2 * layer.param_bytes
    bandwidth = measure_copy_bandwidth(nbytes=4 * 2**20)
    part = solve_partition(profile, OffloadHardware(2, 2 * profile.param_bytes, bandwidth))
    assert part.optimal and max(part.peak_memory_bytes) <= 2 * profile.param_bytes


def test_hardware_from_an_inventory_node():
    node = parse_cluster({"name": "c", "nodes": [{"name": "n", "gpu_type": "cpu-box", "gpu_count": 4,
                                                  "gpu_memory_gib": 24, "peak_tflops": 40, "intra_link": "PCIe",
                                                  "intra_bandwidth_gbps": 64, "pcie_root_complex": [0, 0, 1, 1]}]}).nodes[0]
    hw = hardware_for(node, memory_margin=0.1)
    assert hw.num_gpus == 4 and hw.root_complex == (0, 0, 1, 1)
    assert hw.h2d_bytes_per_s == 8e9 and hw.gpu_memory_bytes == int(24 * 1024**3 * 0.9)
