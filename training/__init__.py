"""forgeflow: training — what torchrun starts on every rank, and what it reads and writes.

    config            the job spec (pydantic): model shape, batch, parallelism, checkpoint, eval
    capabilities      what the worker can run (pipeline stages, TP, recompute, ...): planner and flow read it
    corpus / data     which documents, tokenizer training, packed token files (`forgeflow prepare`)
    sampler           deterministic batches from a packed token file
    model             megatron-core GPTModel (Llama-style), pipeline stages, DDP wrapper, optimizer
    attention         core attention: megatron's unfused kernel or torch's fused SDPA
    megatron_compat   CPU patches for megatron-core 0.16.1 (applied only without CUDA)
    fusion_compile    megatron's fused kernels compiled at their first call, not at import (rank start-up)
    lazy_imports      what megatron imports eagerly and a rank rarely uses (wandb), loaded at first use
    schedule          learning-rate schedule
    spike             loss-spike detection and its marker
    faults            fault injection for drills (off unless asked for)
    runlog            per-rank step log lines and heartbeat files
    collective_watch  where each rank's main thread is (which collective, since when): a hang's culprit
    loss_chart        the loss curve from rank 0's log, attempt by attempt (failures, rollbacks marked)
    metrics           metrics for people: TensorBoard event files (default), MLflow, W&B (rank 0 only)
    progress          live progress in the terminal (attempt, step, loss, tokens/s, ETA) from the run files
    rank_state        RNG streams and the distributed optimizer's checkpoint layout
    checkpointing     the loop's Checkpointer: megatron's sharded state <-> checkpoint.engine
    checkpoint_reader whole model weights out of a checkpoint, any layout (for export)
    export            a checkpoint -> Hugging Face LlamaForCausalLM folder
    control           what all ranks decide together after a step: graceful stop, time checkpoints
    train             the worker's loop (megatron's pipeline schedules run each step)
    standby           a standby rank: imports done, serves node checks, waits for its gate, then is train's
    cli               `forgeflow prepare | train | export`
    offload/          Mobius offloaded fine-tuning: stages in host memory, prefetched to the device
"""

from training import fusion_compile, lazy_imports

fusion_compile.install()  # before anything imports megatron: its fusions compile when first called
lazy_imports.install()  # and wandb loads when a job's W&B sink first uses it
