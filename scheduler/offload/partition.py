"""Mobius's partition: how many pipeline stages, and which contiguous layers each holds.

The model lives in host DRAM; stage s runs on GPU s mod N, and while a GPU
computes one stage it prefetches the next stage it will run (s + N forward,
s - N backward). A mixed-integer program (HiGHS through `scipy.optimize.milp`)
picks the number of stages and the contiguous layer-to-stage assignment that
minimises the modelled step time, subject to per-GPU memory.

The model of one step (`step_time` computes it for any partition; the MIP
encodes exactly the same quantities, so brute force can check it):

    per stage s (m micro batches; F, K = forward, backward(+recompute) time of all m;
    W, G = weight and gradient bytes; I, O = input, output bytes of one micro batch;
    A = activations of one micro batch alive during backward; B = host<->GPU bytes/s)

    forward  Ef_s = max(F_s, (W_{s+N} + m.I_s) / B, m.(O_s + I_s) / B)
             compute, vs. prefetching the GPU's next stage + receiving inputs (host->GPU),
             vs. sending outputs + parking inputs in DRAM for backward (GPU->host)
    backward Eb_s = max(K_s, (W_{s-N} + m.I_{s-N} + m.O_s) / B, (G_s + m.I_s) / B)
             compute, vs. prefetching the previous stage with its inputs + receiving output
             gradients, vs. draining gradients to DRAM + sending input gradients
    step     T = max over GPUs g of sum_{s = g mod N} (Ef_s + Eb_s)       (busiest GPU)
               + max(0, max_{g<N} W_g/B - sum_{s<g} F_s/m)                (first loads not hidden)
               + sum_{s < N-1} (F_s + K_s) / m                             (pipeline fill and drain)

    memory, every stage s (forward and backward peaks):
        W_s + m(I_s + O_s) + A_s + W_{s+N}                        <= M
        W_s + G_s + m(I_s + O_s) + A_s + W_{s-N} + m.I_{s-N}        <= M

The last N stages stay resident between forward and backward (they are the first to run
backward), which is why no reload of them appears. Stages keep only their inputs for
backward and recompute their forward then (the executor does exactly this).

A time limit returns HiGHS's best incumbent (`optimal=False`); if it found none, the best
even split that fits. Either way `gap` says how far from the optimum it can be: the least
lower bound over all stage counts (LP relaxations of those never solved, HiGHS's dual bound
at the limit, optima where proved). 48 layers x 8 GPUs do not prove optimal within 10 s: the
model is prefetch-bound and integer layer counts balance the busiest GPU worse than the LP
(bound ~8% under the incumbents). When nothing fits, `NoFeasiblePartition` names the layer that needs
the most memory and what would help.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import lil_matrix

from scheduler.offload.profile import ModelProfile, OffloadHardware

GIB = 1024**3


class NoFeasiblePartition(ValueError):
    """No partition of the model fits the GPUs' memory."""


@dataclass(frozen=True)
class StepBreakdown:
    total_s: float
    busiest_gpu_s: float
    first_load_s: float
    fill_drain_s: float
    per_gpu_s: tuple[float, ...]


@dataclass
class Partition:
    """Stage boundaries (layer ranges, end exclusive) and the modelled step time."""

    stages: list[tuple[int, int]]
    step: StepBreakdown
    num_gpus: int
    solver: str = "milp"
    optimal: bool = True
    solve_s: float = 0.0
    note: str = ""
    peak_memory_bytes: list[int] = field(default_factory=list)
    gap: float = 0.0  # (step time - the solver's lower bound) / step time; 0 when proved optimal

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def stage_sizes(self) -> list[int]:
        return [b - a for a, b in self.stages]

    def to_dict(self) -> dict:
        return {
            "num_stages": self.num_stages,
            "stages": [list(r) for r in self.stages],
            "predicted_step_time_s": self.step.total_s,
            "busiest_gpu_s": self.step.busiest_gpu_s,
            "first_load_s": self.step.first_load_s,
            "fill_drain_s": self.step.fill_drain_s,
            "solver": self.solver,
            "optimal": self.optimal,
            "solve_s": self.solve_s,
            "gap": self.gap,
            "peak_memory_gib": [round(b / GIB, 3) for b in self.peak_memory_bytes],
            "note": self.note,
        }


# --- the model, evaluated for a given partition ---------------------------------------------


def _stage_quantities(profile: ModelProfile, sizes: list[int]):
    m = profile.microbatches
    out = []
    start = 0
    for size in sizes:
        ls = profile.layers[start:start + size]
        inp = profile.layers[start - 1].output_bytes if start > 0 else 0
        out.append(dict(
            F=m * sum(l.forward_s for l in ls), K=m * sum(l.backward_s for l in ls),
            W=sum(l.param_bytes for l in ls), G=sum(l.grad_bytes for l in ls),
            A=sum(l.activation_bytes for l in ls), I=inp, O=ls[-1].output_bytes,
        ))
        start += size
    return out


def stage_memory(profile: ModelProfile, hw: OffloadHardware, sizes: list[int]) -> list[int]:
    """Peak device bytes while each stage runs (the larger of its forward and backward peaks)."""
    q, m, n = _stage_quantities(profile, sizes), profile.microbatches, hw.num_gpus
    S = len(q)

    def get(s, k):
        return q[s][k] if 0 <= s < S else 0

    peaks = []
    for s in range(S):
        base = q[s]["W"] + m * (q[s]["I"] + q[s]["O"]) + q[s]["A"]
        fwd = base + get(s + n, "W")
        bwd = base + q[s]["G"] + get(s - n, "W") + m * get(s - n, "I")
        peaks.append(max(fwd, bwd))
    return peaks


def step_time(profile: ModelProfile, hw: OffloadHardware, sizes: list[int]) -> StepBreakdown:
    """The modelled step time of a partition given as stage sizes (layers per stage)."""
    q, m, n, bw = _stage_quantities(profile, sizes), profile.microbatches, hw.num_gpus, hw.effective_h2d_bytes_per_s
    S = len(q)

    def get(s, k):
        return q[s][k] if 0 <= s < S else 0

    per_gpu = [0.0] * n
    for s in range(S):
        ef = max(q[s]["F"], (get(s + n, "W") + m * q[s]["I"]) / bw, m * (q[s]["O"] + q[s]["I"]) / bw)
        eb = max(q[s]["K"], (get(s - n, "W") + m * get(s - n, "I") + m * q[s]["O"]) / bw,
                 (q[s]["G"] + m * q[s]["I"]) / bw)
        per_gpu[s % n] += ef + eb
    first = max(0.0, max(q[g]["W"] / bw - sum(q[s]["F"] for s in range(g)) / m for g in range(min(n, S))))
    fill = sum((q[s]["F"] + q[s]["K"]) / m for s in range(min(n - 1, S)))
    busiest = max(per_gpu)
    return StepBreakdown(busiest + first + fill, busiest, first, fill, tuple(per_gpu))


def fits(profile: ModelProfile, hw: OffloadHardware, sizes: list[int]) -> bool:
    return max(stage_memory(profile, hw, sizes)) <= hw.gpu_memory_bytes


def _ranges(sizes: list[int]) -> list[tuple[int, int]]:
    out, a = [], 0
    for s in sizes:
        out.append((a, a + s))
        a += s
    return out


def _make(profile, hw, sizes, **kw) -> Partition:
    return Partition(stages=_ranges(sizes), step=step_time(profile, hw, sizes), num_gpus=hw.num_gpus,
                     peak_memory_bytes=stage_memory(profile, hw, sizes), **kw)


def partition_of(profile: ModelProfile, hw: OffloadHardware, stages: list[tuple[int, int]], solver: str) -> Partition:
    """A given partition (e.g. the one a resumed run was checkpointed with), with its modelled step."""
    return _make(profile, hw, [b - a for a, b in stages], solver=solver)


# --- baselines: brute force (small) and even splits ---------------------------------------------


def _compositions(total: int, parts: int):
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield [bounds[i + 1] - bounds[i] for i in range(parts)]


def brute_force(profile: ModelProfile, hw: OffloadHardware, max_stages: int | None = None) -> Partition | None:
    """Every contiguous partition (2^(L-1) of them): the reference the MIP must match."""
    L = profile.num_layers
    best: tuple[float, list[int]] | None = None
    for S in range(1, min(L, max_stages or L) + 1):
        for sizes in _compositions(L, S):
            if not fits(profile, hw, sizes):
                continue
            t = step_time(profile, hw, sizes).total_s
            if best is None or t < best[0] - 1e-12:
                best = (t, sizes)
    return None if best is None else _make(profile, hw, best[1], solver="brute-force")


def even_sizes(num_layers: int, num_stages: int) -> list[int]:
    base, extra = divmod(num_layers, num_stages)
    return [base + (1 if i < extra else 0) for i in range(num_stages)]


def best_even_split(profile: ModelProfile, hw: OffloadHardware, max_stages: int | None = None) -> Partition | None:
    """The best equal-layer-count split over stage counts (what one would do by hand)."""
    best = None
    for S in range(1, min(profile.num_layers, max_stages or profile.num_layers) + 1):
        sizes = even_sizes(profile.num_layers, S)
        if fits(profile, hw, sizes):
            p = _make(profile, hw, sizes, solver="even-split")
            if best is None or p.step.total_s < best.step.total_s:
                best = p
    return best


# --- the mixed-integer program ---------------------------------------------------------------


def default_max_stages(num_layers: int, num_gpus: int) -> int:
    """Enough stages to cycle each GPU through several (Mobius uses a few per GPU), bounded
    so 48 layers x 8 GPUs solves in seconds."""
    return min(num_layers, max(4 * num_gpus, 8))


def _size(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB / 10 else f"{nbytes / 2**20:.2f} MiB"


def explain_infeasible(profile: ModelProfile, hw: OffloadHardware) -> str:
    worst = max(range(profile.num_layers), key=lambda i: max(stage_memory(profile, hw, [1] * profile.num_layers)[i], 0))
    need = max(stage_memory(profile, hw, [1] * profile.num_layers))
    layer = profile.layers[worst]
    return (
        f"no partition of the {profile.num_layers} layers fits {hw.num_gpus} GPU(s) with "
        f"{_size(hw.gpu_memory_bytes)} each: even one layer per stage needs "
        f"{_size(need)} on a GPU (layer {layer.name!r}: weights {_size(layer.param_bytes)}, "
        f"activations {_size(layer.activation_bytes)} per micro batch, plus the prefetched stage); "
        f"use a smaller micro batch (more micro batches), a shorter sequence, or GPUs with more memory"
    )


def solve_per_layer(
    profile: ModelProfile,
    hw: OffloadHardware,
    *,
    max_stages: int | None = None,
    time_limit_s: float = 10.0,
    mip_rel_gap: float = 1e-6,
    num_stages: int | None = None,
) -> Partition:
    """The MIP optimum (or the best incumbent at the time limit). Raises NoFeasiblePartition."""
    L, n, m, bw = profile.num_layers, hw.num_gpus, profile.microbatches, hw.effective_h2d_bytes_per_s
    S = num_stages or min(L, max_stages or default_max_stages(L, n))
    M = float(hw.gpu_memory_bytes)
    lay = profile.layers
    f = np.array([l.forward_s for l in lay]) * m
    k = np.array([l.backward_s for l in lay]) * m
    w = np.array([l.param_bytes for l in lay], dtype=float)
    g = np.array([l.grad_bytes for l in lay], dtype=float)
    a = np.array([l.activation_bytes for l in lay], dtype=float)
    out = np.array([l.output_bytes for l in lay], dtype=float)
    inp = np.concatenate([[0.0], out[:-1]])

    # variable layout: x[l,s] | fi[l,s] | la[l,s] | Ef[s] | Eb[s] | P | Z
    nx = L * S
    X, FI, LA = 0, nx, 2 * nx
    EF, EB = 3 * nx, 3 * nx + S
    P, Z = 3 * nx + 2 * S, 3 * nx + 2 * S + 1
    nvar = Z + 1

    def x(l, s): return X + l * S + s
    def fi(l, s): return FI + l * S + s
    def la(l, s): return LA + l * S + s

    rows: list[tuple[dict[int, float], float, float]] = []

    def add(coefs: dict[int, float], lo: float, hi: float) -> None:
        rows.append((coefs, lo, hi))

    def acc(d: dict[int, float], idx: int, v: float) -> None:
        if v:
            d[idx] = d.get(idx, 0.0) + v

    # Stage-wise linear expressions as {var: coef}.
    def expr(vec, kind: str, s: int, scale: float = 1.0) -> dict[int, float]:
        d: dict[int, float] = {}
        if not 0 <= s < S:
            return d
        pick = {"x": x, "fi": fi, "la": la}[kind]
        for l in range(L):
            acc(d, pick(l, s), vec[l] * scale)
        return d

    def merge(*ds: dict[int, float]) -> dict[int, float]:
        out_d: dict[int, float] = {}
        for d in ds:
            for i, v in d.items():
                acc(out_d, i, v)
        return out_d

    inf = np.inf
    for l in range(L):
        add({x(l, s): 1.0 for s in range(S)}, 1.0, 1.0)
        for s in range(S):
            # contiguity: layer l+1 is in stage s only if layer l is in s or s-1
            if l + 1 < L:
                d = {x(l + 1, s): 1.0, x(l, s): -1.0}
                if s > 0:
                    d[x(l, s - 1)] = -1.0
                add(d, -inf, 0.0)
            # first / last layer-of-stage indicators (relaxed: >= the difference)
            d = {fi(l, s): 1.0, x(l, s): -1.0}
            if l > 0:
                d[x(l - 1, s)] = 1.0
            add(d, 0.0, inf)
            d = {la(l, s): 1.0, x(l, s): -1.0}
            if l + 1 < L:
                d[x(l + 1, s)] = 1.0
            add(d, 0.0, inf)

    ib = 1.0 / bw
    big_m = (w.sum() + m * inp.max()) * ib
    for s in range(S):
        # forward epigraph
        add(merge({EF + s: 1.0}, expr(f, "x", s, -1.0)), 0.0, inf)
        add(merge({EF + s: 1.0}, expr(w, "x", s + n, -ib), expr(inp, "fi", s, -m * ib)), 0.0, inf)
        add(merge({EF + s: 1.0}, expr(out, "la", s, -m * ib), expr(inp, "fi", s, -m * ib)), 0.0, inf)
        # backward epigraph
        add(merge({EB + s: 1.0}, expr(k, "x", s, -1.0)), 0.0, inf)
        # Only a stage that exists prefetches: a missing stage s (s >= the stage count) would
        # have fetched s - N, which is one of the last N stages and stays resident. Big-M on
        # "stage s exists" = the last layer sits in stage s or later.
        exists = {x(L - 1, t): -big_m for t in range(s, S)} if s >= n and not num_stages else {}
        add(merge({EB + s: 1.0}, expr(w, "x", s - n, -ib), expr(inp, "fi", s - n, -m * ib),
                  expr(out, "la", s, -m * ib), exists), -big_m if exists else 0.0, inf)
        add(merge({EB + s: 1.0}, expr(g, "x", s, -ib), expr(inp, "fi", s, -m * ib)), 0.0, inf)
        # memory (scaled to GPU memory = 1)
        base = merge(expr(w, "x", s, 1 / M), expr(inp, "fi", s, m / M), expr(out, "la", s, m / M),
                     expr(a, "x", s, 1 / M))
        add(merge(base, expr(w, "x", s + n, 1 / M)), -inf, 1.0)
        add(merge(base, expr(g, "x", s, 1 / M), expr(w, "x", s - n, 1 / M), expr(inp, "fi", s - n, m / M)),
            -inf, 1.0)
    for gpu in range(n):
        d = {P: 1.0}
        for s in range(gpu, S, n):
            acc(d, EF + s, -1.0)
            acc(d, EB + s, -1.0)
        add(d, 0.0, inf)
    for gpu in range(min(n, S)):
        add(merge({Z: 1.0}, expr(w, "x", gpu, -ib), *[expr(f, "x", s, 1.0 / m) for s in range(gpu)]), 0.0, inf)

    c = np.zeros(nvar)
    c[P] = 1.0
    c[Z] = 1.0
    for s in range(min(n - 1, S)):
        for l in range(L):
            c[x(l, s)] += (f[l] + k[l]) / m

    A = lil_matrix((len(rows), nvar))
    lo = np.empty(len(rows))
    hi = np.empty(len(rows))
    for r, (coefs, lo_r, hi_r) in enumerate(rows):
        for i, v in coefs.items():
            A[r, i] = v
        lo[r], hi[r] = lo_r, hi_r
    lb = np.zeros(nvar)
    ub = np.full(nvar, np.inf)
    ub[:3 * nx] = 1.0
    for l in range(L):
        for s in range(S):
            if s > l:  # stage s needs at least s layers before it
                ub[x(l, s)] = 0.0
    if num_stages:
        lb[x(L - 1, S - 1)] = 1.0  # exactly num_stages stages: the last layer is in the last one
    integrality = np.zeros(nvar)
    integrality[:nx] = 1

    started = time.perf_counter()
    res = milp(c, constraints=LinearConstraint(A.tocsr(), lo, hi), integrality=integrality,
               bounds=Bounds(lb, ub), options={"time_limit": time_limit_s, "mip_rel_gap": mip_rel_gap})
    solve_s = time.perf_counter() - started
    if res.x is None:
        if res.status == 2:  # infeasible
            raise NoFeasiblePartition(explain_infeasible(profile, hw))
        fallback = best_even_split(profile, hw, S)
        if fallback is None:
            raise NoFeasiblePartition(explain_infeasible(profile, hw))
        fallback.optimal = False
        fallback.solve_s = solve_s
        fallback.note = f"MIP found no incumbent in {time_limit_s:.1f}s ({res.message}); best even split used"
        return fallback
    xs = res.x[:nx].reshape(L, S)
    stage_of = xs.argmax(axis=1)
    sizes = [int((stage_of == s).sum()) for s in range(S) if (stage_of == s).any()]
    gap = 0.0 if res.status == 0 else float(getattr(res, "mip_gap", None) or 0.0)
    return _make(profile, hw, sizes, solver="milp", optimal=res.status == 0, solve_s=solve_s, gap=gap,
                 note="" if res.status == 0 else f"time limit {time_limit_s:.1f}s: best incumbent, at most "
                 f"{100 * gap:.1f}% slower than the optimum")


# --- the same program over layer counts, for models of identical blocks -----------------------


def uniform_blocks(profile: ModelProfile) -> bool:
    """Embedding + identical decoder layers + head (every Llama; measured profiles average the
    decoder layers): the partition is then just how many layers each stage holds."""
    lay = profile.layers
    if len(lay) < 3:
        return False
    body = lay[1:-1]
    same = all((l.forward_s, l.backward_s, l.param_bytes, l.grad_bytes, l.activation_bytes, l.output_bytes)
               == (body[0].forward_s, body[0].backward_s, body[0].param_bytes, body[0].grad_bytes,
                   body[0].activation_bytes, body[0].output_bytes) for l in body)
    return same and lay[0].output_bytes == body[0].output_bytes


def _solve_counts(profile: ModelProfile, hw: OffloadHardware, S: int, time_limit_s: float, mip_rel_gap: float,
                  bound_only: bool = False):
    """Fixed stage count S: integer n_s = decoder layers in stage s (embedding in stage 0, head in
    stage S-1). The same step-time and memory model as `step_time`/`stage_memory`."""
    lay, n, m, ib = profile.layers, hw.num_gpus, profile.microbatches, 1.0 / hw.effective_h2d_bytes_per_s
    emb, blk, head = lay[0], lay[1], lay[-1]
    K = len(lay) - 2
    M = float(hw.gpu_memory_bytes)
    if S > K + 2 or (S >= 2 and K < S - 2):
        return None
    if S == 1:
        sizes = [len(lay)]
        if not fits(profile, hw, sizes):
            return None
        t = step_time(profile, hw, sizes).total_s
        return t if bound_only else (t, sizes, True, t)
    # variables: n_s (S) | Ef (S) | Eb (S) | P | Z ; every stage quantity = const + coef * n_s
    NV = 3 * S + 2
    EF, EB, P, Z = S, 2 * S, 3 * S, 3 * S + 1

    def q(attr: str, s: int) -> tuple[float, float]:
        """(constant, per-layer) of a stage quantity; out-of-range stages are zero."""
        if not 0 <= s < S:
            return 0.0, 0.0
        const = (getattr(emb, attr) if s == 0 else 0.0) + (getattr(head, attr) if s == S - 1 else 0.0)
        return float(const), float(getattr(blk, attr))

    def lin(terms, extra=None):
        """terms: [(attr, s, scale)] -> ({var: coef}, constant)."""
        d, c0 = dict(extra or {}), 0.0
        for attr, s, scale in terms:
            if not 0 <= s < S:
                continue
            const, per = q(attr, s)
            c0 += scale * const
            d[s] = d.get(s, 0.0) + scale * per
        return d, c0

    def inp(s):  # one micro batch's input bytes of stage s
        return 0.0 if s <= 0 or s >= S else float(blk.output_bytes)

    def out(s):
        return float(head.output_bytes if s == S - 1 else blk.output_bytes) if 0 <= s < S else 0.0

    rows = []

    def ge(d, c0, v):  # sum d.x + c0 >= v
        rows.append((d, v - c0, np.inf))

    def le(d, c0, v):
        rows.append((d, -np.inf, v - c0))

    for s in range(S):
        d, c0 = lin([("forward_s", s, -m)], {EF + s: 1.0}); ge(d, c0, 0.0)
        d, c0 = lin([("param_bytes", s + n, -ib)], {EF + s: 1.0}); ge(d, c0 - m * inp(s) * ib, 0.0)
        ge({EF + s: 1.0}, -m * (out(s) + inp(s)) * ib, 0.0)
        d, c0 = lin([("backward_s", s, -m)], {EB + s: 1.0}); ge(d, c0, 0.0)
        d, c0 = lin([("param_bytes", s - n, -ib)], {EB + s: 1.0})
        ge(d, c0 - (m * inp(s - n) + m * out(s)) * ib, 0.0)
        d, c0 = lin([("grad_bytes", s, -ib)], {EB + s: 1.0}); ge(d, c0 - m * inp(s) * ib, 0.0)
        base = [("param_bytes", s, 1 / M), ("activation_bytes", s, 1 / M)]
        io = m * (inp(s) + out(s)) / M
        d, c0 = lin(base + [("param_bytes", s + n, 1 / M)]); le(d, c0 + io, 1.0)
        d, c0 = lin(base + [("grad_bytes", s, 1 / M), ("param_bytes", s - n, 1 / M)])
        le(d, c0 + io + m * inp(s - n) / M, 1.0)
    for g in range(n):
        ge({P: 1.0, **{EF + s: -1.0 for s in range(g, S, n)}, **{EB + s: -1.0 for s in range(g, S, n)}}, 0.0, 0.0)
    for g in range(min(n, S)):
        d, c0 = lin([("param_bytes", g, -ib)] + [("forward_s", s, 1.0) for s in range(g)], {Z: 1.0})
        ge(d, c0, 0.0)
    c = np.zeros(NV)
    c[P] = c[Z] = 1.0
    c_const = 0.0
    for s in range(min(n - 1, S)):
        for attr in ("forward_s", "backward_s"):
            const, per = q(attr, s)
            c[s] += per
            c_const += const
    A = lil_matrix((len(rows) + 1, NV))
    lo, hi = np.empty(len(rows) + 1), np.empty(len(rows) + 1)
    for r, (d, l_, h_) in enumerate(rows):
        for i, v in d.items():
            A[r, i] = v
        lo[r], hi[r] = l_, h_
    A[len(rows), :S] = 1.0
    lo[-1] = hi[-1] = K
    lb = np.zeros(NV)
    ub = np.full(NV, np.inf)
    ub[:S] = K
    lb[1:S - 1] = 1.0  # middle stages hold at least one layer
    integrality = np.zeros(NV)
    integrality[:S] = 0 if bound_only else 1
    res = milp(c, constraints=LinearConstraint(A.tocsr(), lo, hi), integrality=integrality,
               bounds=Bounds(lb, ub), options={"time_limit": max(time_limit_s, 0.05), "mip_rel_gap": mip_rel_gap})
    if res.x is None:
        if res.status == 2 or bound_only:  # nothing with S stages fits
            return None
        bound = getattr(res, "mip_dual_bound", None)  # stopped before finding any partition
        return np.inf, None, False, (float(bound) + c_const if bound is not None and np.isfinite(bound) else -np.inf)
    if bound_only:  # the LP relaxation: no partition with S stages beats this
        return float(res.fun) + c_const
    counts = [int(round(v)) for v in res.x[:S]]
    sizes = [counts[s] + (s == 0) + (s == S - 1) for s in range(S)]
    t = step_time(profile, hw, sizes).total_s
    # No partition with S stages is faster than this: the optimum, or HiGHS's dual bound at the time limit.
    bound = getattr(res, "mip_dual_bound", None)
    bound = t if res.status == 0 or bound is None or not np.isfinite(bound) else min(t, float(bound) + c_const)
    return t, sizes, res.status == 0, bound


def solve_partition(
    profile: ModelProfile,
    hw: OffloadHardware,
    *,
    max_stages: int | None = None,
    time_limit_s: float = 10.0,
    mip_rel_gap: float = 1e-4,
) -> Partition:
    """The MIP optimum over stage counts 1..max_stages (or the best incumbent at the time limit).

    Models made of identical blocks are solved as one small integer program per stage count
    (layers per stage); others with the per-layer assignment program. Raises NoFeasiblePartition.
    """
    L = profile.num_layers
    S_max = min(L, max_stages or default_max_stages(L, hw.num_gpus))
    if not uniform_blocks(profile):
        return solve_per_layer(profile, hw, max_stages=S_max, time_limit_s=time_limit_s, mip_rel_gap=mip_rel_gap)
    started = time.perf_counter()
    best = None
    # LP relaxations first (milliseconds). `lower[S]`: no S-stage partition is faster.
    lower: dict[int, float] = {}
    for S in range(1, S_max + 1):
        lp = _solve_counts(profile, hw, S, time_limit_s, mip_rel_gap, bound_only=True)
        if lp is not None:
            lower[S] = lp
    # Two passes in ascending bound order: first a short slice for every stage count (an
    # incumbent and a raised bound for each: proofs are slow, good partitions come early),
    # then the rest of the budget to the counts still open. A count is skipped once its
    # bound cannot beat the incumbent.
    settled: set[int] = set()
    first_slice = time_limit_s / (2 * max(1, len(lower)))
    for slice_s in (first_slice, None):
        for S in sorted(lower, key=lower.get):
            if S in settled or (best is not None and lower[S] >= best[0] * (1 - mip_rel_gap)):
                continue
            left = time_limit_s - (time.perf_counter() - started)
            if left <= 0.05:
                break
            found = _solve_counts(profile, hw, S, min(left, slice_s or left), mip_rel_gap)
            if found is None:  # proved infeasible
                lower[S] = np.inf
                settled.add(S)
                continue
            t, sizes, optimal, bound = found
            lower[S] = max(lower[S], bound)
            if optimal:
                settled.add(S)
            if sizes is not None and (best is None or t < best[0] - 1e-12):
                best = (t, sizes)
    all_optimal = all(S in settled or (best is not None and lower[S] >= best[0] * (1 - mip_rel_gap))
                      for S in lower)
    solve_s = time.perf_counter() - started
    if best is None:
        if all_optimal:
            raise NoFeasiblePartition(explain_infeasible(profile, hw))
        fallback = best_even_split(profile, hw, S_max)
        if fallback is None:
            raise NoFeasiblePartition(explain_infeasible(profile, hw))
        fallback.optimal, fallback.solve_s = False, solve_s
        fallback.gap = max(0.0, 1 - min(lower.values(), default=0.0) / fallback.step.total_s)
        fallback.note = (f"no incumbent within {time_limit_s:.1f}s; best even split used, at most "
                         f"{100 * fallback.gap:.1f}% slower than the optimum")
        return fallback
    # How far from the optimum at worst: the least lower bound over all stage counts.
    gap = 0.0 if all_optimal else max(0.0, 1 - min(lower.values()) / best[0])
    return _make(profile, hw, best[1], solver="milp-counts", optimal=all_optimal, solve_s=solve_s, gap=gap,
                 note="" if all_optimal else f"time limit {time_limit_s:.1f}s: best incumbent, at most "
                 f"{100 * gap:.1f}% slower than the optimum")
