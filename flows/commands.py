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
    p = subparsers.add_parser("pretrain", help="run the fault-tolerant pretrain flow on a job spec")
    p.add_argument("config", help="job spec YAML")
    p.add_argument("--cluster", default="local", help="cluster inventory YAML, or 'local' (default)")
    p.add_argument("--max-restarts", type=int, default=5)
    p.add_argument("--hang-timeout", type=float, default=300.0, help="seconds without a heartbeat = hang")
    p.add_argument("--drill", action="append", default=[], metavar="KIND@STEP[:RANK]",
                   help="inject a fault drill into the next attempt (repeatable, one per attempt)")
    p.add_argument("--launcher", choices=("local", "prefect", "slurm", "kubernetes"), default="local",
                   help="local: every node's torchrun on this machine; prefect: a node-launch run per node "
                        "on the work queue named after it (needs `forgeflow deploy` and one worker per node); "
                        "slurm: one sbatch job per attempt (the cluster file's slurm: section); "
                        "kubernetes: one indexed Job per attempt (the cluster file's kubernetes: section)")
    p.add_argument("--json", action="store_true",
                   help="print the result as one JSON object (job, finished, attempts, final_step, failures, ...)")
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
    check_pretrain_inputs(args.config, args.cluster, args.drill)  # before Prefect: one line, exit 2
    from flows.pretrain import pretrain

    # live progress on stderr (a panel on a terminal, plain lines in a log file); none with --json
    with training_progress(args.config, "off" if args.json else "auto"):
        result = pretrain(args.config, cluster=args.cluster, max_restarts=args.max_restarts,
                          hang_timeout_s=args.hang_timeout, drill_faults=args.drill or None,
                          launcher=args.launcher)
    if args.json:
        print(json.dumps(pretrain_result_json(result)))
    else:
        print(_pretrain_summary(result))
    return 0 if result.finished else 1


@contextmanager
def training_progress(config: str, mode: str = "auto", console=None):
    """Show the pretrain flow's progress while the block runs: step, loss, tokens/s and ETA from
    the run directory's files (training.progress), and as the last event each failure, its
    diagnosis and the action taken, from the flow's warnings (its run logger)."""
    from training.config import load_job_spec
    from training.progress import LiveProgress

    spec = load_job_spec(config)
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


def check_pretrain_inputs(config: str, cluster: str, drills: list[str]) -> None:
    """Validate the job spec, the cluster file and the drills; a bad one raises its config
    error here, where the CLI reports it in one line, not inside the flow as a traceback."""
    from training.config import load_job_spec
    from training.faults import parse_fault

    load_job_spec(config)
    if cluster not in ("", "local"):
        from scheduler.cluster import load_cluster

        load_cluster(cluster)
    for drill in drills or []:
        parse_fault(drill)


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

    from flows.pretrain import pretrain
    from training.config import load_job_spec

    console = Console(file=sys.stderr) if summary is not None else Console()
    spec = load_job_spec(args.config)
    started = time.monotonic()
    drills = [] if args.no_faults else list(DEMO_DRILLS)
    # The demo is a drill from step 0: a previous demo's checkpoints would make it resume at
    # the last step with nothing to recover from. Prepared data is kept (it is reused).
    import shutil

    for old_run in (spec.resolved_run_dir, spec.checkpoint.url):
        if "://" not in str(old_run) or str(old_run).startswith("file://"):
            path = Path(str(old_run).removeprefix("file://"))
            if path.exists():
                console.print(f"removing the previous demo's {path}")
                shutil.rmtree(path)
    console.rule(f"forgeflow demo: {spec.name}")
    if drills:
        console.print(f"Fault drills: {', '.join(drills)} (an infrastructure error, then a loss spike); "
                      "the flow must diagnose, alert and recover from both on its own.")
    with training_progress(args.config, console=console):
        result = pretrain(args.config, cluster="local", hang_timeout_s=180.0, backoff_s=2.0,
                          drill_faults=drills or None)
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
