"""forgeflow: evalsuite — decoupled checkpoint evaluation (Acme's trial coordinator).

    datasets.py     registry of datasets (HumanEval, perplexity, JSONL tasks from YAML), prompt cache
    backends.py     inference backends (transformers, vLLM) writing one JSONL schema
    records.py      that schema: JSONL records per shard, a completion record written last
    trials.py       a trial: one model load, inference over shards; resumable; in a thread or its own
                    process that sees only its slot's devices (CUDA_VISIBLE_DEVICES, pinned cores)
    preload.py      precursor job: checkpoint from storage into /dev/shm once per node
    sandbox.py      process-per-program HumanEval execution with limits and isolation
    metrics.py      metric jobs on CPU workers (exact match, multiple choice, perplexity, pass@k)
    history.py      runtime history (per dataset, backend, model size) for predictions
    coordinator.py  decompose (split/batch), assign (LPT over slots): the plan
    executor.py     the one loop that runs a plan, records runtime history; pluggable submitters
    node_session.py multi-node evaluation, one long-lived session per node: the node's half (serve_node)
                    and the evaluator's (open_sessions: ready, hand out trials, stop)
    slurm_trials.py the Slurm submitter: one sbatch job per trial, watched, scancelled on interrupt
    kubernetes_trials.py the Kubernetes submitter: one Job per trial (in Kueue when configured), deleted on interrupt
    trial_job.py    inside a trial's batch job (Slurm or Kubernetes): run it, write its result file
    runner.py       the whole pipeline in one call
    suite.py        suite YAML
    reporting.py    results beside the checkpoint, score history across checkpoints, trend chart
    cli.py          `forgeflow eval CHECKPOINT --suite SUITE`
    checkpoints.py  from "a checkpoint" (HF folder, committed training checkpoint, URL) to a model folder
    job_scope.py    what an evaluation created through Prefect's API may name: one job's recorded spec and files
    errors.py       typed errors (EvalConfigError is a config error: one line, exit 2)
"""
