"""Prefect-aware subcommands of `forgeflow`: pretrain, demo, deploy."""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from contextlib import contextmanager
from pathlib import Path

DEMO_DRILLS = ("cuda_error@60:1", "loss_spike@120")


def register(subparsers: argparse._SubParsersAction) -> None:
    from flows.submit import add_job_options

    p = subparsers.add_parser(
        "pretrain", help="run a job in the foreground: queue it, train, recover, until it ends",
        description="The foreground form of `forgeflow submit` (like srun after sbatch): the job is queued "
                    "with the cluster's orchestrator under its own id and the pretrain flow runs it here, "
                    "showing progress, until it finishes or stops. --json prints the result as one object "
                    "(job, job_id, finished, attempts, final_step, failures, ...).")
    add_job_options(p)
    p.set_defaults(func=_pretrain)

    d = subparsers.add_parser("demo", help="the main job end to end on this machine (make demo)")
    d.add_argument("--config", default="configs/tiny-cpu.yaml")
    d.add_argument("--no-faults", action="store_true", help="train without the two fault drills")
    d.add_argument("--no-eval", action="store_true", help="skip evaluating the checkpoints")
    d.add_argument("--json", action="store_true",
                   help="print a summary as one JSON object (pretrain result, evaluations, where to look); "
                        "progress goes to stderr")
    d.set_defaults(func=_demo)

    s = subparsers.add_parser("deploy", help="create the work pool, deployments, automation and limits "
                                             "on the Prefect server PREFECT_API_URL points at")
    s.add_argument("--cluster", default="local", help="inventory to register with the orchestrator (default: this machine)")
    s.add_argument("--pool", default="forgeflow")
    s.add_argument("--pool-type", default="process", choices=["process", "kubernetes"],
                   help="process: workers on the machines; kubernetes: flow runs as Kubernetes Jobs "
                        "(a base job template with memory-backed /dev/shm and the S3 Secret; workers need "
                        "prefect-kubernetes)")
    s.add_argument("--slack-block", default=None, metavar="NAME",
                   help="reuse this existing Slack webhook block (prefect-slack) for flow alerts and the "
                        "automation; default: the block 'forgeflow-slack', created from SLACK_WEBHOOK_URL")
    s.add_argument("--json", action="store_true",
                   help="print what exists on the server afterwards as one JSON object")
    s.set_defaults(func=_deploy)


def _pretrain(args: argparse.Namespace) -> int:
    import socket

    from flows.submit import queue_from_args
    from scheduler.orchestrator.seat import cluster_orchestrator

    # queued before Prefect starts: bad input is one line and exit 2, and the job has its id
    submitted, options = queue_from_args(args, by="forgeflow pretrain")
    cluster_orchestrator().set_runner(submitted.job_id, {"kind": "foreground", "host": socket.gethostname(),
                                                         "pid": os.getpid(), "cwd": os.getcwd()})
    # live progress on stderr (a panel on a terminal, plain lines in a log file); none with --json
    with training_progress(submitted.spec, "off" if args.json else "auto"):
        result = run_submitted(submitted, options)
    if args.json:
        print(json.dumps(pretrain_result_json(result)))
    else:
        print(_pretrain_summary(result))
    return 0 if result.finished else 1


def run_submitted(submitted, options: dict):
    """The pretrain flow on a job queued here, in this process; its flow run named after the job."""
    from flows.pretrain import pretrain

    options = {k: v for k, v in options.items() if k != "priority"}  # it is queued already
    return pretrain.with_options(flow_run_name=f"{submitted.spec.name}-{submitted.job_id}")(
        job_spec=submitted.spec.model_dump(mode="json"), job_id=submitted.job_id, **options)


@contextmanager
def training_progress(spec, mode: str = "auto", console=None):
    """Show the pretrain flow's progress while the block runs: step, loss, tokens/s and ETA from
    the run directory's files (training.progress), and as the last event each failure, its
    diagnosis and the action taken, from the flow's warnings (its run logger)."""
    from training.progress import LiveProgress

    with LiveProgress(spec.resolved_run_dir, spec.training.steps, console, mode=mode) as live:
        handler = _CallbackHandler(live.note)
        loggers = [logging.getLogger(name) for name in ("prefect.flow_runs", "prefect.task_runs")]
        for logger in loggers:
            logger.addHandler(handler)
        moved = _prefect_logs_above(live) if live.mode == "live" else []
        try:
            yield live
        finally:
            for logger in loggers:
                logger.removeHandler(handler)
            for log_handler, log_console in moved:
                log_handler.console = log_console


def _prefect_logs_above(live) -> list:
    """Prefect's console log handlers print through their own rich consoles, bound to the real
    stderr; while the live panel shows, they print through the panel's console instead, so log
    lines scroll above the panel rather than being written into it. Returns (handler, console)
    pairs to restore."""
    moved = []
    for name in ["", *[n for n in logging.Logger.manager.loggerDict if n.startswith("prefect")]]:
        for h in getattr(logging.getLogger(name), "handlers", []):
            log_console = getattr(h, "console", None)
            if callable(getattr(log_console, "print", None)) and not isinstance(log_console, _PrintAbove):
                moved.append((h, log_console))  # a handler on two loggers is moved once
                h.console = _PrintAbove(live.console)
    return moved


class _PrintAbove:
    """A log handler's console stand-in: prints as plain text through the live panel's console."""

    def __init__(self, console) -> None:
        self.console = console

    def print(self, *objects, **kwargs) -> None:
        kwargs.update(markup=False, highlight=False)  # log text, not rich markup ("[SUCCESS] ...")
        self.console.print(*objects, **kwargs)

    def __getattr__(self, name):
        return getattr(self.console, name)


class _CallbackHandler(logging.Handler):
    """A flow's warnings (a failure and what was done about it, a straggler) to a callback."""

    def __init__(self, callback) -> None:
        super().__init__(level=logging.WARNING)
        self.callback = callback

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.callback(record.getMessage())
        except Exception:
            self.handleError(record)


def pretrain_result_json(result) -> dict:
    """`forgeflow pretrain --json`: the PretrainResult as plain JSON (schema in the README)."""
    from dataclasses import asdict

    return asdict(result)


def _pretrain_summary(result) -> str:
    lines = [f"{result.job}: {'finished' if result.finished else 'not finished'} at step {result.final_step} "
             f"after {result.attempts} attempt(s)" + (f" ({result.stopped_because})" if result.stopped_because else "")]
    for failure in result.failures:
        lines.append(f"  attempt {failure.attempt}: {failure.root_cause} at step {failure.step} "
                     f"({failure.source}) -> {failure.action}")
    return "\n".join(lines)


def _demo(args: argparse.Namespace) -> int:
    if not args.json:
        return _run_demo(args)
    # stdout holds only the object: everything else written to fd 1 (rich, Prefect's
    # print logging, torchrun children) goes to stderr while the demo runs
    import sys
    from contextlib import redirect_stdout

    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with redirect_stdout(sys.stderr):
            summary: dict = {}
            code = _run_demo(args, summary)
    finally:
        sys.stderr.flush()
        os.dup2(saved, 1)
        os.close(saved)
    print(json.dumps(summary))
    return code


def _run_demo(args: argparse.Namespace, summary: dict | None = None) -> int:
    import sys

    from rich.console import Console

    from scheduler.orchestrator.seat import queue_spec
    from training.config import load_job_spec

    console = Console(file=sys.stderr) if summary is not None else Console()
    started = time.monotonic()
    drills = [] if args.no_faults else list(DEMO_DRILLS)
    # The demo is a drill from step 0: each run is a new job with its own run directory and
    # checkpoints (a previous demo's would make it resume at the last step with nothing to
    # recover from). Prepared data is shared and reused.
    submitted = queue_spec(load_job_spec(args.config), "local", by="forgeflow demo")
    spec = submitted.spec
    console.rule(f"forgeflow demo: {spec.name} (job {submitted.job_id})")
    if drills:
        console.print(f"Fault drills: {', '.join(drills)} (an infrastructure error, then a loss spike); "
                      "the flow must diagnose, alert and recover from both on its own.")
    with training_progress(spec, console=console):
        result = run_submitted(submitted, {"cluster": "local", "hang_timeout_s": 180.0, "backoff_s": 2.0,
                                           "drill_faults": drills or None})
    console.rule("result")
    for failure in result.failures:
        console.print(f"- attempt {failure.attempt}: {failure.root_cause} at step {failure.step} "
                      f"({failure.source}) → {failure.action}")
    seconds = time.monotonic() - started
    console.print(f"finished={result.finished} at step {result.final_step} after {result.attempts} attempt(s) "
                  f"in {seconds:.0f}s")
    evaluations = []
    if result.finished and not args.no_eval:
        evaluations = _demo_eval(console, spec)
    run_dir = spec.resolved_run_dir.resolve()
    home = os.environ.get("PREFECT_HOME", str(Path.home() / ".prefect"))
    console.rule("where to look")
    console.print(f"checkpoints:  {spec.checkpoint.url}")
    console.print(f"run dir:      {run_dir} (logs/, heartbeat/, markers/, loss_curve.png, diagnosis/)")
    console.print(f"metrics:      .venv/bin/tensorboard --logdir {run_dir / 'tensorboard'}  (train/: loss, lr, "
                  "grad norm, tokens/s, memory, checkpoint stall; eval/: scores per step)")
    console.print(f"Prefect UI:   PREFECT_HOME={home} .venv/bin/prefect server start  → http://127.0.0.1:4200 "
                  "(flow runs, artifacts: plans, placement, failures, loss curve)")
    if summary is not None:
        summary.update(demo_summary_json(result, evaluations, seconds=seconds, checkpoints=str(spec.checkpoint.url),
                                         run_dir=str(run_dir), prefect_home=home))
    return 0 if result.finished else 1


def demo_summary_json(result, evaluations: list[dict], *, seconds: float, checkpoints: str, run_dir: str,
                      prefect_home: str) -> dict:
    """`forgeflow demo --json` (schema in the README): the pretrain result as `forgeflow
    pretrain --json` gives it, each evaluated checkpoint's results, and where to look."""
    return {
        "pretrain": pretrain_result_json(result),
        "seconds": round(seconds, 1),
        "evaluations": evaluations,
        "where": {
            "checkpoints": checkpoints,
            "run_dir": run_dir,
            "loss_curve": str(Path(run_dir) / "loss_curve.png"),
            "tensorboard": str(Path(run_dir) / "tensorboard"),
            "prefect_home": prefect_home,
        },
    }


def evaluation_entry(checkpoint: str, suite_name: str) -> dict:
    """One evaluated checkpoint for `forgeflow demo --json`: where its results are and its scores."""
    from evalsuite.reporting import results_key, split_checkpoint_url
    from infra.storage import open_storage

    root, name = split_checkpoint_url(checkpoint)
    storage = open_storage(root)
    try:
        key = results_key(name, suite_name)
        payload = json.loads(storage.get_bytes(key))
        return {"checkpoint": checkpoint, "results_path": storage.url(key),
                "results": payload.get("results", {}), "failed": payload.get("failed", {})}
    finally:
        storage.close()


def _demo_eval(console, spec) -> list[dict]:
    """Evaluate the demo's committed checkpoints (decoupled evaluation)."""
    from evalsuite.suite import load_suite
    from flows.evaluate import evaluate_committed

    console.rule("evaluating checkpoints")
    evaluated = evaluate_committed(spec)
    suite_name = load_suite("demo", spec).name
    return [evaluation_entry(checkpoint, suite_name) for checkpoint in evaluated]


def _deploy(args: argparse.Namespace) -> int:
    from flows.deploy import deploy_all

    return deploy_all(cluster=args.cluster, pool=args.pool, pool_type=args.pool_type,
                      slack_block=args.slack_block, as_json=args.json)
