"""forgeflow: training — what torchrun starts on every rank, and what it reads and writes.

    config            the job spec (pydantic): model shape, batch, parallelism, checkpoint, eval
    corpus / data     which documents, tokenizer training, packed token files (`forgeflow prepare`)
    sampler           deterministic batches from a packed token file
    model             megatron-core GPTModel (Llama-style), DDP wrapper, optimizer
    megatron_compat   CPU patches for megatron-core 0.16.1 (applied only without CUDA)
    schedule          learning-rate schedule
    spike             loss-spike detection and its marker
    faults            fault injection for drills (off unless asked for)
    runlog            per-rank step log lines and heartbeat files
    rank_state        RNG and optimizer-state helpers both checkpoint writers share
    checkpointing     the loop's Checkpointer: dist_checkpointing writer, writer choice
    async_checkpointer  the loop's Checkpointer over checkpoint.engine (async, S3)
    checkpoint_reader whole model weights out of a checkpoint (for export)
    export            a checkpoint -> Hugging Face LlamaForCausalLM folder
    train             the worker's loop
    cli               `forgeflow prepare | train | export`
"""
