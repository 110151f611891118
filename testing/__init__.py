"""forgeflow: testing — the harness that tests and benchmarks stand on; no forgeflow package imports it.

    local_s3         a local S3 server (SeaweedFS `weed mini`) on free ports; free_ports
    slurm_local      a real single-host Slurm (slurmctld + slurmd + munge); `python -m testing.slurm_local DIR`
    postgres_servers PostgreSQL servers to stop, start, replicate (pg_basebackup -R) and promote, and PgBouncer
    prefect_server   a local `prefect server start` with process workers, pinned to cores if asked
    node_faults      physical node faults for drills on a one-machine cluster (a node lost: its processes killed)
    orphan_drill     a job's flow SIGKILLed while its ranks train through node-launch: how long until they are gone
    torchrun_ranks   which processes are infra.torchrun agents and which their ranks (a forked rank has its agent's command line)
    tiny_checkpoint  a tiny Llama checkpoint in Hugging Face format, built locally in seconds

Not part of the installed package (pyproject lists the product packages only): run from the
repository root, as `make test` and the benchmarks do.
"""
