"""One rank of a node-check world: time allgathers over the node interconnect.

Started by torchrun (see infra/nodecheck.py). Uses NCCL on GPUs (so NVLink,
PCIe and the NIC are exercised, plus a matmul to touch the GPU) and gloo on
CPU. Rank 0 writes {"allgather_s": median seconds per allgather, ...} to
--result. A collective that fails or exceeds --timeout-s makes the rank exit
non-zero, which is what marks the world failed.

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


def _injected_fault(node: str) -> str | None:
    for item in os.environ.get("FORGEFLOW_NODECHECK_FAULT", "").split(","):
        name, _, kind = item.partition("=")
        if name.strip() == node and kind.strip():
            return kind.strip()
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--result", required=True)
    parser.add_argument("--payload-mb", type=float, default=4.0)
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--timeout-s", type=float, default=60.0)
    args = parser.parse_args(argv)

    node = os.environ.get("FORGEFLOW_NODE_NAME", "unknown")
    fault = _injected_fault(node)
    if fault == "fail":
        print(f"node check: injected failure on {node}: NCCL error: unhandled system error", file=sys.stderr)
        return 1

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = torch.device("cuda") if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=args.timeout_s))
    try:
        if fault == "stall":
            time.sleep(args.timeout_s * 10)  # a hung NIC or GPU: the collective never completes
        if cuda:  # touch the GPU itself, not only the links
            a = torch.randn(2048, 2048, device=device)
            (a @ a).sum().item()
        numel = max(1, int(args.payload_mb * 2**20 / 4))
        send = torch.full((numel,), float(dist.get_rank()), device=device)
        recv = [torch.empty_like(send) for _ in range(dist.get_world_size())]
        dist.all_gather(recv, send)  # warm-up and connection set-up
        times = []
        for _ in range(args.iterations):
            start = time.perf_counter()
            if fault == "slow":  # inside the timed region, whichever rank the slow node is
                time.sleep(0.5)
            dist.all_gather(recv, send)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        for rank, tensor in enumerate(recv):
            if tensor[0].item() != float(rank):
                print(f"node check: corrupted allgather payload from rank {rank}", file=sys.stderr)
                return 2
        if dist.get_rank() == 0:
            Path(args.result).parent.mkdir(parents=True, exist_ok=True)
            Path(args.result).write_text(
                json.dumps({"allgather_s": statistics.median(times), "times": times, "world": dist.get_world_size()})
            )
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from infra.fast_exit import exit_now

    exit_now(main())  # a node check waits for every rank's exit: no interpreter teardown
