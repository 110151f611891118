"""forgeflow: tasks — thin, typed Prefect task wrappers over the libraries.

    pretrain_tasks     plan, place, launch, watch, diagnose, node check
    launchers          launchers by name: `local`, `prefect`
    checkpoint_events  the event announcing each committed checkpoint (CommitAnnouncer)
    eval_tasks         the evaluate-checkpoint flow's tasks
"""
