"""The training worker: what `torchrun` starts on every rank.

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        -m training.train configs/tiny-cpu.yaml [--set training.steps=50 ...]

Read top to bottom: set up (distributed, model, optimizer, data, checkpoint resume),
then the loop — get batch → forward → backward → step → log → maybe checkpoint.
Heartbeats, the loss-spike check and fault injection hook in visibly in the loop.
What the worker leaves on disk and its exit codes: infra.runfiles.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import torch

from infra import runfiles
from training.config import ConfigError, JobSpec, dotted_overrides, load_job_spec


@dataclass
class StepResult:
    loss: float  # data-parallel mean over the global batch
    grad_norm: float | None


def train_step(ddp_model, optimizer, sampler, step: int, env, cfg, num_micro: int,
               position_ids: torch.Tensor) -> StepResult:
    """One optimizer step over `num_micro` micro batches (gradient accumulation)."""
    from megatron.core import parallel_state

    ddp_model.zero_grad_buffer()
    optimizer.zero_grad()
    loss_sum = torch.zeros(1, dtype=torch.float32, device=env.device)
    for micro in range(num_micro):
        tokens, labels = sampler.get_micro_batch(step, env.dp_rank, env.dp_size, micro,
                                                 cfg.micro_batch_size, cfg.global_batch_size)
        tokens, labels = tokens.to(env.device), labels.to(env.device)
        token_losses = ddp_model(tokens, position_ids, None, labels=labels)  # [b, s]
        loss = token_losses.float().mean() / num_micro
        loss.backward()
        loss_sum += loss.detach()
    ddp_model.finish_grad_sync()  # all-reduce (average) grads across data-parallel ranks
    _, grad_norm, _ = optimizer.step()  # clips to cfg.grad_clip, then AdamW
    torch.distributed.all_reduce(loss_sum, group=parallel_state.get_data_parallel_group())
    return StepResult(loss=(loss_sum / env.dp_size).item(), grad_norm=grad_norm)


def train(spec: JobSpec, resume_from_step: int | None = None) -> int:
    """Run (or resume) the job; returns the process exit code (infra.runfiles)."""
    from training.checkpointing import open_checkpointer
    from training.data import BatchSampler, PackedTokens, SkippedBatches, load_prepared
    from training.data import micro_batches_per_rank
    from training.faults import FaultInjector, plan_from
    from training.model import build_model, build_optimizer, init_distributed, wrap_data_parallel
    from training.runlog import Heartbeat, RankLog
    from training.schedule import apply_schedule
    from training.spike import LossSpikeDetector, format_spike_line, write_spike_marker

    cfg = spec.training
    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)

    # --- set up -------------------------------------------------------------------------
    env = init_distributed(cfg.tensor_parallel)
    run_dir = spec.resolved_run_dir
    log = RankLog(run_dir, env.rank)
    heartbeat = Heartbeat(run_dir, env.rank)
    faults = FaultInjector(plan_from(spec.fault), env.rank, run_dir)

    prepared = load_prepared(spec.data.data_dir)
    if prepared.tokenizer_vocab_size > spec.model.vocab_size:
        raise ConfigError(
            f"{spec.data.data_dir}: tokenizer has {prepared.tokenizer_vocab_size} tokens but "
            f"model.vocab_size is {spec.model.vocab_size}; prepare the data with this config"
        )
    model = build_model(spec.model, cfg)
    ddp_model = wrap_data_parallel(model, cfg)
    optimizer = build_optimizer(ddp_model, cfg)
    detector = LossSpikeDetector(spec.spike)
    checkpointer = open_checkpointer(spec.checkpoint, env,
                                     after_shards_written=faults.after_shards_written)

    step, skips = 0, SkippedBatches()
    resume_step = resume_from_step if resume_from_step is not None else checkpointer.latest()
    if resume_step is not None:
        state = checkpointer.load(resume_step, model, optimizer)
        step = state["step"]
        skips = SkippedBatches.from_list(state.get("skips"))
        detector.load_state_dict(state.get("spike_detector", {}))
        if spec.spike.skip_batches:  # a rollback after a loss spike: skip the bad batches
            skips = skips.skip_from_step(step, spec.spike.skip_batches)
        log.event("resumed", step=step, skipped_batches=skips.total)
    sampler = BatchSampler(PackedTokens(prepared.train_path, spec.model.seq_length, prepared.dtype),
                           cfg.seed, skips)
    num_micro = micro_batches_per_rank(cfg.global_batch_size, cfg.micro_batch_size, env.dp_size)
    position_ids = torch.arange(spec.model.seq_length, device=env.device).unsqueeze(0).expand(
        cfg.micro_batch_size, -1)
    tokens_per_step = cfg.global_batch_size * spec.model.seq_length

    def trainer_state() -> dict:
        return {"step": step, "consumed_batches": skips.position_for_step(step),
                "skips": skips.to_list(), "seed": cfg.seed, "world_size": env.world_size,
                "config_hash": spec.config_hash(), "spike_detector": detector.state_dict()}

    # --- the loop -----------------------------------------------------------------------
    heartbeat.beat(step, phase="start")
    started = time.monotonic()
    ddp_model.train()
    while step < cfg.steps:
        t0 = time.monotonic()
        lr = apply_schedule(optimizer, step, cfg)
        result = train_step(ddp_model, optimizer, sampler, step, env, cfg, num_micro,
                            position_ids)
        step += 1
        loss = faults.observed_loss(result.loss)
        heartbeat.beat(step)

        if step % cfg.log_interval == 0 or step == cfg.steps:
            log.step(step, loss, lr, result.grad_norm,
                     tokens_per_s=tokens_per_step / max(time.monotonic() - t0, 1e-9),
                     elapsed_s=time.monotonic() - started)
            spike = detector.update(step, loss)  # same loss on every rank: same decision
            if spike is not None:
                if env.rank == 0:
                    write_spike_marker(run_dir, spike)
                    print(format_spike_line(spike), file=sys.stderr, flush=True)
                log.event("loss_spike", onset_step=spike.onset_step,
                          last_healthy_step=spike.last_healthy_step)
                return runfiles.EXIT_LOSS_SPIKE

        if step % spec.checkpoint.interval == 0 or step == cfg.steps:
            heartbeat.beat(step, phase="checkpoint")
            save_info = checkpointer.save(step, model, optimizer, trainer_state())
            log.event("checkpoint_saved", step=step, **(save_info or {}))

        faults.after_step(step)

    checkpointer.close()
    if env.rank == 0:
        _write_finished(run_dir, step)
    log.event("finished", step=step)
    log.close()
    return runfiles.EXIT_OK


def _write_finished(run_dir, step: int) -> None:
    import json
    import os

    path = runfiles.finished_marker_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"step": step, "time": time.time()}), encoding="utf-8")
    os.replace(tmp, path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m training.train",
                                     description="forgeflow training worker (start with torchrun)")
    parser.add_argument("config", help="job spec YAML")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a spec field, e.g. training.steps=50 (repeatable)")
    parser.add_argument("--resume-from-step", type=int, default=None,
                        help="resume from this checkpoint step instead of the newest "
                             "(a rollback after a loss spike)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        spec = load_job_spec(args.config, dotted_overrides(args.set))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from infra.storage import StorageError

    try:
        return train(spec, resume_from_step=args.resume_from_step)
    except StorageError as e:  # e.g. the preflight: bad credentials, missing bucket, full disk
        print(f"error: checkpoint storage ({type(e).__name__}): {e}", file=sys.stderr)
        return 2
    finally:
        from training.model import shutdown_distributed

        shutdown_distributed()


if __name__ == "__main__":
    sys.exit(main())
