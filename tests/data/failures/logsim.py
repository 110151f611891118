"""Building blocks for realistic multi-rank pretraining logs (corpus and benchmarks).

A ``Job`` knows its nodes, ranks and clock and writes what torchrun, NCCL, megatron,
torch and forgeflow's training loop print: launcher banners, NCCL init chatter, per-step
metric lines from every rank, recurring warnings, checkpoint events, and the aftermath
of a failure (watchdog timeouts on the other ranks, SIGABRTs, torchrun's
ChildFailedError summary). Failure cases in ``generate.py`` put their root-cause lines
in between, often *not* last.
"""

from __future__ import annotations

import datetime as dt
import random
from dataclasses import dataclass, field

BASE_TIME = dt.datetime(2026, 11, 22, 6, 0, 0)


@dataclass
class Job:
    seed: int
    hosts: list[str]
    gpus_per_node: int = 8
    prefix_style: str = "rank"  # "rank" -> "[rank3]:", "default" -> "[default3]:", "srun" -> "3: "
    collector_stamps: bool = False  # prefix every line with an ISO timestamp (kubectl --timestamps)
    start: dt.datetime = BASE_TIME
    lines: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.now = self.start + dt.timedelta(minutes=self.rng.randint(0, 600))
        self.pids = {r: 2200 + 37 * r + self.rng.randint(0, 30) for r in range(self.world)}
        self.bus = {g: f"{0x1b + 0x1c * g:02x}000" for g in range(self.gpus_per_node)}
        self.step = 0
        self.loss = 10.4

    # ------------------------------------------------------------------ basics
    @property
    def world(self) -> int:
        return len(self.hosts) * self.gpus_per_node

    def host_of(self, rank: int) -> str:
        return self.hosts[rank // self.gpus_per_node]

    def local(self, rank: int) -> int:
        return rank % self.gpus_per_node

    def tick(self, seconds: float) -> None:
        self.now += dt.timedelta(seconds=seconds)

    def iso(self) -> str:
        return self.now.strftime("%Y-%m-%dT%H:%M:%S.") + f"{self.now.microsecond // 1000:03d}Z"

    def bracket_ts(self) -> str:
        return self.now.strftime("%Y-%m-%d %H:%M:%S,") + f"{self.now.microsecond // 1000:03d}"

    def glog(self, level: str = "E") -> str:
        return self.now.strftime(f"{level}%m%d %H:%M:%S.") + f"{self.now.microsecond:06d}"

    def syslog(self) -> str:
        return self.now.strftime("%b %d %H:%M:%S")

    def pre(self, rank: int) -> str:
        if self.prefix_style == "srun":
            return f"{rank}: "
        return f"[{self.prefix_style}{rank}]:"

    def emit(self, line: str) -> None:
        if self.collector_stamps:
            line = self.now.strftime("%Y-%m-%dT%H:%M:%S.") + f"{self.now.microsecond:06d}Z " + line
        self.lines.append(line)

    def rank_line(self, rank: int, text: str) -> None:
        self.emit(self.pre(rank) + text)

    def nccl(self, rank: int, text: str, tid_offset: int = 0) -> None:
        pid = self.pids[rank]
        self.emit(f"{self.host_of(rank)}:{pid}:{pid + 120 + tid_offset} [{self.local(rank)}] NCCL {text}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"

    # ------------------------------------------------------------------ start-up noise
    def launcher_banner(self) -> None:
        for node, host in enumerate(self.hosts):
            self.emit(f"W{self.now:%m%d %H:%M:%S}.{self.rng.randint(0, 999999):06d} {1900 + node} torch/distributed/run.py:793] ")
            self.emit(f"W{self.now:%m%d %H:%M:%S}.{self.rng.randint(0, 999999):06d} {1900 + node} torch/distributed/run.py:793] *****************************************")
            self.emit(f"W{self.now:%m%d %H:%M:%S}.{self.rng.randint(0, 999999):06d} {1900 + node} torch/distributed/run.py:793] Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, to avoid your system being overloaded, please further tune the variable for optimal performance in your application as needed. ")
            self.emit(f"W{self.now:%m%d %H:%M:%S}.{self.rng.randint(0, 999999):06d} {1900 + node} torch/distributed/run.py:793] *****************************************")
        self.emit("INFO:torch.distributed.launcher.api:Starting elastic_operator with launch configs:")
        self.emit("  entrypoint       : pretrain_gpt.py")
        self.emit(f"  min_nodes        : {len(self.hosts)}")
        self.emit(f"  max_nodes        : {len(self.hosts)}")
        self.emit(f"  nproc_per_node   : {self.gpus_per_node}")
        self.emit(f"  run_id           : ff-{self.rng.randint(10000, 99999)}")
        self.emit("  rdzv_backend     : c10d")
        self.emit(f"  rdzv_endpoint    : {self.hosts[0]}:29500")
        self.emit("  rdzv_configs     : {'timeout': 900}")
        self.emit("  max_restarts     : 0")
        self.emit("  monitor_interval : 5")
        self.emit("INFO:torch.distributed.elastic.agent.server.api:[default] Starting worker group")
        self.emit("INFO:torch.distributed.elastic.agent.server.api:[default] Rendezvous complete for workers. Result:")
        self.emit("  restart_count=0")
        self.emit(f"  master_addr={self.hosts[0]}")
        self.emit("  master_port=29500")
        self.emit("  group_rank=0")
        self.emit(f"  group_world_size={len(self.hosts)}")
        self.emit(f"  local_ranks={list(range(self.gpus_per_node))}")
        self.emit(f"  global_world_sizes={[self.world] * self.gpus_per_node}")

    def nccl_init(self) -> None:
        self.nccl(0, "INFO Bootstrap : Using eth0:10.0.0.11<0>")
        self.nccl(0, "INFO NCCL version 2.21.5+cuda12.4")
        for rank in range(self.world):
            self.nccl(rank, "INFO cudaDriverVersion 12040")
            self.nccl(rank, "INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB [2]mlx5_2:1/IB [3]mlx5_3:1/IB ; OOB eth0:10.0.0.%d<0>" % (11 + rank // self.gpus_per_node))
            self.nccl(rank, "INFO Using network IB")
            self.nccl(rank, "INFO NCCL_IB_TIMEOUT set by environment to 22.")
            self.nccl(rank, f"INFO Setting affinity for GPU {self.local(rank)} to ffff,ffffffff")
        for rank in range(self.world):
            for ch in range(0, 4):
                nxt = (rank + 1) % self.world
                self.nccl(rank, f"INFO Channel {ch:02d}/0 : {rank}[{self.local(rank)}] -> {nxt}[{self.local(nxt)}] via P2P/CUMEM/read")
            self.nccl(rank, "INFO Connected all rings")
            self.nccl(rank, "INFO Connected all trees")
            self.nccl(rank, f"INFO comm 0x{0x55d1c2a0 + 0x1000 * rank:x} rank {rank} nranks {self.world} cudaDev {self.local(rank)} nvmlDev {self.local(rank)} busId {self.bus[self.local(rank)]} commId 0x7f3a21c9e81b4d2e - Init COMPLETE")

    def megatron_init(self) -> None:
        self.emit("using world size: %d, data-parallel size: %d, context-parallel size: 1, tensor-model-parallel size: 2, pipeline-model-parallel size: 1 " % (self.world, self.world // 2))
        self.emit("------------------------ arguments ------------------------")
        for name, value in (("micro_batch_size", 2), ("global_batch_size", 1024), ("seq_length", 4096),
                            ("num_layers", 32), ("hidden_size", 4096), ("lr", "0.0003"), ("lr_warmup_iters", 2000),
                            ("save_interval", 500), ("tensor_model_parallel_size", 2), ("use_distributed_optimizer", True)):
            self.emit(f"  {name} {'.' * (40 - len(name))} {value}")
        self.emit("-------------------- end of arguments ---------------------")
        self.emit("setting random seeds to 1234 ...")
        self.emit("> initializing torch distributed ...")
        self.emit("> initialized tensor model parallel with size 2")
        self.emit("> initialized pipeline model parallel with size 1")
        self.emit("> compiling dataset index builder ...")
        self.emit("make: Entering directory '/opt/megatron/megatron/core/datasets'")
        self.emit("make: Nothing to be done for 'default'.")
        self.emit("make: Leaving directory '/opt/megatron/megatron/core/datasets'")
        self.emit(">>> done with dataset index builder. Compilation time: 0.051 seconds")
        for rank in range(self.world):
            self.rank_line(rank, "WARNING:megatron.core.models.gpt.gpt_layer_specs:Apex is not installed. Falling back to Torch Norm")
        self.emit("building GPT model ...")
        self.emit(f" > number of parameters on (tensor, pipeline) model parallel rank (0, 0): {3_500_000_000 + self.rng.randint(0, 99999)}")
        self.emit("> building train, validation, and test datasets ...")
        self.emit("    train:      1024000000")
        self.emit("    validation: 10240000")
        self.emit("    test:       10240")
        self.emit(f"[after dataloaders are built] datetime: {self.now:%Y-%m-%d %H:%M:%S} ")
        self.emit(f"time to initialize megatron (seconds): {self.rng.uniform(30, 90):.3f}")
        for rank in range(self.world):
            self.rank_line(rank, "/opt/venv/lib/python3.11/site-packages/torch/utils/data/dataloader.py:617: UserWarning: This DataLoader will create 8 worker processes in total. Our suggested max number of worker in current system is 6, which is smaller than what this DataLoader is going to create. Please be aware that excessive worker creation might get DataLoader running slow or even freeze, lower the worker number to avoid potential slowness/freeze if necessary.")
            self.rank_line(rank, "  warnings.warn(")

    def startup(self) -> None:
        self.launcher_banner()
        self.tick(4)
        self.nccl_init()
        self.tick(2)
        self.megatron_init()
        self.tick(3)

    # ------------------------------------------------------------------ training noise
    def train(self, steps: int, spike_at: int | None = None) -> None:
        for _ in range(steps):
            self.step += 1
            self.tick(self.rng.uniform(1.8, 2.3))
            self.loss = max(1.6, self.loss * 0.995 + self.rng.uniform(-0.02, 0.02))
            if spike_at is not None and self.step >= spike_at:
                self.loss = 7.5 + self.rng.uniform(0, 2.5)
            lr = min(3e-4, 3e-4 * self.step / 2000)
            for rank in range(self.world):
                r_loss = self.loss + self.rng.uniform(-0.001, 0.001)
                self.rank_line(rank, f"{self.iso()} rank={rank} step={self.step} loss={r_loss:.9g} lr={lr:.3e} "
                                     f"grad_norm={self.rng.uniform(0.2, 1.4):.4f} tokens_per_s={self.rng.uniform(9e3, 1.3e4):.1f} elapsed_s={self.step * 2.05:.2f}")
            self.emit(f" [{self.now:%Y-%m-%d %H:%M:%S}] iteration {self.step:8d}/  250000 | consumed samples: {self.step * 1024:12d} | "
                      f"elapsed time per iteration (ms): {self.rng.uniform(1900, 2200):.1f} | learning rate: {lr:.6E} | global batch size:  1024 | "
                      f"lm loss: {self.loss:.6E} | loss scale: 1.0 | grad norm: {self.rng.uniform(0.2, 1.4):.3f} | number of skipped iterations:   0 | number of nan iterations:   0 |")
            if self.step % 10 == 0:
                for rank in range(self.world):
                    self.rank_line(rank, f"[W{self.now:%m%d %H:%M:%S}.{self.rng.randint(0, 999999):06d} {self.pids[rank]} ProcessGroupNCCL.cpp:4561] Warning: TORCH_NCCL_AVOID_RECORD_STREAMS=1 has no effect for point-to-point collectives. (function operator())")
            if self.step % 25 == 0:
                self.emit(f"{self.iso()} rank=0 event=checkpoint_saved step={self.step} url=s3://ff-ckpt/run/step_{self.step:07d}")
                self.emit(f"{self.iso()} rank=0 event=checkpoint_committed step={self.step}")
            if self.step == 1:
                self.emit(f"[Rank 0] (after 1 iterations) memory (MB) | allocated: 23811.3 | max allocated: 61204.9 | reserved: 64310.0 | max reserved: 64310.0")

    # ------------------------------------------------------------------ aftermath
    def watchdog_timeouts(self, ranks, seq: int | None = None, op: str = "ALLREDUCE") -> None:
        seq = seq or self.rng.randint(20000, 90000)
        for rank in ranks:
            self.tick(self.rng.uniform(0.0, 0.3))
            ms = 600000 + self.rng.randint(1, 90)
            self.rank_line(rank, f"[{self.glog('E')} {self.pids[rank]} ProcessGroupNCCL.cpp:616] [Rank {rank}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum={seq}, OpType={op}, NumelIn=52428800, NumelOut=52428800, Timeout(ms)=600000) ran for {ms} milliseconds before timing out.")
            self.rank_line(rank, f"[{self.glog('E')} {self.pids[rank]} ProcessGroupNCCL.cpp:1664] [PG 0 (default_pg) Rank {rank}] Exception (either an error or timeout) detected by watchdog at work: {seq}, last enqueued NCCL work: {seq}, last completed NCCL work: {seq - 1}.")
            self.rank_line(rank, f"[{self.glog('E')} {self.pids[rank]} ProcessGroupNCCL.cpp:630] [Rank {rank}] Some NCCL operations have failed or timed out. Due to the asynchronous nature of CUDA kernels, subsequent GPU operations might run on corrupted/incomplete data.")
            self.rank_line(rank, f"[{self.glog('E')} {self.pids[rank]} ProcessGroupNCCL.cpp:636] [Rank {rank}] To avoid data inconsistency, we are taking the entire process down.")

    def aborts(self, ranks) -> None:
        for rank in ranks:
            self.rank_line(rank, "terminate called after throwing an instance of 'c10::DistBackendError'")
            self.rank_line(rank, f"  what():  [PG 0 (default_pg) Rank {rank}] Process group watchdog thread terminated with exception: [Rank {rank}] Watchdog caught collective operation timeout")

    def python_traceback(self, rank: int, frames: list[tuple[str, int, str, str]], final: list[str]) -> None:
        self.rank_line(rank, "Traceback (most recent call last):")
        for path, line, func, code in frames:
            self.rank_line(rank, f'  File "{path}", line {line}, in {func}')
            self.rank_line(rank, f"    {code}")
        for text in final:
            self.rank_line(rank, text)

    def closing_signals(self, node: int, failed_local: int) -> None:
        for local in range(self.gpus_per_node):
            if local != failed_local:
                self.emit(f"W{self.now:%m%d %H:%M:%S}.{self.rng.randint(0, 999999):06d} {1900 + node} torch/distributed/elastic/multiprocessing/api.py:897] Sending process {self.pids[node * self.gpus_per_node + local]} closing signal SIGTERM")

    def child_failed(self, rank: int, exitcode: int = 1, signal_name: str | None = None, others=()) -> None:
        node = rank // self.gpus_per_node
        self.tick(self.rng.uniform(2, 6))
        self.closing_signals(node, self.local(rank))
        self.emit(f"E{self.now:%m%d %H:%M:%S}.{self.rng.randint(0, 999999):06d} {1900 + node} torch/distributed/elastic/multiprocessing/api.py:869] failed (exitcode: {exitcode}) local_rank: {self.local(rank)} (pid: {self.pids[rank]}) of binary: /opt/venv/bin/python")
        self.emit("Traceback (most recent call last):")
        self.emit('  File "/opt/venv/bin/torchrun", line 8, in <module>')
        self.emit("    sys.exit(main())")
        self.emit('  File "/opt/venv/lib/python3.11/site-packages/torch/distributed/run.py", line 919, in main')
        self.emit("    run(args)")
        self.emit('  File "/opt/venv/lib/python3.11/site-packages/torch/distributed/launcher/api.py", line 263, in launch_agent')
        self.emit("    raise ChildFailedError(")
        self.emit("torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ")
        self.emit("============================================================")
        self.emit("pretrain_gpt.py FAILED")
        self.emit("------------------------------------------------------------")
        self.emit("Failures:")
        if others:
            for i, other in enumerate(others, 1):
                self.emit(f"[{i}]:")
                self.emit(f"  time      : {self.now:%Y-%m-%d_%H:%M:%S}")
                self.emit(f"  host      : {self.host_of(other)}")
                self.emit(f"  rank      : {other} (local_rank: {self.local(other)})")
                self.emit(f"  exitcode  : -6 (pid: {self.pids[other]})")
                self.emit("  error_file: <N/A>")
                self.emit(f"  traceback : Signal 6 (SIGABRT) received by PID {self.pids[other]}")
        else:
            self.emit("  <NO_OTHER_FAILURES>")
        self.emit("------------------------------------------------------------")
        self.emit("Root Cause (first observed failure):")
        self.emit("[0]:")
        self.emit(f"  time      : {self.now:%Y-%m-%d_%H:%M:%S}")
        self.emit(f"  host      : {self.host_of(rank)}")
        self.emit(f"  rank      : {rank} (local_rank: {self.local(rank)})")
        if signal_name:
            self.emit(f"  exitcode  : {exitcode} (pid: {self.pids[rank]})")
            self.emit("  error_file: <N/A>")
            self.emit(f"  traceback : Signal {abs(exitcode)} ({signal_name}) received by PID {self.pids[rank]}")
        else:
            self.emit(f"  exitcode  : {exitcode} (pid: {self.pids[rank]})")
            self.emit("  error_file: <N/A>")
            self.emit("  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html")
        self.emit("============================================================")

    def store_lost(self, ranks, master_rank: int = 0) -> None:
        for rank in ranks:
            self.rank_line(rank, f"[{self.glog('W')} {self.pids[rank]} TCPStore.cpp:125] [c10d] recvValue failed on SocketImpl(fd=58, addr=[{self.host_of(rank)}]:41512, remote=[{self.host_of(master_rank)}]:29500): Connection reset by peer")
