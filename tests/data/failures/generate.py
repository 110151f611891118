"""Write the labelled failure corpus: ``python tests/data/failures/generate.py``.

Each case is a multi-rank pretraining log (torchrun + NCCL + megatron + forgeflow's
training loop) with routine noise, in which one fault happens and the rest of the job
reacts to it: other ranks' NCCL watchdog timeouts, SIGABRTs, lost c10d stores and
torchrun's ChildFailedError summary usually come *after* the root cause, so the last
error in the file is rarely the answer. ``labels.json`` holds, per file: root_cause,
kind, restart_helps, suspect_nodes (hosts to check for infrastructure faults, else
[]) and a note saying what makes the case hard.

The output is deterministic (fixed seeds); the .log files are committed so tests and
benchmarks do not depend on running this script.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

from logsim import Job  # noqa: E402

HERE = Path(__file__).resolve().parent
CASES: dict[str, tuple[Callable[[], tuple[Job, list[str]]], str, bool, str]] = {}
# Cases whose messages the seeded diagnosis rules were deliberately NOT written for
# (they name the wrong cause or none): what the agents and learned rules are for.
NOVEL: set[str] = set()

PY = "/opt/venv/lib/python3.11/site-packages"
MEG = "/opt/megatron/megatron"


def case(name: str, root_cause: str, restart_helps: bool, note: str, novel: bool = False):
    def register(fn):
        CASES[name] = (fn, root_cause, restart_helps, note)
        if novel:
            NOVEL.add(name)
        return fn
    return register


def hosts(prefix: str, n: int, start: int = 1) -> list[str]:
    return [f"{prefix}{i:02d}" for i in range(start, start + n)]


def others(job: Job, bad: int) -> list[int]:
    return [r for r in range(job.world) if r != bad]


def train_frames() -> list[tuple[str, int, str, str]]:
    return [
        ("/workspace/forgeflow/training/worker.py", 412, "<module>", "main()"),
        ("/workspace/forgeflow/training/worker.py", 398, "main", "train(spec, state)"),
        ("/workspace/forgeflow/training/loop.py", 171, "train", "loss = train_step(model, batch, optimizer)"),
    ]


# =========================================================================== infrastructure


@case("nvlink_xid74", "NVLinkError", True, "Xid 74 in the kernel log precedes CUDA errors and watchdog timeouts")
def _():
    job = Job(101, hosts("gpu-h100-", 2, 17))
    job.startup(); job.train(30)
    bad = 11
    job.tick(3)
    job.emit(f"{job.syslog()} {job.host_of(bad)} kernel: NVRM: Xid (PCI:0000:{job.bus[job.local(bad)][:2]}:00): 74, pid={job.pids[bad]}, name=python, NVLink: fatal error detected on link 5(0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)")
    job.tick(1.2)
    job.python_traceback(bad, train_frames(), [
        "RuntimeError: CUDA error: unspecified launch failure",
        "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might be incorrect.",
        "For debugging consider passing CUDA_LAUNCH_BLOCKING=1",
        "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.",
    ])
    job.tick(600)
    job.watchdog_timeouts(others(job, bad)[:9])
    job.aborts(others(job, bad)[:4])
    job.child_failed(bad, others=[12, 13])
    return job, [job.host_of(bad)]


@case("nvlink_cuda_failure", "NVLinkError", True, "NCCL reports the NVLink fault through a CUDA failure; generic RuntimeErrors follow")
def _():
    job = Job(102, hosts("node-b", 2, 3), prefix_style="default")
    job.startup(); job.train(18)
    bad = 5
    job.tick(2)
    job.nccl(bad, "WARN Cuda failure 'an uncorrectable NVLink error was detected during the execution'")
    job.nccl(bad, "INFO transport/p2p.cc:275 -> 1")
    job.rank_line(bad, f"[{job.glog('E')} {job.pids[bad]} ProcessGroupNCCL.cpp:1515] [PG 0 (default_pg) Rank {bad}] Process group watchdog thread terminated with exception: NCCL error: unhandled cuda error (run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5")
    job.python_traceback(bad, train_frames(), ["RuntimeError: NCCL Error 1: unhandled cuda error (run with NCCL_DEBUG=INFO for details)"])
    job.tick(601)
    job.watchdog_timeouts(others(job, bad)[:6])
    job.child_failed(bad, exitcode=-6, signal_name="SIGABRT")
    return job, [job.host_of(bad)]


@case("cuda_illegal_address", "CUDAError", True, "rank 13 hits an illegal memory access; 15 ranks then time out and abort")
def _():
    job = Job(103, hosts("sh-a800-", 2, 40))
    job.startup(); job.train(40)
    bad = 13
    job.tick(1)
    job.python_traceback(bad, train_frames() + [
        (f"{PY}/torch/autograd/__init__.py", 347, "backward", "_engine_run_backward("),
    ], [
        "RuntimeError: CUDA error: an illegal memory access was encountered",
        "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might be incorrect.",
        "For debugging consider passing CUDA_LAUNCH_BLOCKING=1",
    ])
    job.tick(600)
    job.watchdog_timeouts(others(job, bad))
    job.aborts(others(job, bad)[:3])
    job.child_failed(bad, others=[0, 1, 2])
    return job, [job.host_of(bad)]


@case("cuda_watchdog_exception", "CUDAError", True, "the CUDA error surfaces inside a watchdog 'terminated with exception' line, among timeouts")
def _():
    job = Job(104, hosts("node-", 2, 7), collector_stamps=True)
    job.startup(); job.train(22)
    job.tick(600)
    job.watchdog_timeouts([0, 1, 2, 3])
    bad = 9
    job.rank_line(bad, f"[{job.glog('E')} {job.pids[bad]} ProcessGroupNCCL.cpp:1515] [PG 0 (default_pg) Rank {bad}] Process group watchdog thread terminated with exception: CUDA error: an illegal memory access was encountered")
    job.rank_line(bad, "Exception raised from c10_cuda_check_implementation at ../c10/cuda/CUDAException.cpp:43 (most recent call first):")
    job.watchdog_timeouts([4, 5, 6])
    job.aborts([bad, 0, 1])
    job.child_failed(bad, exitcode=-6, signal_name="SIGABRT")
    return job, [job.host_of(bad)]


@case("node_fell_off_bus", "NodeFailure", True, "Xid 79 on one node; its ranks die silently, everyone else times out")
def _():
    job = Job(105, hosts("gpu-", 3, 101))
    job.startup(); job.train(25)
    bad = 17
    job.tick(4)
    job.emit(f"{job.syslog()} {job.host_of(bad)} kernel: NVRM: GPU at PCI:0000:{job.bus[job.local(bad)][:2]}:00: GPU-4f1c2b7e-9a0d-4c1b-8f36-2e5f0a9c7d11")
    job.emit(f"{job.syslog()} {job.host_of(bad)} kernel: NVRM: Xid (PCI:0000:{job.bus[job.local(bad)][:2]}:00): 79, pid={job.pids[bad]}, GPU has fallen off the bus.")
    job.emit(f"{job.syslog()} {job.host_of(bad)} kernel: NVRM: GPU 0000:{job.bus[job.local(bad)][:2]}:00.0: GPU has fallen off the bus.")
    job.tick(600)
    job.watchdog_timeouts([r for r in range(job.world) if job.host_of(r) != job.host_of(bad)][:10])
    job.store_lost([0, 1])
    job.child_failed(3, exitcode=-6, signal_name="SIGABRT")
    return job, [job.host_of(bad)]


@case("node_failure_slurm", "NodeFailure", True, "slurm cancels the step for a node failure after ranks lost the store")
def _():
    job = Job(106, hosts("nid", 4, 1032), prefix_style="srun")
    job.startup(); job.train(20)
    job.tick(35)
    job.store_lost([1, 2, 9, 10])
    job.tick(2)
    job.emit(f"slurmstepd: error: *** STEP 8812344.0 ON nid1032 CANCELLED AT {job.now:%Y-%m-%dT%H:%M:%S} DUE TO NODE FAILURE, SEE SLURMCTLD LOG FOR DETAILS ***")
    job.emit("srun: error: Node failure on nid1034")
    job.emit("srun: Job step aborted: Waiting up to 32 seconds for job step to finish.")
    job.emit("srun: error: nid1033: tasks 8-15: Killed")
    return job, ["nid1034"]


@case("ecc_uncorrectable", "ECCError", True, "RuntimeError text carries the ECC error; NCCL timeouts follow")
def _():
    job = Job(107, hosts("node-a", 2, 1))
    job.startup(); job.train(33)
    bad = 6
    job.tick(1)
    job.emit(f"{job.syslog()} {job.host_of(bad)} kernel: NVRM: Xid (PCI:0000:{job.bus[job.local(bad)][:2]}:00): 48, pid={job.pids[bad]}, name=python, An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 3, subpartition 0.")
    job.tick(0.5)
    job.python_traceback(bad, train_frames(), ["RuntimeError: CUDA error: uncorrectable ECC error encountered"])
    job.tick(600)
    job.watchdog_timeouts(others(job, bad)[:7])
    job.child_failed(bad)
    return job, [job.host_of(bad)]


@case("ecc_xid94_then_cuda", "ECCError", True, "contained ECC Xid 94 precedes a generic CUDA launch failure on the same GPU")
def _():
    job = Job(108, hosts("gpu-h800-", 2, 5), collector_stamps=True)
    job.startup(); job.train(28)
    bad = 3
    job.emit(f"{job.syslog()} {job.host_of(bad)} kernel: NVRM: Xid (PCI:0000:{job.bus[job.local(bad)][:2]}:00): 94, pid={job.pids[bad]}, name=python, Contained: SM (0x1). RST: No, D-RST: No")
    job.tick(2)
    job.python_traceback(bad, train_frames(), ["RuntimeError: CUDA error: unspecified launch failure"])
    job.tick(600)
    job.watchdog_timeouts(others(job, bad)[:5])
    job.child_failed(bad)
    return job, [job.host_of(bad)]


@case("ib_completion_error", "NetworkError", True, "IB completion error on one node; remote-peer errors and timeouts on the others")
def _():
    job = Job(109, hosts("node-c", 2, 1))
    job.startup(); job.train(35)
    bad = 9
    job.tick(1)
    job.nccl(bad, "WARN NET/IB : Got completion from peer 10.0.0.11<41233> with status=12 opcode=0 len=0 vendor err 129 (Recv) localGid ::ffff:10.0.0.12 remoteGids::ffff:10.0.0.11")
    job.nccl(bad, "INFO transport/net.cc:1298 -> 6")
    job.tick(0.4)
    for r in (1, 2, 3):
        job.rank_line(r, f"torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970, remote process exited or there was a network error, NCCL version 2.21.5")
        job.rank_line(r, "ncclRemoteError: A call failed possibly due to a network error or a remote process exiting prematurely.")
        job.rank_line(r, f"Last error:\nNET/IB : Got completion from peer {job.host_of(bad)}<0> with status=12 opcode=0 len=0 vendor err 129 (Recv)".replace("\n", " "))
    job.tick(600)
    job.watchdog_timeouts([4, 5, 6, 7])
    job.child_failed(1, others=[2, 3])
    return job, [job.host_of(bad)]


@case("network_unreachable", "NetworkError", True, "socket transport loses its route; later NCCL remote errors")
def _():
    job = Job(110, hosts("cn", 2, 210), prefix_style="default")
    job.startup(); job.train(19)
    bad = 12
    job.tick(1)
    job.nccl(bad, "WARN socketProgressOpt: Call to recv from 10.0.0.210<55931> failed : Network is unreachable")
    job.nccl(bad, "INFO misc/socket.cc:752 -> 6")
    job.nccl(bad, "WARN NET/Socket : socket progress error")
    job.tick(1)
    for r in (0, 4):
        job.rank_line(r, "torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:317, remote process exited or there was a network error, NCCL version 2.21.5")
    job.tick(600)
    job.watchdog_timeouts([1, 2, 3])
    job.child_failed(0, others=[4])
    return job, [job.host_of(bad)]


@case("wandb_connection_refused", "ConnectionError", True, "the tracker is unreachable on rank 0; others lose the store and time out")
def _():
    job = Job(111, hosts("node-d", 2, 4))
    job.startup(); job.train(12)
    job.tick(1)
    job.rank_line(0, "wandb: Currently logged in as: forgeflow-bot (acme-llm). Use `wandb login --relogin` to force relogin")
    job.python_traceback(0, [
        ("/workspace/forgeflow/training/worker.py", 412, "<module>", "main()"),
        ("/workspace/forgeflow/training/tracking.py", 58, "log_metrics", "self.run.log(metrics, step=step)"),
        (f"{PY}/requests/adapters.py", 700, "send", "raise ConnectionError(e, request=request)"),
    ], [
        "requests.exceptions.ConnectionError: HTTPSConnectionPool(host='wandb.internal.acme', port=443): Max retries exceeded with url: /files/acme-llm/run-7/file_stream (Caused by NewConnectionError('<urllib3.connection.HTTPSConnection object at 0x7f1c2a3b4d90>: Failed to establish a new connection: [Errno 111] Connection refused'))",
    ])
    job.tick(2)
    job.store_lost([1, 2, 3, 8, 9])
    job.tick(600)
    job.watchdog_timeouts([4, 5, 6, 7])
    job.child_failed(0)
    return job, []


@case("redis_metrics_down", "ConnectionError", True, "a metrics service (redis) refuses connections mid-run")
def _():
    job = Job(112, hosts("node-e", 2, 1), collector_stamps=True)
    job.startup(); job.train(27)
    bad = 8
    job.python_traceback(bad, [
        ("/workspace/forgeflow/training/worker.py", 412, "<module>", "main()"),
        ("/workspace/acme_metrics/client.py", 91, "push", "self._redis.xadd(self.stream, fields)"),
        (f"{PY}/redis/connection.py", 357, "connect", "raise ConnectionError(self._error_message(e))"),
    ], ["redis.exceptions.ConnectionError: Error 111 connecting to metrics-redis.acme.svc:6379. Connection refused."])
    job.tick(600)
    job.watchdog_timeouts(others(job, bad)[:6])
    job.child_failed(bad)
    return job, []


@case("rendezvous_store_timeout", "ConnectionError", True, "a node never joins: the c10d store times out waiting for clients")
def _():
    job = Job(113, hosts("node-f", 2, 1))
    job.launcher_banner()
    job.tick(901)
    job.emit(f"E{job.now:%m%d %H:%M:%S}.120331 1900 torch/distributed/elastic/rendezvous/dynamic_rendezvous.py:1131] The node 'node-f01_1900_0' has failed to start the next rendezvous round.")
    job.python_traceback(0, [
        (f"{PY}/torch/distributed/rendezvous.py", 189, "_create_c10d_store", "return TCPStore("),
    ], ["torch.distributed.DistStoreError: Timed out after 901 seconds waiting for clients. 8/16 clients joined."])
    job.child_failed(0)
    return job, []


@case("s3_slowdown_on_checkpoint", "S3StorageError", True, "the checkpoint upload is throttled; rank 0 dies, the rest time out")
def _():
    job = Job(114, hosts("node-g", 2, 1))
    job.startup(); job.train(50)
    job.tick(3)
    job.python_traceback(0, [
        ("/workspace/forgeflow/checkpoint/writer.py", 133, "_persist", "fs.put_file(local, remote)"),
        (f"{PY}/s3fs/core.py", 1260, "_put_file", "await self._call_s3("),
        (f"{PY}/aiobotocore/client.py", 412, "_make_api_call", "raise error_class(parsed_response, operation_name)"),
    ], ["botocore.exceptions.ClientError: An error occurred (SlowDown) when calling the UploadPart operation (reached max retries: 4): Please reduce your request rate."])
    job.rank_line(0, "OSError: [Errno 5] Please reduce your request rate.")
    job.tick(600)
    job.watchdog_timeouts(range(1, 9))
    job.child_failed(0)
    return job, []


@case("s3_no_credentials", "S3StorageError", True, "s3fs re-raises missing credentials as a PermissionError at resume")
def _():
    job = Job(115, hosts("node-h", 1, 1))
    job.startup()
    for r in range(job.world):
        job.python_traceback(r, [
            ("/workspace/forgeflow/training/worker.py", 221, "resume", "manifest = storage.read_manifest(spec.checkpoint.url)"),
            (f"{PY}/botocore/auth.py", 418, "add_auth", "raise NoCredentialsError()"),
        ], ["botocore.exceptions.NoCredentialsError: Unable to locate credentials",
            "",
            "The above exception was the direct cause of the following exception:",
            "",
            "PermissionError: Unable to locate credentials"])
    job.child_failed(0, others=[1, 2])
    return job, []


@case("nccl_timeout_only", "NCCLTimeoutError", True, "a collective times out everywhere and no rank prints anything else")
def _():
    job = Job(116, hosts("node-i", 2, 1))
    job.startup(); job.train(31)
    job.tick(600)
    job.watchdog_timeouts(range(job.world), op="_ALLGATHER_BASE")
    job.aborts(range(6))
    job.child_failed(0, exitcode=-6, signal_name="SIGABRT", others=[1, 2])
    return job, []


@case("nccl_remote_only", "NCCLRemoteError", True, "only remote-peer errors: the peer's own log is elsewhere")
def _():
    job = Job(117, hosts("node-j", 2, 1))
    job.startup(); job.train(22)
    job.tick(2)
    for r in range(0, 8):
        job.rank_line(r, f"[{job.glog('E')} {job.pids[r]} ProcessGroupNCCL.cpp:1515] [PG 0 (default_pg) Rank {r}] Process group watchdog thread terminated with exception: NCCL error: remote process exited or there was a network error, NCCL version 2.21.5")
        job.rank_line(r, "ncclRemoteError: A call failed possibly due to a network error or a remote process exiting prematurely.")
    job.aborts(range(0, 4))
    job.child_failed(0, exitcode=-6, signal_name="SIGABRT", others=[1])
    return job, []


@case("oom_under_timeouts", "OutOfMemoryError", False, "OOM on one node's section appears after the other node's later timeouts (merged per node)")
def _():
    job = Job(118, hosts("node-k", 2, 1), collector_stamps=True)
    job.startup(); job.train(44)
    bad = 11
    t_fail = job.now
    # node-k01's output first, 10 minutes later than the OOM on node-k02
    job.tick(600)
    job.watchdog_timeouts(range(0, 8))
    job.aborts(range(0, 8))
    job.child_failed(2, exitcode=-6, signal_name="SIGABRT", others=[0, 1])
    job.now = t_fail  # node-k02's section: the OOM happened first
    job.tick(0.8)
    job.python_traceback(bad, train_frames(), [
        f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.91 GiB. GPU {job.local(bad)} has a total capacity of 79.11 GiB of which 2.88 GiB is free. Including non-PyTorch memory, this process has 76.22 GiB memory in use. Of the allocated memory 71.02 GiB is allocated by PyTorch, and 3.80 GiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.",
    ])
    job.child_failed(bad)
    return job, []


@case("oom_plain", "OutOfMemoryError", False, "rank 3 runs out of GPU memory at a long batch")
def _():
    job = Job(119, hosts("gpu-a100-", 1, 9))
    job.startup(); job.train(60)
    job.tick(1)
    job.python_traceback(3, train_frames() + [(f"{MEG}/core/transformer/attention.py", 612, "forward", "core_attn_out = self.core_attention(")], [
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.95 GiB. GPU 3 has a total capacity of 79.11 GiB of which 1.02 GiB is free. Process 2319 has 78.08 GiB memory in use.",
    ])
    job.tick(600)
    job.watchdog_timeouts([0, 1, 2, 4, 5, 6, 7])
    job.child_failed(3)
    return job, []


@case("oom_cublas_alloc", "OutOfMemoryError", False, "cuBLAS cannot allocate its workspace (reported as a CUDA error)")
def _():
    job = Job(120, hosts("node-l", 1, 1), prefix_style="default")
    job.startup(); job.train(3)
    job.python_traceback(5, train_frames(), ["RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"])
    job.tick(600)
    job.watchdog_timeouts([0, 1, 2])
    job.child_failed(5)
    return job, []


# =========================================================================== framework


@case("dataloader_oom_killed", "DataloaderKilled", False, "the host OOM killer takes a DataLoader worker; the message says Killed and out of memory")
def _():
    job = Job(121, hosts("node-m", 2, 1))
    job.startup(); job.train(41)
    bad = 4
    job.tick(1)
    job.emit(f"{job.syslog()} {job.host_of(bad)} kernel: Out of memory: Killed process 48213 (pt_data_worker) total-vm:48212340kB, anon-rss:31820112kB, file-rss:0kB, shmem-rss:0kB, UID:0 pgtables:64212kB oom_score_adj:0")
    job.python_traceback(bad, train_frames() + [(f"{PY}/torch/utils/data/_utils/signal_handling.py", 73, "handler", "_error_if_any_worker_fails()")], [
        "RuntimeError: DataLoader worker (pid 48213) is killed by signal: Killed. ",
    ])
    job.tick(600)
    job.watchdog_timeouts(others(job, bad)[:5])
    job.child_failed(bad)
    return job, []


@case("dataloader_bus_error", "DataloaderKilled", False, "shared memory exhausted: bus error in a worker")
def _():
    job = Job(122, hosts("node-n", 1, 1))
    job.startup(); job.train(7)
    job.rank_line(2, "ERROR: Unexpected bus error encountered in worker. This might be caused by insufficient shared memory (shm).")
    job.python_traceback(2, train_frames(), ["RuntimeError: DataLoader worker (pid 9911) is killed by signal: Bus error. It is possible that dataloader's workers are out of shared memory. Please try to raise your shared memory limit."])
    job.tick(600)
    job.watchdog_timeouts([0, 1, 3])
    job.child_failed(2)
    return job, []


@case("attribute_error_config", "AttributeError", False, "a megatron version mismatch: every rank raises the same AttributeError")
def _():
    job = Job(123, hosts("node-o", 2, 1))
    job.launcher_banner(); job.nccl_init()
    for r in range(job.world):
        job.python_traceback(r, [
            (f"{MEG}/training/training.py", 291, "pretrain", "model, optimizer, opt_param_scheduler = setup_model_and_optimizer("),
            (f"{MEG}/core/transformer/moe/router.py", 88, "__init__", "self.topk = self.config.moe_router_topk"),
        ], ["AttributeError: 'TransformerConfig' object has no attribute 'moe_router_topk'"])
    job.child_failed(0, others=[1, 2, 3])
    return job, []


@case("runtime_shape_mismatch", "RuntimeError", False, "a plain RuntimeError in the model; c10d store resets follow on other ranks")
def _():
    job = Job(124, hosts("node-p", 2, 1))
    job.startup()
    job.python_traceback(0, train_frames() + [(f"{MEG}/core/models/common/embeddings/rotary_pos_embedding.py", 203, "apply_rotary_pos_emb", "t = (t * cos_) + (_rotate_half(t) * sin_)")], [
        "RuntimeError: The size of tensor a (4096) must match the size of tensor b (2048) at non-singleton dimension 0",
    ])
    job.tick(3)
    job.store_lost(range(8, 16))
    job.child_failed(0)
    return job, []


@case("runtime_device_mismatch", "RuntimeError", False, "RuntimeError before NCCL remote errors (symptoms of the crash)")
def _():
    job = Job(125, hosts("node-q", 2, 1), collector_stamps=True)
    job.startup(); job.train(1)
    job.python_traceback(6, train_frames(), ["RuntimeError: Expected all tensors to be on the same device, but found at least two devices, cuda:6 and cpu! (when checking argument for argument index in method wrapper_CUDA__index_select)"])
    job.tick(1)
    for r in (7, 14):
        job.rank_line(r, "torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:317, remote process exited or there was a network error, NCCL version 2.21.5")
    job.child_failed(6, others=[7, 14])
    return job, []


@case("assertion_batch_config", "AssertionError", False, "a config assertion at start-up on every rank")
def _():
    job = Job(126, hosts("node-r", 1, 1))
    job.launcher_banner()
    job.megatron_init()
    for r in range(job.world):
        job.python_traceback(r, [(f"{MEG}/training/arguments.py", 431, "validate_args", "assert args.global_batch_size % (args.micro_batch_size * args.data_parallel_size) == 0")],
                             ["AssertionError: global batch size (1000) is not divisible by micro batch size (3) times data parallel size (4)"])
    job.child_failed(0, others=[1, 2, 3])
    return job, []


@case("value_error_heads", "ValueError", False, "a shape config error raised as ValueError")
def _():
    job = Job(127, hosts("node-s", 1, 1), prefix_style="default")
    job.launcher_banner(); job.nccl_init()
    for r in range(job.world):
        job.python_traceback(r, [("/workspace/forgeflow/training/model.py", 88, "build_model", "config = TransformerConfig(**kwargs)"),
                                 (f"{MEG}/core/transformer/transformer_config.py", 512, "__post_init__", "raise ValueError(")],
                             ["ValueError: num_attention_heads (30) must be a multiple of tensor_model_parallel_size (4)."])
    job.child_failed(0, others=[1])
    return job, []


@case("zero_division_warmup", "ZeroDivisionError", False, "lr warmup of 0 iterations divides by zero at step 1")
def _():
    job = Job(128, hosts("node-t", 1, 1))
    job.startup()
    for r in range(job.world):
        job.python_traceback(r, [("/workspace/forgeflow/training/schedule.py", 41, "lr_at", "return self.max_lr * step / self.warmup_steps")], ["ZeroDivisionError: division by zero"])
    job.child_failed(0, others=[1, 2])
    return job, []


@case("model_load_size_mismatch", "ModelLoadingError", False, "a RuntimeError whose text is a state_dict size mismatch")
def _():
    job = Job(129, hosts("node-u", 2, 1))
    job.startup()
    for r in (0, 1, 8, 9):
        job.python_traceback(r, [("/workspace/forgeflow/training/worker.py", 233, "resume", "model.load_state_dict(state['model'])"),
                                 (f"{PY}/torch/nn/modules/module.py", 2584, "load_state_dict", "raise RuntimeError(")], [
            "RuntimeError: Error(s) in loading state_dict for GPTModel:",
            "\tsize mismatch for decoder.layers.0.mlp.linear_fc1.weight: copying a param with shape torch.Size([22016, 4096]) from checkpoint, the shape in current model is torch.Size([11008, 4096]).",
        ])
    job.child_failed(0, others=[1, 8])
    return job, []


@case("model_load_corrupt", "ModelLoadingError", False, "a truncated checkpoint shard fails to unpickle")
def _():
    job = Job(130, hosts("node-v", 1, 1), collector_stamps=True)
    job.startup()
    job.python_traceback(0, [("/workspace/forgeflow/training/worker.py", 233, "resume", "state = torch.load(shard_path, map_location='cpu')"),
                             (f"{PY}/torch/serialization.py", 1470, "load", "return _legacy_load(")], ["_pickle.UnpicklingError: invalid load key, '\\x00'."])
    job.store_lost(range(1, 8))
    job.child_failed(0)
    return job, []


@case("dataset_packed_shard", "DatasetLoadingError", False, "the data shard is truncated; raised as a ValueError subclass")
def _():
    job = Job(131, hosts("node-w", 1, 1))
    job.startup()
    for r in range(job.world):
        job.python_traceback(r, [("/workspace/forgeflow/training/data.py", 201, "open_split", "tokens = PackedTokens(path, seq_length)")],
                             ["training.corpus.DataError: failed to load data shard /data/packed/train_00017.bin: size 1048575 bytes is not a multiple of 2 (uint16 tokens); re-run `forgeflow prepare`"])
    job.child_failed(0, others=[1, 2, 3])
    return job, []


@case("dataset_hf_generation", "DatasetLoadingError", False, "HF datasets fails to build the dataset from a bad JSON file (ArrowInvalid first)")
def _():
    job = Job(132, hosts("node-x", 1, 1))
    job.launcher_banner()
    job.rank_line(0, "Generating train split: 1203221 examples [00:41, 29011.47 examples/s]")
    job.python_traceback(0, [(f"{PY}/datasets/packaged_modules/json/json.py", 160, "_generate_tables", "pa_table = paj.read_json(")],
                         ["pyarrow.lib.ArrowInvalid: JSON parse error: Missing a closing quotation mark in string. in row 88213",
                          "", "The above exception was the direct cause of the following exception:", ""])
    job.python_traceback(0, [(f"{PY}/datasets/builder.py", 1995, "_prepare_split_single", "raise DatasetGenerationError(\"An error occurred while generating the dataset\") from e")],
                         ["datasets.exceptions.DatasetGenerationError: An error occurred while generating the dataset"])
    job.store_lost(range(1, 8))
    job.child_failed(0)
    return job, []


# =========================================================================== script


def script_case(name, root, seed, final, frames=None, host_prefix="node-", note=""):
    @case(name, root, False, note)
    def _():
        job = Job(seed, hosts(host_prefix, 2, seed % 7 + 1), prefix_style=("rank", "default", "srun")[seed % 3])
        job.startup()
        if seed % 2:
            job.train(5 + seed % 11)
        bad = seed % job.world
        job.python_traceback(bad, frames or train_frames(), final)
        job.tick(2)
        if seed % 3 == 0:
            job.store_lost([r for r in range(job.world) if r != bad][:6])
        else:
            job.tick(600)
            job.watchdog_timeouts([r for r in range(job.world) if r != bad][:5])
        job.child_failed(bad, others=[(bad + 1) % job.world])
        return job, []


script_case("file_not_found_index", "FileNotFoundError", 140,
            ["FileNotFoundError: [Errno 2] No such file or directory: '/mnt/data/tokenized/pile_text_document.idx'"],
            [("/workspace/forgeflow/training/data.py", 188, "open_split", "index = np.memmap(index_path, dtype=np.int64, mode='r')")],
            note="a missing index file (not a dataset-loading message)")
script_case("os_error_disk_full", "OSError", 141,
            ["OSError: [Errno 28] No space left on device: '/local_ckpt/step_0004500/model_rank_3.pt'"],
            [("/workspace/forgeflow/checkpoint/writer.py", 97, "_snapshot_to_disk", "torch.save(state, tmp)")],
            note="the local spool disk fills during a checkpoint")
script_case("type_error_kwarg", "TypeError", 142,
            ["TypeError: GPTModel.forward() got an unexpected keyword argument 'packed_seq_params'"],
            note="API mismatch in forward()")
script_case("name_error_typo", "NameError", 143,
            ["NameError: name 'rotary_pos_emb' is not defined. Did you mean: 'rotary_pos_embs'?"],
            note="a typo that only runs after the first eval")
script_case("permission_ckpt_dir", "PermissionError", 144,
            ["PermissionError: [Errno 13] Permission denied: '/checkpoints/llama-7b/iter_0002000'"],
            [("/workspace/forgeflow/infra/storage.py", 71, "makedirs", "os.makedirs(path, exist_ok=True)")],
            note="the checkpoint directory belongs to another user")
script_case("import_flash_attn", "ImportError", 145,
            ["ImportError: /opt/venv/lib/python3.11/site-packages/flash_attn_2_cuda.cpython-311-x86_64-linux-gnu.so: undefined symbol: _ZN3c104cuda9SetDeviceEi"],
            [("/workspace/forgeflow/training/model.py", 12, "<module>", "from flash_attn import flash_attn_func")],
            note="a binary extension built for another torch")
script_case("key_error_batch", "KeyError", 146,
            ["KeyError: 'attention_mask'"],
            [("/workspace/forgeflow/training/loop.py", 120, "train_step", "mask = batch['attention_mask']")],
            note="a batch dict without the expected key")
script_case("index_error_blend", "IndexError", 147,
            ["IndexError: list index out of range"],
            [("/workspace/forgeflow/training/data.py", 260, "blend", "weight = weights[i]")],
            note="blend weights shorter than the dataset list")
script_case("called_process_git", "CalledProcessError", 148,
            ["subprocess.CalledProcessError: Command '['git', '-C', '/workspace/forgeflow', 'rev-parse', 'HEAD']' returned non-zero exit status 128."],
            [("/workspace/forgeflow/training/worker.py", 61, "record_provenance", "sha = subprocess.check_output(['git', '-C', root, 'rev-parse', 'HEAD'])")],
            note="git is not available in the container's workspace")


@case("syntax_error_edit", "SyntaxError", False, "a syntax error in the entry point: every rank fails before NCCL init")
def _():
    job = Job(150, hosts("node-y", 1, 1))
    job.launcher_banner()
    for r in range(job.world):
        job.rank_line(r, "Traceback (most recent call last):")
        job.rank_line(r, '  File "/workspace/forgeflow/training/worker.py", line 212')
        job.rank_line(r, "    if spec.train.fp8 = True:")
        job.rank_line(r, "       ^^^^^^^^^^^^^^^^^^")
        job.rank_line(r, "SyntaxError: invalid syntax. Maybe you meant '==' or ':=' instead of '='?")
    job.child_failed(0, others=[1, 2, 3, 4])
    return job, []


@case("argparse_unrecognized", "ArgumentError", False, "argparse rejects a flag; the launcher prints usage then exit code 2")
def _():
    job = Job(151, hosts("node-z", 1, 1), prefix_style="default")
    job.launcher_banner()
    for r in range(job.world):
        job.rank_line(r, "usage: pretrain_gpt.py [-h] [--num-layers NUM_LAYERS] [--hidden-size HIDDEN_SIZE]")
        job.rank_line(r, "                       [--ffn-hidden-size FFN_HIDDEN_SIZE] [--num-attention-heads NUM_ATTENTION_HEADS]")
        job.rank_line(r, "pretrain_gpt.py: error: unrecognized arguments: --use-flash-attn-v3 --fp8-recipe delayed")
    job.child_failed(0, exitcode=2, others=[1, 2])
    return job, []


@case("called_process_make", "CalledProcessError", False, "the dataset helper build fails: make's own Error lines come first")
def _():
    job = Job(152, hosts("node-aa", 1, 1))
    job.launcher_banner()
    job.emit("> compiling dataset index builder ...")
    job.emit("make: Entering directory '/opt/megatron/megatron/core/datasets'")
    job.emit("g++ -O3 -Wall -shared -std=c++11 -fPIC -fdiagnostics-color -I/usr/include/python3.11 helpers.cpp -o helpers.cpython-311-x86_64-linux-gnu.so")
    job.emit("helpers.cpp:12:10: fatal error: pybind11/pybind11.h: No such file or directory")
    job.emit("compilation terminated.")
    job.emit("make: *** [Makefile:9: helpers.cpython-311-x86_64-linux-gnu.so] Error 1")
    job.emit("make: Leaving directory '/opt/megatron/megatron/core/datasets'")
    job.python_traceback(0, [(f"{MEG}/core/datasets/utils.py", 24, "compile_helpers", "subprocess.run(command, check=True)")],
                         ["subprocess.CalledProcessError: Command '['make', '-C', '/opt/megatron/megatron/core/datasets']' returned non-zero exit status 2."])
    job.child_failed(0)
    return job, []


# =========================================================================== training signals


@case("loss_spike", "LossSpike", True, "loss jumps and stays up; training writes its spike event, then the flow stops the job")
def _():
    job = Job(160, hosts("node-ab", 2, 1))
    job.startup(); job.train(40)
    onset = job.step + 1
    job.train(8, spike_at=onset)
    job.emit(f"{job.iso()} rank=0 event=loss_spike onset_step={onset} last_healthy_step={onset - 1} loss={job.loss:.4f} median={2.41:.4f} zscore=11.8")
    job.tick(5)
    for node in range(len(job.hosts)):
        job.closing_signals(node, -1)
    job.emit(f"W{job.now:%m%d %H:%M:%S}.004411 1900 torch/distributed/elastic/agent/server/api.py:704] Received Signals.SIGTERM death signal, shutting down workers")
    return job, []


@case("loss_spike_legacy_marker", "LossSpike", True, "legacy spike marker among NaN-free but exploding losses; SIGTERM aftermath")
def _():
    job = Job(161, hosts("gpu-", 1, 31))
    job.startup(); job.train(30)
    onset = job.step + 1
    job.train(6, spike_at=onset)
    job.emit(f"FORGEFLOW_LOSS_SPIKE onset_step={onset} last_healthy_step={onset - 1}")
    job.closing_signals(0, -1)
    return job, []


@case("hang_heartbeat", "Hang", True, "training stops printing; the watcher writes the hang marker and kills the job")
def _():
    job = Job(162, hosts("node-ac", 2, 1))
    job.startup(); job.train(37)
    job.tick(1800)
    job.emit(f"FORGEFLOW_HANG last_step={job.step} stale_s=1800 ranks=0-{job.world - 1}")
    for node in range(len(job.hosts)):
        job.closing_signals(node, -1)
    return job, []


@case("hang_event", "Hang", True, "a hang event line from the flow, with py-spy stacks showing ranks stuck in a collective")
def _():
    job = Job(163, hosts("node-ad", 1, 1))
    job.startup(); job.train(12)
    job.tick(1200)
    job.emit(f"{job.iso()} rank=0 event=hang last_step={job.step} stale_s=1200")
    job.emit("Thread 2281 (idle): \"MainThread\"")
    job.emit("    synchronize (torch/cuda/__init__.py:892)")
    job.emit("    all_reduce (torch/distributed/distributed_c10d.py:2288)")
    return job, []


# =========================================================================== novel to the seed rules


@case("nvswitch_fatal", "NVLinkError", True, "the fabric manager reports an NVSwitch fatal error; the rank then sees a generic CUDA launch failure", novel=True)
def _():
    job = Job(170, hosts("gpu-h100-", 2, 21))
    job.startup(); job.train(26)
    bad = 12
    job.emit(f"{job.syslog()} {job.host_of(bad)} nv-fabricmanager[2211]: [ERROR] [tid 2290] detected NVSwitch fatal error 12028 on fid 0 on NVSwitch pci bus id 00000000:86:00.0 physical id 3 port 17")
    job.emit(f"{job.syslog()} {job.host_of(bad)} nv-fabricmanager[2211]: [ERROR] [tid 2290] NVSwitch fatal error: GPU partition 0 is degraded, reset required")
    job.tick(1.5)
    job.python_traceback(bad, train_frames(), ["RuntimeError: CUDA error: unspecified launch failure"])
    job.tick(600)
    job.watchdog_timeouts(others(job, bad)[:6])
    job.child_failed(bad)
    return job, [job.host_of(bad)]


@case("row_remap_failure", "ECCError", True, "the driver cannot remap a failing memory row; the rank dies with 'unknown error'", novel=True)
def _():
    job = Job(171, hosts("node-ae", 2, 1), collector_stamps=True)
    job.startup(); job.train(30)
    bad = 5
    job.emit(f"{job.syslog()} {job.host_of(bad)} kernel: NVRM: GPU at PCI:0000:{job.bus[job.local(bad)][:2]}:00: Row Remapper: remapping failure, bank 12 row 0x3f1a has no spare rows left")
    job.emit(f"{job.syslog()} {job.host_of(bad)} nv-hostengine: DCGM health watch: GPU {job.local(bad)} memory: row remapping failure, GPU must be drained")
    job.tick(3)
    job.python_traceback(bad, train_frames(), ["RuntimeError: CUDA error: unknown error"])
    job.tick(600)
    job.watchdog_timeouts(others(job, bad)[:6])
    job.child_failed(bad)
    return job, [job.host_of(bad)]


@case("ipoib_tx_timeout", "NetworkError", True, "the IB interface stalls (transmit timeouts in the kernel log); every rank then times out", novel=True)
def _():
    job = Job(172, hosts("cn", 2, 300))
    job.startup(); job.train(33)
    bad_host = job.hosts[1]
    for q in (3, 5):
        job.emit(f"{job.syslog()} {bad_host} kernel: mlx5_core 0000:5e:00.0 ib0: TX timeout on queue: {q}, SQ: 0x11{q}8, CQ: 0x7{q}1, SQ Cons: 0x1a2 SQ Prod: 0x1c9, usecs since last trans: 10240000")
    job.emit(f"{job.syslog()} {bad_host} kernel: ib0: transmit timeout: latency 10240 msecs")
    job.tick(600)
    job.watchdog_timeouts(range(job.world))
    job.child_failed(0, exitcode=-6, signal_name="SIGABRT", others=[1, 2])
    return job, [bad_host]


@case("s3_payload_incomplete", "S3StorageError", True, "aiohttp aborts a checkpoint read from S3 mid-body during resume", novel=True)
def _():
    job = Job(173, hosts("node-af", 2, 1))
    job.startup()
    job.python_traceback(0, [
        ("/workspace/forgeflow/training/worker.py", 233, "resume", "shard = storage.read_bytes(url)"),
        (f"{PY}/s3fs/core.py", 1187, "_cat_file", "return await _error_wrapper(_call_and_read, retries=self.retries)"),
        (f"{PY}/aiohttp/streams.py", 380, "read", "raise self._exception"),
    ], ["aiohttp.client_exceptions.ClientPayloadError: Response payload is not completed: <ContentLengthError: 400, message='Not enough data for satisfy content length header.'>"])
    job.tick(600)
    job.watchdog_timeouts(range(1, 9))
    job.child_failed(0)
    return job, []


@case("mlflow_unavailable", "ConnectionError", True, "the experiment tracker answers 503 through its proxy; the log call raises", novel=True)
def _():
    job = Job(174, hosts("node-ag", 1, 1), prefix_style="default")
    job.startup(); job.train(15)
    job.python_traceback(0, [
        ("/workspace/forgeflow/training/tracking.py", 71, "log_metrics", "mlflow.log_metrics(metrics, step=step)"),
        (f"{PY}/mlflow/utils/rest_utils.py", 305, "verify_rest_response", "raise MlflowException("),
    ], ["mlflow.exceptions.MlflowException: API request to endpoint /api/2.0/mlflow/runs/log-batch failed with error code 503 != 200. Response body: 'upstream connect error or disconnect/reset before headers. reset reason: connection failure'"])
    job.tick(600)
    job.watchdog_timeouts(range(1, 8))
    job.child_failed(0)
    return job, []


@case("cudnn_mapping_error", "CUDAError", True, "a cuDNN status the CUDA rule does not list; it reads like a plain RuntimeError", novel=True)
def _():
    job = Job(175, hosts("node-ah", 2, 1), collector_stamps=True)
    job.startup(); job.train(21)
    bad = 14
    job.python_traceback(bad, train_frames(), ["RuntimeError: cuDNN error: CUDNN_STATUS_MAPPING_ERROR"])
    job.tick(600)
    job.watchdog_timeouts(others(job, bad)[:5])
    job.child_failed(bad)
    return job, [job.host_of(bad)]


@case("index_bin_mismatch", "DatasetLoadingError", False, "the dataset index and bin file disagree; megatron asserts", novel=True)
def _():
    job = Job(176, hosts("node-ai", 1, 1))
    job.startup()
    for r in range(job.world):
        job.python_traceback(r, [(f"{MEG}/core/datasets/indexed_dataset.py", 412, "__init__", "assert self.sequence_lengths.shape[0] == self.document_indices[-1]")],
                             ["AssertionError: index file /data/pile_text_document.idx holds 88213444 sequences but /data/pile_text_document.bin ends after 88213001"])
    job.child_failed(0, others=[1, 2])
    return job, []


@case("checkpoint_format_version", "ModelLoadingError", False, "the checkpoint was written by a newer format; raised as a ValueError", novel=True)
def _():
    job = Job(177, hosts("node-aj", 2, 1))
    job.startup()
    for r in (0, 8):
        job.python_traceback(r, [("/workspace/forgeflow/training/worker.py", 226, "resume", "manifest = read_manifest(spec.checkpoint.url)")],
                             ["ValueError: s3://ff-ckpt/llama-7b/step_0012000/manifest.json has format_version 3; this forgeflow reads format_version 2 (upgrade forgeflow or resume from an older checkpoint)"])
    job.store_lost(range(1, 8))
    job.child_failed(0)
    return job, []


def kind_of(root_cause: str) -> str:
    from diagnosis.vocabulary import kind_of as vocab_kind

    return vocab_kind(root_cause)


def main() -> None:
    sys.path.insert(0, str(HERE.parents[2]))
    labels = {}
    for name, (build, root_cause, restart, note) in CASES.items():
        job, suspect_nodes = build()
        kind = kind_of(root_cause)
        (HERE / f"{name}.log").write_text(job.text(), encoding="utf-8")
        labels[f"{name}.log"] = {
            "root_cause": root_cause,
            "kind": kind,
            "restart_helps": restart,
            "suspect_nodes": suspect_nodes if kind == "infrastructure" else [],
            "note": note,
            "novel_to_seed_rules": name in NOVEL,
        }
    (HERE / "labels.json").write_text(json.dumps(labels, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {len(labels)} logs to {HERE}")


if __name__ == "__main__":
    main()
