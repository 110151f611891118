"""forgeflow: tasks — Prefect adapters over the libraries: tasks, artifacts, flow runs.

    pretrain_tasks     launch, watch, diagnose, node check
    cluster_tasks      the shared cluster: join, submit, wait for GPUs, cordon, the cluster table
    launchers          launchers by name: `local`, `prefect`
    checkpoint_events  the event announcing each committed checkpoint (CommitAnnouncer)
    eval_tasks         the evaluate-checkpoint flow's tasks
"""
