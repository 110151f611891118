"""The `forgeflow` command line.

Each library owns its subcommands in its own `cli.py` (`register(subparsers)`);
this module only collects them, so `forgeflow --help` starts fast and a library
is usable from the command line without Prefect. Any config error a command raises
becomes one line on stderr and exit code 2 (with --json also {"error": ...} on stdout).
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Modules that contribute subcommands, in the order `--help` lists them.
_COMMAND_MODULES = (
    "training.cli",     # prepare, train, export
    "scheduler.cli",    # plan, simulate
    "scheduler.orchestrator.cli",  # cluster register|status|queue|cordon|drain|uncordon|serve, jobs, cancel, logs
    "diagnosis.cli",    # diagnose, rules
    "evalsuite.cli",    # eval
    "flows.submit",     # submit (queue a job and return; a runner or a Prefect flow run trains it)
    "flows.commands",   # pretrain, demo, deploy (Prefect-aware)
    "flows.finetune_cli",  # finetune (Mobius offload; Prefect-aware)
)


# Commands run on the failure path (the flow's diagnose step, an on-call shell on a big
# log): their parser is built from their own module only, so start-up does not import
# every other command's stack (the orchestrator's database layer alone takes seconds).
_LIGHT_COMMANDS = {"diagnose": "diagnosis.cli", "rules": "diagnosis.cli"}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The full parser, or for a command in ``_LIGHT_COMMANDS`` only its module's."""
    parser = argparse.ArgumentParser(
        prog="forgeflow",
        description="Plan, train, checkpoint, diagnose and evaluate LLM pretraining jobs.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    modules = (_LIGHT_COMMANDS[command],) if command in _LIGHT_COMMANDS else _COMMAND_MODULES
    for name in modules:
        importlib.import_module(name).register(subparsers)
    return parser


# Errors that mean "the input is wrong", by module and class: checked only once raised,
# so `forgeflow --help` imports none of them. Each names the field and the fix.
_CONFIG_ERRORS = (
    ("infra.yaml_config", "ConfigFileError"),
    ("training.config", "ConfigError"),          # job specs; ClusterError, TraceError, DataError
    ("training.faults", "FaultSpecError"),       # --drill KIND@STEP[:RANK]
    ("training.offload.executor", "OffloadConfigError"),
    ("evalsuite.errors", "EvalConfigError"),     # suites, datasets, backends
    ("diagnosis.llm", "LLMConfigError"),         # FORGEFLOW_LLM_* / OPENAI_* settings
    ("scheduler.gpus", "UnknownGpuType"),        # --gpu-type: not in the catalogue nor the cluster
)

def is_config_error(exc: BaseException) -> bool:
    for module, name in _CONFIG_ERRORS:
        cls = getattr(sys.modules.get(module), name, None)
        if cls is not None and isinstance(exc, cls):
            return True
    return False


def temporary_server_defaults(environ=None) -> None:
    """Without a server configured, Prefect starts a temporary one for the command (a subprocess
    that inherits this environment, so these must be set before it starts). Defaults, unless the
    user set them: no anonymous telemetry (with no way out, a cluster node or an air-gapped
    machine, it logs `Failed to send telemetry` errors mid-run); and 180 s for it to come up
    instead of Prefect's 20 (a fresh PREFECT_HOME migrates its database first, slow on a busy node)."""
    import os

    environ = os.environ if environ is None else environ
    environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")


def main(argv: list[str] | None = None) -> int:
    temporary_server_defaults()
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv[0] if argv else None)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # `forgeflow jobs | head`: the reader left; nothing is wrong
        sys.stderr.close()
        return 0
    except Exception as exc:
        if not is_config_error(exc):
            raise
        from infra.yaml_config import report_error  # the message names the field and the fix

        return report_error(exc, bool(getattr(args, "json", False)))


if __name__ == "__main__":
    sys.exit(main())
