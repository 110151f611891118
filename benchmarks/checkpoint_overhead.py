"""What a checkpoint costs the training loop: synchronous save vs the async engine.

    .venv/bin/python benchmarks/checkpoint_overhead.py            # ~135M-parameter GPT
    .venv/bin/python benchmarks/checkpoint_overhead.py --hidden 512 --layers 4   # quick
    .venv/bin/python benchmarks/checkpoint_overhead.py --smoke    # tiny model, seconds

A megatron GPTModel (training/model.py, Llama-style) with its Adam state trains on
one intra-op thread (the other core is the writer's, as a GPU node leaves its CPUs
to it). Checkpoints go to a local SeaweedFS S3 server started here (and, reported
separately, to local disk). Measured side by side in one run:

- stall per checkpoint: a synchronous save vs the async engine, for both writers.
  The async stall is everything the loop blocks for: save() (building megatron's
  sharded state, laying out the shard, pickling the small state) plus the wait
  right before the next optimizer step for the host copy, which runs in the
  background during that step's forward and backward (`save(overlap=True)` and
  `wait_snapshot()`, exactly as training/train.py's train_step calls them);
  `stall_s_async_over_step_s` is that stall over the median training step;
- snapshot copy bandwidth (a synchronous take_snapshot, layout included) vs a plain
  torch copy_ of the same number of bytes;
- end-to-end persist throughput vs a raw upload of the same shard file (boto3's
  transfer manager, what infra.storage uses for files; and s3fs's put_file, the
  baseline of earlier runs, when s3fs is installed);
- step-time slowdown while a persist runs in the background: median step time during
  the persist (from the step the copy overlaps to the commit) vs the median of steps
  right before and right after it (process writer and thread writer).

The baseline, and why it is fair: the synchronous save is the blocking save
practitioners run when they call torch.save / torch.distributed.checkpoint.save /
megatron's dist_checkpointing.save without an async strategy: training stops, the
state is serialised and written to the same S3 server, and training resumes once the
checkpoint is committed. It is measured through this same engine in blocking mode,
so both sides write the same bytes in the same format with the same commit protocol
and the same S3 client, and the baseline gets the engine's own speed-ups
(serialisation into reused buffers, no temporary file, parallel zero-copy multipart
upload); a torch.save to a file followed by an upload would stall longer, so the
ratio is, if anything, understated. Every engine is warmed by one save first (buffers
allocated, connections open); then rounds interleave the synchronous S3 save and the
two async writers, rotating which goes first, and each figure is the median over the
rounds (--rounds, default 3), all in one run on the same shared machine.

Where the S3 server runs: SeaweedFS stands in for a remote object store, but here it
shares the trainer's two cores and spends several times the writer's CPU per byte
(both are reported: server_cpu_s_per_gb_*, writer_cpu_s_per_gb_process_*). On a
cluster that work runs on other machines, so by default the server runs at the
writer's niceness (--server-nice, checkpoint.writer.WRITER_NICENESS): it takes the CPU
second, as the writer does, rather than charging the trainer for a remote store's
work. `--server-nice 0` runs it at the trainer's priority; the synchronous baseline
uses the same server either way, and `server_nice` is in the output.

--smoke runs the same code path (the same SeaweedFS server, engines, writers and
rounds) on a tiny model with one round, in seconds, and prints the same last-line
keys; its figures say only that the path works.

The last line is one JSON object: the HEADLINE_KEYS first, then the per-writer detail.
"""

from __future__ import annotations

import json
import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.headline import checked_headline  # noqa: E402
from checkpoint.writer import WRITER_NICENESS  # noqa: E402

HEADLINE_KEYS = ("params", "stall_s_sync", "stall_s_async", "stall_ratio_sync_over_async",
                 "stall_s_async_over_step_s", "snapshot_bw_fraction_of_memcpy",
                 "step_slowdown_during_persist", "persist_mb_s", "raw_s3fs_mb_s")


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

    def step(before_update=None) -> float:
        """One training step; `before_update` runs right before optimizer.step(), as the
        checkpointer's wait does in training/train.py's train_step."""
        start = time.perf_counter()
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
        ddp_model.zero_grad_buffer()
        optimizer.zero_grad()
        loss = ddp_model(tokens, position_ids, None, labels=tokens).float().mean()
        loss.backward()
        ddp_model.finish_grad_sync()
        if before_update is not None:
            before_update()
        optimizer.step()
        return time.perf_counter() - start

    def save(engine, step_no: int):
        """What training.checkpointing.Checkpointer.save hands the engine, built the same way
        (an async engine overlaps its host copy with the next step, as the trainer's does)."""
        from training.checkpointing import sharded_state, to_pieces
        from training.rank_state import capture_rng_states

        pieces, common = to_pieces(sharded_state(model, optimizer))
        return engine.save(step_no, {"rng": capture_rng_states()}, pieces=pieces,
                           common={"megatron": common, "trainer": {"step": step_no}},
                           overlap=engine.async_save)

    def tensors() -> list:
        from training.checkpointing import sharded_state, to_pieces

        return [p.data for p in to_pieces(sharded_state(model, optimizer))[0] if not p.is_object]

    params = sum(p.numel() for p in model.parameters())
    return env, step, save, tensors, params


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


def cpu_seconds(server_pid: int) -> dict[str, float]:
    """CPU seconds used so far by this process's checkpoint writer children and by the S3
    server: who pays for a persist (the thread writer's share is inside the trainer)."""
    import psutil

    def used(proc) -> float:
        try:
            times = proc.cpu_times()
            return times.user + times.system
        except psutil.NoSuchProcess:
            return 0.0

    writers = [c for c in psutil.Process().children()
               if "checkpoint.writer" in " ".join(c.cmdline() if c.is_running() else [])]
    return {"writer": sum(used(c) for c in writers), "server": used(psutil.Process(server_pid))}


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
    p.add_argument("--rounds", type=int, default=3,
                   help="interleaved rounds (sync S3, async process, async thread); medians")
    p.add_argument("--workdir", default=None, help="where SeaweedFS and local checkpoints live")
    p.add_argument("--server-nice", type=int, default=WRITER_NICENESS,
                   help="niceness of the local S3 server (it stands in for a remote store; "
                        "0: the trainer's own priority)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny model, one round: the same code path in seconds (for the test suite)")
    args = p.parse_args()
    if args.smoke:
        args.hidden, args.layers, args.heads, args.vocab, args.seq = 64, 2, 4, 1024, 32
        args.rounds, args.baseline_steps = 1, 2

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)  # one core trains, the other is the writer's
    from checkpoint.engine import CheckpointEngine
    from testing.local_s3 import SeaweedS3
    from infra.storage import open_storage

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="ckpt-bench-"))
    env, step, save, tensors, params = build_training(args)
    step()  # creates the Adam state the checkpoint must hold
    print(f"model: {params / 1e6:.1f}M parameters, hidden {args.hidden}, {args.layers} layers, "
          f"vocab {args.vocab}; training on 1 intra-op thread")

    server = SeaweedS3(workdir / "seaweed")
    server.data_dir.mkdir(parents=True, exist_ok=True)
    server.start()
    # The whole server (every thread of its process group) at --server-nice: see the docstring.
    os.setpriority(os.PRIO_PGRP, server.proc.pid, args.server_nice)
    out: dict[str, float] = {"params": params, "server_nice": args.server_nice}
    try:
        bucket = server.make_bucket("bench")
        options = server.options()
        s3 = lambda name: f"s3://{bucket}/{name}"  # noqa: E731

        # ---- local disk: sync vs async (process writer), each warmed, median of the rounds ------
        samples: dict[str, dict[str, list[float]]] = {}

        def pool(key: str) -> dict[str, list[float]]:
            return samples.setdefault(key, {"baseline": [], "during": [], "stall": [], "persist": [],
                                            "copy_wait": [], "writer_cpu": [], "server_cpu": []})

        def async_round(engine, key: str, step_no: int, nbytes: int) -> None:
            baseline = [step() for _ in range(args.baseline_steps)]
            cpu_before = cpu_seconds(server.proc.pid)
            outcome = save(engine, step_no)
            # The host copy overlaps this step's forward and backward; the step waits for it
            # right before its optimizer step (train_step's before_update), and that wait is
            # part of the checkpoint's stall.
            first = step(engine.wait_snapshot)
            during = ([first] if engine.busy else []) + steps_while(lambda: engine.busy, step)
            report = engine.wait()
            assert report.committed, report
            cpu = {k: v - cpu_before[k] for k, v in cpu_seconds(server.proc.pid).items()}
            baseline += [step() for _ in range(args.baseline_steps)]
            p = pool(key)
            p["writer_cpu"].append(cpu["writer"] / (nbytes / 1e9))
            p["server_cpu"].append(cpu["server"] / (nbytes / 1e9))
            p["baseline"] += baseline
            p["during"] += during
            p["stall"].append(outcome.total_stall_s)
            p["copy_wait"].append(outcome.copy_wait_s)
            p["persist"].append(nbytes / report.persist_s / 1e6)
            print(f"async {key:14s} (save {step_no}): stall {outcome.total_stall_s * 1e3:7.1f} ms "
                  f"(save() {outcome.stall_s * 1e3:.1f} + copy wait {outcome.copy_wait_s * 1e3:.1f}), "
                  f"persist {p['persist'][-1]:.0f} MB/s in {report.persist_s:.1f}s; step "
                  f"{statistics.median(baseline):.3f}s idle vs "
                  f"{statistics.median(during) if during else float('nan'):.3f}s during persist "
                  f"({len(during)} steps); CPU s/GB: writer process {p['writer_cpu'][-1]:.1f}, "
                  f"S3 server {p['server_cpu'][-1]:.1f}")

        def sync_round(engine, key: str, step_no: int) -> None:
            outcome = save(engine, step_no)
            assert engine.reports[-1].committed, engine.reports[-1]
            pool(key)["stall"].append(outcome.stall_s)
            print(f"sync  {key:14s} (save {step_no}): stall {outcome.stall_s * 1e3:7.1f} ms")

        with CheckpointEngine(str(workdir / "local-sync"), async_save=False, writer="thread",
                              keep_last=1) as sync_local, \
                CheckpointEngine(str(workdir / "async-process"), writer="process",
                                 keep_last=1) as async_local:
            nbytes = save(sync_local, 1).bytes  # warm: buffers allocated, pages faulted in
            save(async_local, 1)
            async_local.wait()
            # The same bytes for the raw-upload comparison (retention drops step 1 later).
            shutil.copyfile(workdir / "local-sync" / "step-00000001" / "rank-0-of-1.bin",
                            workdir / "raw-shard.bin")
            print(f"checkpoint: {nbytes / 1e9:.2f} GB per save (model + Adam state + RNG)")
            for r in range(args.rounds):
                sync_round(sync_local, "sync_local", 2 + r)
                async_round(async_local, "process_local", 2 + r, nbytes)

        # ---- raw uploads of the same bytes -----------------------------------------------------
        raw = open_storage(s3("raw"), options)
        start = time.perf_counter()
        raw.client.upload_file(str(workdir / "raw-shard.bin"), bucket, "raw/boto3-shard.bin",
                               Config=raw._transfer_config())
        out["raw_boto3_mb_s"] = nbytes / (time.perf_counter() - start) / 1e6
        raw.close()
        try:  # the baseline earlier runs reported (s3fs is a dev dependency now)
            import s3fs

            fs = s3fs.S3FileSystem(key=options.access_key, secret=options.secret_key,
                                   endpoint_url=options.endpoint_url, skip_instance_cache=True)
            start = time.perf_counter()
            fs.put_file(str(workdir / "raw-shard.bin"), f"{bucket}/raw/shard.bin")
            out["raw_s3fs_mb_s"] = nbytes / (time.perf_counter() - start) / 1e6
        except ImportError:
            out["raw_s3fs_mb_s"] = float("nan")

        # ---- snapshot copy vs a plain memcpy of the same bytes, interleaved, best of 3 ---------
        # (single copies on a shared 2-core machine vary 2-3x run to run; best-of-n on both
        # sides compares what each path can do rather than what a neighbour left it)
        from checkpoint.shard import HostBuffers, take_snapshot

        snap_best = memcpy_best = 0.0
        for shared in (True, False):  # the process writer's shared buffers, the thread writer's
            buffers = HostBuffers(shared=shared)
            current = {"pieces": tensors()}
            take_snapshot(3, current, buffers)  # first use: allocation and page faults
            for _ in range(3):
                snap = take_snapshot(3, current, buffers)
                snap_best = max(snap_best, snap.tensor_bytes / (snap.layout_s + snap.copy_s) / 1e9)
                memcpy_best = max(memcpy_best, memcpy_gbps(snap.tensor_bytes, repeats=1))
            del snap, current
            buffers.close()
        out["memcpy_gb_s"] = memcpy_best
        out["snapshot_gb_s"] = snap_best

        # ---- S3: sync vs both async writers, warmed, interleaved rounds, medians ---------------
        # Each round rotates which of the three goes first, so neither a neighbour's burst nor
        # the order decides a figure.
        with CheckpointEngine(s3("sync"), async_save=False, writer="thread", keep_last=1,
                              storage_options=options) as sync_s3, \
                CheckpointEngine(s3("async-process"), writer="process", keep_last=1,
                                 storage_options=options) as process_s3, \
                CheckpointEngine(s3("async-thread"), writer="thread", keep_last=1,
                                 storage_options=options) as thread_s3:
            engines = {"sync": sync_s3, "process": process_s3, "thread": thread_s3}
            for engine in engines.values():  # warm every path the same way
                save(engine, 1)
                engine.wait()
            names = list(engines)
            for r in range(args.rounds):
                for name in names[r % 3:] + names[:r % 3]:
                    if name == "sync":
                        sync_round(sync_s3, "sync_s3", 2 + r)
                    else:
                        async_round(engines[name], f"{name}_s3", 2 + r, nbytes)
        sync_stalls = samples["sync_s3"]["stall"]
        out["stall_s_sync"] = statistics.median(sync_stalls)
        out["sync_persist_mb_s"] = nbytes / out["stall_s_sync"] / 1e6
        out["stall_s_sync_local"] = statistics.median(samples["sync_local"]["stall"])
        for key, p in samples.items():
            if key.startswith("sync"):
                continue
            out[f"stall_s_async_{key}"] = statistics.median(p["stall"])
            out[f"copy_wait_s_{key}"] = statistics.median(p["copy_wait"])
            if key.startswith("process"):  # the thread writer's CPU is inside the trainer's
                out[f"writer_cpu_s_per_gb_{key}"] = statistics.median(p["writer_cpu"])
            if key.endswith("_s3"):
                out[f"server_cpu_s_per_gb_{key}"] = statistics.median(p["server_cpu"])
            out[f"step_s_{key}"] = statistics.median(p["baseline"])
            out[f"persist_mb_s_{key}"] = statistics.median(p["persist"])
            out[f"steps_during_persist_{key}"] = len(p["during"])
            if p["during"]:
                # Medians: one step stolen by a neighbour should not count as checkpoint
                # overhead (nor hide it).
                out[f"step_slowdown_{key}"] = (statistics.median(p["during"])
                                               / statistics.median(p["baseline"]) - 1)
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
    # The stall as a fraction of one training step (median step time around the same saves).
    out["stall_s_async_over_step_s"] = out["stall_s_async"] / out[f"step_s_{best}_s3"]
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
          f"{out['sync_persist_mb_s']:.0f} MB/s with training paused (sync save), vs raw upload "
          f"{out['raw_boto3_mb_s']:.0f} MB/s boto3 / {out['raw_s3fs_mb_s']:.0f} MB/s s3fs (training paused)")
    print(f"step slowdown during a background persist: {out['step_slowdown_during_persist']:+.1%} "
          f"(process writer {out.get('step_slowdown_process_s3', float('nan')):+.1%}, "
          f"thread writer {out.get('step_slowdown_thread_s3', float('nan')):+.1%})")
    ordered = [k for k in HEADLINE_KEYS if k in out] + sorted(k for k in out if k not in HEADLINE_KEYS)
    print(json.dumps(checked_headline({k: (round(out[k], 4) if isinstance(out[k], float) else out[k]) for k in ordered},
                   HEADLINE_KEYS)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
