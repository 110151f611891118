"""`forgeflow finetune JOB.yaml`: the finetune flow from the command line (Prefect imported only when run)."""

from __future__ import annotations

import argparse
import json
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("finetune", help="fine-tune a model larger than GPU memory (Mobius offload)")
    p.add_argument("config", help="fine-tuning spec YAML (see training/offload/spec.py)")
    p.add_argument("--no-eval", action="store_true", help="skip the evaluation flow")
    p.set_defaults(func=_finetune)


def _finetune(args: argparse.Namespace) -> int:
    from training.config import ConfigError

    try:
        from training.offload.spec import load_finetune_spec

        load_finetune_spec(args.config)  # bad files fail here, before Prefect starts
        from flows.finetune import finetune

        result = finetune(args.config, evaluate=not args.no_eval)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({k: result[k] for k in ("name", "losses", "device_peak_bytes", "checkpoint_url")}))
    return 0
