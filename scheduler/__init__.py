"""forgeflow: scheduler — how big a job is, where it fits, and who runs next.

    gpus          GPU catalogue: memory, peak TFLOP/s, links, per type
    cluster       cluster inventory (YAML or auto-detected), free GPUs, cordons
    memory_model  MARP: predicted per-GPU peak memory of a plan (and Frenzy's formula)
    memory_probe  measured peak memory of a plan on this machine (checks MARP)
    cost_model    predicted step time of a plan (compute, TP/PP/DP communication)
    planner       Crius cells: every runnable (dp, tp, pp, micro-batch, recompute) plan, ranked
    placement     HAS best-fit placement and Mobius cross mapping: node -> GPUs -> ranks
    placement_chart  the placement picture: nodes x GPUs, the job's ranks and stages on them
    worker_command   the worker's command line for one attempt (the placement's layout, the attempt's overrides)
    offload/      Mobius: fine-tune beyond GPU memory (profiles, partition MIP, cross mapping, simulator)
    traces        job-arrival traces (synthetic, Philly/Helios-shaped) for the simulator
    policy        the scheduling policies (FCFS, HAS, ECT; EASY backfill and SJF baselines): one pass,
                  run by simulator and orchestrator
    fair_share    teams: quotas with borrowing, fair-share order, decayed usage; the admission decision
                  over a snapshot (queue, holdings, quotas, usage, policy)
    elastic       elastic policy: running data-parallel jobs shrink so queued jobs start, grow into idle
                  GPUs, shrink back when needed; one pass, run by the simulator (policy `elastic`)
    preemption    which running jobs give way to a waiting one: the fewest GPU-seconds lost since
                  their last committed checkpoint (lower class, or another team's borrowed quota)
    simulate      discrete-event cluster simulator running the placement policies
    orchestrator  live cluster state, queue and leases in the state database (SQLite / PostgreSQL)
    cli           `forgeflow plan`, `simulate`, `cluster ...` and `submit`
"""
