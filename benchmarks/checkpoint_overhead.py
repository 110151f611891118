"""What a checkpoint costs the training loop: synchronous save vs the async engine.

    .venv/bin/python benchmarks/checkpoint_overhead.py            # ~125M-parameter GPT
    .venv/bin/python benchmarks/checkpoint_overhead.py --hidden 512 --layers 4   # quick

A megatron GPTModel (training/model.py, Llama-style) with its Adam state trains on
one intra-op thread (the other core is the writer's, as a GPU node leaves its CPUs
to it). Checkpoints go to a local SeaweedFS S3 server started here (and, reported
separately, to local disk). Measured side by side in one run:

- stall per checkpoint: a synchronous save (snapshot + upload + commit in the loop)
  vs the async engine's save() (snapshot only), for both writers;
- snapshot copy bandwidth vs a plain torch copy_ of the same number of bytes;
- end-to-end persist throughput vs a raw s3fs upload of the same shard file;
- step-time slowdown while a persist runs in the background: median step time during
  the persist vs the median of steps right before and right after it (process writer
  and thread writer).

The last line is one JSON object with the headline keys.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def build_training(args):
    from training.config import ModelConfig, TrainingConfig
    from training.model import build_model, build_optimizer, init_distributed, wrap_data_parallel

    model_cfg = ModelConfig(num_layers=args.layers, hidden_size=args.hidden,
                            num_attention_heads=args.heads, vocab_size=args.vocab,
                            seq_length=args.seq)
    training_cfg = TrainingConfig(global_batch_size=args.batch, micro_batch_size=args.batch,
                                  steps=1000, lr=1e-4, min_lr=1e-5, seed=1234)
    env = init_distributed(1)
    model = build_model(model_cfg, training_cfg)
    ddp_model = wrap_data_parallel(model, training_cfg)
    optimizer = build_optimizer(ddp_model, training_cfg)
    g = torch.Generator().manual_seed(0)
    position_ids = torch.arange(args.seq).unsqueeze(0).expand(args.batch, -1)

    def step() -> float:
        start = time.perf_counter()
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
        ddp_model.zero_grad_buffer()
        optimizer.zero_grad()
        loss = ddp_model(tokens, position_ids, None, labels=tokens).float().mean()
        loss.backward()
        ddp_model.finish_grad_sync()
        optimizer.step()
        return time.perf_counter() - start

    def state(step_no: int) -> dict:
        from training.rank_state import capture_rng_states

        return {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "rng": capture_rng_states(), "trainer": {"step": step_no}}

    params = sum(p.numel() for p in model.parameters())
    return env, step, state, params


def memcpy_gbps(nbytes: int, repeats: int = 3) -> float:
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)  # touched: no first-use page faults timed
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    del src, dst
    return nbytes / best / 1e9


def steps_while(cond, step, limit: int = 1000) -> list[float]:
    """Step times of the steps that ran while `cond()` held (started and ended inside)."""
    times = []
    while cond() and len(times) < limit:
        t = step()
        if cond():
            times.append(t)
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--baseline-steps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2, help="alternating process/thread rounds")
    p.add_argument("--workdir", default=None, help="where SeaweedFS and local checkpoints live")
    args = p.parse_args()

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)  # one core trains, the other is the writer's
    from checkpoint.engine import CheckpointEngine
    from infra.local_s3 import SeaweedS3
    from infra.storage import open_storage

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="ckpt-bench-"))
    env, step, state, params = build_training(args)
    step()  # creates the Adam state the checkpoint must hold
    print(f"model: {params / 1e6:.1f}M parameters, hidden {args.hidden}, {args.layers} layers, "
          f"vocab {args.vocab}; training on 1 intra-op thread")

    server = SeaweedS3(workdir / "seaweed")
    server.data_dir.mkdir(parents=True, exist_ok=True)
    server.start()
    out: dict[str, float] = {"params": params}
    try:
        bucket = server.make_bucket("bench")
        options = server.options()
        s3 = lambda name: f"s3://{bucket}/{name}"  # noqa: E731

        # ---- synchronous saves (the stall is the whole save) ----------------------------------
        with CheckpointEngine(str(workdir / "local-sync"), async_save=False, writer="thread",
                              keep_last=1) as engine:
            engine.save(1, state(1))  # first use: buffers allocated, page faults
            outcome = engine.save(2, state(2))
            nbytes = outcome.bytes
            out["stall_s_sync_local"] = outcome.stall_s
            local_shard = workdir / "local-sync" / "step-00000002" / "rank-0-of-1.bin"
        print(f"checkpoint: {nbytes / 1e9:.2f} GB per save (model + Adam state + RNG)")
        with CheckpointEngine(s3("sync"), async_save=False, writer="thread", keep_last=1,
                              storage_options=options) as engine:
            outcome = engine.save(1, state(1))
            out["stall_s_sync"] = outcome.stall_s
            out["sync_persist_mb_s"] = nbytes / outcome.stall_s / 1e6

        # ---- raw s3fs upload of the same bytes -------------------------------------------------
        fs = open_storage(s3("raw"), options).fs
        start = time.perf_counter()
        fs.put_file(str(local_shard), f"{bucket}/raw/shard.bin")
        out["raw_s3fs_mb_s"] = nbytes / (time.perf_counter() - start) / 1e6

        # ---- snapshot copy vs a plain memcpy of the same bytes, interleaved, best of 3 ---------
        # (single copies on a shared 2-core machine vary 2-3x run to run; best-of-n on both
        # sides compares what each path can do rather than what a neighbour left it)
        from checkpoint.shard import HostBuffers, take_snapshot

        snap_best = memcpy_best = 0.0
        for shared in (True, False):  # the process writer's shared buffers, the thread writer's
            buffers = HostBuffers(shared=shared)
            current = state(3)
            take_snapshot(3, current, buffers)  # first use: allocation and page faults
            for _ in range(3):
                snap = take_snapshot(3, current, buffers)
                snap_best = max(snap_best, snap.tensor_bytes / snap.copy_s / 1e9)
                memcpy_best = max(memcpy_best, memcpy_gbps(snap.tensor_bytes, repeats=1))
            del snap, current
            buffers.close()
        out["memcpy_gb_s"] = memcpy_best
        out["snapshot_gb_s"] = snap_best

        # ---- async saves: stall, snapshot bandwidth, persist throughput, step slowdown ---------
        # Rounds alternate which writer goes first, and each writer's samples are pooled
        # over rounds: on a shared machine a neighbour's burst should not decide the winner.
        phases = [("process", "local", 0)]
        for r in range(args.rounds):
            order = ("process", "thread") if r % 2 == 0 else ("thread", "process")
            phases += [(w, "s3", r) for w in order]
        samples: dict[str, dict[str, list[float]]] = {}
        for writer, target, r in phases:
            url = s3(f"async-{writer}-{r}") if target == "s3" else str(workdir / f"async-{writer}")
            with CheckpointEngine(url, writer=writer, keep_last=1, storage_options=options) as engine:
                engine.save(1, state(1))  # first use: allocate and fault in the buffers
                engine.wait()
                baseline = [step() for _ in range(args.baseline_steps)]
                outcome = engine.save(2, state(2))
                during = steps_while(lambda: engine.busy, step)
                report = engine.wait()
                assert report.committed, report
                baseline += [step() for _ in range(args.baseline_steps)]
            key = f"{writer}_{target}"
            pool = samples.setdefault(key, {"baseline": [], "during": [], "stall": [], "persist": []})
            pool["baseline"] += baseline
            pool["during"] += during
            pool["stall"].append(outcome.stall_s)
            pool["persist"].append(nbytes / report.persist_s / 1e6)
            print(f"async {writer:7s} -> {target:5s} (round {r}): stall {outcome.stall_s * 1e3:7.1f} ms, "
                  f"persist {pool['persist'][-1]:.0f} MB/s in {report.persist_s:.1f}s; step "
                  f"{statistics.median(baseline):.3f}s idle vs "
                  f"{statistics.median(during) if during else float('nan'):.3f}s during persist "
                  f"({len(during)} steps)")
        for key, pool in samples.items():
            out[f"stall_s_async_{key}"] = statistics.median(pool["stall"])
            out[f"persist_mb_s_{key}"] = statistics.median(pool["persist"])
            out[f"steps_during_persist_{key}"] = len(pool["during"])
            if pool["during"]:
                # Medians: one step stolen by a neighbour should not count as checkpoint
                # overhead (nor hide it).
                out[f"step_slowdown_{key}"] = (statistics.median(pool["during"])
                                               / statistics.median(pool["baseline"]) - 1)
    finally:
        server.stop()
        from training.model import shutdown_distributed

        shutdown_distributed()

    # The better writer blocks training less. Differences under 5 points are within this
    # machine's run-to-run noise; then the faster persist wins (a shorter window at risk,
    # fewer busy checkpoint steps).
    slow = {w: out.get(f"step_slowdown_{w}_s3", float("inf")) for w in ("process", "thread")}
    if abs(slow["process"] - slow["thread"]) < 0.05:
        best = max(slow, key=lambda w: out[f"persist_mb_s_{w}_s3"])
    else:
        best = min(slow, key=slow.get)
    out["stall_s_async"] = out[f"stall_s_async_{best}_s3"]
    out["stall_ratio_sync_over_async"] = out["stall_s_sync"] / out["stall_s_async"]
    out["stall_ratio_sync_over_async_local"] = out["stall_s_sync_local"] / out["stall_s_async_process_local"]
    out["snapshot_bw_fraction_of_memcpy"] = out["snapshot_gb_s"] / out["memcpy_gb_s"]
    out["step_slowdown_other_writer"] = out.get(
        f"step_slowdown_{'thread' if best == 'process' else 'process'}_s3", float("nan"))
    out["step_slowdown_during_persist"] = out.get(f"step_slowdown_{best}_s3", float("nan"))
    out["persist_mb_s"] = out[f"persist_mb_s_{best}_s3"]
    out["persist_mb_s_local"] = out["persist_mb_s_process_local"]
    out["writer"] = best
    print(f"sync save stall: {out['stall_s_sync']:.2f}s to S3, {out['stall_s_sync_local']:.2f}s to local disk")
    print(f"async ({best} writer) stall: {out['stall_s_async'] * 1e3:.1f} ms "
          f"-> {out['stall_ratio_sync_over_async']:.0f}x less than sync (S3), "
          f"{out['stall_ratio_sync_over_async_local']:.0f}x (local disk)")
    print(f"snapshot copy {out['snapshot_gb_s']:.2f} GB/s vs memcpy {out['memcpy_gb_s']:.2f} GB/s "
          f"({out['snapshot_bw_fraction_of_memcpy']:.0%})")
    print(f"persist {out['persist_mb_s']:.0f} MB/s end to end while training (one core left), "
          f"{out['sync_persist_mb_s']:.0f} MB/s with training paused (sync save), vs raw s3fs "
          f"upload {out['raw_s3fs_mb_s']:.0f} MB/s (training paused)")
    print(f"step slowdown during a background persist: {out['step_slowdown_during_persist']:+.1%} "
          f"(process writer {out.get('step_slowdown_process_s3', float('nan')):+.1%}, "
          f"thread writer {out.get('step_slowdown_thread_s3', float('nan')):+.1%})")
    headline = ["params", "stall_s_sync", "stall_s_async", "stall_ratio_sync_over_async",
                "snapshot_bw_fraction_of_memcpy", "step_slowdown_during_persist", "persist_mb_s",
                "raw_s3fs_mb_s"]
    extra = sorted(k for k in out if k not in headline)
    print(json.dumps({k: (round(out[k], 4) if isinstance(out[k], float) else out[k])
                      for k in headline + extra}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
