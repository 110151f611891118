"""Two ranks (gloo, under torchrun) load a checkpoint while one of them hits a fault.

    torchrun --nproc-per-node 2 two_ranks_load.py URL CASE OUT_DIR

CASE = "transient": rank 1's read of its step-20 shard fails with a storage error;
CASE = "corrupt_and_transient": rank 1's step-20 shard is damaged, rank 0's read fails.
Each rank writes OUT_DIR/rank-<r>.json: what its load() did.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    from checkpoint.engine import CheckpointEngine, CheckpointStorageUnavailable
    from checkpoint.manifest import shard_key
    from infra.storage import LocalStorage, StorageUnavailable

    url, case, out_dir = sys.argv[1:4]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    engine = CheckpointEngine(url, rank=rank, world_size=2, writer="thread", keep_last=5)
    for step in (10, 20):
        engine.save(step, {"w": torch.full((4,), float(10 * step + rank))}, blocking=True)
    dist.barrier()
    if case == "corrupt_and_transient" and rank == 1:
        path = Path(url) / shard_key(20, 1, 2)
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
    dist.barrier()
    failing = {"transient": (1, shard_key(20, 1, 2)),
               "corrupt_and_transient": (0, shard_key(20, 0, 2))}[case]
    real = LocalStorage.get_bytes

    def get_bytes(self, key):
        if (rank, key) == failing:
            raise StorageUnavailable("get_object kept failing for ~120s (503 SlowDown)", self.url(key))
        return real(self, key)

    LocalStorage.get_bytes = get_bytes
    result: dict = {"rank": rank}
    try:
        loaded = engine.load()
        result.update(step=loaded.step, skipped=loaded.skipped_steps)
    except CheckpointStorageUnavailable as e:
        result.update(error=str(e))
    LocalStorage.get_bytes = real
    dist.barrier()
    result["committed"] = engine.committed_steps()
    Path(out_dir, f"rank-{rank}.json").write_text(json.dumps(result))
    engine.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
