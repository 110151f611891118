"""`forgeflow prepare | train | export` — the training library's subcommands.

Heavy imports (torch, megatron, tokenizers) happen inside the command functions so
`forgeflow --help` stays fast.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("prepare", help="train the tokenizer and pack the corpus into token files")
    p.add_argument("config", help="job spec YAML")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a spec field, e.g. data.max_corpus_mb=4 (repeatable)")
    p.add_argument("--json", action="store_true", help="print the prepared data as one JSON object")
    p.set_defaults(func=cmd_prepare)

    p = subparsers.add_parser("train", help="train a job spec locally under torchrun")
    p.add_argument("config", help="job spec YAML")
    p.add_argument("--nproc", type=int, default=None,
                   help="worker processes (default: GPUs if any, else min(2, CPU cores))")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a spec field, e.g. training.steps=50 (repeatable)")
    p.add_argument("--resume-from-step", type=int, default=None,
                   help="resume from this checkpoint step instead of the newest")
    p.add_argument("--json", action="store_true",
                   help="send the workers' output to stderr and print one JSON object when they exit")
    p.set_defaults(func=cmd_train)

    p = subparsers.add_parser("export", help="convert a checkpoint to a Hugging Face Llama folder")
    p.add_argument("checkpoint_dir", help="a checkpoint step directory or a checkpoint root")
    p.add_argument("out_dir", help="where to write config.json, safetensors and the tokenizer")
    p.add_argument("--config", required=True, help="the job spec the checkpoint was trained with")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--json", action="store_true", help="print where the export went as one JSON object")
    p.set_defaults(func=cmd_export)


def _load_spec(args: argparse.Namespace):
    from training.config import dotted_overrides, load_job_spec

    return load_job_spec(args.config, dotted_overrides(getattr(args, "set", []) or []))


def _missing(module: str, what: str) -> int:
    from infra.yaml_config import report_error

    return report_error(f"{what} is not available in this build ({module} is missing)")


def cmd_prepare(args: argparse.Namespace) -> int:
    try:
        from training.data import prepare_data
    except ImportError:
        return _missing("training.data", "forgeflow prepare")
    # A ConfigError (DataError is one) reaches forgeflow's main: one line, exit 2.
    spec = _load_spec(args)
    prepared = prepare_data(spec, progress=not args.json)
    if args.json:
        print(json.dumps({
            "job": spec.name, "data_dir": str(prepared.data_dir), "reused": prepared.reused,
            "train_tokens": prepared.train_tokens, "val_tokens": prepared.val_tokens,
            "vocab_size": prepared.vocab_size, "tokenizer_vocab_size": prepared.tokenizer_vocab_size,
            "tokenizer_dir": str(prepared.tokenizer_dir), "dtype": prepared.dtype,
        }))
        return 0
    state = "reused" if prepared.reused else "prepared"
    print(f"{state} {prepared.data_dir}: {prepared.train_tokens:,} train / "
          f"{prepared.val_tokens:,} val tokens, vocab {prepared.tokenizer_vocab_size}")
    return 0


def default_nproc(model_parallel: int = 1) -> int:
    """Every GPU (on CPU: 2 ranks at most), rounded down to whole model replicas
    (tensor_parallel x pipeline_parallel ranks each)."""
    import torch

    if torch.cuda.is_available():
        n = torch.cuda.device_count()
    else:
        n = min(2, os.cpu_count() or 1)
    return max(model_parallel, n - n % model_parallel)


def torchrun_command(config: str, nproc: int, overrides: list[str],
                     resume_from_step: int | None = None) -> list[str]:
    """The single-node torchrun command line that starts the worker on `nproc` ranks: forgeflow's
    torchrun (infra.torchrun: the ranks forked from the agent, which has imported torch already)."""
    cmd = [sys.executable, "-m", "infra.torchrun", "--standalone",
           "--nproc-per-node", str(nproc), "-m", "training.train", config]
    for item in overrides:
        cmd += ["--set", item]
    if resume_from_step is not None:
        cmd += ["--resume-from-step", str(resume_from_step)]
    return cmd


def cmd_train(args: argparse.Namespace) -> int:
    spec = _load_spec(args)  # a ConfigError reaches forgeflow's main: one line, exit 2
    # Prepare first: it returns at once when the data is already there, and the workers
    # then never race each other to create it.
    try:
        from training.data import prepare_data
    except ImportError:
        return _missing("training.data", "forgeflow train")
    prepare_data(spec, progress=not args.json)
    model_parallel = spec.training.tensor_parallel * spec.training.pipeline_parallel
    nproc = args.nproc or default_nproc(model_parallel)
    if nproc % model_parallel:
        from infra.yaml_config import report_error

        return report_error(f"--nproc {nproc} is not a multiple of training.tensor_parallel x "
                            f"pipeline_parallel = {model_parallel}", args.json)
    cmd = torchrun_command(args.config, nproc, args.set, args.resume_from_step)
    print(f"run dir: {spec.resolved_run_dir}  (logs/, heartbeat/, markers/)", flush=True,
          file=sys.stderr if args.json else sys.stdout)
    try:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        # On CPU, idle OpenMP threads should sleep, not spin: spinning threads fight the
        # other ranks (and anything else on the machine) for cores — 10x slower steps
        # measured at world size 1 with 2 threads on a busy 2-core machine.
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        # With --json stdout carries only the result object, so the workers talk on stderr.
        code = subprocess.call(cmd, env=env, stdout=sys.stderr if args.json else None)
    except KeyboardInterrupt:
        return 130
    if args.json:
        print(json.dumps({"job": spec.name, "exit_code": code, "nproc": nproc,
                          "run_dir": str(spec.resolved_run_dir), "checkpoint_url": str(spec.checkpoint.url)}))
    return code


def cmd_export(args: argparse.Namespace) -> int:
    try:
        from training.export import ExportError, export_hf
    except ImportError:
        return _missing("training.export", "forgeflow export")
    spec = _load_spec(args)  # a ConfigError reaches forgeflow's main: one line, exit 2
    try:
        out = export_hf(args.checkpoint_dir, args.out_dir, spec, dtype=args.dtype)
    except ExportError as e:
        from infra.yaml_config import report_error

        return report_error(e, args.json)
    if args.json:
        print(json.dumps({"job": spec.name, "checkpoint": args.checkpoint_dir, "out_dir": str(out),
                          "dtype": args.dtype, "files": sorted(p.name for p in out.iterdir())}))
        return 0
    print(f"exported {args.checkpoint_dir} -> {out}")
    return 0
