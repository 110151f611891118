"""Simulated step time and PCIe traffic of Mobius and its baselines on a commodity GPU server.

A discrete-event simulation with fluid bandwidth sharing:

* every GPU runs its compute operations in a fixed order, each when its inputs
  are there (weights on the GPU, the micro batch's activations or gradients);
* every copy is a flow over its GPU's PCIe link (`h2d_bytes_per_s`, each
  direction) and its root complex's uplink (`root_complex_bytes_per_s`, shared
  by the GPUs under it); link and uplink capacity are handed out by priority
  (the stage that executes first wins — Mobius's stream priority), so copies of
  GPUs that share a root complex slow each other down exactly when they overlap.

Systems (same model, same global batch = micro_batch x microbatches, same profile):

* `mobius`            — stage s on GPU mapping[s mod N]; prefetch s+N while s computes
                        (s-N in backward); the last N stages stay resident between forward
                        and backward; gradients to host after each stage's backward;
                        activations between stages through host memory (no P2P on GeForce).
                        Run with the cross mapping and with the sequential one.
* `offload_data_parallel` — the DeepSpeed-style baseline the issue names: every GPU streams
                        every layer's parameters from DRAM (forward, and again in backward)
                        with one-layer-ahead prefetch and processes global_batch/N samples:
                        parameters cross PCIe once per GPU. Its collectives (ZeRO-3 offload's
                        parameter all-gather and gradient reduce-scatter) go through host
                        memory in both directions, as NCCL moves them without GPU peer-to-peer.
* `gpipe`             — N resident stages (even split), everything on the GPUs; only where
                        weights + gradients + Adam state + activations fit (`gpipe_fits`).

The optimizer step is not simulated: all offload systems run the same CPU Adam over the same
state, and GPipe's runs on the GPUs in milliseconds; both would add the same to every row.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from scheduler.offload.profile import ModelProfile, OffloadHardware

EPS = 1e-12


@dataclass
class SimResult:
    system: str
    step_time_s: float
    h2d_bytes: float  # host -> GPU, all GPUs
    d2h_bytes: float
    param_h2d_bytes: float  # of which parameters
    busy_s: list[float] = field(default_factory=list)

    @property
    def pcie_bytes(self) -> float:
        return self.h2d_bytes + self.d2h_bytes

    def to_dict(self) -> dict:
        return {"system": self.system, "step_time_s": self.step_time_s, "pcie_gb": self.pcie_bytes / 1e9,
                "param_h2d_gb": self.param_h2d_bytes / 1e9, "h2d_gb": self.h2d_bytes / 1e9,
                "d2h_gb": self.d2h_bytes / 1e9}


@dataclass
class _Flow:
    gpu: int
    direction: str
    remaining: float
    priority: float
    done: object
    rate: float = 0.0


@dataclass
class _Op:
    name: tuple
    duration: float
    needs: list
    on_start: object = None
    on_end: object = None


class _Engine:
    def __init__(self, hw: OffloadHardware, ops_per_gpu: list[list[_Op]]):
        self.hw = hw
        self.ops = ops_per_gpu
        self.next_op = [0] * len(ops_per_gpu)
        self.running: list[tuple[float, _Op] | None] = [None] * len(ops_per_gpu)
        self.events: set = set()
        self.flows: list[_Flow] = []
        self.now = 0.0
        self.bytes = {"h2d": 0.0, "d2h": 0.0}
        self.param_h2d = 0.0
        self.busy = [0.0] * len(ops_per_gpu)
        rc = hw.root_complex or tuple([0] * hw.num_gpus)
        self.rc = rc

    def flow(self, gpu: int, direction: str, nbytes: float, priority: float, done, param: bool = False) -> None:
        self.bytes[direction] += nbytes
        if param:
            self.param_h2d += nbytes
        if nbytes <= 0:
            self.events.add(done) if done is not None else None
            return
        self.flows.append(_Flow(gpu, direction, nbytes, priority, done))

    def _rates(self) -> None:
        link = {}
        uplink = {}
        for f in sorted(self.flows, key=lambda f: f.priority):
            lk = (f.gpu, f.direction)
            uk = (self.rc[f.gpu], f.direction)
            lcap = link.get(lk, self.hw.h2d_bytes_per_s)
            ucap = uplink.get(uk, self.hw.root_complex_bytes_per_s or float("inf"))
            f.rate = max(0.0, min(lcap, ucap))
            link[lk] = lcap - f.rate
            uplink[uk] = ucap - f.rate

    def run(self) -> float:
        while True:
            progressed = True
            while progressed:
                progressed = False
                for g, ops in enumerate(self.ops):
                    if self.running[g] is None and self.next_op[g] < len(ops):
                        op = ops[self.next_op[g]]
                        if all(n in self.events for n in op.needs):
                            self.next_op[g] += 1
                            self.running[g] = (self.now + op.duration, op)
                            self.busy[g] += op.duration
                            if op.on_start:
                                op.on_start()
                            progressed = True
            if not self.flows and all(r is None for r in self.running):
                if any(i < len(o) for i, o in zip(self.next_op, self.ops)):
                    stuck = [o[i].name for i, o in zip(self.next_op, self.ops) if i < len(o)]
                    raise RuntimeError(f"simulation deadlock at t={self.now:.3f}s waiting: {stuck[:4]}")
                return self.now
            self._rates()
            t_next = min([r[0] for r in self.running if r is not None] +
                         [self.now + f.remaining / f.rate for f in self.flows if f.rate > 0] or [float("inf")])
            dt = t_next - self.now
            self.now = t_next
            finished = []
            for f in self.flows:
                f.remaining -= f.rate * dt
                if f.remaining <= max(1.0, f.rate * 1e-9):  # within a byte or a nanosecond: done
                    finished.append(f)
            for f in finished:
                self.flows.remove(f)
                if f.done is not None:
                    self.events.add(f.done)
            for g, r in enumerate(self.running):
                if r is not None and r[0] <= self.now + EPS:
                    self.running[g] = None
                    self.events.add(r[1].name)
                    if r[1].on_end:
                        r[1].on_end()


def _stage_sums(profile: ModelProfile, stages: list[tuple[int, int]]):
    out = []
    for a, b in stages:
        ls = profile.layers[a:b]
        out.append(dict(f=sum(l.forward_s for l in ls), b=sum(l.backward_s for l in ls),
                        W=sum(l.param_bytes for l in ls), G=sum(l.grad_bytes for l in ls), O=ls[-1].output_bytes))
    return out


def simulate_mobius(profile: ModelProfile, hw: OffloadHardware, stages: list[tuple[int, int]],
                    mapping: tuple[int, ...] | None = None, name: str = "mobius") -> SimResult:
    """Mobius's pipeline: `stages` (from the partition), position p on GPU mapping[p]."""
    N, S, m = hw.num_gpus, len(stages), profile.microbatches
    gpu_of_pos = mapping or tuple(range(N))
    q = _stage_sums(profile, stages)
    resident = set(range(max(0, S - N), S))
    ops: list[list[_Op]] = [[] for _ in range(N)]
    eng: _Engine

    def gpu(s):
        return gpu_of_pos[s % N]

    def prefetch(s, phase):
        prio = s if phase == "f" else S + (S - 1 - s)
        eng.flow(gpu(s), "h2d", q[s]["W"], prio, ("w", s, phase), param=True)

    for s in range(S):  # forward
        for k in range(m):
            needs = [("w", s, "f")] + ([("a", s, k)] if s > 0 else [])

            def start(s=s, k=k):
                if k == 0 and s + N < S:
                    prefetch(s + N, "f")

            def end(s=s, k=k):
                if s + 1 < S:  # activations through host: down from this GPU, up to the next
                    eng.flow(gpu(s), "d2h", q[s]["O"], -1, None)
                    eng.flow(gpu(s + 1), "h2d", q[s]["O"], -1, ("a", s + 1, k))
            ops[gpu(s)].append(_Op(("f", s, k), q[s]["f"], needs, start, end))
    for s in reversed(range(S)):  # backward
        for k in range(m):
            needs = [("f", s, m - 1)] if s in resident else [("w", s, "b")]
            needs += [("f", S - 1, m - 1)] if s == S - 1 else [("g", s, k)]

            def start(s=s, k=k):
                if k == 0 and s - N >= 0 and s - N not in resident:
                    prefetch(s - N, "b")

            def end(s=s, k=k):
                if s > 0:
                    eng.flow(gpu(s), "d2h", q[s - 1]["O"], -1, None)
                    eng.flow(gpu(s - 1), "h2d", q[s - 1]["O"], -1, ("g", s - 1, k))
                if k == m - 1:
                    eng.flow(gpu(s), "d2h", q[s]["G"], S + (S - 1 - s), None)
            ops[gpu(s)].append(_Op(("b", s, k), q[s]["b"], needs, start, end))
    eng = _Engine(hw, ops)
    for s in range(min(N, S)):
        prefetch(s, "f")
    t = eng.run()
    return SimResult(name, t, eng.bytes["h2d"], eng.bytes["d2h"], eng.param_h2d, eng.busy)


def simulate_offload_data_parallel(profile: ModelProfile, hw: OffloadHardware) -> SimResult:
    """Every GPU streams every layer (forward, then backward) for its share of the batch, with
    DeepSpeed ZeRO-3 offload's collectives as they run on GPUs without peer-to-peer (GeForce
    cards: NCCL's shared-memory transport stages every byte in host memory):

    * parameters: each GPU copies its 1/N partition of the layer from DRAM and the all-gather
      brings the other (N-1)/N through host memory: the full layer host->GPU on every GPU,
      and (N-1)/N of it GPU->host as each GPU passes the partitions on;
    * gradients: the reduce-scatter sends (N-1)/N of the layer's gradients GPU->host and
      receives as much host->GPU, then the GPU's reduced 1/N partition goes to DRAM.

    A layer computes when its all-gather (both directions) is done."""
    N, L, m = hw.num_gpus, profile.num_layers, profile.microbatches
    share = m / N  # micro batches per GPU (the same global batch)
    peers = (N - 1) / N
    lay = profile.layers
    ops: list[list[_Op]] = [[] for _ in range(N)]
    eng: _Engine

    def load(g, l, phase):
        prio = l if phase == "f" else L + (L - 1 - l)
        eng.flow(g, "h2d", lay[l].param_bytes, prio, ("w", g, l, phase), param=True)
        eng.flow(g, "d2h", peers * lay[l].param_bytes, prio, ("wd", g, l, phase))

    def ready(g, l, phase):
        return [("w", g, l, phase), ("wd", g, l, phase)]

    for g in range(N):
        for l in range(L):
            def start(g=g, l=l):
                if l + 1 < L:
                    load(g, l + 1, "f")
            ops[g].append(_Op(("f", g, l), share * lay[l].forward_s, ready(g, l, "f"), start))
        for l in reversed(range(L)):
            needs = [("f", g, L - 1)] if l == L - 1 else ready(g, l, "b")

            def start(g=g, l=l):
                if l - 1 >= 0:
                    load(g, l - 1, "b")

            def end(g=g, l=l):
                prio = L + (L - 1 - l)
                grads = lay[l].grad_bytes
                eng.flow(g, "d2h", peers * grads + grads / N, prio, None)  # reduce-scatter out + own partition to DRAM
                eng.flow(g, "h2d", peers * grads, prio, None)  # reduce-scatter in
            ops[g].append(_Op(("b", g, l), share * lay[l].backward_s, needs, start, end))
    eng = _Engine(hw, ops)
    for g in range(N):
        load(g, 0, "f")
    t = eng.run()
    return SimResult("offload_data_parallel", t, eng.bytes["h2d"], eng.bytes["d2h"], eng.param_h2d, eng.busy)


def gpipe_memory(profile: ModelProfile, hw: OffloadHardware, adam_bytes_per_param_byte: float = 6.0) -> int:
    """Peak per-GPU bytes of GPipe with N even stages: weights, grads, Adam (fp32 master + 2 moments
    = 6x the 2-byte weights), and the activations of all micro batches (no recompute)."""
    from scheduler.offload.partition import even_sizes

    N, m = hw.num_gpus, profile.microbatches
    sizes = even_sizes(profile.num_layers, min(N, profile.num_layers))
    peak, a = 0, 0
    for size in sizes:
        ls = profile.layers[a:a + size]
        w = sum(l.param_bytes for l in ls)
        inp = profile.layers[a - 1].output_bytes if a else 0
        # no recompute: every micro batch's activations stay until its backward
        peak = max(peak, int(w * (2 + adam_bytes_per_param_byte) + m * (inp + sum(l.activation_bytes for l in ls))))
        a += size
    return peak


def gpipe_fits(profile: ModelProfile, hw: OffloadHardware) -> bool:
    return gpipe_memory(profile, hw) <= hw.gpu_memory_bytes


def simulate_gpipe(profile: ModelProfile, hw: OffloadHardware) -> SimResult | None:
    """GPipe with everything resident (None when it does not fit)."""
    from scheduler.offload.partition import even_sizes

    if not gpipe_fits(profile, hw):
        return None
    N = min(hw.num_gpus, profile.num_layers)
    sizes = even_sizes(profile.num_layers, N)
    stages, a = [], 0
    for size in sizes:
        stages.append((a, a + size))
        a += size
    q = _stage_sums(profile, stages)
    m = profile.microbatches
    ops: list[list[_Op]] = [[] for _ in range(hw.num_gpus)]
    eng: _Engine
    for s in range(N):
        for k in range(m):
            def end(s=s, k=k):
                if s + 1 < N:
                    eng.flow(s, "d2h", q[s]["O"], -1, None)
                    eng.flow(s + 1, "h2d", q[s]["O"], -1, ("a", s + 1, k))
            ops[s].append(_Op(("f", s, k), q[s]["f"], [("a", s, k)] if s else [], None, end))
    for s in reversed(range(N)):
        for k in range(m):
            needs = [("f", N - 1, m - 1)] if s == N - 1 else [("g", s, k)]

            def end(s=s, k=k):
                if s > 0:
                    eng.flow(s, "d2h", q[s - 1]["O"], -1, None)
                    eng.flow(s - 1, "h2d", q[s - 1]["O"], -1, ("g", s - 1, k))
            # the profile's backward includes recomputing the forward; GPipe keeps activations
            ops[s].append(_Op(("b", s, k), q[s]["b"] - q[s]["f"], needs, None, end))
    eng = _Engine(hw, ops)
    t = eng.run()
    return SimResult("gpipe", t, eng.bytes["h2d"], eng.bytes["d2h"], eng.param_h2d, eng.busy)
