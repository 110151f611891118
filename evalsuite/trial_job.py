"""Inside a trial's batch job (Slurm or Kubernetes): `python -m evalsuite.trial_job run trial.json result.json`.

The submitter wrote the trial (as the job sees its devices) to `trial.json` on storage the
job sees; this runs it (`evalsuite.trials.run_trial`) and writes `result.json` atomically.
A failure raises: its traceback lands in the job's output (Slurm's output file, the pod's
log), which the submitter reports. Where it ran goes into the result's `worker`: the Slurm
job id, or the Kubernetes Job, pod and node.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from evalsuite.trials import Trial
from infra.atomic_write import atomic_write

K8S_JOB_ENV = "FORGEFLOW_TRIAL_JOB"   # set in a trial's Kubernetes Job (evalsuite.kubernetes_trials)


def where_it_ran(environ: dict[str, str] | None = None) -> dict[str, str]:
    env = os.environ if environ is None else environ
    if env.get(K8S_JOB_ENV):
        return {"k8s_job": env[K8S_JOB_ENV], "k8s_pod": env.get("HOSTNAME", ""),
                "k8s_node": env.get("FORGEFLOW_NODE_NAME", "")}
    return {"slurm_job_id": env.get("SLURM_JOB_ID", "")}


def run_job(trial_file: Path, result_file: Path) -> int:
    from evalsuite.trials import run_trial

    trial = Trial.model_validate_json(Path(trial_file).read_text())
    result = run_trial(trial)   # a failure raises: its traceback lands in the job's output
    result.worker.update(where_it_ran())
    atomic_write(result_file, json.dumps(result.model_dump(mode="json")))
    return 0


def main(argv: list[str] | None = None, prog: str = "python -m evalsuite.trial_job") -> int:
    import argparse

    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run one trial inside its batch job and write its result file")
    run.add_argument("trial_file")
    run.add_argument("result_file")
    args = parser.parse_args(argv)
    return run_job(Path(args.trial_file), Path(args.result_file))


if __name__ == "__main__":
    sys.exit(main())
