"""Profiles measured on the device the executor will run on (on CPU it measures the CPU).

`measure_profile` loads the embedding, ONE decoder layer and the head of a HF
Llama folder (the decoder layers are identical, so one stands for all: the
partition then solves the small layer-count program), and times each for one
micro batch: forward without autograd, and backward as the executor runs it
(recompute the forward with autograd, then backward). Bytes are read off the
tensors: parameters, gradients (same), Adam state (2x, host), the activations
autograd saves (every saved storage once, weights excluded — the executor's own
accounting), and the output a stage boundary carries.

`measure_copy_bandwidth` times host->device copies (on CPU: the clone the CPU
prefetcher makes); `hardware_for` builds OffloadHardware from an inventory node
(PCIe figure and root complexes) or from a measured bandwidth.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from scheduler.cluster import Node
from scheduler.offload.profile import LayerProfile, ModelProfile, OffloadHardware


def _timed(fn, repeats: int) -> float:
    fn()  # warm-up (allocator, kernels)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure_profile(model_dir: str | Path, *, micro_batch: int, seq_length: int, microbatches: int,
                    device: str | torch.device = "cpu", repeats: int = 3) -> ModelProfile:
    from training.offload.units import SequenceContext, load_llama_config, load_units, run_unit, unit_kind

    device = torch.device(device)
    config = load_llama_config(model_dir)
    L = config.num_hidden_layers
    head_index = L + 1
    units = load_units(model_dir, config, [0, 1, head_index])
    ctx = SequenceContext(config, device)
    tokens = torch.randint(0, config.vocab_size, (micro_batch, seq_length + 1), generator=torch.Generator().manual_seed(0))
    x_tokens, target = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
    with torch.no_grad():
        hidden = run_unit("embed", units[0].to(device), x_tokens, ctx)

    profiles = {}
    for index in (0, 1, head_index):
        module = units[index].to(device)
        kind = unit_kind(config, index)
        inp = x_tokens if kind == "embed" else hidden
        params = {n: p.detach().clone().requires_grad_(True) for n, p in module.named_parameters()}
        weight_ptrs = {p.untyped_storage().data_ptr() for p in params.values()}

        def forward():
            with torch.no_grad():
                return run_unit(kind, module, inp, ctx, params)

        saved = {"bytes": 0, "seen": set()}

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in weight_ptrs and ptr not in saved["seen"]:
                saved["seen"].add(ptr)
                saved["bytes"] += t.untyped_storage().nbytes()
            return t

        def backward():
            saved["bytes"], saved["seen"] = 0, set()
            x = inp if kind == "embed" else inp.detach().requires_grad_(True)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                y = run_unit(kind, module, x, ctx, params)
                out = F.cross_entropy(y.reshape(-1, y.shape[-1]).float(), target.reshape(-1)) if kind == "head" else y
            if kind == "head":
                out.backward()
            else:
                out.backward(torch.ones_like(out))
            for p in params.values():
                p.grad = None

        fwd_s = _timed(forward, repeats)
        bwd_s = _timed(backward, repeats)
        pbytes = sum(p.numel() * p.element_size() for p in params.values())
        out_bytes = 4 * micro_batch if kind == "head" else hidden.numel() * hidden.element_size()
        profiles[index] = dict(forward_s=fwd_s, backward_s=bwd_s, param_bytes=pbytes, grad_bytes=pbytes,
                               optimizer_bytes=2 * pbytes, activation_bytes=saved["bytes"], output_bytes=out_bytes)

    def layer(name: str, index: int) -> LayerProfile:
        return LayerProfile(name=name, **profiles[index])

    layers = (layer("embedding", 0), *[layer(f"layer{i}", 1) for i in range(L)], layer("head", head_index))
    return ModelProfile(layers, microbatches=microbatches, source=f"measured on {device}",
                        meta={"micro_batch": micro_batch, "seq_length": seq_length, "model_dir": str(model_dir)})


def measure_copy_bandwidth(device: str | torch.device = "cpu", nbytes: int = 32 * 2**20, repeats: int = 3) -> float:
    """Host->device bytes/s: pinned-memory copies to a GPU, or the clone a CPU prefetch makes."""
    device = torch.device(device)
    src = torch.empty(nbytes // 4, dtype=torch.float32)
    if device.type == "cuda":
        src = src.pin_memory()
        seconds = _timed(lambda: src.to(device, non_blocking=True), repeats)
    else:
        seconds = _timed(lambda: src.clone(), repeats)
    return nbytes / max(seconds, 1e-9)


def hardware_for(node: Node, *, gpus: int | None = None, memory_bytes: int | None = None,
                 memory_margin: float = 0.10, h2d_bytes_per_s: float | None = None) -> OffloadHardware:
    """The offload view of an inventory node: its GPUs' memory (minus a margin), per-GPU PCIe
    bandwidth (`intra_bandwidth_gbps`, or measured), and root complexes."""
    count = gpus or node.gpu_count
    usable = memory_bytes if memory_bytes is not None else int(node.gpu_memory_bytes * (1 - memory_margin))
    rc = tuple(node.pcie_root_complex[:count]) if node.pcie_root_complex else None
    return OffloadHardware(num_gpus=count, gpu_memory_bytes=usable,
                           h2d_bytes_per_s=h2d_bytes_per_s or node.intra_bandwidth_bytes_per_s,
                           root_complex=rc, name=node.name)
