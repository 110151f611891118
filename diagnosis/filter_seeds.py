"""The routine-line rules every job family starts with.

Each pattern covers one kind of line that pretraining logs print over and over and
that never says what went wrong: init banners, metric lines, NCCL INFO chatter,
launcher banners and warnings that recur every run. They are written as the log agent
should write rules: anchored at the start of the line (after the launcher's rank
prefix), specific, and in the linear-time subset (RE2/Hyperscan).

forgeflow's own per-step metric and event lines (``training.runlog``) are::

    2026-11-22T08:00:00.123Z rank=0 step=12 loss=3.21234512 lr=1.000e-04 grad_norm=0.5213 tokens_per_s=12345.6 elapsed_s=10.12
    2026-11-22T08:00:00.123Z rank=0 event=checkpoint_saved step=20

(the older ``[ts] [rank3] step=12 loss=...`` form is covered too). Event lines are
covered only for routine events; ``event=loss_spike`` and ``event=hang`` are signals.

Lines with an error signal (``loss=nan`` for instance) are kept even when one of these
rules covers them: compression checks ``diagnosis.signals.ERROR_KEYWORDS`` and the
diagnosis rules separately.
"""

from __future__ import annotations

# Optional prefixes: a log collector's timestamp (kubectl logs --timestamps), srun --label
# ("12: ") and torchrun ("[rank3]:"/"[default3]:").
P = r"^(?:\d{4}-\d\d-\d\dT[\d:.]+Z )?(?:\d+: )?(?:\[(?:rank|default)\d+\]:)?"
# NCCL's prefix: host:pid:tid [gpu]
NCCL = P + r"\s*[\w.-]+:\d+:\d+ \[\d+\] NCCL INFO "
# A leading "[2026-11-22 07:41:02,123] " style stamp, optional.
TS = r"(?:\[\d{4}-\d\d-\d\d[ T][\d:.,]+\] ?)?"

SEED_FILTER_RULES: tuple[tuple[str, str], ...] = (
    # ---- forgeflow training loop
    ("forgeflow-step-metrics", P + TS + r"\s*(?:\d{4}-\d\d-\d\dT[\d:.]+Z )?(?:\[rank\d+\] |rank=\d+ )?step=\d+ loss=\S+ lr=\S+"),
    ("forgeflow-routine-event", P + r"\s*\d{4}-\d\d-\d\dT[\d:.]+Z rank=\d+ event=(?:checkpoint_(?:saved|snapshot|committed|persisted|started)|started|resumed|eval_done|data_ready|finished)\b"),
    ("forgeflow-checkpoint", P + TS + r"\s*(?:\[rank\d+\] )?checkpoint (?:snapshot|saved|committed|persisted|written) step=\d+"),
    ("forgeflow-heartbeat", P + TS + r"\s*(?:\[rank\d+\] )?heartbeat step=\d+"),
    ("forgeflow-eval-metrics", P + TS + r"\s*(?:\[rank\d+\] )?eval step=\d+ (?:val_)?loss=\S+"),
    # ---- megatron / common trainer output
    ("megatron-iteration", P + r"\s*(?:\[[\d\- :.,]+\] )?iteration\s+\d+/\s*\d+ \| consumed samples:"),
    ("megatron-init-step", P + r"\s*> (?:building|initializ|setting|compiling|done with|finished|loading|number of parameters|learning rate decay|padded vocab|elapsed time for|rank \d+ ha)"),
    ("megatron-args-line", P + r"\s+[A-Za-z_][\w]* \.{3,} \S"),
    ("megatron-args-banner", P + r"\s*-{5,} ?(?:end of )?arguments ?-{5,}\s*$"),
    ("megatron-world-size", P + r"\s*using world size: \d+, data-parallel size: \d+"),
    ("megatron-random-seeds", P + r"\s*setting random seeds to \d+"),
    ("megatron-init-time", P + r"\s*time to initialize megatron \(seconds\): [\d.]+"),
    ("megatron-datetime-marker", P + r"\s*\[(?:after|before) [\w ]+\] datetime: \d{4}-"),
    ("megatron-timers-header", P + r"\s*\(min, max\) time across ranks \(ms\):"),
    ("megatron-timers-line", P + r"\s+[\w-]+ \.+: \([\d., ]+\)\s*$"),
    ("megatron-memory-report", P + r"\s*\[Rank \d+\] \(after \d+ iterations\) memory \(MB\) \| allocated:"),
    ("megatron-dataset-split", P + r"\s+(?:train|validation|test):\s+\d+\s*$"),
    ("megatron-checkpoint-save", P + r"\s*(?:saving checkpoint at iteration\s+\d+ to|successfully saved checkpoint (?:from|at) iteration\s+\d+ to)"),
    ("megatron-apex-fallback", P + r"\s*WARNING:megatron\.core\.[\w.]+:Apex is not installed\."),
    ("megatron-te-missing", P + r"\s*(?:WARNING:[\w.]+:)?Transformer Engine (?:is )?not (?:installed|available)"),
    ("megatron-building-model", P + r"\s*building (?:GPT|BERT|T5|Llama) model \.\.\."),
    ("megatron-zarr", P + r"\s*(?:INFO|WARNING):megatron\.core\.dist_checkpointing\.\w+:(?:zarr|Using)"),
    # ---- torchrun / torch.distributed.elastic
    ("torchrun-omp-banner", P + r"\s*(?:WARNING:torch\.distributed\.run:|W\d{4} [\d:.]+ \d+ \S*torch/distributed/run\.py:\d+\] )?\s*Setting OMP_NUM_THREADS environment variable for each process"),
    ("torchrun-star-line", P + r"\s*(?:WARNING:torch\.distributed\.run:|W\d{4} [\d:.]+ \d+ \S*torch/distributed/run\.py:\d+\] )?\s*\*{20,}\s*$"),
    ("elastic-launch-config", P + r"\s+(?:entrypoint|min_nodes|max_nodes|nproc_per_node|run_id|rdzv_backend|rdzv_endpoint|rdzv_configs|max_restarts|monitor_interval|log_dir|metrics_cfg)\s*:"),
    ("elastic-rendezvous-result", P + r"\s+(?:restart_count|master_addr|master_port|group_rank|group_world_size|local_ranks|role_ranks|global_ranks|role_world_sizes|global_world_sizes)="),
    ("elastic-agent-info", P + r"\s*(?:INFO:|I\d{4} [\d:.]+ \d+ \S*\] ?)torch\.distributed\.(?:elastic|launcher)\.[\w.]+:(?:\[default\] )?(?:Starting|Rendezvous|Environment variable|Setting worker|log directory|Using nproc_per_node|Local worker group finished|Done waiting)"),
    ("elastic-launch-configs-header", P + r"\s*(?:INFO:torch\.distributed\.launcher\.api:)?Starting elastic_operator with launch configs:"),
    ("elastic-redirects-note", P + r"\s*\S*torch\.distributed\.elastic\.multiprocessing\.redirects: NOTE: Redirects are currently not supported"),
    ("torch-distributed-init", P + r"\s*(?:Initializing torch\.distributed with backend|initialized (?:tensor|pipeline|data|context|expert) model parallel with size|> initializing torch distributed)"),
    # ---- NCCL INFO chatter (one rule per message family, as the log agent would learn them)
    ("nccl-version", P + r"\s*(?:[\w.-]+:\d+:\d+ \[\d+\] )?NCCL (?:INFO )?(?:version|NCCL version) \d+\.\d+"),
    ("nccl-bootstrap", NCCL + r"(?:Bootstrap|bootstrap)"),
    ("nccl-net-plugin", NCCL + r"(?:NET/|Using network|Plugin|Failed to open libnccl-net)"),
    ("nccl-channel", NCCL + r"Channel \d+/\d+ :"),
    ("nccl-connected", NCCL + r"Connected (?:all|NVLS|binomial|collnet)"),
    ("nccl-comm-init", NCCL + r"(?:comm 0x[0-9a-f]+ rank \d+|ncclCommInitRank|Init COMPLETE|init\.cc:\d+ -> )"),
    ("nccl-env-set", NCCL + r"NCCL_\w+ set by environment to"),
    ("nccl-cuda-driver", NCCL + r"cudaDriverVersion \d+"),
    ("nccl-trees-rings", NCCL + r"(?:Trees|Ring \d+|Pattern \d+|P2P Chunksize|threadThresholds|\d+ coll channels|CC Off|NVLS multicast|Channel \d+ :)"),
    ("nccl-affinity", NCCL + r"(?:Setting affinity|NVLS|Comm config|[Ss]ervice thread|Proxy|ncclProxy|Allocated|MNNVL|Check P2P|Using non-device net plugin|Assigned NET plugin|Enabled NCCL Func/Proto/Algo|Using Buffer|Loaded|Topology|comm 0x[0-9a-f]+ [a-z])"),
    ("nccl-collnet", NCCL + r"(?:CollNet|ncclCommSplit|comm 0x[0-9a-f]+ (?:splitCount|Destroy))"),
    # ---- torch warnings that recur every run
    ("torch-typedstorage", P + r"\s*\S+\.py:\d+: UserWarning: TypedStorage is deprecated"),
    ("torch-amp-future", P + r"\s*\S+\.py:\d+: FutureWarning: `?torch\.cuda\.amp\.\w+"),
    ("torch-dataloader-workers", P + r"\s*\S+\.py:\d+: UserWarning: This DataLoader will create \d+ worker processes"),
    ("torch-record-streams", P + r"\s*\[W\d{4} [\d:.]+ (?:\d+ )?ProcessGroupNCCL\.cpp:\d+\] Warning: TORCH_NCCL_AVOID_RECORD_STREAMS"),
    ("torch-warnings-warn", P + r"\s+(?:warnings\.warn|return fn)\($"),
    ("torch-autograd-kernel", P + r"\s*\S+\.py:\d+: UserWarning: c10d::\w+: an autograd kernel was not registered"),
    ("torch-checkpoint-reentrant", P + r"\s*\S+\.py:\d+: UserWarning: torch\.utils\.checkpoint: (?:the use_reentrant parameter|please pass in use_reentrant)"),
    ("torch-barrier-device", P + r"\s*\[W\d{4} [\d:.]+ (?:\d+ )?ProcessGroupNCCL\.cpp:\d+\] \[PG (?:ID )?\d+ ?(?:PG GUID \d+)?(?:\(\w+\))? Rank \d+\]\s+using GPU \d+ to perform barrier"),
    ("torch-nccl-destroy-warn", P + r"\s*\[W\d{4} [\d:.]+ (?:\d+ )?ProcessGroupNCCL\.cpp:\d+\] Warning: WARNING: process group has NOT been destroyed"),
    ("torch-extensions", P + r"\s*(?:Using \S+ as PyTorch extensions root|Detected CUDA files, patching ldflags|Emitting ninja build file|Building extension module|Allowing ninja to set a default number of workers|Loading extension module|ninja: no work to do)"),
    ("hf-tokenizers-fork", P + r"\s*huggingface/tokenizers: The current process just got forked"),
    ("hf-tokenizers-parallelism", P + r"\s*To disable this warning, you can either:|\s+- (?:Avoid using `tokenizers`|Explicitly set the environment variable TOKENIZERS_PARALLELISM)"),
    # ---- experiment trackers and progress bars
    ("wandb-info", P + r"\s*wandb: (?:Tracking run|Run data is saved|Syncing run|Currently logged in|Run `wandb offline`|Using wandb-core|View project at|View run at|Waiting for W&B process|Find logs at|\s*$)"),
    ("tqdm-shards", P + r"\s*(?:Loading checkpoint shards|Map|Tokenizing|Downloading|Fetching \d+ files)[^:|]*:\s+\d+%"),
    ("forgeflow-banner", P + TS + r"\s*forgeflow (?:training|worker) (?:starting|started|config|plan)\b"),
)
