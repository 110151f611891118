"""Run under torchrun by test_export.py: a tensor-parallel model's logits and checkpoint.

    torchrun --nproc-per-node 2 tp_export_worker.py JOB.yaml OUT_DIR

Builds the job's GPTModel with its tensor_parallel degree, sets every weight to
seeded random values, computes the logits of a fixed batch (gathering the
vocab-parallel shards), and saves a checkpoint as the worker does (OUT_DIR/ck).
Rank 0 writes OUT_DIR/logits.pt and OUT_DIR/tokens.pt for the single-process export to match.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch


def main() -> int:
    from megatron.core import parallel_state

    from training.checkpointing import Checkpointer
    from training.config import load_job_spec
    from training.model import (build_model, build_optimizer, init_distributed,
                                shutdown_distributed, wrap_data_parallel)

    spec = load_job_spec(sys.argv[1])
    out = Path(sys.argv[2])
    env = init_distributed(spec.training.tensor_parallel)
    try:
        model = build_model(spec.model, spec.training)
        g = torch.Generator().manual_seed(0)  # same on every rank: replicated norms stay equal
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
                else:
                    p.copy_(0.08 * torch.randn(p.shape, generator=g))
        tokens = torch.randint(0, spec.model.vocab_size, (2, spec.model.seq_length),
                               generator=torch.Generator().manual_seed(1))
        positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
        model.eval()
        with torch.no_grad():
            shard = model(tokens, positions, None)  # [b, s, vocab / tp]
        group = parallel_state.get_tensor_model_parallel_group()
        shards = [torch.empty_like(shard) for _ in range(env.tp_size)]
        torch.distributed.all_gather(shards, shard.contiguous(), group=group)
        optimizer = build_optimizer(wrap_data_parallel(model, spec.training), spec.training)
        cfg = spec.checkpoint.model_copy(update={"url": str(out / "ck"), "async_save": False})
        # Persisted inline by a writer thread (no writer process to start: faster test).
        checkpointer = Checkpointer(cfg, env, writer="thread")
        checkpointer.save(1, model, optimizer, {"world_size": env.world_size})
        checkpointer.close()
        if env.rank == 0:
            torch.save(torch.cat(shards, dim=-1), out / "logits.pt")
            torch.save(tokens, out / "tokens.pt")
    finally:
        shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
