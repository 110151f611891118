"""`python -m training.offload.worker RUN.json`: one offload worker (start W of them with torchrun)."""

from __future__ import annotations

import faulthandler
import os
import sys

from training.offload.executor import OffloadRunConfig, run_worker


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m training.offload.worker RUN.json", file=sys.stderr)
        return 2
    with open(args[0], encoding="utf-8") as f:
        cfg = OffloadRunConfig.model_validate_json(f.read())
    if os.environ.get("FORGEFLOW_OFFLOAD_HANG_DUMP_S"):  # debugging a stuck pipeline: stacks to stderr
        faulthandler.dump_traceback_later(float(os.environ["FORGEFLOW_OFFLOAD_HANG_DUMP_S"]), repeat=True)
    run_worker(cfg)
    import torch

    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
