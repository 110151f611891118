"""forgeflow: flows — Prefect flows (the runbooks) and the `forgeflow` command line.

    pretrain     plan, place, launch, watch, diagnose, act, alert — until the job is done
    node_launch  one node's share of a training attempt (runs on that node's work queue)
    diagnose     the `diagnose-failure` flow
    evaluate     evaluate checkpoints as they are committed, and catch up on a schedule
    finetune     Mobius offloaded fine-tuning: profile, partition, map, run, checkpoint, evaluate
    finetune_cli `forgeflow finetune JOB.yaml` (imports Prefect only when it runs)
    deploy       `forgeflow deploy`: pool, deployments, limits, automations
    submit       `forgeflow submit`: queue a job and return its id; a runner or a Prefect flow run trains it
    job_runner   the detached runner of a submitted job on the embedded default (no Prefect server)
    cancelled_run  `release-cancelled-job`: a submitted job whose flow run was cancelled in Prefect leaves the queue
    commands     Prefect-aware subcommands: pretrain (the foreground form of submit), demo, deploy
    cli          the `forgeflow` entry point
"""
