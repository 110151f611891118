"""`forgeflow finetune JOB.yaml`: the finetune flow from the command line (Prefect imported only when run)."""

from __future__ import annotations

import argparse
import json


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("finetune", help="fine-tune a model larger than GPU memory (Mobius offload)")
    p.add_argument("config", help="fine-tuning spec YAML (see training/offload/spec.py)")
    p.add_argument("--no-eval", action="store_true", help="skip the evaluation flow")
    p.add_argument("--json", action="store_true", help="accepted for symmetry: the result is always one JSON object")
    p.set_defaults(func=_finetune)


def _finetune(args: argparse.Namespace) -> int:
    from training.offload.spec import load_finetune_spec

    # Bad files fail here, before Prefect starts; forgeflow's main reports the
    # ConfigError in one line with exit code 2.
    load_finetune_spec(args.config)
    from flows.finetune import finetune

    result = finetune(args.config, evaluate=not args.no_eval)
    print(json.dumps({k: result[k] for k in ("name", "losses", "device_peak_bytes", "checkpoint_url")}))
    return 0
