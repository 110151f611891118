"""A stand-in rank for launcher tests: joins the process group, records the names in its
environment and its pid, then sleeps or exits with the code it is told (FORGEFLOW_TEST_EXIT)."""

import json
import os
import time
from pathlib import Path

import torch.distributed as dist

dist.init_process_group("gloo")
out = Path(os.environ["FORGEFLOW_TEST_PID_DIR"])
out.mkdir(parents=True, exist_ok=True)
(out / f"rank{dist.get_rank()}.env").write_text(json.dumps(sorted(os.environ)))
(out / f"rank{dist.get_rank()}.pid").write_text(str(os.getpid()))
print(f"rank {dist.get_rank()} of {dist.get_world_size()} on node {os.environ['FORGEFLOW_NODE_NAME']}", flush=True)
code = int(os.environ.get("FORGEFLOW_TEST_EXIT", "-1"))
if code >= 0 and dist.get_rank() == dist.get_world_size() - 1:
    os._exit(code)
time.sleep(600 if code < 0 else 60)
