"""Mobius fine-tuning: the model lives in host memory, stages are swapped through the device.

One process per GPU ("worker"); stage s runs on worker s mod W. Every step:

    forward   for each of my stages, in order:
                  wait for its weights (prefetched), start prefetching my next stage (s + W)
                  for each micro batch: input from the previous stage's worker (or token ids),
                      forward without autograd, park the input in host memory, send the output on
                  drop the stage's device weights, unless it is one of the last W stages
                  (they run backward first, so they stay)
    backward  for each of my stages, in reverse:
                  its weights are resident or prefetched; start prefetching s - W
                  for each micro batch: output gradient from the next stage's worker (or the
                      loss), recompute the stage forward from the parked input, backward,
                      send the input gradient back
                  gradients -> host, drop the stage from the device
    optimizer global gradient-norm clipping (one all-reduce), AdamW on the host copies
              (`optimizer_on="device"`: each stage steps on the device right after its
              backward, with its Adam state swapped in and out with it; no clipping then)

Parameters, gradients and optimizer state of every stage stay in (pinned, on CUDA) host
memory; the device holds at most: the running stage, the one being prefetched, gradients of
the running stage, one micro batch's activations, and boundary tensors — every byte of it
accounted against `device_budget_bytes` (`training.offload.device`).

Every `checkpoint_every` steps each worker saves its stages' host weights and optimizer state
under out_dir/checkpoints/step-N/ and rank 0 writes COMMITTED last; a run started again on
the same out_dir, stages and world size resumes from the newest committed one (a killed
run loses at most `checkpoint_every` steps). A finished run removes them.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator

from training.offload.device import DeviceMemory, Prefetcher, pin, tensor_bytes
from training.offload.units import (
    SequenceContext, load_llama_config, load_units, run_unit, unit_count, unit_kind, unit_state_dict,
)


class OffloadConfigError(ValueError):
    """An offload run description is inconsistent (what is wrong and how to fix it)."""


class DataSource(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["random", "prepared"] = "random"
    data_dir: str | None = Field(default=None, description="prepared data (forgeflow prepare) for kind=prepared")
    seed: int = 0
    distinct_batches: int | None = Field(default=None, gt=0, description="random: cycle through this many batches")


class OffloadRunConfig(BaseModel):
    """One offloaded fine-tuning run: model folder, partition, schedule, optimizer, budget."""

    model_config = ConfigDict(extra="forbid")

    model_dir: str
    stages: list[tuple[int, int]] = Field(description="unit ranges [start, end) per stage, in order")
    steps: int = Field(gt=0)
    micro_batch_size: int = Field(default=1, gt=0)
    microbatches: int = Field(default=1, gt=0)
    seq_length: int = Field(gt=0)
    lr: float = Field(default=1e-4, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    adam_betas: tuple[float, float] = (0.9, 0.95)
    adam_eps: float = 1e-8
    grad_clip: float = Field(default=1.0, ge=0, description="0 disables")
    seed: int = 1234
    device_budget_bytes: int | None = Field(default=None, gt=0, description="None: no limit")
    optimizer_on: Literal["host", "device"] = "host"
    data: DataSource = Field(default_factory=DataSource)
    gpu_of_rank: list[int] | None = Field(default=None, description="cross mapping: GPU index per worker")
    out_dir: str
    save_model: bool = True
    checkpoint_every: int = Field(default=0, ge=0, description="steps between committed checkpoints of the "
                                  "host state (weights + optimizer), under out_dir/checkpoints; 0: none")
    resume: bool = Field(default=True, description="start from the last committed checkpoint of the same "
                         "stages and world size under out_dir/checkpoints, if any")

    @model_validator(mode="after")
    def _check(self) -> "OffloadRunConfig":
        if not self.stages:
            raise ValueError("stages must list at least one [start, end) range")
        for (a, b), (c, _d) in zip(self.stages, self.stages[1:]):
            if b != c:
                raise ValueError(f"stages must be contiguous: {[a, b]} is followed by a range starting at {c}")
        if any(b <= a for a, b in self.stages) or self.stages[0][0] != 0:
            raise ValueError(f"stages {self.stages} must start at unit 0 and be non-empty")
        if self.optimizer_on == "device" and self.grad_clip:
            raise ValueError("optimizer_on=device steps each stage before the global gradient norm is "
                             "known: set grad_clip: 0, or optimizer_on: host")
        return self

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.microbatches


def step_tokens(cfg: OffloadRunConfig, vocab_size: int):
    """A callable step -> int64 [global_batch, seq_length + 1], identical on every worker."""
    if cfg.data.kind == "prepared":
        from training.sampler import BatchSampler, PackedTokens

        if not cfg.data.data_dir:
            raise OffloadConfigError("data.kind=prepared needs data.data_dir (run `forgeflow prepare` first)")
        sampler = BatchSampler(PackedTokens(Path(cfg.data.data_dir) / "train.bin", cfg.seq_length), cfg.data.seed)

        def prepared(step: int) -> torch.Tensor:
            ids = sampler.sample_ids(step, cfg.global_batch)
            return torch.from_numpy(sampler.dataset.samples(ids))
        return prepared

    def random_tokens(step: int) -> torch.Tensor:
        if cfg.data.distinct_batches:
            step %= cfg.data.distinct_batches
        g = torch.Generator().manual_seed(cfg.data.seed * 1_000_003 + step)
        return torch.randint(0, vocab_size, (cfg.global_batch, cfg.seq_length + 1), generator=g)
    return random_tokens


def _init_world(backend: str) -> tuple[int, int]:
    import datetime

    if not torch.distributed.is_initialized():
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            torch.distributed.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=600))
        else:
            torch.distributed.init_process_group(backend=backend, store=torch.distributed.HashStore(),
                                                 rank=0, world_size=1)
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


class _Stage:
    """One stage's units on this worker: host parameters (master), host gradients, optimizer."""

    def __init__(self, index: int, units: dict[int, torch.nn.Module], kinds: dict[int, str]):
        self.index = index
        self.units = units
        self.kinds = kinds
        self.host: dict[str, torch.Tensor] = {}
        for u, module in units.items():
            for name, p in module.named_parameters():
                p.data = pin(p.data)
                p.grad = pin(torch.zeros_like(p.data))
                self.host[f"{u}/{name}"] = p
        self.param_bytes = tensor_bytes(self.host.values())
        self.inputs: list[torch.Tensor] = []  # parked micro-batch inputs (host)
        self.optimizer: torch.optim.Optimizer | None = None

    def run(self, x: torch.Tensor, ctx: SequenceContext, device_params: dict[str, torch.Tensor]) -> torch.Tensor:
        for u, module in self.units.items():
            prefix = f"{u}/"
            params = {k[len(prefix):]: v for k, v in device_params.items() if k.startswith(prefix)}
            x = run_unit(self.kinds[u], module, x, ctx, params)
        return x


def run_worker(cfg: OffloadRunConfig) -> dict:
    """Run the fine-tuning loop on this process's share of the stages; returns its report."""
    use_cuda = torch.cuda.is_available()
    rank, world = _init_world("nccl" if use_cuda else "gloo")
    if use_cuda:
        gpu = (cfg.gpu_of_rank or list(range(world)))[rank]
        torch.cuda.set_device(gpu)
        device = torch.device("cuda", gpu)
    else:
        device = torch.device("cpu")
    torch.manual_seed(cfg.seed)
    config = load_llama_config(cfg.model_dir)
    total_units = unit_count(config)
    if cfg.stages[-1][1] != total_units:
        raise OffloadConfigError(f"stages cover units 0..{cfg.stages[-1][1]} but the model has {total_units} "
                                 f"(embedding + {config.num_hidden_layers} layers + head)")
    S, m = len(cfg.stages), cfg.microbatches
    mine = [s for s in range(S) if s % world == rank]
    stages: dict[int, _Stage] = {}
    for s in mine:
        a, b = cfg.stages[s]
        units = load_units(cfg.model_dir, config, range(a, b))
        stages[s] = _Stage(s, units, {u: unit_kind(config, u) for u in units})
    host_params = [p for st in stages.values() for p in st.host.values()]
    adam = dict(lr=cfg.lr, betas=cfg.adam_betas, eps=cfg.adam_eps, weight_decay=cfg.weight_decay, foreach=False)
    optimizer = torch.optim.AdamW(host_params, **adam) if host_params and cfg.optimizer_on == "host" else None
    memory = DeviceMemory(cfg.device_budget_bytes or 1 << 62, device)
    prefetcher = Prefetcher(device)
    ctx = SequenceContext(config, device)
    tokens_of = step_tokens(cfg, config.vocab_size)
    hidden_shape = (cfg.micro_batch_size, cfg.seq_length, config.hidden_size)
    dtype = next(iter(host_params)).dtype if host_params else torch.float32
    act_bytes = math.prod(hidden_shape) * torch.tensor([], dtype=dtype).element_size()
    resident_after_forward = set(range(max(0, S - world), S))
    on_device: dict[int, dict[str, torch.Tensor]] = {}
    pending: dict[int, object] = {}

    def prefetch(s: int, urgent: bool) -> None:
        if s in stages and s not in on_device and s not in pending:
            memory.alloc(f"w{s}", stages[s].param_bytes)
            pending[s] = prefetcher.fetch(s, {k: p.data for k, p in stages[s].host.items()}, urgent=urgent)

    def weights(s: int) -> dict[str, torch.Tensor]:
        if s not in on_device:
            prefetch(s, urgent=True)
            on_device[s] = pending.pop(s).result()
        return on_device[s]

    def drop(s: int) -> None:
        on_device.pop(s)
        memory.free(f"w{s}")

    def peer(s: int) -> int:
        return s % world

    mailbox: dict[int, torch.Tensor] = {}  # a world of one hands tensors to itself
    in_flight: list = []  # (work, tensor): sends must not block, or two workers sending to
    # each other (stage 0 -> 1 while stage 1 -> 2 on a world of two) wait on each other forever

    def send(t: torch.Tensor, dst: int, tag: int) -> None:
        t = t.detach().contiguous()
        if dst == rank:
            mailbox[tag] = t.clone()
        else:
            t = t.cpu() if device.type == "cuda" else t.clone()
            in_flight.append((torch.distributed.isend(t, dst=dst, tag=tag), t))

    def recv(src: int, tag: int) -> torch.Tensor:
        if src == rank:
            return mailbox.pop(tag)
        t = torch.empty(hidden_shape, dtype=dtype)
        torch.distributed.recv(t, src=src, tag=tag)
        return t.to(device)

    losses: list[float] = []
    step_times: list[float] = []
    start = 0
    if cfg.resume:
        found = latest_checkpoint(cfg, world)
        if found is not None:
            start, losses = _load_checkpoint(found, rank, stages, optimizer, adam)
            losses = list(losses)
    # Activations autograd keeps for backward: every saved tensor's storage once, except the
    # stage's weights (already accounted as w{s}).
    saved_bytes = {"n": 0}
    saved_storages: set[int] = set()
    weight_storages: set[int] = set()

    def pack(t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in weight_storages and ptr not in saved_storages:
            saved_storages.add(ptr)
            saved_bytes["n"] += t.untyped_storage().nbytes()
        return t

    for step in range(start, cfg.steps):
        started = time.perf_counter()
        batch = tokens_of(step)
        micro = batch.split(cfg.micro_batch_size)
        step_loss = torch.zeros((), dtype=torch.float64)
        if mine:
            prefetch(mine[0], urgent=True)
        # --- forward ---
        for s in mine:
            w = weights(s)
            nxt = s + world
            if nxt < S:
                prefetch(nxt, urgent=False)
            st = stages[s]
            st.inputs = []
            for k in range(m):
                if s == 0:
                    x = micro[k][:, :-1].to(device)
                else:
                    x = recv(peer(s - 1), s * 10_000 + k)
                memory.alloc(f"in{s}.{k}", x.numel() * x.element_size())
                with torch.no_grad():
                    y = st.run(x, ctx, w)
                st.inputs.append(x.to("cpu") if device.type == "cuda" else x)
                memory.free(f"in{s}.{k}")
                if s == S - 1:
                    target = micro[k][:, 1:].to(device)
                    step_loss += F.cross_entropy(y.reshape(-1, y.shape[-1]).float(), target.reshape(-1)).double().cpu()
                else:
                    send(y, peer(s + 1), (s + 1) * 10_000 + k)
                del y
            if s not in resident_after_forward:
                drop(s)
        # --- backward ---
        for s in reversed(mine):
            w = weights(s)
            prev = s - world
            if prev >= 0:
                prefetch(prev, urgent=False)
            st = stages[s]
            leaves = {k: v.detach().requires_grad_(True) for k, v in w.items()}
            memory.alloc(f"g{s}", st.param_bytes)
            for k in range(m):
                x = st.inputs[k].to(device)
                if s > 0:
                    x.requires_grad_(True)
                saved_bytes["n"] = 0
                saved_storages.clear()
                weight_storages.clear()
                weight_storages.update(v.untyped_storage().data_ptr() for v in leaves.values())
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    y = st.run(x, ctx, leaves)
                    if s == S - 1:
                        target = micro[k][:, 1:].to(device)
                        out = F.cross_entropy(y.reshape(-1, y.shape[-1]).float(), target.reshape(-1)) / m
                memory.alloc(f"act{s}", saved_bytes["n"])
                if s == S - 1:
                    out.backward()
                else:
                    y.backward(recv(peer(s + 1), 1_000_000 + s * 10_000 + k))
                memory.free(f"act{s}")
                if s > 0:
                    send(x.grad, peer(s - 1), 1_000_000 + (s - 1) * 10_000 + k)
                del y, x
            for name, p in st.host.items():  # gradients -> host (accumulated over micro batches on device)
                p.grad.copy_(leaves[name].grad, non_blocking=False)
            if cfg.optimizer_on == "device":
                _device_step(st, leaves, adam, memory, s)
            del leaves
            memory.free(f"g{s}")
            drop(s)
            st.inputs = []
        for work, _ in in_flight:
            work.wait()
        in_flight.clear()
        # --- optimizer ---
        if cfg.optimizer_on == "host":
            if cfg.grad_clip:
                sq = torch.zeros((), dtype=torch.float64)
                for p in host_params:
                    sq += p.grad.double().pow(2).sum()
                torch.distributed.all_reduce(sq)
                norm = float(sq.sqrt())
                coef = min(1.0, cfg.grad_clip / (norm + 1e-6))
                for p in host_params:
                    p.grad.mul_(coef)
            if optimizer is not None:
                optimizer.step()
        for p in host_params:
            p.grad.zero_()
        torch.distributed.broadcast(step_loss, src=peer(S - 1))
        losses.append(float(step_loss) / m)
        step_times.append(time.perf_counter() - started)
        if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0 and step + 1 < cfg.steps:
            _save_checkpoint(cfg, step + 1, rank, world, stages, optimizer, losses)
    prefetcher.close()
    report = {
        "rank": rank, "world_size": world, "stages": mine, "losses": losses, "step_times_s": step_times,
        "resumed_from_step": start,
        "device_budget_bytes": cfg.device_budget_bytes, "device_peak_bytes": memory.peak_bytes,
        "allocator_peak_bytes": memory.allocator_peak_bytes(), "prefetch_order": prefetcher.order,
        "host_state_bytes": sum(3 * p.numel() * p.element_size() for p in host_params),
        "device": str(device),
    }
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"worker{rank}.json").write_text(json.dumps(report, indent=1))
    if cfg.save_model:
        _save_model(cfg, config, stages, rank, world, out)
    torch.distributed.barrier()
    if rank == 0 and checkpoint_root(cfg).is_dir():  # finished: the resume state (weights + Adam) is spent
        import shutil

        shutil.rmtree(checkpoint_root(cfg), ignore_errors=True)
    return report


# --- checkpoints of the host state (weights + optimizer), for resuming a killed run -------------


def checkpoint_root(cfg: OffloadRunConfig) -> Path:
    return Path(cfg.out_dir) / "checkpoints"


def committed_checkpoint(out_dir: str | Path, model_dir: str, world: int) -> dict | None:
    """The newest committed checkpoint's record (step, stages, world size) of this model on this
    many workers under `out_dir`, whatever its stages: a re-run re-uses them to resume."""
    for folder in sorted((Path(out_dir) / "checkpoints").glob("step-*"), reverse=True):
        marker = folder / "COMMITTED"
        if marker.is_file():
            meta = json.loads(marker.read_text())
            if meta["world_size"] == world and meta["model_dir"] == model_dir:
                return meta
    return None


def latest_checkpoint(cfg: OffloadRunConfig, world: int) -> Path | None:
    """The newest committed checkpoint written by the same stages on the same world size (the
    state is saved per worker, by stage), or None. Uncommitted ones (a kill mid-save) are ignored."""
    root = checkpoint_root(cfg)
    if not root.is_dir():
        return None
    for folder in sorted(root.glob("step-*"), reverse=True):
        marker = folder / "COMMITTED"
        if not marker.is_file():
            continue
        meta = json.loads(marker.read_text())
        if meta["world_size"] == world and [list(r) for r in cfg.stages] == meta["stages"] and \
                meta["model_dir"] == cfg.model_dir:
            return folder
    return None


def _save_checkpoint(cfg: OffloadRunConfig, step: int, rank: int, world: int, stages: dict[int, "_Stage"],
                     optimizer, losses: list[float]) -> None:
    """Every worker writes its stages' host weights and optimizer state; after a barrier rank 0
    writes COMMITTED last (the manifest-last rule of checkpoint/), then older ones go."""
    folder = checkpoint_root(cfg) / f"step-{step:08d}"
    folder.mkdir(parents=True, exist_ok=True)
    state = {
        "step": step, "losses": list(losses),
        "params": {f"{s}/{k}": p.data.detach().cpu().clone() for s, st in stages.items() for k, p in st.host.items()},
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "stage_optimizers": {s: st.optimizer.state_dict() for s, st in stages.items() if st.optimizer is not None},
    }
    tmp = folder / f"worker{rank}.pt.partial"
    torch.save(state, tmp)
    tmp.replace(folder / f"worker{rank}.pt")
    torch.distributed.barrier()
    if rank == 0:
        meta = {"step": step, "world_size": world, "stages": [list(r) for r in cfg.stages], "model_dir": cfg.model_dir}
        (folder / "COMMITTED.partial").write_text(json.dumps(meta))
        (folder / "COMMITTED.partial").replace(folder / "COMMITTED")
        import shutil

        for old in checkpoint_root(cfg).glob("step-*"):
            if old != folder:
                shutil.rmtree(old, ignore_errors=True)
    torch.distributed.barrier()


def _load_checkpoint(folder: Path, rank: int, stages: dict[int, "_Stage"], optimizer, adam: dict):
    state = torch.load(folder / f"worker{rank}.pt", map_location="cpu", weights_only=True)
    with torch.no_grad():
        for s, st in stages.items():
            for k, p in st.host.items():
                p.data.copy_(state["params"][f"{s}/{k}"])
    if optimizer is not None and state["optimizer"] is not None:
        optimizer.load_state_dict(state["optimizer"])
    for s, saved in state["stage_optimizers"].items():
        stages[s].optimizer = torch.optim.AdamW(list(stages[s].host.values()), **adam)
        stages[s].optimizer.load_state_dict(saved)
    return int(state["step"]), state["losses"]


def _device_step(st: _Stage, leaves: dict[str, torch.Tensor], adam: dict, memory: DeviceMemory, s: int) -> None:
    """optimizer_on=device: swap the stage's Adam state in, step on the device copy, swap back."""
    if st.optimizer is None:
        st.optimizer = torch.optim.AdamW(list(st.host.values()), **adam)
    state_bytes = 2 * st.param_bytes
    memory.alloc(f"opt{s}", state_bytes)
    device = next(iter(leaves.values())).device
    params = [leaves[k] for k in st.host]
    grads = [p.grad for p in params]
    opt = torch.optim.AdamW(params, **adam)
    host_state = st.optimizer.state
    for hp, dp in zip(st.host.values(), params):
        if hp in host_state:
            opt.state[dp] = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in host_state[hp].items()}
    with torch.no_grad():
        opt.step()
    for hp, dp, g in zip(st.host.values(), params, grads):
        hp.data.copy_(dp.detach())
        host_state[hp] = {k: (v.to("cpu") if torch.is_tensor(v) else v) for k, v in opt.state[dp].items()}
    memory.free(f"opt{s}")


def _save_model(cfg: OffloadRunConfig, config, stages: dict[int, _Stage], rank: int, world: int, out: Path) -> None:
    """Each worker writes its units; worker 0 merges them into one HF folder (model/)."""
    from safetensors.torch import load_file, save_file

    part = {}
    for st in stages.values():
        for u, module in st.units.items():
            part.update(unit_state_dict(config, u, module))
    save_file({k: v.cpu() for k, v in part.items()}, str(out / f"part{rank}.safetensors"))
    torch.distributed.barrier()
    if rank != 0:
        return
    import shutil

    merged = {}
    for r in range(world):
        merged.update(load_file(str(out / f"part{r}.safetensors")))
        (out / f"part{r}.safetensors").unlink()
    model_dir = out / "model"
    model_dir.mkdir(exist_ok=True)
    for f in Path(cfg.model_dir).iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy2(f, model_dir / f.name)
    save_file(merged, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    conf = json.loads((model_dir / "config.json").read_text())
    conf["tie_word_embeddings"] = False
    (model_dir / "config.json").write_text(json.dumps(conf, indent=2))


def train_without_offload(cfg: OffloadRunConfig) -> list[float]:
    """The reference: the same fine-tuning with the whole model in one module, no offload
    (HF LlamaForCausalLM, same micro batches, loss, clipping and AdamW)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(cfg.seed)
    model = LlamaForCausalLM.from_pretrained(cfg.model_dir, dtype=torch.float32, attn_implementation="sdpa")
    if model.config.tie_word_embeddings:  # the executor unties: do the same
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone())
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.adam_betas, eps=cfg.adam_eps,
                            weight_decay=cfg.weight_decay, foreach=False)
    tokens_of = step_tokens(cfg, model.config.vocab_size)
    losses = []
    for step in range(cfg.steps):
        total = 0.0
        for mb in tokens_of(step).split(cfg.micro_batch_size):
            logits = model(input_ids=mb[:, :-1]).logits
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), mb[:, 1:].reshape(-1))
            (loss / cfg.microbatches).backward()
            total += float(loss.detach())
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad()
        losses.append(total / cfg.microbatches)
    return losses
