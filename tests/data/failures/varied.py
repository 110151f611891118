"""Varied routine output of several training stacks, for benchmarks that must not be
easy for forgeflow's seed rules.

``logsim.Job`` writes what forgeflow's own stack prints (torchrun, NCCL, megatron,
forgeflow's step lines): the seed filter rules were written for exactly that. This
module writes what other stacks print between errors, and what real terminals make of
it:

* Hugging Face Trainer dict lines, DeepSpeed ``log_dist`` lines, PyTorch Lightning and
  tqdm progress bars redrawn with carriage returns, vLLM engine metrics, accelerate /
  datasets / torch._dynamo INFO lines, rich-coloured logging with ANSI escape codes,
  and user ``print`` output whose *words* vary (dataset shards, file names, sample
  text), not only its numbers;
* two ranks writing to one pipe: a line cut short and finished by another rank's
  output (interleaving), lines of several library versions' wording;
* ``KEYWORD_FREE_ERRORS``: real failure lines that hold none of the error words
  (``diagnosis.signals.ERROR_WORDS``; plus two the issue cited that do); a filter that
  keeps only error-word lines would drop them.

Everything is seeded: the same seed writes the same bytes.
"""

from __future__ import annotations

import random
from typing import Iterator

WORDS = (
    "alpha beta gamma delta shard token corpus wiki books code arxiv github stack math "
    "pile c4 refined web crawl dedup filter sample mixture domain english german french "
    "python rust java legal medical news forum reddit qa dialogue instruct chat reward "
    "policy critic value actor rollout prompt response chosen rejected pairwise margin "
    "tokenizer vocab merges bpe sentencepiece unigram pack concat pad truncate stride "
    "window rope alibi flash fused kernel triton cutlass gemm attention mlp norm rms "
    "layer block expert router gate capacity aux balance dropout residual embed head"
).split()

ANSI = ("\x1b[32m", "\x1b[33m", "\x1b[36m", "\x1b[1m", "\x1b[2m", "\x1b[34m")
RESET = "\x1b[0m"

# Real failure lines whose text holds no error keyword (see the module docstring).
# Each is {r} = rank, {p} = pid, {h} = host index, {n} = a number.
KEYWORD_FREE_ERRORS: tuple[str, ...] = (
    # The brief cites these two; both do hold a keyword ("killed", "segmentation fault").
    "Killed",
    "Segmentation fault (core dumped)",
    # DataLoader worker death, as printed when the RuntimeError prefix sits on another line.
    "[rank{r}]:   DataLoader worker (pid(s) {p}) exited unexpectedly",
    # NCCL watchdog (torch >= 2.3 heartbeat monitor).
    "[rank{r}]:[E1122 07:41:02.{n:06d} {p} ProcessGroupNCCL.cpp:1293] [PG 0 (default_pg) Rank {r}] ProcessGroupNCCL's watchdog got stuck for 480 seconds without making progress in monitoring enqueued collectives.",
    # A Python warning turned into an error (python -W error): the exception line itself.
    "[rank{r}]: UserWarning: Detected call of `lr_scheduler.step()` before `optimizer.step()`.",
    "[rank{r}]: FutureWarning: `torch.cuda.amp.GradScaler(args...)` is deprecated. Please use `torch.amp.GradScaler('cuda', args...)` instead.",
    # C++ aborts.
    "[rank{r}]: terminate called after throwing an instance of 'std::bad_alloc'",
    "[rank{r}]:   what():  std::bad_alloc",
    "free(): invalid pointer",
    "double free or corruption (!prev)",
    # Scheduler and environment.
    "slurmstepd: *** JOB 4{n:05d} ON node-a0{h} CANCELLED AT 2026-11-22T07:41:02 DUE TO TIME LIMIT ***",
    "CUDA driver version is insufficient for CUDA runtime version",
    "[rank{r}]: torch._dynamo.exc.Unsupported: call_function BuiltinVariable(setattr) [TensorVariable(), ConstantVariable(str)] {{}}",
    "Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.",
)


def _words(rng: random.Random, k: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(k))


def _name(rng: random.Random) -> str:
    return "-".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3)))


def _hf_trainer(rng: random.Random, step: int, rank: int) -> str:
    loss = rng.uniform(1.5, 3.0)
    if rng.random() < 0.5:  # transformers < 4.36: no grad_norm
        return f"{{'loss': {loss:.4f}, 'learning_rate': {rng.uniform(1e-5, 3e-4):.4e}, 'epoch': {step / 1e4:.2f}}}"
    return (f"{{'loss': {loss:.4f}, 'grad_norm': {rng.uniform(0.2, 2):.6f}, "
            f"'learning_rate': {rng.uniform(1e-5, 3e-4):.4e}, 'epoch': {step / 1e4:.2f}}}")


def _deepspeed(rng: random.Random, step: int, rank: int) -> str:
    ts = f"[2026-11-22 0{rng.randint(6, 9)}:{rng.randint(10, 59)}:{rng.randint(10, 59)},{rng.randint(100, 999)}]"
    kind = rng.random()
    if kind < 0.4:
        return (f"{ts} [INFO] [logging.py:96:log_dist] [Rank 0] step={step}, skipped=0, "
                f"lr=[{rng.uniform(1e-5, 3e-4):.6e}], mom=[(0.9, 0.95)]")
    if kind < 0.7:
        return (f"{ts} [INFO] [timer.py:260:stop] epoch=0/micro_step={step * 4}/global_step={step}, "
                f"RunningAvgSamplesPerSec={rng.uniform(100, 140):.6f}, CurrSamplesPerSec={rng.uniform(90, 150):.6f}, "
                f"MemAllocated={rng.uniform(10, 30):.2f}GB, MaxMemAllocated={rng.uniform(30, 60):.2f}GB")
    return f"{ts} [INFO] [engine.py:{rng.randint(2000, 3000)}:_{_name(rng).replace('-', '_')}] {_words(rng, 5)}"


def _bar(rng: random.Random, total: int, upto: int, label: str) -> str:
    # tqdm/Lightning redraw one terminal line with "\r"; a file receives every redraw.
    frames = []
    for i in sorted(rng.sample(range(1, total), min(6, total - 1))) + [upto]:
        pct = int(100 * i / total)
        fill = "█" * (pct // 10) + " " * (10 - pct // 10)
        frames.append(f"{label}: {pct:3d}%|{fill}| {i}/{total} [{i // 60:02d}:{i % 60:02d}<{(total - i) // 60:02d}:{(total - i) % 60:02d}, "
                      f"{rng.uniform(1, 12):.2f}it/s, loss={rng.uniform(1.5, 3):.3f}, v_num={rng.randint(0, 9)}]")
    return "\r".join(frames)


def _vllm(rng: random.Random, step: int, rank: int) -> str:
    if rng.random() < 0.5:
        return (f"INFO 11-22 07:{rng.randint(10, 59)}:{rng.randint(10, 59)} metrics.py:{rng.choice((341, 345, 351))}] "
                f"Avg prompt throughput: {rng.uniform(0, 900):.1f} tokens/s, Avg generation throughput: {rng.uniform(0, 3000):.1f} tokens/s, "
                f"Running: {rng.randint(0, 256)} reqs, Swapped: 0 reqs, Pending: {rng.randint(0, 40)} reqs, GPU KV cache usage: {rng.uniform(0, 99):.1f}%, CPU KV cache usage: 0.0%.")
    # newer vLLM wording
    return (f"INFO {rng.randint(10, 12)}-22 07:{rng.randint(10, 59)}:{rng.randint(10, 59)} [loggers.py:{rng.choice((116, 118))}] "
            f"Engine 000: Avg prompt throughput: {rng.uniform(0, 900):.1f} tokens/s, Avg generation throughput: {rng.uniform(0, 3000):.1f} tokens/s, "
            f"Running: {rng.randint(0, 256)} reqs, Waiting: {rng.randint(0, 40)} reqs, GPU KV cache usage: {rng.uniform(0, 99):.1f}%, Prefix cache hit rate: {rng.uniform(0, 80):.1f}%")


def _python_logging(rng: random.Random, step: int, rank: int) -> str:
    module = rng.choice(("data.loader", "train", "callbacks.eval", "utils.profiler", "accelerate.accelerator",
                         "datasets.builder", "torch._dynamo.convert_frame", "torch._inductor.compile_fx"))
    msg = rng.choice((
        f"Processing shard s3://lake/{_name(rng)}/{rng.choice(('train', 'val'))}/part-{rng.randint(0, 99999):05d}-{rng.getrandbits(32):08x}.parquet ({rng.randint(1, 900)} MB)",
        f"Loaded {rng.randint(1000, 90000)} samples from {_name(rng)}.jsonl in {rng.uniform(0.1, 9):.2f}s",
        f"sample[{rng.randint(0, 99)}]: {_words(rng, rng.randint(6, 18))}",
        f"Step {rng.randint(0, 9999)} compiled graph {_name(rng)} in {rng.uniform(0.1, 30):.1f}s ({rng.randint(1, 80)} kernels)",
        f"mixture weights: " + ", ".join(f"{rng.choice(WORDS)}={rng.random():.3f}" for _ in range(4)),
        f"Caching {_name(rng)} to /scratch/cache/{rng.getrandbits(48):012x}",
    ))
    level = "INFO" if rng.random() < 0.9 else "DEBUG"
    if rng.random() < 0.3:  # rich / colorlog output keeps its colour codes in files
        colour = rng.choice(ANSI)
        return f"{colour}{level}{RESET} {module}: {msg}"
    return f"2026-11-22 07:{rng.randint(10, 59)}:{rng.randint(10, 59)},{rng.randint(100, 999)} - {module} - {level} - {msg}"


def _user_print(rng: random.Random, step: int, rank: int) -> str:
    return rng.choice((
        f"epoch {step // 1000} batch {step % 1000}: {_words(rng, 3)} acc={rng.random():.4f}",
        f">>> {_words(rng, rng.randint(4, 12))}",
        f"saving {_name(rng)} snapshot to /ckpt/{_name(rng)}/{rng.getrandbits(24):06x}",
        f"eval/{rng.choice(WORDS)}/{rng.choice(WORDS)}: {rng.random():.5f}",
    ))


SOURCES = (_hf_trainer, _deepspeed, _vllm, _python_logging, _user_print)


def routine_lines(rng: random.Random, n: int, ranks: int = 16, start_step: int = 0) -> Iterator[str]:
    """``n`` routine lines from several stacks, rank-prefixed, sometimes interleaved."""
    step = start_step
    for i in range(n):
        rank = rng.randrange(ranks)
        if i % 7 == 0:
            step += 1
        roll = rng.random()
        if roll < 0.06:
            line = _bar(rng, rng.randint(50, 2000), rng.randint(1, 50), rng.choice(("Epoch 0", "Map", "Validation DataLoader 0", "Generating train split")))
        else:
            line = rng.choice(SOURCES)(rng, step, rank)
        prefix = rng.random()
        if prefix < 0.4:
            line = f"[rank{rank}]:{line}"
        elif prefix < 0.55:
            line = f"{rank}: {line}"
        if rng.random() < 0.01:
            # two ranks on one pipe: this line is cut and the next rank's text follows on it
            cut = rng.randint(1, max(1, len(line) - 1))
            line = line[:cut] + f"[rank{(rank + 1) % ranks}]:" + _user_print(rng, step, rank)
        yield line


def keyword_free_error(rng: random.Random, template: str) -> str:
    return template.format(r=rng.randrange(16), p=rng.randint(1000, 99999), h=rng.randint(1, 4), n=rng.randrange(10**6))
