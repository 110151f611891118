"""`forgeflow eval CHECKPOINT --suite SUITE`: evaluate a checkpoint without Prefect."""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "eval", help="evaluate a checkpoint with a suite (HumanEval, perplexity, JSONL tasks)",
        description="Preload the model once, run balanced inference trials over slots, score on CPU "
                    "workers, print the plan before and predicted-vs-actual after.")
    p.add_argument("checkpoint", help="exported Hugging Face folder (path, file:// or s3:// URL) "
                                      "or a training checkpoint directory (needs --config)")
    p.add_argument("--suite", required=True,
                   help="suite YAML, a name in configs/eval/, or dataset names: humaneval,arith-em")
    p.add_argument("--config", help="the job spec (perplexity data, export of training checkpoints)")
    p.add_argument("--slots", type=int, help="inference slots (default: the suite's)")
    p.add_argument("--metric-workers", type=int, help="CPU workers for metric jobs (default: one per core)")
    p.add_argument("--output", help="where generations, scores and results.json go (default: with --config, "
                   "RUN_DIR/eval/step-N-SUITE under the job's run directory; else runs/eval/NAME-SUITE)")
    p.add_argument("--naive", action="store_true",
                   help="baseline: one trial per dataset, load per trial, metrics in the slot, FIFO")
    p.add_argument("--submitter", choices=("local", "slurm", "kubernetes"), default="local",
                   help="where trials run: local (slot threads/processes here, default), slurm "
                        "(one sbatch job per trial) or kubernetes (one Job per trial, queued in Kueue "
                        "when the cluster file says so); metrics stay here")
    p.add_argument("--cluster", help="with --submitter slurm: a cluster file whose slurm: section gives "
                                     "partition, account, time limit, GPU request (default: the environment's "
                                     "Slurm); with --submitter kubernetes (required): its kubernetes: section "
                                     "(namespace, image, run volume, kueue); its nodes' one GPU type, if they "
                                     "have one, pins the trial Jobs")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (logs, CI)")
    p.add_argument("--json", action="store_true",
                   help="print results.json's content (plus its path) as one JSON object; "
                        "the plan and report go to stderr")
    p.set_defaults(func=_run_eval)


def _run_eval(args: argparse.Namespace) -> int:
    import functools
    import sys
    from pathlib import Path

    import json

    from evalsuite.checkpoints import checkpoint_to_evaluate, eval_output_dir, model_source_for
    from evalsuite.coordinator import Policy
    from evalsuite.errors import EvalConfigError, EvalError
    from evalsuite.runner import evaluate
    from evalsuite.suite import load_suite

    # With --json stdout carries one JSON object only: the plan and report go to stderr.
    echo = (lambda text: print(text, file=sys.stderr)) if args.json else print
    try:
        job_spec = None
        if args.config:
            from training.config import load_job_spec

            job_spec = load_job_spec(args.config)  # a ConfigError reaches forgeflow's main: one line, exit 2
        overrides: dict[str, Any] = {}
        if args.slots:
            overrides["slots"] = args.slots
        if args.metric_workers:
            overrides["metric_workers"] = args.metric_workers
        suite = load_suite(args.suite, job_spec, overrides)
        target = checkpoint_to_evaluate(args.checkpoint, job_spec)  # located once
        output = Path(args.output or eval_output_dir(target, suite.name, job_spec))
        source = model_source_for(target, job_spec, output)
        policy = Policy.naive() if args.naive else Policy()
        if args.submitter == "kubernetes":
            settings, gpu_type = _kubernetes_settings(args.cluster)
            run: Any = functools.partial(evaluate, submitter="kubernetes", kubernetes=settings, gpu_type=gpu_type)
        else:
            run = functools.partial(evaluate, submitter=args.submitter,
                                    slurm=_slurm_settings(args.cluster, args.submitter))
        if args.no_progress or args.json:  # --json: stdout is one JSON object, stderr stays quiet
            report = run(source, suite, output, policy=policy, echo=echo)
        else:
            with _Progress() as progress:
                report = run(source, suite, output, policy=policy, on_event=progress.on_event, echo=progress.print)
    except EvalConfigError:
        raise  # forgeflow's main: one line naming what is wrong, exit 2
    except EvalError as e:
        from infra.yaml_config import report_error

        return report_error(e, args.json)
    if args.json:
        payload = json.loads((output / "results.json").read_text())
        print(json.dumps({**payload, "results_path": str(output / "results.json")}))
        return 1 if report.failed_datasets else 0
    print(f"results: {output / 'results.json'}")
    return 1 if report.failed_datasets else 0


def _slurm_settings(cluster: str | None, submitter: str) -> Any:
    """The cluster file's slurm: section for --submitter slurm (None: the environment's Slurm)."""
    if not cluster:
        return None
    from evalsuite.errors import EvalConfigError
    from scheduler.cluster import load_cluster

    if submitter != "slurm":
        raise EvalConfigError(f"--cluster {cluster} is only used with --submitter slurm or kubernetes; add one "
                              "or drop --cluster")
    settings = load_cluster(cluster).slurm   # a bad file raises its ConfigError: one line, exit 2
    if settings is None:
        raise EvalConfigError(f"{cluster} has no slurm: section; add one (partition, account, ...) "
                              "or drop --cluster to use the environment's Slurm defaults")
    return settings


def _kubernetes_settings(cluster: str | None) -> tuple[Any, str]:
    """The cluster file's kubernetes: section for --submitter kubernetes, and the GPU type that pins
    the trial Jobs (its nodes' one GPU type; "cpu", no pin, when they have none or several)."""
    from evalsuite.errors import EvalConfigError
    from scheduler.cluster import load_cluster

    if not cluster:
        raise EvalConfigError("--submitter kubernetes needs --cluster FILE: a cluster file with a kubernetes: "
                              "section (namespace, image, run_volume_claim, kueue)")
    loaded = load_cluster(cluster)   # a bad file raises its ConfigError: one line, exit 2
    if loaded.kubernetes is None:
        raise EvalConfigError(f"{cluster} has no kubernetes: section; add one (image, run_volume_claim, ...)")
    types = [t for t in loaded.gpu_types() if t != "cpu"]
    return loaded.kubernetes, types[0] if len(types) == 1 else "cpu"


class _Progress:
    """Progress of an evaluation fed by the executor's events (thread-safe: rich locks internally):
    on a terminal, live bars (trials with ETA, metric jobs, one per running trial) and the last
    event; elsewhere (a file, a pipe) one plain line per finished or failed trial and per failed
    metric job. `forgeflow eval --json` shows none (stdout is one JSON object)."""

    def __init__(self, console: Any = None) -> None:
        from rich.console import Console

        self.console = console or Console(stderr=True)
        self.live = self.console.is_terminal
        self.last_event = "planning"
        self.done = {"trials": 0, "metrics": 0}
        self.total = {"trials": 0, "metrics": 0}

    def __enter__(self) -> "_Progress":
        import time

        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn,
                                   TimeElapsedColumn, TimeRemainingColumn)
        from rich.text import Text

        owner = self

        class _Bars(Progress):
            def get_renderables(self):
                yield self.make_tasks_table(self.tasks)
                yield Text(f"last event: {owner.last_event}", style="dim", overflow="ellipsis", no_wrap=True)

        self.started = time.monotonic()
        self.bars = _Bars(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                          TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=self.console,
                          disable=not self.live)
        self.bars.__enter__()
        self.trials = self.bars.add_task("inference trials", total=None)
        self.metrics = self.bars.add_task("metric jobs", total=None)
        self.per_trial: dict[str, Any] = {}
        return self

    def __exit__(self, *exc: Any) -> None:
        self.bars.__exit__(*exc)

    def print(self, text: str) -> None:
        # soft_wrap: a log file or pipe keeps each line whole (no wrapping at a guessed width)
        self.console.print(text, markup=False, highlight=False, soft_wrap=True)

    def eta_s(self) -> float | None:
        """Seconds left at the rate so far, counting trials and metric jobs alike."""
        import time

        done, total = sum(self.done.values()), sum(self.total.values())
        if not done or not total:
            return None
        return (time.monotonic() - self.started) / done * max(0, total - done)

    def plain_line(self) -> str:
        from training.progress import format_duration

        return (f"eval | trials {self.done['trials']}/{self.total['trials']} | metric jobs "
                f"{self.done['metrics']}/{self.total['metrics']} | ETA {format_duration(self.eta_s())} | "
                f"{self.last_event}")

    def on_event(self, kind: str, info: dict[str, Any]) -> None:
        trial = info.get("trial", "")
        if kind == "plan":
            self.total = {"trials": info["trials"], "metrics": info["shards"]}
            self.bars.update(self.trials, total=info["trials"])
            self.bars.update(self.metrics, total=info["shards"])
            self.last_event = f"plan: {info['trials']} trial(s), {info['shards']} metric job(s)"
        elif kind == "trial_started":
            self.per_trial[trial] = self.bars.add_task(f"  {trial} ({info['slot']})", total=None)
            self.last_event = f"trial {trial} started on {info['slot']}"
        elif kind == "progress" and trial in self.per_trial:
            self.bars.advance(self.per_trial[trial], info["n"])
        elif kind in ("trial_done", "trial_failed"):
            if trial in self.per_trial:
                self.bars.remove_task(self.per_trial.pop(trial))
            self.bars.advance(self.trials)
            self.done["trials"] += 1
            self.last_event = (f"trial {trial} done in {info.get('seconds', 0.0):.1f} s" if kind == "trial_done"
                               else f"trial {trial} FAILED: {' '.join(str(info.get('error', '')).split())[:200]}")
        elif kind in ("metric_done", "metric_failed"):
            self.bars.advance(self.metrics)
            self.done["metrics"] += 1
            if kind == "metric_failed":
                self.last_event = (f"metric job {info.get('dataset', '')} FAILED: "
                                   f"{' '.join(str(info.get('error', '')).split())[:200]}")
        else:
            return
        if not self.live and (kind in ("plan", "trial_done", "trial_failed", "metric_failed")
                              or (kind == "metric_done" and self.done["metrics"] == self.total["metrics"])):
            self.print(self.plain_line())
