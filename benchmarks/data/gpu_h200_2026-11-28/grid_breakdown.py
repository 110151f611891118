"""One process per row: peak allocated, peak reserved and the process's device memory outside the
allocator (NVML) after two training steps, for the calibration GRID (and held-out row 11)."""
import json, os, subprocess, sys
sys.path.insert(0, os.getcwd())
os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29533")
from benchmarks import gpu_check as g

def one(kind, index):
    import torch
    from training import model as tm
    row = (g.GRID if kind == "grid" else g.HELDOUT_GRID)[index]
    env = tm.init_distributed(1)
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    g.two_steps(*g.configs(row), env.device)
    used, source = g._process_device_memory()
    free, total = torch.cuda.mem_get_info()
    print(json.dumps({"kind": kind, "index": index, "row": list(row), "base": base,
                      "allocated_peak": torch.cuda.max_memory_allocated(), "reserved_peak": torch.cuda.max_memory_reserved(),
                      "reserved_end": torch.cuda.memory_reserved(), "used": used, "used_from": source,
                      "device_used": total - free, "attention": tm.attention_kernel(g.configs(row)[1])}))

if len(sys.argv) > 2:
    one(sys.argv[1], int(sys.argv[2])); sys.exit()
out = open(os.path.join(os.environ["OUT"], "grid.jsonl"), "a")
for kind, index in [("heldout", 11)] + [("grid", i) for i in range(len(g.GRID))]:
    p = subprocess.run([sys.executable, __file__, kind, str(index)], capture_output=True, text=True)
    line = p.stdout.strip().splitlines()[-1] if p.returncode == 0 else json.dumps({"kind": kind, "index": index, "error": p.stderr[-800:]})
    print(line, flush=True); out.write(line + "\n"); out.flush()
