"""The training worker: what `torchrun` starts on every rank.

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        -m training.train configs/tiny-cpu.yaml [--set training.steps=50 ...]

Read top to bottom: set up (distributed, model, optimizer, data, checkpoint resume),
then the loop — get batch → forward → backward → step → log → maybe checkpoint.
Heartbeats, the loss-spike check and fault injection hook in visibly in the loop. A peer
that fails mid-step ends the loop with its collective's error; before that error is raised, a
survivor may commit the last completed step (training.checkpointing: save_after_failure).
What the worker leaves on disk and its exit codes: infra.runfiles.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import NoReturn

import torch

from infra import runfiles
from infra.fast_exit import exit_now
from training.config import ConfigError, JobSpec, dotted_overrides, load_job_spec


@dataclass
class StepResult:
    loss: float  # data-parallel mean over the global batch
    grad_norm: float | None


def install_pipeline_hooks(ddp_chunks: list, optimizer):
    """What megatron's schedules call around the micro batches (as megatron's own training
    loop sets them): no grad all-reduce until the last micro batch, then
    `finalize_model_grads` (data-parallel all-reduce, tied-embedding grads across pipeline
    stages), and the optimizer's loss scale (1 in fp32/bf16; the dynamic scale in fp16).
    Returns the ComputeTimers megatron now reports this rank's compute time to."""
    from megatron.core.distributed import finalize_model_grads

    from training.runlog import ComputeTimers

    config = ddp_chunks[0].config
    no_sync = [chunk.no_sync for chunk in ddp_chunks]
    config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    config.timers = ComputeTimers()
    return config.timers


def train_step(ddp_chunks: list, optimizer, sampler, step: int, env, cfg, num_micro: int,
               position_ids: torch.Tensor, faults=None, before_update=None) -> StepResult:
    """One optimizer step over `num_micro` micro batches (gradient accumulation).

    Megatron's pipeline schedule runs the micro batches: without pipelining one after
    another, with `pipeline_parallel` > 1 as 1F1B (interleaved with virtual stages), the
    activations passing between stages point to point. Every stage reads the same micro
    batches (the first uses the tokens, the last the labels), so the data order is the
    same for any layout. `before_update()` runs right before the optimizer step: the
    checkpointer's wait for its overlapped host copy of the previous step's state.
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def micro_batches():
        for micro in range(num_micro):
            tokens, labels = sampler.get_micro_batch(step, env.dp_rank, env.dp_size, micro,
                                                     cfg.micro_batch_size, cfg.global_batch_size)
            yield tokens.to(env.device), labels.to(env.device)

    def forward_step(data_iterator, model):
        tokens, labels = next(data_iterator)
        if faults is not None:
            faults.in_forward()  # the slow_rank drill
        output = model(tokens, position_ids, None, labels=labels)  # last stage: [b, s] losses

        def loss_func(token_losses):
            loss = token_losses.float().mean()  # the schedule divides it by num_micro in place
            return loss, {"loss": loss.detach().clone()}

        return output, loss_func

    for chunk in ddp_chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    reported = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=[micro_batches() for _ in ddp_chunks] if len(ddp_chunks) > 1
        else micro_batches(),
        model=ddp_chunks if len(ddp_chunks) > 1 else ddp_chunks[0],
        num_microbatches=num_micro,
        seq_length=position_ids.shape[1],
        micro_batch_size=cfg.micro_batch_size,
    )  # grads are all-reduced across data-parallel ranks by finalize_model_grads
    if before_update is not None:
        before_update()  # a checkpoint's host copy must end before the update
    _, grad_norm, _ = optimizer.step()  # clips to cfg.grad_clip, then AdamW

    loss_sum = torch.zeros(1, dtype=torch.float32, device=env.device)
    for item in reported:  # only the last pipeline stage has the losses
        loss_sum += item["loss"] / num_micro
    torch.distributed.all_reduce(loss_sum, group=parallel_state.get_data_parallel_group())
    if env.pp_size > 1:  # every rank logs (and judges spikes on) the same loss
        torch.distributed.broadcast(loss_sum, parallel_state.get_pipeline_model_parallel_last_rank(),
                                    group=parallel_state.get_pipeline_model_parallel_group())
    return StepResult(loss=(loss_sum / env.dp_size).item(), grad_norm=grad_norm)


def train(spec: JobSpec, resume_from_step: int | None = None, warm: bool = False) -> int:
    """Run (or resume) the job; returns the process exit code (infra.runfiles). `warm`: this rank
    was started ahead, as a standby (training.standby), and only waited for this attempt."""
    from training.checkpointing import open_checkpointer
    from training.data import BatchSampler, PackedTokens, SkippedBatches, load_prepared
    from training.data import micro_batches_per_rank
    from training.faults import FaultInjector, plan_from
    from training.model import (attention_kernel, build_model, build_optimizer, count_parameters,
                                init_distributed, wrap_data_parallel)
    from training.collective_watch import CollectiveWatch
    from training.control import StepControl, write_stop_marker
    from training.metrics import MetricsLogger
    from training.runlog import Heartbeat, RankLog
    from training.schedule import apply_schedule
    from training.spike import LossSpikeDetector, format_spike_line, write_spike_marker

    cfg = spec.training
    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)

    # --- set up -------------------------------------------------------------------------
    env = init_distributed(cfg.tensor_parallel, cfg.pipeline_parallel, cfg.virtual_pipeline_stages)
    control = StepControl(env, spec.checkpoint)  # SIGTERM -> stop after the current step
    run_dir = spec.resolved_run_dir
    log = RankLog(run_dir, env.rank)
    heartbeat = Heartbeat(run_dir, env.rank)
    where = CollectiveWatch(run_dir, env.rank).start()  # which collective this rank waits in (a hang's culprit)
    faults = FaultInjector(plan_from(spec.fault), env.rank, run_dir)

    prepared = load_prepared(spec.data.data_dir)
    if prepared.tokenizer_vocab_size > spec.model.vocab_size:
        raise ConfigError(
            f"{spec.data.data_dir}: tokenizer has {prepared.tokenizer_vocab_size} tokens but "
            f"model.vocab_size is {spec.model.vocab_size}; prepare the data with this config"
        )
    model = build_model(spec.model, cfg)
    # what `auto` chose is part of the run's record (the same job runs unfused on CPU)
    log.event("started", attention=attention_kernel(cfg), parameters=count_parameters(model),
              world_size=env.world_size, warm=warm)
    ddp_model = wrap_data_parallel(model, cfg)
    optimizer = build_optimizer(ddp_model, cfg)
    ddp_chunks = ddp_model if isinstance(ddp_model, list) else [ddp_model]
    compute_timers = install_pipeline_hooks(ddp_chunks, optimizer)
    detector = LossSpikeDetector(spec.spike)
    checkpointer = open_checkpointer(spec.checkpoint, env,
                                     after_shards_written=faults.after_shards_written)

    step, skips = 0, SkippedBatches()
    resume_step = resume_from_step if resume_from_step is not None else checkpointer.latest()
    if resume_step is not None:
        # a checkpoint of another model shape is refused (ConfigError naming the fields)
        state = checkpointer.load(resume_step, model, optimizer, expect_model=spec.model)
        step = state["step"]
        skips = SkippedBatches.from_list(state.get("skips"))
        detector.load_state_dict(state.get("spike_detector", {}))
        if spec.spike.skip_batches:  # a rollback after a loss spike: skip the spike's batches
            # The onset step O trained the batch of step counter O-1: the steps from the
            # checkpoint up to the onset replay their batches, the spike's are skipped.
            onset = spec.spike.skip_from_step
            first = step if onset is None else onset - 1
            if first < step:
                log.event("skip_window_before_resume", onset_step=onset, resumed_step=step)
            skips = skips.skip_from_step(first, spec.spike.skip_batches)
        # the layout may differ from the one that saved (a node was lost): the log says so
        log.event("resumed", step=step, skipped_batches=skips.total, world_size=env.world_size,
                  saved_world_size=state.get("world_size", "unknown"))
    sampler = BatchSampler(PackedTokens(prepared.train_path, spec.model.seq_length, prepared.dtype),
                           cfg.seed, skips)
    num_micro = micro_batches_per_rank(cfg.global_batch_size, cfg.micro_batch_size, env.dp_size)
    position_ids = torch.arange(spec.model.seq_length, device=env.device).unsqueeze(0).expand(
        cfg.micro_batch_size, -1)
    tokens_per_step = cfg.global_batch_size * spec.model.seq_length
    # rank 0's metrics for people (TensorBoard; MLflow, W&B if configured); a resumed attempt
    # replaces what the failed one logged after the checkpoint it resumed from
    metrics = MetricsLogger.open(spec, env.rank, first_step=step + 1 if resume_step is not None else None)

    def trainer_state() -> dict:
        return {"step": step, "consumed_batches": skips.position_for_step(step),
                "skips": skips.to_list(), "seed": cfg.seed, "world_size": env.world_size,
                "config_hash": spec.config_hash(), "spike_detector": detector.state_dict(),
                "model_config": spec.model.model_dump(mode="json")}  # checked by the next load

    # --- the loop -----------------------------------------------------------------------
    heartbeat.beat(step, phase="start")
    started = time.monotonic()
    for chunk in ddp_chunks:
        chunk.train()
    updating = False  # from the optimizer's update to the step count: the state is no step's

    def before_update() -> None:
        nonlocal updating
        checkpointer.before_optimizer_step()  # a checkpoint's host copy must end before the update
        updating = True

    try:
        while step < cfg.steps:
            t0 = time.monotonic()
            lr = apply_schedule(optimizer, step, cfg)
            batch = skips.position_for_step(step)  # the global batch this step trains
            result = train_step(ddp_chunks, optimizer, sampler, step, env, cfg, num_micro,
                                position_ids, faults, before_update=before_update)
            step += 1
            updating = False
            loss = faults.observed_loss(result.loss)
            heartbeat.beat(step, step_time_s=time.monotonic() - t0, compute_s=compute_timers.take())
            where.step = step

            if step % cfg.log_interval == 0 or step == cfg.steps:
                tokens_per_s = tokens_per_step / max(time.monotonic() - t0, 1e-9)
                log.step(step, loss, lr, result.grad_norm, tokens_per_s=tokens_per_s,
                         elapsed_s=time.monotonic() - started, batch=batch)
                metrics.step(step, loss=loss, lr=lr, grad_norm=result.grad_norm, tokens_per_s=tokens_per_s)
                spike = detector.update(step, loss)  # same loss on every rank: same decision
                if spike is not None:
                    if env.rank == 0:
                        write_spike_marker(run_dir, spike)
                        print(format_spike_line(spike), file=sys.stderr, flush=True)
                    log.event("loss_spike", onset_step=spike.onset_step,
                              last_healthy_step=spike.last_healthy_step)
                    return runfiles.EXIT_LOSS_SPIKE

            decision = control.after_step()  # every rank: stop requested? checkpoint due by time?
            stopping = decision.stop and step < cfg.steps  # after the last step: just finish
            if stopping:
                control.begin_stop(step)
            if (step % spec.checkpoint.interval == 0 or step == cfg.steps
                    or decision.checkpoint_due or stopping):
                heartbeat.beat(step, phase="stopping" if stopping else "checkpoint")
                save_info = checkpointer.save(step, model, optimizer, trainer_state())
                control.saved()
                log.event("checkpoint_saved", step=step, **(save_info or {}))
                metrics.checkpoint(step, save_info)
            if stopping:  # graceful stop: wait for the commit, say so, exit "stopped"
                checkpointer.close()
                control.finish_stop()
                if env.rank == 0:
                    write_stop_marker(run_dir, step, control.signal_name)
                log.event("stopped", step=step, signal=control.signal_name or "peer")
                log.close()
                return runfiles.EXIT_STOPPED

            faults.after_step(step)

    except Exception as failure:  # before the update the state is the last completed step's
        _save_after_failure(failure, updating, checkpointer, step, model, optimizer, trainer_state(),
                            env, cfg, log)
        raise

    checkpointer.close(job_finished=True)
    if env.rank == 0:
        _write_finished(run_dir, step)
    log.event("finished", step=step)
    log.close()
    metrics.close()
    return runfiles.EXIT_OK


def _save_after_failure(failure, updating: bool, checkpointer, step, model, optimizer, trainer_state,
                        env, cfg, log) -> None:
    """`failure` interrupted the step after `step`: if a peer's, commit `step` from here when this
    rank may (the checkpointer decides), and say what happened in the rank's log."""
    full_replica = env.tp_size == 1 and env.pp_size == 1 and not cfg.use_distributed_optimizer
    try:
        saved, why = checkpointer.save_after_failure(failure, step, model, optimizer, trainer_state,
                                                     full_replica, updating=updating)
    except Exception as e:  # noqa: BLE001 - the failure being raised is what the flow must see
        print(f"forgeflow: the save after a peer's failure raised {type(e).__name__}: {e}",
              file=sys.stderr, flush=True)
        saved, why = None, "error"
    if why is None:  # not a peer's failure (or no peers): nothing to say
        return
    log.event("save_after_failure", step=step, saved=saved is not None, why=why, **(saved or {}))
    if saved is not None:
        print(f"forgeflow: a peer rank failed during step {step + 1}; rank {env.rank} committed "
              f"step {step} before exiting ({saved['seconds']:.2f} s)", file=sys.stderr, flush=True)


def _write_finished(run_dir, step: int) -> None:
    from infra.atomic_write import atomic_write_json

    atomic_write_json(runfiles.finished_marker_path(run_dir), {"step": step, "time": time.time()})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m training.train",
                                     description="forgeflow training worker (start with torchrun)")
    parser.add_argument("config", help="job spec YAML (or the JSON the flow wrote for this attempt)")
    parser.add_argument("--config-hash", default=None, metavar="HASH",
                        help="refuse to train unless the spec's model, training and data hash to "
                             "this (JobSpec.config_hash, before --set): the flow's own spec")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a spec field, e.g. training.steps=50 (repeatable)")
    parser.add_argument("--resume-from-step", type=int, default=None,
                        help="resume from this checkpoint step instead of the newest "
                             "(a rollback after a loss spike)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None, warm: bool = False) -> int:
    args = parse_args(argv)
    try:
        if args.config_hash is not None:
            found = load_job_spec(args.config).config_hash()
            if found != args.config_hash:
                raise ConfigError(f"{args.config}: the job spec's config hash is {found}, not "
                                  f"{args.config_hash} as the flow that launched this worker validated "
                                  "it; the file changed after launch: launch again from the flow")
        spec = load_job_spec(args.config, dotted_overrides(args.set))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from infra.storage import StorageError

    try:
        return train(spec, resume_from_step=args.resume_from_step, warm=warm)
    except StorageError as e:  # e.g. the preflight: bad credentials, missing bucket, full disk
        print(f"error: checkpoint storage ({type(e).__name__}): {e}", file=sys.stderr)
        return 2
    except ConfigError as e:  # e.g. a checkpoint of another model shape to resume from
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        from training.model import shutdown_distributed

        shutdown_distributed()


def run_worker(argv: list[str] | None = None, warm: bool = False) -> NoReturn:
    """`main`, then exit with its code: a rank's whole life (`python -m training.train`, and a standby
    rank once its gate opens: training.standby)."""
    try:
        code = main(argv, warm)
    except Exception:  # printed as Python would, through torch's hook: "[rankN]: ..." lines diagnosis reads
        sys.excepthook(*sys.exc_info())
        code = 1
    exit_now(code)  # without the interpreter's teardown: nothing is left to finalize by now


if __name__ == "__main__":
    run_worker()
