"""The `forgeflow` command line.

Each library owns its subcommands in its own `cli.py` (`register(subparsers)`);
this module only collects them, so `forgeflow --help` starts fast and a library
is usable from the command line without Prefect.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Modules that contribute subcommands, in the order `--help` lists them.
_COMMAND_MODULES = (
    "training.cli",     # prepare, train, export
    "scheduler.cli",    # plan, simulate
    "scheduler.orchestrator.cli",  # cluster register|status|queue|cordon|drain|uncordon, submit
    "diagnosis.cli",    # diagnose, rules
    "evalsuite.cli",    # eval
    "flows.commands",   # pretrain, demo, deploy (Prefect-aware)
    "flows.finetune_cli",  # finetune (Mobius offload; Prefect-aware)
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="forgeflow",
        description="Plan, train, checkpoint, diagnose and evaluate LLM pretraining jobs.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def quiet_temporary_server(environ=None) -> None:
    """Without a server configured, Prefect starts a temporary one for the command; it would try
    to send anonymous telemetry and, with no way out (a cluster node, an air-gapped machine),
    log `Failed to send telemetry` errors mid-run. Off unless the user set it; it must be in the
    environment before that server starts (it is a subprocess and inherits it)."""
    import os

    environ = os.environ if environ is None else environ
    environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


def main(argv: list[str] | None = None) -> int:
    quiet_temporary_server()
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
