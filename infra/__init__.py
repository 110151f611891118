"""forgeflow: infra — what touches machines and services while a job runs.

    storage       one URL-based object-storage interface (local paths, S3 through boto3)
    runfiles      the run directory and exit codes: the worker's contract with its watchers, typed readers
    atomic_write  replace a file in one step (temp file + fsync + os.replace)
    yaml_config   the YAML loader of every config kind: `base:` inheritance, field-naming errors
    launch        launchers: one torchrun per node (local subprocess; Prefect in tasks/)
    standby       warm restarts: the next attempt's world started ahead, waiting at a gate (local launcher); node checks in its ranks
    autogroup     a session's autogroup niceness (the kernel's scheduling group), set through its rate limit
    slurm         the Slurm launcher (one batch job per attempt), node states, drain/resume
    slurm_start   delegated Slurm: sbatch --test-only for each option, submit the one done first
    kubernetes    the Kubernetes launcher: indexed Job + headless Service per attempt, PyTorchJob,
                  evaluation Jobs, the Prefect kubernetes work pool's base job template
    kueue         Kubernetes under Kueue: admission, the admitted flavor, eviction as preemption
    reaper        run a command so none of its descendants outlives its starter
    torchrun      torchrun (the agent on each node), forking its ranks and exiting as soon as they have
    fast_exit     exit a process that imported torch without the interpreter's teardown
    lease_guard   a node's own check of its job's lease (database or lease file): ranks stop once the holder is gone
    stop_signal   stop a loop on SIGTERM/SIGINT: a handler that only flags (and wakes a pipe), never locks
    watch         follow a launched job until it finishes, fails, hangs or spikes
    nodecheck     two-round pairwise collective tests that find faulty and slow nodes
    nodecheck_worker  one rank of a node-check world
    notify        alerts: Slack incoming webhook, or printed and kept
    untrusted_text  log and LLM text made safe for a terminal, a markdown code block, a Slack code block
    charts        a matplotlib figure -> PNG -> inline data-URI markdown image (renders in the Prefect UI)
    statedb       the state database (SQLite file / PostgreSQL): engines, schema, Alembic migrations
"""
