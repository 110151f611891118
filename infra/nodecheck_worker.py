"""One rank of a node-check world: time allgathers over the node interconnect.

Started by torchrun (see infra/nodecheck.py), or run by a standby rank that is already up on
the node (`check_world`, infra.standby's warm node check). Uses NCCL on GPUs (so NVLink, PCIe
and the NIC are exercised, plus a matmul to touch the GPU) and gloo on CPU. Rank 0 writes
{"allgather_s": median seconds per allgather, ...} to --result. A collective that fails or
exceeds --timeout-s makes the rank exit non-zero, which is what marks the world failed.

For tests, FORGEFLOW_NODECHECK_FAULT="node-b=fail,node-c=stall,node-d=slow"
makes the named nodes misbehave the way a broken or degraded node does.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


class NodeCheckFailed(Exception):
    """This rank's check failed (besides a collective's own error): `code` is its exit code."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def _injected_fault(node: str) -> str | None:
    for item in os.environ.get("FORGEFLOW_NODECHECK_FAULT", "").split(","):
        name, _, kind = item.partition("=")
        if name.strip() == node and kind.strip():
            return kind.strip()
    return None


def check_world(store: dist.Store, rank: int, world_size: int, *, payload_mb: float = 4.0,
                iterations: int = 5, timeout_s: float = 60.0) -> dict:
    """Join the world of `world_size` ranks that meet in `store` as `rank`, touch the GPU, time
    `iterations` allgathers of `payload_mb` per rank and check their payload. Returns
    {"allgather_s": median seconds, "times", "world"}; raises NodeCheckFailed (or the
    collective's error) when the check fails. The process group is gone when it returns."""
    node = os.environ.get("FORGEFLOW_NODE_NAME", "unknown")
    fault = _injected_fault(node)
    if fault == "fail":
        raise NodeCheckFailed(f"injected failure on {node}: NCCL error: unhandled system error", 1)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = torch.device("cuda") if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        if fault == "stall":
            time.sleep(timeout_s * 10)  # a hung NIC or GPU: the collective never completes
        if cuda:  # touch the GPU itself, not only the links
            a = torch.randn(2048, 2048, device=device)
            (a @ a).sum().item()
        numel = max(1, int(payload_mb * 2**20 / 4))
        send = torch.full((numel,), float(rank), device=device)
        recv = [torch.empty_like(send) for _ in range(world_size)]
        dist.all_gather(recv, send)  # warm-up and connection set-up
        times = []
        for _ in range(iterations):
            start = time.perf_counter()
            if fault == "slow":  # inside the timed region, whichever rank the slow node is
                time.sleep(0.5)
            dist.all_gather(recv, send)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        for other, tensor in enumerate(recv):
            if tensor[0].item() != float(other):
                raise NodeCheckFailed(f"corrupted allgather payload from rank {other}", 2)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return {"allgather_s": statistics.median(times), "times": times, "world": world_size}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--result", required=True)
    parser.add_argument("--payload-mb", type=float, default=4.0)
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--timeout-s", type=float, default=60.0)
    args = parser.parse_args(argv)

    # torchrun's agent keeps the world's store: its ranks join it as clients
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=datetime.timedelta(seconds=args.timeout_s))
    rank = int(os.environ["RANK"])
    try:
        measured = check_world(store, rank, int(os.environ["WORLD_SIZE"]), payload_mb=args.payload_mb,
                               iterations=args.iterations, timeout_s=args.timeout_s)
    except NodeCheckFailed as e:
        print(f"node check: {e}", file=sys.stderr)
        return e.code
    if rank == 0:
        Path(args.result).parent.mkdir(parents=True, exist_ok=True)
        Path(args.result).write_text(json.dumps(measured))
    return 0


if __name__ == "__main__":
    from infra.fast_exit import exit_now

    exit_now(main())  # a node check waits for every rank's exit: no interpreter teardown
