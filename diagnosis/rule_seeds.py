"""The seeded diagnosis rules, in match order (first rule matching a line names it).

Each entry: (name, pattern, root_cause, restart_helps, mitigation, symptom).

* Order matters within a line: specific messages come before the generic exception
  rules at the end ("RuntimeError: CUDA error: out of memory" is an OOM, not a
  CUDAError nor a RuntimeError).
* ``symptom=True`` marks messages that are usually the *consequence* of another rank's
  failure (NCCL watchdog timeouts, remote-peer errors, SIGABRT, torchrun's
  ChildFailedError, the c10d store losing its host). They name the root cause only
  when nothing else in the log does. Rules whose root cause is ``Unknown`` are pure
  symptoms: they give evidence and suspects, never a root cause.
* Restart policy follows the vocabulary: infrastructure faults restart (after
  excluding the suspect node); deterministic code/config errors and OOM do not.

Loss spikes and hangs are reported by forgeflow itself: ``training`` writes an event
line ``<ts> rank=R event=loss_spike onset_step=N last_healthy_step=M`` (or the legacy
marker ``FORGEFLOW_LOSS_SPIKE onset_step=N last_healthy_step=M``), and the flow's
heartbeat watcher appends ``FORGEFLOW_HANG last_step=N stale_s=S`` (or an
``event=hang`` line) before it kills a stuck job.
"""

from __future__ import annotations

# An exception line: the name (after an optional prefix and module path) followed by
# ":" or the end of the line, so code lines such as "raise RuntimeError(" do not count.
X = r"(?:^|[\s:\]>])(?:[\w]+\.)*"
XID = r"\bXid \([^)]*\): "
# A driver line blaming an earlier Xid ("Xid (PCI:0000:dc:00): 45, pid=..., name=python3, Ch
# 00000001 caused by previous Xid 149": Xid 45 is the clean-up of channels a fault left): the
# earlier Xid's number names the fault, whichever Xid the line itself carries.
PREV_XID = r"\bcaused by previous Xid "
# CUDA's error prefix as any wrapper prints it before cudaGetErrorString's text: torch's
# "CUDA error: ", Marian's "CUDA error 999 '", Paddle's "CUDA error(719), ", Kaldi's
# "cudaError_t 4 : \"", a driver's "CUDA Error 700 (", torch 1.x's THC "cuda runtime error
# (30) : " and its "THCudaCheck FAIL file=... line=51 error=30 : " warning.
CUDA_ERR = (r"(?:(?i:\bcuda[ _]?(?:runtime )?error)(?:_t)?[^A-Za-z\n]{0,12}"
            r"|THCudaCheck FAIL file=\S+ line=\d+ error=\d+ : )")
# Memory exhausted in the wording of frameworks other than torch's CUDA allocator:
# TensorFlow 1.x/2.x and Paddle ("ResourceExhaustedError (see above for traceback): OOM
# when allocating tensor", "Resource exhausted: OOM when allocating", "ResourceExhaustedError:
# failed to allocate memory", Paddle's "ResourceExhaustedError: Out of memory error on GPU"),
# JAX/XLA ("XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate",
# "Ran out of memory in memory space hbm"), the CUDA driver API's and HIP's names, and
# torch's ROCm / Apple / Intel backends. gRPC's RESOURCE_EXHAUSTED (message too large) names
# no memory and does not count.
OTHER_OOM = (r"(?i:resource[ _]?exhausted)[^\n]{0,200}?(?:\bOOM\b|(?i:out of memory|failed to allocate|ran out of memory))"
             r"|\bOOM when allocating tensor|CUDA_ERROR_OUT_OF_MEMORY\b|hipErrorOutOfMemory\b|\b(?:HIP|XPU|MPS backend) out of memory"
             # cudaMalloc failing in a framework's own allocator (MXNet's "cudaMalloc retry failed: out
             # of memory", ggml / llama.cpp's "cudaMalloc failed: out of memory", Caffe's "Check failed:
             # error == cudaSuccess (2 vs. 0)  out of memory"); Paddle 1.x / 2.x's "Out of memory error on
             # GPU 0. Cannot allocate 80.000000MB memory on GPU 0" with or without ResourceExhaustedError;
             # llama.cpp's buffers that do not fit ("failed to allocate buffer for kv cache", "unable to
             # allocate CUDA0 buffer")
             r"|\bcudaMalloc\w*[^\n]{0,80}?\bout of memory|== cudaSuccess\b[^\n]{0,40}?\bout of memory"
             r"|\bOut of memory error on (?:GPU|XPU|NPU|MLU|CPU)\b|\bCannot allocate [\d.]+ ?[KMGT]i?B memory on (?:GPU|XPU|NPU) \d+"
             r"|(?i:failed to allocate (?:the )?buffer for (?:the )?kv cache)|(?i:(?:unable|failed) to allocate (?:CUDA|ROCm|Vulkan|Metal|SYCL)\d* buffer)")
# The CUDA build does not fit the GPU or the driver: no kernel compiled for this compute
# capability (runtime, driver API and HIP names), a driver older than the toolkit, PTX from
# a newer toolchain, forward compatibility on a GPU that lacks it. Every restart on the same
# image and node type fails the same way.
CUDA_BUILD = (r"no kernel image is available for execution on the device|cudaErrorNoKernelImageForDevice\b|CUDA_ERROR_NO_BINARY_FOR_GPU\b|hipErrorNoBinaryForGpu\b"
              r"|(?i:\b(?:cuda|hip)[ _]?(?:runtime )?error)(?:_t)?[^A-Za-z\n]{0,12}invalid device function|cudaErrorInvalidDeviceFunction\b|hipErrorInvalidDeviceFunction\b"
              r"|CUDA driver version is insufficient for CUDA runtime version|cudaErrorInsufficientDriver\b"
              r"|the provided PTX was compiled with an unsupported toolchain|CUDA_ERROR_UNSUPPORTED_PTX_VERSION\b|cudaErrorUnsupportedPtxVersion\b"
              r"|forward compatibility was attempted on non supported HW|cudaErrorCompatNotSupportedOnDevice\b")
# S3 error codes that reject the request's own configuration (see "s3-rejected").
S3_CODES = r"(?:AccessDenied|InvalidAccessKeyId|SignatureDoesNotMatch|RequestTimeTooSkewed|ExpiredToken|InvalidToken|AllAccessDisabled|AccountProblem|InvalidBucketName|NoSuchBucket)"

# The Slurm client commands a job is submitted with, as they prefix their messages.
SLURM_CMD = r"\b(?:sbatch|srun|salloc)(?:\[\d+\])?: "

RESTART_EXCLUDE = "Restart from the last checkpoint after cordoning the suspect node(s) and running the node check."

SEED_DIAGNOSIS_RULES: tuple[tuple[str, str, str, bool, str, bool], ...] = (
    # ------------------------------------------------------------- forgeflow signals
    ("loss-spike-event", r"\bevent=loss_spike\b|FORGEFLOW_LOSS_SPIKE\b", "LossSpike", True,
     "Roll back to the last healthy checkpoint before the spike onset and skip the batches that followed.", False),
    # A framework that stops the job itself on a non-finite loss (detectron2, fairseq,
    # Megatron's NaN checks, DeepSpeed's loss-scale floor): the optimisation diverged, and
    # without forgeflow's rollback-and-skip (the event above) the same run diverges again.
    ("loss-nonfinite", r"(?i)loss (?:became|is|was|has become) (?:infinite or nan|nan|inf(?:inite)?)\b|training has diverged|non-finite loss|loss is not finite|found nan in local (?:grad norm|forward loss)|Minimum loss scale reached|loss scale already at minimum", "LossSpike", False,
     "The loss became NaN/inf and the framework stopped: lower the learning rate (or warm up longer), check fp16 loss scaling and the batches at that step, then restart from a healthy checkpoint.", False),
    ("hang-event", r"\bevent=hang\b|FORGEFLOW_HANG\b", "Hang", True,
     "Dump stacks (py-spy), kill the job, run the node check on all nodes, restart from the last checkpoint.", False),
    # forgeflow's checkpoint engine: the storage failed while checkpoints were listed or read at
    # start-up (any storage: S3, GCS, a file system over NFS); nothing was set aside, so the same
    # checkpoint loads once the storage answers. The storage class of the vocabulary.
    ("checkpoint-storage-unavailable", r"\bCheckpointStorageUnavailable\b", "S3StorageError", True,
     "The checkpoint storage failed while the job read its checkpoint at start-up; nothing was set aside: "
     "check the storage (endpoint, mount, credentials); a restart after a backoff resumes from the same checkpoint.", False),
    # ------------------------------------------------------------- hardware
    # (nvidia-smi / NVML unable to reach a GPU the node has: "Unable to determine the device handle
    # for GPU 0000:0B:00.0: Unknown Error" or ": GPU is lost", NVML_ERROR_GPU_IS_LOST: the GPU is
    # gone from the bus, whatever Xid the log lacks.)
    ("xid-fallen-off-bus", XID + r"79\b|" + PREV_XID + r"79\b|fallen off the bus|\bGPU is lost\b|GPU lost from the bus"
     r"|Unable to determine the device handle for GPU|NVML_ERROR_GPU_IS_LOST\b", "NodeFailure", True,
     "GPU fell off the bus: cordon the node and open a hardware ticket; " + RESTART_EXCLUDE, False),
    ("node-failure-slurm", r"DUE TO NODE FAILURE|srun: error: Node failure on|Node failure on \S+", "NodeFailure", True,
     RESTART_EXCLUDE, False),
    # The scheduler or the cloud taking the node back from a job that did nothing wrong:
    # Slurm's "CANCELLED AT ... DUE TO PREEMPTION" (sacct's PREEMPTED state), a spot / preemptible
    # VM's termination notice (GCP's metadata server "termination is imminent", AWS's spot
    # interruption notice), a node preempted. The job runs again as it is once it has nodes.
    ("node-preempted", r"DUE TO PREEMPTION|\bPREEMPTED\b|(?i:termination is imminent)|(?i:spot (?:instance )?(?:interruption|termination) notice)"
     # SkyPilot's "Cluster is preempted (status: INIT). Recovering...", a TPU / pod / worker
     # preempted, Kubernetes' "Preempted by <pod> on node ...".
     r"|(?i:\b(?:instance|node|vm|cluster|pod|worker|host|tpu|slice)s? (?:was |were |has been |have been |is being |is |are |got )?preempted)|(?i:\bpreemption notice\b)|\bPreempted by \S+", "NodeFailure", True,
     "The job lost its node(s) to preemption (a higher-priority job or a spot/preemptible VM reclaimed): resubmit or requeue; "
     "it resumes from the last checkpoint (checkpoint more often, or on the termination signal, on preemptible capacity).", False),
    # Slurm's controller refusing a submission or allocation for a passing reason: it was
    # busy or unreachable ("sbatch: error: Batch job submission failed: Socket timed out on
    # send/recv operation", "Unable to contact slurm controller (connect failure)", "Slurm
    # temporarily unable to accept job, sleeping and retrying", "Unable to create job record, try
    # again"), or the nodes asked for at once were busy. The same submission goes through later.
    # (Refusals for the job's own request are "slurm-submit-refused", further down.)
    ("slurm-submit-transient", SLURM_CMD + r"error: [^\n]*?(?:Socket timed out on send/recv operation|Unable to contact slurm controller|Zero Bytes were transmitted or received"
     r"|Unable to create job record, try again|backup controller in standby mode|Communication connection failure|Message (?:send|receive) failure"
     r"|Resource temporarily unavailable|Requested nodes are busy|Immediate execution impossible)|Slurm temporarily unable to accept job", "ConnectionError", True,
     "Slurm's controller was busy or unreachable when the job was submitted: submit it again (check slurmctld's health if it persists).", False),
    # Slurm's daemons telling of a node that cannot run jobs: slurmstepd unable to exec the
    # batch script slurmd itself spooled ("execve(): /var/spool/slurmd/job123/slurm_script: No
    # such file or directory": the node's spool or tmp is broken, not the user's path), a task
    # the node could not kill, a prolog/epilog failing, the job's launch failing and being
    # requeued held, sacct's NODE_FAIL state. The job is fine elsewhere (or after a reboot).
    ("node-failure-slurm-daemon", r"slurmstepd(?:\[\d+\])?: error: execve\(\): \S*/slurm_script: (?:No such file or directory|Permission denied)|\bKill task failed\b|\bbatch job complete failure\b"
     r"|launch failed requeued held|\b(?:Prolog|Epilog) (?:error|failure|failed)\b|\bNODE_FAIL\b", "NodeFailure", True,
     RESTART_EXCLUDE, False),
    # slurmctld recording that a job's batch step was killed by SIGKILL ("_job_complete:
    # JobId=N WTERMSIG 9") while the job itself printed nothing: killed from outside on its node.
    # A symptom, so that an out-of-memory kill or the job's own error names the cause when the
    # log has it; alone, the node is the suspect.
    ("slurm-job-sigkilled", r"_job_complete: JobId=\d+ WTERMSIG 9\b", "NodeFailure", True,
     "Slurm's controller saw the job killed by SIGKILL with no error of its own: check the node (slurmd log, dmesg, "
     "the OOM killer) and " + RESTART_EXCLUDE, True),
    # (also: an MPI launcher losing the daemon on another node, Open MPI's "ORTE has lost
    # communication with its daemon" / "with a remote daemon", PRRTE's, a PMIx server; and
    # PCIe errors the hardware could not correct, AER's "Uncorrected (Fatal) error received",
    # "PCIe Bus Error: severity=Uncorrected". Corrected AER errors are noise and not matched.)
    ("node-not-ready", r"(?i)\bnode \S+ (?:is )?(?:not responding|unreachable|NotReady|lost)\b|NodeNotReady|kernel: .*\[Hardware Error\]|mce: \[Hardware Error\]"
     r"|(?i:\b(?:ORTE|PRTE|PRRTE|PMIx|mpirun|HNP) has lost (?:communication|contact|connection) with (?:its|a remote|the remote|a) daemon)|(?i:\blost (?:communication|contact|connection) with (?:its|a remote|the remote) daemon)"
     r"|AER: (?:Multiple )?Uncorrected \((?:Non-)?Fatal\) error received|PCIe Bus Error: severity=Uncorrected", "NodeFailure", True,
     RESTART_EXCLUDE, False),
    ("ecc-uncorrectable", r"(?i)uncorrectable ECC error|double bit (?:ECC )?error|\bDBE\b", "ECCError", True,
     "Uncorrectable ECC error: drain the GPU (page retirement / reset), cordon the node. " + RESTART_EXCLUDE, False),
    ("ecc-xid", XID + r"(?:48|63|64|92|94|95)\b|" + PREV_XID + r"(?:48|63|64|92|94|95)\b", "ECCError", True,
     "ECC Xid reported by the driver: cordon the node and reset the GPU. " + RESTART_EXCLUDE, False),
    ("nvlink-xid", XID + r"(?:74|144|145|146|147|148|149|150)\b|" + PREV_XID + r"(?:74|144|145|146|147|148|149|150)\b", "NVLinkError", True,
     "NVLink error: check `nvidia-smi nvlink -e` and temperatures, cordon the node. " + RESTART_EXCLUDE, False),
    ("nvlink-message", r"(?i)nvlink (?:error|fatal|link .* (?:down|inactive))|NVLink (?:error|errors? detected)|nvlink.*replay errors|NCCL WARN .*NVL(?:S|ink)\b.*(?:fail|error)", "NVLinkError", True,
     "NVLink error: check `nvidia-smi nvlink -e` and temperatures, cordon the node. " + RESTART_EXCLUDE, False),
    # ------------------------------------------------------------- OOM before CUDA errors
    ("cuda-oom", r"OutOfMemoryError|CUDA out of memory|" + CUDA_ERR + r"out of memory|CUBLAS_STATUS_ALLOC_FAILED|Cuda failure 'out of memory'|cudaErrorMemoryAllocation|" + OTHER_OOM, "OutOfMemoryError", False,
     "GPU memory exhausted: pick a plan with more recompute, a smaller micro-batch or more model parallelism (re-plan), then restart.", False),
    # Memory exhausted in the wording of the job's memory limit rather than the GPU's: Slurm's
    # cgroup ("Detected 1 oom-kill event(s) in step 123.0 cgroup", srun's "task 4: Out Of
    # Memory", sacct's OUT_OF_MEMORY), Kubernetes ("reason: OOMKilled", kubelet evicting a pod
    # because "The node was low on resource: memory"), docker / OpenPAI / YARN ("exceeded the
    # request memory", "killed ... for exceeding memory limits"). A restart with the same memory
    # request runs out again. (The kernel's own "oom-kill" / "Killed process" lines stay
    # symptoms: a DataLoader worker's death or the job's error names the cause.)
    ("job-memory-limit", r"Detected \d+ oom[-_ ]kill events?|oom[-_]kill event\(s\)|srun: error: [^\n]*: tasks? [\d,-]+: Out Of Memory|\bOUT_OF_MEMORY\b"
     r"|\bOOMKilled\b|The node was low on resource: memory|exceeded the request memory|(?i:killed [^\n]{0,40}for exceeding memory limits?)|(?i:exceeded (?:its|the) memory limit)", "OutOfMemoryError", False,
     "The job exceeded its memory limit (Slurm cgroup, Kubernetes or container limit) and was killed: request more memory per task "
     "(or whole nodes), or lower host memory use (DataLoader workers, prefetch, in-memory datasets), then restart.", False),
    # An inference engine with no GPU memory left for its KV cache under the configured memory
    # budget (vLLM's "No available memory for the cache blocks", SGLang's "Not enough memory.
    # Please try to increase --mem-fraction-static"): a memory budget, not a fault.
    ("kv-cache-memory", r"No available memory for the cache blocks|Not enough memory\. Please try to increase --mem-fraction-static", "OutOfMemoryError", False,
     "The engine has no GPU memory left for its KV cache: raise gpu_memory_utilization / mem-fraction-static, lower max_model_len or "
     "max_num_seqs, or use more tensor parallelism, then restart.", False),
    ("cuda-error", r"CUDA error: (?:an illegal memory access|unspecified launch failure|misaligned address|an illegal instruction|invalid device|an uncorrectable|unknown error|the launch timed out|operation not permitted|invalid argument)|cudaErrorIllegalAddress|cudaErrorLaunchFailure|CUBLAS_STATUS_EXECUTION_FAILED|CUDNN_STATUS_(?:EXECUTION_FAILED|INTERNAL_ERROR)|CUDA driver error|Cuda failure '|CUDA_ERROR_(?:ILLEGAL_ADDRESS|LAUNCH_FAILED|ILLEGAL_INSTRUCTION|MISALIGNED_ADDRESS|HARDWARE_STACK_ERROR|UNKNOWN)\b|unspecified launch failure|an illegal memory access was encountered|an illegal instruction was encountered|launch timed out and was terminated|\bhardware stack error\b|" + CUDA_ERR + r"unknown error|cudaError(?:Unknown|LaunchTimeout|IllegalInstruction|MisalignedAddress|HardwareStackError)\b", "CUDAError", True,
     "CUDA fault: check the node's Xid log; " + RESTART_EXCLUDE, False),
    # A device-side assert is reported after the kernel's own "Assertion `...` failed."
    # line, which names the cause (an out-of-range index is a script error): the CUDA
    # error names the cause only when no assertion line made it into the log.
    ("cuda-device-assert", r"" + CUDA_ERR + r"device-side assert(?:ion)? triggered|cudaErrorAssert\b|CUDA_ERROR_ASSERT\b", "CUDAError", True,
     "A device-side assertion failed: read the kernel's 'Assertion ... failed' line (often an out-of-range index or label); " + RESTART_EXCLUDE, True),
    ("cuda-build-mismatch", CUDA_BUILD, "CUDAError", False,
     "The CUDA build does not match this GPU or driver (no kernel for its compute capability, driver older than the toolkit): install a build for this GPU and driver (or run on GPUs it was built for); a restart on the same image fails again.", False),
    ("cuda-xid", XID + r"(?:13|31|43|45|62|109|119|120)\b", "CUDAError", True,
     "Driver reported a GPU fault (Xid): " + RESTART_EXCLUDE, False),
    # The process finds no usable GPU on a node that has them: no device visible (CUDA's
    # cudaErrorNoDevice in torch 1.x's "cuda runtime error (38)", torch 2.x's "No CUDA GPUs
    # are available" and the driver API's name), the kernel driver and the user-space
    # libraries at different versions after a driver update without a reboot (NVML's
    # "Driver/library version mismatch", CUDA_ERROR_SYSTEM_DRIVER_MISMATCH), nvidia-smi
    # unable to reach the driver, devices held busy, torch's "CUDA unknown error" at
    # initialisation (a GPU or the UVM module in a bad state). The node, not the job, is
    # broken: elsewhere (or after a reboot) the same job starts.
    ("gpu-unusable", r"no CUDA-capable device is detected|cudaErrorNoDevice\b|CUDA_ERROR_NO_DEVICE\b|No CUDA GPUs are available"
     r"|(?i:driver/library version mismatch)|CUDA_ERROR_SYSTEM_DRIVER_MISMATCH\b|cudaErrorSystemDriverMismatch\b|NVML_ERROR_DRIVER_NOT_LOADED\b"
     r"|couldn't communicate with the NVIDIA driver|all CUDA-capable devices are busy or unavailable|cudaErrorDevicesUnavailable\b"
     r"|CUDA unknown error - this may be due to an incorrectly set up environment", "CUDAError", True,
     "The node's GPUs are not usable (none visible, driver and libraries at different versions, a GPU in a bad state): "
     "cordon the node, check nvidia-smi and reboot or replace it; " + RESTART_EXCLUDE, False),
    # ------------------------------------------------------------- interconnect
    # A queue pair that cannot be brought up (ibv_modify_qp failing, e.g. INIT -> RTR timing out)
    # fails while the connection is set up: the two NICs have no working path (rail-only fabric
    # with cross-NIC traffic, RoCE GID / routing, a wrong NCCL_IB_GID_INDEX). The same node set
    # and settings fail the same way on a restart; a port dying mid-run is the rule below.
    ("ib-qp-setup-failed", r"\bibv_modify_qp failed\b|Call to ibv_modify_qp failed", "NetworkError", False,
     "NCCL could not bring up an InfiniBand/RoCE connection between two NICs: check that they can reach each other (ib_write_bw), "
     "the fabric's rail topology (NCCL_CROSS_NIC=0 on rail-only fabrics), NCCL_IB_GID_INDEX and RoCE routing, then restart.", False),
    ("ib-completion-error", r"NCCL WARN NET/IB.*(?:completion.*(?:error|status=[1-9])|status=[1-9]\d*)|transport retry counter exceeded|NCCL WARN NET/IB : .*(?:failed|error)|ibv_\w+ failed|NET/IB ?: Got completion from peer \S+ with (?:error [1-9]|status=[1-9])|NET/OFI .*completed with error", "NetworkError", True,
     "InfiniBand error: check the HCA/port of the suspect node (ibstat, link flaps). " + RESTART_EXCLUDE, False),
    # NCCL finds no interface it can open a socket on (container without host networking,
    # a wrong NCCL_SOCKET_IFNAME), or its topology names a network device it cannot find
    # ("NCCL WARN Could not find NET with id 0": a topology file from other hardware, a net
    # plugin or NCCL build that does not match the NICs): the same on every restart until the
    # setting changes.
    ("nccl-no-interface", r"WARN (?:NET/|Net/)?Socket creation failed|Bootstrap : no socket interface found|No usable listening interface found|no socket interface found|NCCL_SOCKET_IFNAME.*(?:not found|no interface)"
     r"|NCCL WARN Could not find (?:NET|NIC) with id\b", "NetworkError", False,
     "NCCL found no usable network interface: run the container with host networking or set NCCL_SOCKET_IFNAME to an interface that exists on every node, then restart.", False),
    ("network-unreachable", r"(?i)Network is unreachable|No route to host|\bmlx5_\d+.*(?:link down|port .*down)|IB port \d+ .*(?:down|inactive)|WARN NET/Socket ?: .*(?:fail|error)", "NetworkError", True,
     RESTART_EXCLUDE, False),
    ("nccl-remote-error", r"ncclRemoteError|remote process exited or there was a network error|NCCL WARN .*Connection closed by remote peer", "NCCLRemoteError", True,
     "A peer died or the network dropped it: find that peer's own error; otherwise " + RESTART_EXCLUDE, True),
    ("gloo-peer-closed", r"gloo/transport/\w+/.*(?:Connection closed by peer|Connection reset by peer|Read error)|This is typically caused by a remote worker crashing|Application timeout caused pair closure", "NCCLRemoteError", True,
     "A peer's connection closed, usually because that rank crashed first: find that rank's own error; otherwise " + RESTART_EXCLUDE, True),
    # A collective that timed out among the first of the process group (the watchdog's
    # SeqNum, or torch 2.4+'s "work: N", below 20: set-up barriers, the parameter broadcast,
    # the first step): the ranks never got through set-up together. Either one rank's
    # one-off work (preprocessing, clustering, loading, compiling) outlasts the collective
    # timeout while the others wait, or the ranks cannot reach each other at all; both
    # repeat on a restart unchanged. A timeout after thousands of collectives, once the
    # job ran, is the transient kind below.
    ("nccl-timeout-at-start", r"WorkNCCL\(SeqNum=1?\d, |(?:detected by watchdog at work|Timeout at NCCL work): 1?\d, last enqueued", "NCCLTimeoutError", False,
     "A collective timed out among the first of the job: one rank's set-up work (preprocessing, clustering, loading, compiling) outlasts "
     "the collective timeout, or the ranks cannot reach each other: raise the process group's timeout or do that work before the "
     "collectives (once, cached), check the NCCL network settings if no rank was busy; a restart unchanged times out again.", True),
    ("nccl-watchdog-timeout", r"Watchdog caught collective operation timeout|ran for \d+ milliseconds before timing out|Some NCCL operations have failed or timed out|NCCL communicator was aborted|ProcessGroupNCCL.*(?:[Tt]imeout|timed out)|collective operation timeout", "NCCLTimeoutError", True,
     "A collective timed out, usually because one rank failed or hung first: look for that rank's error; if none, run the node check and " + RESTART_EXCLUDE, True),
    # NCCL reporting that a CUDA call it made failed (ncclUnhandledCudaError), in torch's
    # "NCCL error in: <file>:<line>, unhandled cuda error", the short "NCCL error: unhandled
    # cuda error (run with NCCL_DEBUG=INFO for details)" that Ray and torch 2.x's watchdog
    # print, "NCCL Error 1: unhandled cuda error" and nccl-tests' "NCCL failure ...": a CUDA
    # fault on that GPU. A symptom, so that the CUDA failure NCCL logged under it (an
    # out-of-memory, an NVLink error, an Xid) names the cause when it is in the log.
    ("nccl-unhandled-cuda", r"ncclUnhandledCudaError|NCCL (?:error|Error \d+|failure)\b[^\n]*?\bunhandled cuda error", "CUDAError", True,
     "NCCL reports a failed CUDA call (a GPU fault on that rank, unless NCCL_DEBUG=INFO's 'Cuda failure' line says otherwise): check the node's Xid log; " + RESTART_EXCLUDE, True),
    ("nccl-unhandled", r"ncclSystemError|ncclInternalError|NCCL (?:error|Error \d+|failure)\b[^\n]*?\bunhandled system error", "NCCLRemoteError", True,
     RESTART_EXCLUDE, True),
    # The rendezvous/store port is already taken on this machine (another job, or a previous
    # run still alive, on torchrun's default 29500): c10d's "failed to bind to [::]:29500 (errno:
    # 98 - Address already in use)", torch 2.4+'s "name: EADDRINUSE", torch 1.x's "Address already
    # in use". Not a lost store: a launch setting, the same on every restart while the port is held.
    ("store-port-in-use", r"errno: 98 - Address already in use|\bname: EADDRINUSE\b|RuntimeError: Address already in use|The server socket has failed to bind to \S+ \(errno: 98", "ArgumentError", False,
     "The launcher's rendezvous port is already in use on this node: give this job its own --master_port / --rdzv_endpoint "
     "(or port 0 for a free one), or stop the process holding it, then restart.", False),
    ("store-connection-lost", r"recvValue failed|sendBytes failed|TCPStore.*(?:Connection reset|Broken pipe|failed)|store->get\(.*\) got error|DistNetworkError|Failed to recv, got 0 bytes", "ConnectionError", True,
     "Lost the c10d store (hosted by rank 0's node): check why that node/rank went away; restart.", True),
    # c10d's client socket giving up on the store's address, torch 1.x and 2.x wordings:
    # timed out waiting for the store host (like the rendezvous timeouts above) ...
    ("store-connect-timeout", r"The client socket has timed out after \S+ while trying to connect to|TCP client failed to connect/validate to host|connect\(\) timed out\. Original timeout was", "ConnectionError", True,
     "Could not reach the c10d store (rank 0's node) in time: check that node is up and MASTER_ADDR/port reachable; restart.", False),
    ("store-timeout", r"DistStoreError: (?:Timed out|Socket Timeout)|Timed out after \d+ seconds waiting for (?:clients|workers)|RendezvousTimeoutError|RendezvousConnectionError|connection to the C10d store has failed|Timed out initializing process group in store based barrier", "ConnectionError", True,
     "Rendezvous/store timed out: some node never joined; check it is alive and reachable, then restart.", False),
    # ------------------------------------------------------------- storage
    # PyTorch's shared-memory files (/dev/shm) filling up is the DataLoader's problem,
    # not the checkpoint disk's.
    ("shared-memory-full", r"unable to write to file </torch_\d+|Unexpected bus error encountered in worker|insufficient shared memory \(shm\)|out of shared memory", "DataloaderKilled", False,
     "Shared memory (/dev/shm) is exhausted by DataLoader workers: enlarge /dev/shm (docker --shm-size / --ipc=host) or lower num_workers/prefetch.", False),
    # Disk full, over quota or failing writes, in Python's, Rust's (safetensors: "(os
    # error 28)", "kind: StorageFull"), C's (EIO "Input/output error") and torch.save's
    # zip writer's wordings, whatever exception wraps it.
    ("disk-full", r"(?i)No space left on device|Disk quota exceeded|low on resource: (?:ephemeral-storage|nodefs|imagefs)|ephemeral local storage usage exceeds|exceeded its local ephemeral storage limit|\(os error (?:5|28|122)\)|kind: StorageFull|\bENOSPC\b|\bEDQUOT\b|Input/output error|PytorchStreamWriter failed writing file|\binline_container\.cc:\d+\] \. unexpected pos \d+ vs \d+", "OSError", False,
     "The file system is full or over quota: free space or write checkpoints elsewhere (and keep fewer), then restart.", False),
    # S3 refusing the request itself (credentials' permissions, signature, clock skew,
    # a missing bucket): the same request fails after a restart until the setting is fixed.
    ("s3-rejected", r"(?:An error occurred|A client error) \(" + S3_CODES + r"\)|<Code>" + S3_CODES + r"</Code>|\b403 " + S3_CODES + r"\b|ExceptionName: " + S3_CODES + r"\b", "S3StorageError", False,
     "Object storage refused the request (permissions, credentials, clock skew or bucket name): fix the IAM policy / credentials / node clock / bucket, then restart.", False),
    # Google Cloud Storage's per-object and per-project mutation limits (one write per second to
    # an object, bucket creation every ~2 s): hit by a workload that rewrites one object or
    # creates buckets in parallel, and hit again by the same workload after a restart.
    ("gcs-mutation-rate-limit", r"exceeded the rate limit for (?:creating and deleting buckets|object mutation operations)|The total number of changes to the object \S+ exceeds the rate limit", "S3StorageError", False,
     "The job mutates one GCS object (or creates buckets) faster than GCS allows: write distinct objects, check a bucket exists "
     "before creating it, back off between writes; then restart.", False),
    ("s3-botocore", r"botocore\.exceptions\.\w+|An error occurred \(\w+\) when calling the \w+ operation|<Error><Code>\w+</Code>|(?:upload|download|copy|move|delete) failed: (?:\S+ to )?s3://|A client error \(\w+\) occurred when calling the \w+ operation|S3UploadFailedError|\bSlowDown\b|HTTP Error 503: Slow Down|503 Slow Down|Please reduce your request rate|S3 (?:upload|download|put|get|write|read)\w* failed|s3fs.*(?:Error|failed)|aiobotocore.*Error|NoSuchBucket|EndpointConnectionError"
     # an HTTP client's timeout or dropped connection to an S3 endpoint (botocore's vendored
     # urllib3, requests, aiohttp under s3fs): the object store, not a tracker or the Hub
     r"|ConnectionPool\(host='(?:[\w.-]+\.)?s3[\w.-]*\.amazonaws\.com(?:\.cn)?'|Cannot connect to host (?:[\w.-]+\.)?s3[\w.-]*\.amazonaws\.com"
     # aws-sdk-cpp's "Unable to parse ExceptionName: InternalError Message: ...", S3's own
     # server-side messages; Azure Blob's ServerBusy / "The server is busy." / OperationTimedOut
     # and Google Cloud Storage's endpoint in any client's error line
     r"|ExceptionName: \w+ Message: |We encountered an internal error\. Please try again|\bServerBusy\b|The server is busy\.|\bOperationTimedOut\b|Operation could not be completed within the specified time"
     r"|https://storage\.googleapis\.com/\S*: |\.blob\.core\.windows\.net\b[^\n]*(?i:error|fail)"
     # GCS's error message without its endpoint: gcsfs raising it as it came ("RuntimeError:
     # b'Backend Error'", "gcsfs.retry.HttpError: Backend Error, 503"), the JSON's "reason":
     # "backendError", googleapiclient's "<HttpError 503 when requesting https://storage...>"
     r"|b?'Backend Error'|\bBackend Error, 5\d\d\b|\bgcsfs\.\w+\.HttpError\b|\breason.: .backendError\b|HttpError 5\d\d when requesting https://(?:www|storage)\.googleapis\.com/", "S3StorageError", True,
     "Object storage failed (throttling, credentials, endpoint): check the bucket and credentials; restart resumes from the last committed checkpoint.", False),
    # ------------------------------------------------------------- service connections
    ("tracker-connection", r"requests\.exceptions\.(?:ConnectionError|ConnectTimeout|ReadTimeout)|urllib3\.exceptions\.(?:MaxRetryError|NewConnectionError|ProtocolError)|redis\.exceptions\.ConnectionError|wandb\.errors\.\w*(?:Comm|Network|Connection)\w*|grpc.*StatusCode\.UNAVAILABLE|HTTPSConnectionPool\(host=\S+\): Max retries exceeded", "ConnectionError", True,
     "A metrics/logging/tracking service was unreachable: check the service or disable it for this run; restart.", False),
    # A model hub refusing the job's credentials: a gated Hugging Face repo whose terms the
    # account has not accepted (huggingface_hub's GatedRepoError, "Cannot access gated repo for
    # url", transformers' "You are trying to access a gated repo", "Access to model X is
    # restricted"), a missing or invalid token (401/403 for url in requests' or urllib's
    # wording). The same request is refused after a restart until access is granted.
    ("hub-access-refused", r"GatedRepoError|Cannot access gated repo|You are trying to access a gated repo|Access to model \S+ is restricted"
     r"|\b40[13] Client Error: (?:Unauthorized|Forbidden) for url\b|HTTP Error 40[13]: (?:Unauthorized|Forbidden)|Invalid (?:user )?token passed|Invalid credentials in Authorization header", "PermissionError", False,
     "The model hub refused the job's credentials (gated repo, missing or invalid token): request access to the repo and log in "
     "(HF_TOKEN) on every node, or use a local copy of the weights; a restart without that is refused again.", False),
    # The model hub answering that the repo, revision or file does not exist where the job
    # looks (huggingface_hub's RepositoryNotFoundError / RevisionNotFoundError /
    # EntryNotFoundError, "Repository Not Found for url" even under a 401, transformers' "is not
    # a local folder and is not a valid model identifier"): a wrong name, repo type or revision.
    ("hub-not-found", r"\b(?:RepositoryNotFoundError|RevisionNotFoundError|EntryNotFoundError)\b|\b(?:401|404) Client Error: (?:Repository Not Found|Revision Not Found|Entry Not Found|Not Found) for url"
     r"|is not a local folder and is not a valid model identifier", "FileNotFoundError", False,
     "The hub has no such repo/revision/file under that name: check the repo id, repo_type (model/dataset/space) and revision "
     "(a private repo also answers not-found without a token), then restart.", False),
    # The hub unreachable with nothing cached to fall back on ("LocalEntryNotFoundError:
    # Connection error, and we cannot find the requested files in the disk cache", transformers'
    # "We couldn't connect to 'https://huggingface.co' to load this file"): the network or the
    # hub, which passes. (Offline mode with nothing cached says "outgoing traffic has been
    # disabled" and is a setting: not matched here.)
    ("hub-unreachable-uncached", r"Connection error, and we cannot find the requested files in the (?:disk |local )?cache|We couldn't connect to '?https?://\S+'? to load", "ConnectionError", True,
     "The model hub could not be reached and the files are not cached: check the network / hub status or pre-download the weights "
     "to a shared cache; restart.", False),
    # An HTTP client's own retry notice (urllib3's "Retrying (Retry(total=4, ...)) after
    # connection broken by 'ReadTimeoutError(...)'", huggingface_hub's "... Retrying in 1s
    # [Retry 1/5]."; pip prints the first): the request may still succeed, so the notice
    # names a cause only when nothing else does.
    ("http-retry-notice", r"Retrying \(Retry\(total=\d+|Retrying in \d+(?:\.\d+)?s \[Retry \d+/\d+\]", "ConnectionError", True,
     "An HTTP client is retrying a remote service: watch it; no action unless the job fails with the service's error.", True),
    # An HTTP service (the Hugging Face Hub, a tracker, a model registry) failing on its
    # side or shedding load, in requests' / huggingface_hub's ("502 Server Error: Bad Gateway
    # for url: ..."), urllib's ("HTTP Error 503: Service Unavailable"), httpx's ("Server
    # error '504 Gateway Timeout' for url") and aiohttp's ("502, message='Bad Gateway'")
    # wordings, with or without an exception name: the request was right and the outage
    # passes. (S3's "503 Slow Down" is named by the S3 rules above.)
    ("http-server-error", r"\b(?:50[0234]|429) (?:Server|Client) Error: |HTTP Error (?:50[0234]|429): |(?i:server error) '50[0234] |\b50[0234], message='"
     r"|\b(?:Bad Gateway|Gateway Time-?out|Service (?:Temporarily )?Unavailable|Too Many Requests) for url\b", "ConnectionError", True,
     "A remote service (model hub, tracker, registry) failed on its side or throttled: wait for it or use a local mirror/cache; restart.", False),
    # The client giving up on a response, or the server dropping it mid-transfer, in
    # urllib3's / requests' / huggingface_hub's wordings without the package prefix
    # ("ReadTimeoutError: HTTPSConnectionPool(...): Read timed out.", "'(ProtocolError('Connection
    # aborted.', RemoteDisconnected(...)))' thrown while requesting GET ..."), and httpx's,
    # aiohttp's and http.client's. (An object-store read cut short, aiohttp's ClientPayloadError
    # under s3fs, is left to the S3 rules and the agent: the line does not say which service.)
    ("http-connection-dropped", r"\b(?:ReadTimeoutError|ConnectTimeoutError|NewConnectionError|MaxRetryError|ChunkedEncodingError|RemoteDisconnected|IncompleteRead)\b"
     r"|ProtocolError\(.Connection (?:aborted|broken)|Connection broken: |Remote end closed connection without response|HTTPS?ConnectionPool\(host=\S+\): Read timed out"
     r"|httpx\.(?:ReadTimeout|ConnectTimeout|ConnectError|ReadError|RemoteProtocolError)\b|aiohttp\.\S*(?:ServerDisconnectedError|ServerTimeoutError|ClientConnectorError)\b",
     "ConnectionError", True,
     "A connection to a remote service (model hub, dataset stream, tracker) timed out or dropped: check the service and the network, "
     "raise the client's timeout or retries if it keeps happening (or stage the data locally); restart.", False),
    ("tracker-retry-warning", r"wandb: Network error \(\w+\), entering retry loop", "ConnectionError", True,
     "Tracker connectivity is flaky (retrying): watch it; no action needed unless the job fails.", True),
    ("connection-reset", r"ConnectionResetError|ConnectionRefusedError|ConnectionAbortedError|Connection reset by peer|Connection refused", "ConnectionError", True,
     "A connection to a service was reset/refused: check the service and the network; restart.", False),
    # c10d's client socket, continued from "store-connect-timeout": the warning a client
    # prints for each failed attempt (errno 110 timed out, "any network address of"). It is
    # printed during a slow start too, so it names the cause only when nothing else does;
    # alone it means the store's address is wrong or blocked, which a restart does not
    # change. (Attempts refused or unroutable are named by the rules above.)
    ("store-connect-failed", r"\[c10d\] The client socket has failed to connect", "ConnectionError", False,
     "This node cannot reach the c10d store's address: check MASTER_ADDR / MASTER_PORT (or --rdzv_endpoint) and that the port is open between the nodes, then restart.", True),
    # ------------------------------------------------------------- framework
    ("dataloader-killed", r"DataLoader worker \(pid\(?s?\)? ?[\d, ]+\)? (?:is killed by signal|exited unexpectedly)|DataLoader worker .*killed by signal", "DataloaderKilled", False,
     "A DataLoader worker died (usually host RAM or /dev/shm exhausted): lower num_workers/prefetch, enlarge /dev/shm, check host memory.", False),
    ("model-loading", r"Error\(s\) in loading state_dict for|size mismatch for [\w.]+: copying a param|Missing key\(s\) in state_dict|Unexpected key\(s\) in state_dict|SafetensorError|Error while deserializing header: |\b(?:HeaderTooLarge|HeaderTooSmall|InvalidHeaderDeserialization|MetadataIncompleteBuffer)\b|PytorchStreamReader failed (?:reading zip archive|locating file|reading file)|unexpected EOF, expected \d+ more bytes|UnpicklingError|CheckpointingException|(?i:(?:failed|unable) to load (?:the )?(?:checkpoint|model|weights))|does not appear to have a file named (?:pytorch_model|model)|(?i:checkpoint .*(?:corrupt|truncated|incomplete))", "ModelLoadingError", False,
     "The checkpoint/weights do not load: check the checkpoint path, that its manifest is complete, and that the model config matches it.", False),
    ("dataset-loading", r"DatasetGenerationError|datasets\.exceptions\.\w+|(?i:(?:failed|unable|error) (?:to load|loading|while loading) (?:the )?(?:dataset|data shard|index))|ArrowInvalid|(?i:indexed dataset .*(?:mismatch|corrupt))|(?i:dataset (?:index|shard) .*(?:corrupt|mismatch|truncated))|MMapIndexedDataset.*(?:Error|assert)|(?i:\bdataset\b[^\n]{0,40} does not exist)"
     # a sample the loader cannot decode: PIL's "cannot identify image file", a truncated image,
     # datasets' "Not able to read records in the JSON file"
     r"|UnidentifiedImageError|cannot identify image file|image file is truncated|Not able to read records in the JSON file"
     # a data file corrupt or cut short: TensorFlow's record reader ("DataLossError: corrupted
     # record at 15458974733", "Data loss: truncated record at"), gzip / lzma shards ("Compressed
     # file ended before the end-of-stream marker was reached", BadGzipFile), and text shards
     # that do not decode ("UnicodeDecodeError: 'utf-8' codec can't decode byte 0xdf")
     r"|(?i:\b(?:corrupted|truncated) record at \d+)|DataLossError: [^\n]{0,40}(?i:record)|Compressed file ended before the end-of-stream marker was reached|\bBadGzipFile\b|Not a gzipped file"
     r"|" + X + r"UnicodeDecodeError(?::|\s*$)|codec can't decode byte 0x[0-9a-fA-F]+ in position \d+", "DatasetLoadingError", False,
     "The dataset does not load: check the data path and that preprocessing finished (index and binary files match).", False),
    # ------------------------------------------------------------- torchrun summaries and signals (pure symptoms)
    ("child-failed", r"ChildFailedError|Worker group FAILED|Local worker group failed|\] failed \(exitcode: -?\d+\) local_rank: \d+|^\S*\s*[\w.-]+\.py FAILED\s*$", "Unknown", True,
     "torchrun reports that a worker failed; its own error is the root cause.", True),
    ("signal-abort", r"Signal 6 \(SIGABRT\)|SIGABRT|Fatal Python error: Aborted|terminate called after throwing an instance of|Signal 15 \(SIGTERM\)|Sending process \d+ closing signal SIGTERM", "Unknown", True,
     "A process aborted, usually after another rank failed; look for that rank's error.", True),
    ("signal-kill", r"Signal 9 \(SIGKILL\)|exitcode\s*:\s*-9\b|Killed process \d+|oom-kill", "Unknown", True,
     "A process was SIGKILLed (host OOM killer or the scheduler).", True),
    ("torchrun-summary", r"^\S*\s*(?:exitcode|error_file)\s*:|Root Cause \(first observed failure\)", "Unknown", True,
     "torchrun's failure summary; the failed rank's own error is the root cause.", True),
    ("traceback-header", r"Traceback \(most recent call last\):|^\S*\s*During handling of the above exception|The above exception was the direct cause", "Unknown", True,
     "A Python traceback starts here; the exception line at its end names the error.", True),
    ("segfault", r"Segmentation fault|SIGSEGV|Signal 11", "Unknown", True,
     "A process crashed with a segmentation fault.", True),
    # ------------------------------------------------------------- Python exceptions (script)
    # (and hydra's overrides: "Could not override 'task.data'." / omegaconf's "Key 'data' is
    # not in struct" for a key the config does not have, "Could not append to config. An item is
    # already at", an override that does not parse, a config group option that does not exist)
    ("argparse-error", r"error: unrecognized arguments:|error: the following arguments are required:|error: argument [-\w/]+: |argparse\.ArgumentError|error: ambiguous option:"
     r"|Could not override '[^'\n]+'|Could not (?:append to|delete from) config\b|\bKey '[^'\n]+' is not in struct\b|hydra\.errors\.(?:OverrideParseException|ConfigCompositionException|MissingConfigException)\b"
     r"|Error (?:parsing|merging) override\b"
     # a launcher's argument check refusing to write over an earlier run's output: transformers'
     # example scripts ("Output directory (out/) already exists and is not empty. Use
     # --overwrite_output_dir to overcome."), LlamaFactory's parser ("... Please set
     # `overwrite_output_dir`.")
     r"|\b[Oo]utput dir(?:ectory)? (?:\S+ |\([^)\n]*\) )?already exists and is not empty\b", "ArgumentError", False,
     "The command line is wrong: fix the arguments in the job spec / launch command.", False),
    # Slurm refusing the job's own request: sbatch's "Batch job submission failed: Requested node
    # configuration is not available" (or an invalid account, partition, QOS, time limit, gres,
    # node count; a policy the job violates), srun's "Unable to allocate resources: ...", salloc's
    # "Job submit/allocate failed: ...", an option the site no longer accepts ("Parameter
    # --gres=gpu:1 no longer acceptable, please switch to --gpus=1") or an invalid one. The same
    # request is refused again: the job's resources or options must change. (Passing reasons are
    # "slurm-submit-transient", which matches such a line first.)
    ("slurm-submit-refused", SLURM_CMD + r"error: (?:Batch job submission failed|Unable to allocate resources|Job submit/allocate failed|Allocation failure): "
     r"|" + SLURM_CMD + r"(?:error: )?(?:[Ii]nvalid|[Uu]nrecognized) (?:option\b|argument\b|[-\w/() ]{1,40}?(?:specification|specified)\b)"
     r"|" + SLURM_CMD + r"error: [^\n]*?\bno longer (?:acceptable|supported|allowed)\b", "ArgumentError", False,
     "Slurm refused the job's request (resources, account, partition, QOS, time limit or an option): change the job's Slurm "
     "options (or the cluster inventory's slurm: section) to what the cluster offers, then submit again.", False),
    # (and a build step the job runs failing in the compiler's or linker's own words: a JIT-built
    # extension or Triton's launcher - "collect2: error: ld returned 1 exit status", "cannot find
    # 'ld'", "/usr/bin/ld: cannot find -lcuda", "ninja: build stopped: subcommand failed",
    # setuptools' "error: command '/usr/bin/gcc' failed with exit code 1", "nvcc fatal : ...")
    ("called-process", r"CalledProcessError|returned non-zero exit status \d+"
     r"|\bcollect2: (?:fatal )?error: |\bld returned \d+ exit status\b|\bld(?:\.(?:bfd|gold|lld))?: (?:error: )?cannot find -l"
     r"|cannot find [^\w\s]{1,3}ld[^\w\s]|ninja: build stopped: subcommand failed|error: command '[^'\n]*' failed with exit (?:code|status) \d+|\bnvcc fatal\s*: ", "CalledProcessError", False,
     "A subprocess the script runs failed: check that command and its environment.", False),
    ("permission", X + r"PermissionError(?::|\s*$)|\[Errno 13\] Permission denied", "PermissionError", False,
     "Permission denied: fix ownership/permissions of the path, or write elsewhere.", False),
    # (transformers' "OSError: <dir> does not appear to have a file named generation_config.json":
    # a file the folder lacks; missing weights files are model-loading's, which matches first)
    ("file-not-found", X + r"FileNotFoundError(?::|\s*$)|\[Errno 2\] No such file or directory|\bdoes not appear to have (?:a file|files) named\b", "FileNotFoundError", False,
     "A file is missing: check the path in the job spec and that the data/checkpoint exists on every node.", False),
    # transformers' lazy imports wrap the ImportError in "RuntimeError: Failed to import X
    # because of the following error"; a compiled extension built for another torch says
    # "undefined symbol".
    ("import", X + r"(?:ImportError|ModuleNotFoundError)(?::|\s*$)|No module named |Failed to import [\w.]+ because of the following error|\.so: undefined symbol: |\.so[.\d]*: cannot open shared object file"
     # a library found missing at run time in a framework's own wording (XLA's "Unable to load
     # NCCL library", TF's "Could not load dynamic library 'libcudnn.so.8'", "Failed to load library",
     # cuDNN 9's "Unable to load any of {libcudnn_graph.so.9.1.0, ...}")
     r"|(?i:\b(?:unable|failed|could not|couldn't) (?:to )?(?:load|dlopen) (?:the )?(?:dynamic |shared )?(?:library\b|\S+ library\b))|Unable to load any of \{lib"
     # an extension compiled against another numpy (or another build of a C type): "numpy.dtype
     # size changed, may indicate binary incompatibility", numpy 2's "A module that was compiled
     # using NumPy 1.x cannot be run in NumPy 2.0", "_ARRAY_API not found", "module compiled
     # against API version 0x10 but this version of numpy is 0xe"
     r"|size changed, may indicate binary incompatibility|compiled using NumPy \d\.x cannot be run in NumPy|\b_ARRAY_API not found"
     r"|module compiled against (?:ABI|API) version \w+ but this version of numpy is", "ImportError", False,
     "A module is missing or broken: fix the environment (install/pin the package) on every node.", False),
    ("syntax", X + r"(?:SyntaxError|IndentationError|TabError)(?::|\s*$)", "SyntaxError", False,
     "The script does not parse: fix the syntax error.", False),
    ("name", X + r"(?:NameError|UnboundLocalError)(?::|\s*$)", "NameError", False,
     "A name is undefined: fix the script.", False),
    ("key", X + r"KeyError(?::|\s*$)", "KeyError", False,
     "A key is missing (config, state dict or batch): fix the script or config.", False),
    # an out-of-range index on the GPU is a device-side assertion in ATen's Indexing.cu
    ("index", X + r"IndexError(?::|\s*$)|Assertion .srcIndex < srcSelectDimSize. failed|Assertion .index >= -sizes\[i\] && index < sizes\[i\]|Assertion .*(?:t >= 0 && t < n_classes|cur_target >= 0 && cur_target < n_classes|idx_dim >= 0 && idx_dim < index_size|index out of bounds)", "IndexError", False,
     "An index is out of range: fix the script or data.", False),
    ("type", X + r"TypeError(?::|\s*$)", "TypeError", False,
     "Wrong argument types: fix the script.", False),
    # torch.save reports a file the OS would not create (disk full, no such directory,
    # read-only) as "RuntimeError: File X cannot be opened."
    ("os", X + r"(?:OSError|IOError)(?::|\s*$)|\[Errno (?:5|28|30|122)\]|\bFile \S+ cannot be opened\.", "OSError", False,
     "An OS-level error (disk full, I/O error, read-only file system): check the node's file systems.", False),
    # ------------------------------------------------------------- Python exceptions (framework)
    ("attribute", X + r"AttributeError(?::|\s*$)", "AttributeError", False,
     "An attribute is missing (version mismatch or bug): fix the code or pin versions.", False),
    ("assertion", X + r"AssertionError(?::|\s*$)", "AssertionError", False,
     "An assertion failed (usually an inconsistent config): fix the config.", False),
    ("zero-division", X + r"ZeroDivisionError(?::|\s*$)", "ZeroDivisionError", False,
     "Division by zero: check the config values that feed it (batch sizes, intervals).", False),
    ("value", X + r"ValueError(?::|\s*$)", "ValueError", False,
     "A bad value (config or data): fix the value named in the message.", False),
    ("runtime", X + r"(?:RuntimeError|DistBackendError|DistError)(?::|\s*$)", "RuntimeError", False,
     "A runtime error in the framework: read the message; restart will not help until it is fixed.", False),
)
