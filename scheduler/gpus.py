"""A catalogue of common accelerator types: memory, peak dense TFLOP/s, typical intra-node link.

The inventory (`scheduler.cluster`) fills a node's missing fields from here, so a
cluster file can say `gpu_type: A100-40G` and nothing else. Figures are vendor
datasheet values for dense (no sparsity) tensor-core math in bf16, or fp16 on
GPUs without bf16 (V100, T4, Turing cards), which `supports_bf16` records.
Memory is the device's total memory in GiB as the driver reports it, rounded;
what a job can really use is lower (CUDA context, allocator), and that gap is
the memory estimator's runtime-overhead term, not the catalogue's business.

Bandwidths are unidirectional-aggregate per GPU in gigabits per second (Gbit/s)
so that intra-node links and network links share one unit
(NVLink3 on A100 SXM: 600 GB/s = 4800 Gbit/s; PCIe 4.0 x16: ~32 GB/s = 256 Gbit/s).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Literal

IntraLink = Literal["NVLink", "PCIe"]

# One PCIe generation's x16 slot, in Gbit/s (≈ usable GB/s × 8).
PCIE3_X16_GBPS = 128.0
PCIE4_X16_GBPS = 256.0
PCIE5_X16_GBPS = 512.0


@dataclass(frozen=True, kw_only=True)
class GpuSpec:
    """Datasheet facts about one accelerator type."""

    name: str
    memory_gib: float
    peak_tflops: float  # dense bf16 (fp16 where bf16 is unsupported)
    supports_bf16: bool
    intra_link: IntraLink  # the link of the usual server form factor
    intra_bandwidth_gbps: float  # Gbit/s per GPU over intra_link
    aliases: tuple[str, ...] = ()


_CATALOGUE: tuple[GpuSpec, ...] = (
    GpuSpec(name="A100-40G", memory_gib=40, peak_tflops=312, supports_bf16=True,
            intra_link="NVLink", intra_bandwidth_gbps=4800, aliases=("A100-SXM4-40GB", "A100-PCIE-40GB", "A100")),
    GpuSpec(name="A100-80G", memory_gib=80, peak_tflops=312, supports_bf16=True,
            intra_link="NVLink", intra_bandwidth_gbps=4800, aliases=("A100-SXM4-80GB", "A100 80GB PCIe", "A100-PCIE-80GB")),
    # China-market A100: same compute, NVLink capped at 400 GB/s.
    GpuSpec(name="A800-80G", memory_gib=80, peak_tflops=312, supports_bf16=True,
            intra_link="NVLink", intra_bandwidth_gbps=3200, aliases=("A800-SXM4-80GB", "A800 80GB PCIe", "A800")),
    GpuSpec(name="H100-80G", memory_gib=80, peak_tflops=989, supports_bf16=True,
            intra_link="NVLink", intra_bandwidth_gbps=7200, aliases=("H100 80GB HBM3", "H100-SXM5-80GB", "H100")),
    GpuSpec(name="H100-PCIe", memory_gib=80, peak_tflops=756, supports_bf16=True,
            intra_link="PCIe", intra_bandwidth_gbps=PCIE5_X16_GBPS, aliases=("H100 PCIe",)),
    GpuSpec(name="H800", memory_gib=80, peak_tflops=989, supports_bf16=True,
            intra_link="NVLink", intra_bandwidth_gbps=3200, aliases=("H800 80GB HBM3", "H800-80G")),
    GpuSpec(name="H200", memory_gib=140, peak_tflops=989, supports_bf16=True,
            intra_link="NVLink", intra_bandwidth_gbps=7200, aliases=("H200-141G", "NVIDIA H200")),
    GpuSpec(name="H20", memory_gib=96, peak_tflops=148, supports_bf16=True,
            intra_link="NVLink", intra_bandwidth_gbps=7200, aliases=()),
    GpuSpec(name="B200", memory_gib=180, peak_tflops=2250, supports_bf16=True,
            intra_link="NVLink", intra_bandwidth_gbps=14400, aliases=()),
    GpuSpec(name="A40", memory_gib=48, peak_tflops=149.7, supports_bf16=True,
            intra_link="PCIe", intra_bandwidth_gbps=PCIE4_X16_GBPS, aliases=()),
    GpuSpec(name="A10", memory_gib=24, peak_tflops=125, supports_bf16=True,
            intra_link="PCIe", intra_bandwidth_gbps=PCIE4_X16_GBPS, aliases=("A10G",)),
    GpuSpec(name="L4", memory_gib=24, peak_tflops=121, supports_bf16=True,
            intra_link="PCIe", intra_bandwidth_gbps=PCIE4_X16_GBPS, aliases=()),
    GpuSpec(name="L40S", memory_gib=48, peak_tflops=362, supports_bf16=True,
            intra_link="PCIe", intra_bandwidth_gbps=PCIE4_X16_GBPS, aliases=()),
    GpuSpec(name="RTXA6000", memory_gib=48, peak_tflops=154.8, supports_bf16=True,
            intra_link="PCIe", intra_bandwidth_gbps=PCIE4_X16_GBPS, aliases=("RTX A6000",)),
    GpuSpec(name="RTX4090", memory_gib=24, peak_tflops=165, supports_bf16=True,
            intra_link="PCIe", intra_bandwidth_gbps=PCIE4_X16_GBPS, aliases=("GeForce RTX 4090",)),
    GpuSpec(name="V100-32G", memory_gib=32, peak_tflops=125, supports_bf16=False,
            intra_link="NVLink", intra_bandwidth_gbps=2400, aliases=("V100-SXM2-32GB", "V100-PCIE-32GB")),
    GpuSpec(name="V100-16G", memory_gib=16, peak_tflops=125, supports_bf16=False,
            intra_link="NVLink", intra_bandwidth_gbps=2400, aliases=("V100-SXM2-16GB", "V100-PCIE-16GB", "V100")),
    # Quadro RTX 6000 (Turing), the GPU of the Sia/Frenzy simulated cluster.
    GpuSpec(name="RTX6000", memory_gib=24, peak_tflops=130.5, supports_bf16=False,
            intra_link="PCIe", intra_bandwidth_gbps=PCIE3_X16_GBPS, aliases=("Quadro RTX 6000",)),
    GpuSpec(name="2080Ti", memory_gib=11, peak_tflops=107.6, supports_bf16=False,
            intra_link="PCIe", intra_bandwidth_gbps=PCIE3_X16_GBPS, aliases=("GeForce RTX 2080 Ti", "RTX2080Ti")),
    GpuSpec(name="T4", memory_gib=15, peak_tflops=65, supports_bf16=False,
            intra_link="PCIe", intra_bandwidth_gbps=PCIE3_X16_GBPS, aliases=("Tesla T4",)),
    GpuSpec(name="MI300X", memory_gib=192, peak_tflops=1307, supports_bf16=True,
            intra_link="NVLink", intra_bandwidth_gbps=7168, aliases=("AMD Instinct MI300X",)),
)

# "cpu" is the pseudo-device of a CPU-only machine: one worker process. Its
# memory and TFLOP/s depend on the machine, so the inventory must state them
# (detect_local_cluster does); the entry only makes the name known.
CPU_DEVICE = "cpu"


def _key(name: str) -> str:
    return "".join(ch for ch in name.upper() if ch.isalnum())


_BY_KEY: dict[str, GpuSpec] = {}
for _spec in _CATALOGUE:
    for _n in (_spec.name, *_spec.aliases):
        _BY_KEY.setdefault(_key(_n), _spec)


def known_gpu_types() -> list[str]:
    """Canonical names of every catalogued type."""
    return [spec.name for spec in _CATALOGUE]


def lookup_gpu(name: str) -> GpuSpec | None:
    """The catalogue entry for a name or alias (case, spaces and dashes ignored), else None."""
    return _BY_KEY.get(_key(name))


def gpu_spec(name: str) -> GpuSpec:
    """Like `lookup_gpu` but raises KeyError naming the known types."""
    spec = lookup_gpu(name)
    if spec is None:
        raise KeyError(
            f"unknown GPU type {name!r}; known types: {', '.join(known_gpu_types())}"
        )
    return spec


class UnknownGpuType(ValueError):
    """A GPU type a person gave (--gpu-type, a spec) that neither the catalogue nor the cluster knows."""


def checked_gpu_type(name: str, present: Iterable[str] = ()) -> str:
    """The GPU type a person asked for, as the inventory spells it: one of `present` (the
    cluster's own types, which may include types outside the catalogue), else the catalogue's
    canonical name of a name or alias ("a100" -> "A100-40G"; case, spaces and dashes ignored).
    Anything else is an UnknownGpuType naming the known types."""
    present = list(present)
    for own in present:
        if _key(own) == _key(name):
            return own
    spec = lookup_gpu(name) if isinstance(name, str) else None
    if spec is not None:
        return spec.name
    custom = [t for t in present if lookup_gpu(t) is None]
    raise UnknownGpuType(
        f"unknown GPU type {name!r}: give one of the catalogue's ({', '.join(known_gpu_types())})"
        + (f" or this cluster's own ({', '.join(custom)})" if custom else "")
        + "; case, spaces and dashes are ignored and aliases such as 'A100' work")


def match_device_name(device_name: str, memory_gib: float | None = None) -> GpuSpec | None:
    """Map a driver's device name ("NVIDIA A100-SXM4-80GB") to a catalogue entry.

    Exact alias matches win; otherwise the longest catalogue name contained in
    the device name, disambiguated by memory size when given (the driver says
    "A100" for both 40 and 80 GB PCIe parts on some versions).
    """
    cleaned = device_name.replace("NVIDIA", "").replace("Tesla", "").strip()
    exact = lookup_gpu(cleaned)
    if exact is not None and (memory_gib is None or abs(exact.memory_gib - memory_gib) < 8):
        return exact
    # Otherwise match the family ("A100", "V100", "L40S") as a whole word, so
    # "A10" does not match an A100.
    tokens = set(re.split(r"[^A-Z0-9]+", cleaned.upper()))
    candidates = [spec for spec in _CATALOGUE if spec.name.split("-")[0].upper() in tokens]
    if memory_gib is not None:
        candidates.sort(key=lambda s: abs(s.memory_gib - memory_gib))
    return candidates[0] if candidates else None
