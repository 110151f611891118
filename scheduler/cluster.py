"""The cluster inventory: nodes, their GPUs, links, root complexes and what is free.

A cluster is described in YAML (see `configs/clusters/`) or detected on the
local machine (`detect_local_cluster`). A node entry may give only its name,
GPU type and count; memory, peak TFLOP/s and the intra-node link are filled in
from the GPU catalogue (`scheduler.gpus`). An entry with `replicas: N` stands for N
identical nodes named `<name>-0 … <name>-(N-1)`.

Units: memory in GiB; bandwidths in Gbit/s (the `*_bytes_per_s` properties
convert); compute in dense bf16 TFLOP/s per GPU.

Inconsistent inventories (duplicate names, a free GPU index that does not
exist, a root-complex list of the wrong length, an unknown GPU type without its
memory and TFLOP/s, ...) raise one `ClusterError` that names the node and the
field and says how to fix it.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any, Iterable, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from infra.kubernetes import KubernetesSettings
from infra.slurm import SlurmSettings
from infra.yaml_config import load_yaml_mapping, validate
from scheduler.gpus import CPU_DEVICE, PCIE4_X16_GBPS, lookup_gpu, match_device_name
from training.config import ConfigError

IntraLink = Literal["NVLink", "PCIe", "host"]
"""How GPUs inside a node talk: NVLink, PCIe, or `host` for CPU worker processes (shared memory)."""

GIB = 1024**3

# Caps no real cluster reaches, so a typo (`replicas: 10000000`) is an error at load time
# rather than a planner working for hours through ten million nodes. The largest training
# clusters today are some tens of thousands of nodes (100-200 thousand GPUs), and the
# densest node, a rack-scale NVLink domain (GB200 NVL72), has 72 GPUs.
MAX_NODES = 100_000
MAX_GPUS_PER_NODE = 1_024
# A cluster's or node's name keys the state database's rows (at most 200 characters there),
# and names Slurm jobs, Kubernetes objects and folders: letters, digits, '.', '_', '-'.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
MAX_NAME_CHARS = 200


class ClusterError(ConfigError):
    """A cluster inventory is missing, malformed or inconsistent, or an operation on it is invalid."""


class Node(BaseModel):
    """One machine: `gpu_count` accelerators of one type, and which of them are free."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=MAX_NAME_CHARS, pattern=NAME_PATTERN)
    gpu_type: str = Field(min_length=1, description="catalogue name (scheduler.gpus) or your own")
    gpu_count: int = Field(gt=0)
    gpu_memory_gib: float = Field(gt=0, description="per GPU; default from the catalogue")
    peak_tflops: float = Field(gt=0, description="dense bf16 per GPU; default from the catalogue")
    supports_bf16: bool = True
    intra_link: IntraLink = "PCIe"
    intra_bandwidth_gbps: float = Field(gt=0, description="per GPU over intra_link, Gbit/s")
    pcie_root_complex: list[int] | None = Field(
        default=None, description="root complex id of each GPU (index = GPU index); None = unknown"
    )
    host_ram_gib: float | None = Field(default=None, gt=0)
    free_gpus: list[int] | None = Field(default=None, description="free GPU indices; default all")
    cordoned: bool = False
    address: str | None = Field(default=None, description="host name or IP the launcher uses")

    @model_validator(mode="before")
    @classmethod
    def _fill_from_catalogue(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not isinstance(data.get("gpu_type"), str):
            return data  # field validation reports what is missing
        data = dict(data)
        spec = lookup_gpu(data["gpu_type"])
        if spec is None:
            missing = [f for f in ("gpu_memory_gib", "peak_tflops") if data.get(f) is None]
            if missing:
                kind = "CPU pseudo-device" if data["gpu_type"] == CPU_DEVICE else "GPU type"
                raise ValueError(
                    f"{kind} {data['gpu_type']!r} is not in the GPU catalogue, so "
                    f"{' and '.join(missing)} must be given explicitly (or use a catalogue "
                    f"name such as A100-40G, A100-80G, H100-80G, A40, A10, V100-32G)"
                )
            data.setdefault("intra_link", "host" if data["gpu_type"] == CPU_DEVICE else "PCIe")
            data.setdefault("intra_bandwidth_gbps", PCIE4_X16_GBPS)
            return data
        data["gpu_type"] = spec.name  # canonical spelling, so types group correctly
        data.setdefault("gpu_memory_gib", spec.memory_gib)
        data.setdefault("peak_tflops", spec.peak_tflops)
        data.setdefault("supports_bf16", spec.supports_bf16)
        if "intra_link" not in data:
            data["intra_link"] = spec.intra_link
            data.setdefault("intra_bandwidth_gbps", spec.intra_bandwidth_gbps)
        elif data["intra_link"] == spec.intra_link:
            data.setdefault("intra_bandwidth_gbps", spec.intra_bandwidth_gbps)
        else:
            # e.g. an A100 PCIe card: the catalogue's NVLink figure does not apply.
            data.setdefault("intra_bandwidth_gbps", PCIE4_X16_GBPS)
        return data

    @model_validator(mode="after")
    def _consistent(self) -> "Node":
        if self.gpu_count > MAX_GPUS_PER_NODE:
            raise ValueError(
                f"gpu_count {self.gpu_count} is over the cap of {MAX_GPUS_PER_NODE:,} GPUs per node (the densest "
                "real node, a GB200 NVL72 rack, has 72): give the GPUs of one machine, and more machines as "
                "more nodes (`replicas: N`)"
            )
        if self.pcie_root_complex is not None:
            if len(self.pcie_root_complex) != self.gpu_count:
                raise ValueError(
                    f"pcie_root_complex has {len(self.pcie_root_complex)} entries but gpu_count is "
                    f"{self.gpu_count}; give one root-complex id per GPU (or omit the list)"
                )
            if any(rc < 0 for rc in self.pcie_root_complex):
                raise ValueError("pcie_root_complex ids must be >= 0")
        if self.free_gpus is None:
            self.free_gpus = list(range(self.gpu_count))
        else:
            bad = [i for i in self.free_gpus if not 0 <= i < self.gpu_count]
            if bad:
                raise ValueError(
                    f"free_gpus {bad} out of range: this node has GPUs 0..{self.gpu_count - 1}"
                )
            if len(set(self.free_gpus)) != len(self.free_gpus):
                raise ValueError(f"free_gpus {self.free_gpus} lists a GPU more than once")
            self.free_gpus = sorted(self.free_gpus)
        return self

    # --- derived views -------------------------------------------------
    @property
    def gpu_memory_bytes(self) -> int:
        return int(self.gpu_memory_gib * GIB)

    @property
    def intra_bandwidth_bytes_per_s(self) -> float:
        return self.intra_bandwidth_gbps * 1e9 / 8

    @property
    def idle_gpus(self) -> list[int]:
        """GPUs a scheduler may hand out now: the free ones, none if cordoned."""
        return [] if self.cordoned else list(self.free_gpus or [])

    @property
    def idle_count(self) -> int:
        return 0 if self.cordoned else len(self.free_gpus or [])

    def root_complex_of(self, gpu_index: int) -> int | None:
        """The root complex of a GPU, or None when the inventory does not know it."""
        if self.pcie_root_complex is None:
            return None
        return self.pcie_root_complex[gpu_index]


class Cluster(BaseModel):
    """A set of nodes joined by a network of `inter_node_bandwidth_gbps` per node."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(default="cluster", min_length=1, max_length=MAX_NAME_CHARS, pattern=NAME_PATTERN)
    inter_node_bandwidth_gbps: float = Field(default=100.0, gt=0, description="per node NIC, Gbit/s")
    nodes: list[Node] = Field(min_length=1)
    policy: Literal["has", "easy", "ect", "elastic"] = Field(
        default="has", description="how the orchestrator admits queued jobs: has (best fit in queue order), "
        "easy (FCFS + EASY backfilling), ect (expected completion, HRRN, conservative backfilling), elastic "
        "(FCFS admission; running data-parallel jobs shrink so queued ones start and grow into idle GPUs: "
        "scheduler.elastic; the simulator runs it, and the orchestrator's decider, `forgeflow cluster serve`, "
        "resizes jobs as checkpoint-first preemptions; without a decider jobs are admitted FCFS, not resized)")
    usage_half_life_hours: float = Field(default=168.0, gt=0, description="fair share: past GPU use counts half "
                                         "after this long")
    slurm: SlurmSettings | None = Field(
        default=None, description="the cluster is Slurm-managed: partition, account, time limit for "
        "`launcher: slurm` (node names are Slurm's); None: not Slurm-managed")
    kubernetes: KubernetesSettings | None = Field(
        default=None, description="the cluster runs attempts as Kubernetes Jobs: image, namespace, the run "
        "volume claim for `launcher: kubernetes`; None: no Kubernetes")
    _index: dict[str, Node] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _one_manager(self) -> "Cluster":
        if self.slurm is not None and self.kubernetes is not None:
            raise ValueError("the cluster has both a 'slurm' and a 'kubernetes' section; a cluster's nodes are "
                             "managed by one of them: keep the one that starts jobs on these nodes")
        return self

    @model_validator(mode="after")
    def _unique_names(self) -> "Cluster":
        seen: set[str] = set()
        dupes = sorted({n.name for n in self.nodes if n.name in seen or seen.add(n.name)})
        if dupes:
            raise ValueError(f"duplicate node name(s) {dupes}; every node needs its own name")
        self._index = {n.name: n for n in self.nodes}
        return self

    # --- look-ups ------------------------------------------------------
    @property
    def inter_node_bandwidth_bytes_per_s(self) -> float:
        return self.inter_node_bandwidth_gbps * 1e9 / 8

    @property
    def total_gpus(self) -> int:
        return sum(n.gpu_count for n in self.nodes)

    def node(self, name: str) -> Node:
        if len(self._index) != len(self.nodes):  # nodes were added/removed after loading
            self._index = {n.name: n for n in self.nodes}
        try:
            return self._index[name]
        except KeyError:
            shown = ", ".join(list(self._index)[:10]) + (" ..." if len(self._index) > 10 else "")
            raise ClusterError(f"no node named {name!r} in cluster {self.name!r}; nodes: {shown}") from None

    def gpu_types(self) -> list[str]:
        """GPU types present, fastest (peak TFLOP/s) first."""
        best: dict[str, float] = {}
        for n in self.nodes:
            best[n.gpu_type] = max(best.get(n.gpu_type, 0.0), n.peak_tflops)
        return sorted(best, key=lambda t: (-best[t], t))

    def nodes_of_type(self, gpu_type: str, *, include_cordoned: bool = False) -> list[Node]:
        return [
            n for n in self.nodes
            if n.gpu_type == gpu_type and (include_cordoned or not n.cordoned)
        ]

    def schedulable_nodes(self) -> list[Node]:
        return [n for n in self.nodes if not n.cordoned]

    def total_gpus_by_type(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for n in self.nodes:
            out[n.gpu_type] = out.get(n.gpu_type, 0) + n.gpu_count
        return out

    def free_gpus_by_type(self) -> dict[str, int]:
        """Idle GPUs per type on nodes that are not cordoned (types with none idle show 0)."""
        out = {t: 0 for t in self.total_gpus_by_type()}
        for n in self.nodes:
            out[n.gpu_type] += n.idle_count
        return out

    def gpu_memory_gib(self, gpu_type: str) -> float:
        """Smallest per-GPU memory among nodes of this type (the safe figure for sizing)."""
        nodes = self.nodes_of_type(gpu_type, include_cordoned=True)
        if not nodes:
            raise ClusterError(f"no {gpu_type} nodes in cluster {self.name!r}; types: {self.gpu_types()}")
        return min(n.gpu_memory_gib for n in nodes)

    # --- mutations -----------------------------------------------------
    def cordon(self, name: str) -> None:
        """Take a node out of scheduling (its running work is not touched)."""
        self.node(name).cordoned = True

    def uncordon(self, name: str) -> None:
        self.node(name).cordoned = False

    def allocate(self, name: str, gpu_indices: Iterable[int]) -> None:
        """Mark GPUs busy; all of them must be free and the node not cordoned."""
        node = self.node(name)
        wanted = list(gpu_indices)
        if node.cordoned:
            raise ClusterError(f"node {name!r} is cordoned; uncordon it before allocating")
        free = set(node.free_gpus or [])
        busy = [i for i in wanted if i not in free]
        if busy or len(set(wanted)) != len(wanted):
            raise ClusterError(
                f"cannot allocate GPUs {wanted} on {name!r}: {busy or 'duplicates'} not free "
                f"(free: {sorted(free)})"
            )
        node.free_gpus = sorted(free - set(wanted))

    def release(self, name: str, gpu_indices: Iterable[int]) -> None:
        """Return GPUs to the free pool; releasing a GPU that is already free is an error."""
        node = self.node(name)
        returned = list(gpu_indices)
        free = set(node.free_gpus or [])
        bad = [i for i in returned if i in free or not 0 <= i < node.gpu_count]
        if bad or len(set(returned)) != len(returned):
            raise ClusterError(
                f"cannot release GPUs {returned} on {name!r}: {bad or 'duplicates'} already free "
                f"or out of range 0..{node.gpu_count - 1}"
            )
        node.free_gpus = sorted(free | set(returned))

    def copy_state(self) -> "Cluster":
        """An independent copy (free lists, cordons) for what-if planning and simulation.

        Nodes are copied field by field with their own free list; the rest of a node's
        fields (links, root complexes) are never changed in place, so they are shared: a
        deep copy of a 420-node cluster cost ~10 ms, most of an orchestrator's read-back.
        """
        nodes = []
        for n in self.nodes:
            c = n.model_copy()
            c.free_gpus = list(n.free_gpus) if n.free_gpus is not None else None
            nodes.append(c)
        copied = self.model_copy(update={"nodes": nodes})
        copied._index = {n.name: n for n in nodes}  # model_copy kept the original's index
        return copied

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(exclude_none=True), sort_keys=False)


# --- loading ----------------------------------------------------------


def _expand_replicas(raw_nodes: Any, source: str) -> Any:
    """The node list with each `replicas: N` entry made N nodes; at most MAX_NODES in all,
    counted before any is made."""
    if not isinstance(raw_nodes, list):
        return raw_nodes
    total = 0
    for entry in raw_nodes:
        replicated = isinstance(entry, dict) and "replicas" in entry
        n = entry["replicas"] if replicated else 1
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ClusterError(
                f"{source}: node {entry.get('name')!r}: replicas must be a whole number >= 1 (got {n!r})"
            )
        total += n
        if total > MAX_NODES:
            where = f"node {entry.get('name')!r}: replicas {n:,} brings" if replicated else "the nodes list brings"
            raise ClusterError(
                f"{source}: {where} the cluster over the cap of {MAX_NODES:,} nodes (no real cluster has "
                "that many; the largest have some tens of thousands): check the replicas counts"
            )
    out: list[Any] = []
    for entry in raw_nodes:
        if isinstance(entry, dict) and "replicas" in entry:
            entry = dict(entry)
            n = entry.pop("replicas")
            base = entry.get("name", "node")
            for i in range(n):
                out.append({**copy.deepcopy(entry), "name": f"{base}-{i}"})
        else:
            out.append(entry)
    return out


def parse_cluster(data: Any, source: str = "<cluster>") -> Cluster:
    """Validate an inventory given as a mapping (e.g. parsed YAML)."""
    if not isinstance(data, dict):
        raise ClusterError(f"{source}: a cluster inventory must be a mapping with a 'nodes' list")
    data = dict(data)
    data["nodes"] = _expand_replicas(data.get("nodes"), source)
    return validate(Cluster, data, source=source, kind="cluster inventory", error=ClusterError)


def load_cluster(path: str | Path) -> Cluster:
    """Read and validate a cluster inventory YAML file (it may derive from another with `base:`)."""
    path = Path(path)
    data = load_yaml_mapping(path, kind="cluster", needs="a 'nodes' list", error=ClusterError,
                             missing_hint="check the path (examples: configs/clusters/)")
    if "name" not in data:
        # The orchestrator keeps a cluster's queue, leases and cordons under its name: two
        # files without one would both register as the default and share (and rewrite) them.
        raise ClusterError(f"{path}: the inventory names no cluster; add a line `name: {path.stem}` "
                           "(the orchestrator keeps each cluster's queue, leases and cordons under its name)")
    return parse_cluster(data, source=str(path))


def load_inventory(source: str) -> Cluster:
    """The inventory a flow places on: this machine for "local" (or ""), else the YAML file; on a
    Slurm-managed cluster (a `slurm:` section), nodes Slurm will not run work on (drained, down)
    are cordoned, so forgeflow never places onto them."""
    inventory = detect_local_cluster() if source in ("", "local") else load_cluster(source)
    if inventory.slurm is not None:
        from infra.slurm import unschedulable_nodes

        for name in unschedulable_nodes(inventory.slurm):
            if name in {n.name for n in inventory.nodes}:
                inventory.cordon(name)
    return inventory


# --- the local machine ------------------------------------------------


def _root_complex_ids(pci_bus_ids: list[str]) -> list[int] | None:
    """Root complex per GPU from sysfs: the `pciDDDD:BB` ancestor of each device's path."""
    roots: list[str] = []
    for bus_id in pci_bus_ids:
        dev = Path("/sys/bus/pci/devices") / bus_id.lower()
        try:
            parts = dev.resolve().parts
        except OSError:
            return None
        root = next((p for p in parts if p.startswith("pci")), None)
        if root is None:
            return None
        roots.append(root)
    order = {r: i for i, r in enumerate(dict.fromkeys(roots))}
    return [order[r] for r in roots]


def _cuda_node(torch: Any, host: str, host_ram_gib: float) -> Node:
    count = torch.cuda.device_count()
    props = [torch.cuda.get_device_properties(i) for i in range(count)]
    mem_gib = min(p.total_memory for p in props) / GIB
    spec = match_device_name(props[0].name, mem_gib)
    bus_ids = [
        f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
        for p in props
        if hasattr(p, "pci_bus_id")
    ]
    fields: dict[str, Any] = {
        "name": host,
        "gpu_type": spec.name if spec else props[0].name.replace(" ", "-"),
        "gpu_count": count,
        "gpu_memory_gib": round(mem_gib, 2),
        "host_ram_gib": round(host_ram_gib, 1),
        "pcie_root_complex": _root_complex_ids(bus_ids) if len(bus_ids) == count else None,
        "address": "127.0.0.1",
    }
    if spec is None:
        # Not catalogued: an Ampere-class guess (2,048 dense bf16 FLOP per SM per clock at
        # ~1.4 GHz, which gives an A100's 312 TFLOP/s from its 108 SMs) keeps ranking possible.
        fields["peak_tflops"] = round(props[0].multi_processor_count * 2048 * 1.4e9 / 1e12, 1)
    link = _nvlink_state(count)
    if link is not None:
        fields["intra_link"] = "NVLink" if link else "PCIe"
    return Node(**fields)


def _nvlink_state(count: int) -> bool | None:
    """True if GPU 0 has an active NVLink, False if none, None when NVML is unavailable."""
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        for link in range(18):
            try:
                if pynvml.nvmlDeviceGetNvLinkState(handle, link):
                    return True
            except pynvml.NVMLError:
                break
        return False if count > 1 else None
    except Exception:  # NVML present but unusable (driver mismatch): unknown
        return None


def detect_local_cluster(
    *,
    cpu_workers: int | None = None,
    cpu_memory_fraction: float = 0.8,
    cpu_tflops_per_core: float = 0.05,
    force_cpu: bool = False,
) -> Cluster:
    """Describe this machine as a one-node cluster.

    With CUDA GPUs: one device per GPU, type matched against the catalogue,
    root complexes from sysfs, NVLink from NVML when pynvml is installed.

    CPU-only (or `force_cpu`): the "devices" are training worker processes of
    type `cpu`. Their count defaults to the number of usable cores (one gloo
    process per core is what torchrun on CPU can keep busy); each gets an equal
    share of `cpu_memory_fraction` of the currently available RAM, since every
    worker holds its own model replica/shard and activations in host memory.
    `cpu_tflops_per_core` is a rough fp32 figure (a modern core does ~50 GFLOP/s
    in a large matmul) used only to rank plans.
    """
    import platform

    import psutil

    host = "".join(ch if ch.isalnum() or ch in "._-" else "-" for ch in platform.node()) or "localhost"
    host = host.lstrip("._-") or "localhost"
    vm = psutil.virtual_memory()
    host_ram_gib = vm.total / GIB
    if not force_cpu:
        try:
            import torch

            if torch.cuda.is_available() and torch.cuda.device_count() > 0:
                return Cluster(name=f"local-{host}", nodes=[_cuda_node(torch, host, host_ram_gib)])
        except ImportError:
            pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    workers = cpu_workers or max(1, cores)
    if workers < 1:
        raise ClusterError(f"cpu_workers must be >= 1 (got {workers})")
    if not 0 < cpu_memory_fraction <= 1:
        raise ClusterError(f"cpu_memory_fraction must be in (0, 1] (got {cpu_memory_fraction})")
    share_gib = vm.available * cpu_memory_fraction / workers / GIB
    threads_per_worker = max(1, cores // workers)
    node = Node(
        name=host,
        gpu_type=CPU_DEVICE,
        gpu_count=workers,
        gpu_memory_gib=round(share_gib, 2),
        peak_tflops=round(cpu_tflops_per_core * threads_per_worker, 4),
        supports_bf16=False,  # bf16 matmuls on CPU are emulated/slow; plan fp32
        intra_link="host",
        intra_bandwidth_gbps=80.0,  # memcpy through shared memory, ~10 GB/s
        host_ram_gib=round(host_ram_gib, 1),
        address="127.0.0.1",
    )
    return Cluster(name=f"local-{host}", nodes=[node])
