"""`forgeflow diagnose` and `forgeflow rules`, through diagnosis.cli.register."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from diagnosis import cli

CORPUS = Path(__file__).resolve().parents[2] / "data" / "failures"


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="forgeflow")
    cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.func(args)


def test_diagnose_json(state, capsys):
    assert run(["diagnose", str(CORPUS / "oom_under_timeouts.log"), "--json", "--no-agent"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("root_cause", "kind", "restart_helps", "confidence", "culprit_lines", "suspect_nodes", "mitigation", "source"):
        assert key in out
    assert (out["root_cause"], out["kind"], out["restart_helps"], out["source"]) == ("OutOfMemoryError", "framework", False, "rule")
    assert any("CUDA out of memory" in line for line in out["culprit_lines"])


def test_diagnose_text_and_missing_file(state, capsys, tmp_path):
    assert run(["diagnose", str(CORPUS / "node_fell_off_bus.log"), "--no-agent"]) == 0
    assert "NodeFailure (infrastructure)" in capsys.readouterr().out
    assert run(["diagnose", str(tmp_path / "missing.log"), "--no-agent"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_rules_add_list_and_refusals(state, capsys):
    assert run(["rules", "add", "--type", "filter", "--pattern", r"^custom banner \d+$", "--job-family", "llama", "--name", "banner"]) == 0
    assert run(["rules", "add", "--type", "filter", "--pattern", "(a)\\1", "--job-family", "llama"]) == 2
    assert "RE2" in capsys.readouterr().err
    assert run(["rules", "add", "--type", "diagnosis", "--pattern", ".*", "--root-cause", "KeyError", "--restart-helps", "no"]) == 2
    assert "catch-all" in capsys.readouterr().err
    assert run(["rules", "add", "--type", "diagnosis", "--pattern", "flux capacitor", "--root-cause", "NVLinkError", "--restart-helps", "yes"]) == 0
    capsys.readouterr()
    assert run(["rules", "list", "--type", "filter", "--job-family", "llama", "--learned", "--json"]) == 0
    assert [r["name"] for r in json.loads(capsys.readouterr().out)] == ["banner"]
    assert run(["rules", "list", "--type", "diagnosis", "--json"]) == 0
    rules = json.loads(capsys.readouterr().out)
    assert rules[0]["pattern"] == "flux capacitor" and len(rules) > 40


def test_rules_test_shows_matches_and_flags_error_lines(state, capsys):
    log = str(CORPUS / "cuda_illegal_address.log")
    assert run(["rules", "test", log]) == 0
    assert "[cuda-error -> CUDAError, cause]" in capsys.readouterr().out
    assert run(["rules", "test", log, "--pattern", "illegal memory"]) == 1  # would hide an error line
    assert run(["rules", "test", log, "--pattern", "make: (?:Entering|Leaving) directory"]) == 0


def test_forgeflow_diagnose_starts_without_the_other_commands_stacks(tmp_path):
    """`forgeflow diagnose` runs on every failure, on logs of 100 MB and more: its start-up
    must not import every other command (the orchestrator's database stack alone took
    seconds). Checked in a fresh interpreter, through the real entry point."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from flows.cli import main\n"
        f"code = main(['diagnose', {str(CORPUS / 'oom_under_timeouts.log')!r}, '--no-agent', '--json'])\n"
        "print('LOADED', [m for m in ('scheduler.orchestrator', 'evalsuite.cli', 'training.cli') if m in sys.modules], code)\n"
    )
    root = Path(__file__).resolve().parents[3]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "FORGEFLOW_STATE_DIR": str(tmp_path / "state")})
    assert done.returncode == 0, done.stderr[-2000:]
    assert '"root_cause": "OutOfMemoryError"' in done.stdout
    assert "LOADED [] 0" in done.stdout


def test_working_out_the_rules_database_does_not_import_sqlalchemy(tmp_path):
    # The CLI builds a LearnedRuleStore at start-up; SQLAlchemy + Alembic (~0.4 s) load only
    # when the database is really opened.
    import subprocess
    import sys

    code = (
        "import sys; from diagnosis.state import LearnedRuleStore; "
        f"s = LearnedRuleStore({str(tmp_path)!r}); "
        "assert s.url.endswith('forgeflow.db'), s.url; "
        "assert 'sqlalchemy' not in sys.modules, 'sqlalchemy imported'; "
        "assert s.load() == []"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_escape_sequences_in_the_log_never_reach_the_terminal(state, capsys, tmp_path):
    log = tmp_path / "job.log"
    hostile = "\x1b]0;owned\x07\x1b[2J\x1b]52;c;cHduZWQ=\x07\r"
    lines = (CORPUS / "oom_under_timeouts.log").read_text().splitlines()
    log.write_text("\n".join(line.replace("CUDA out of memory.", f"CUDA out of {hostile}memory.") for line in lines) + "\n")
    assert run(["diagnose", str(log), "--no-agent"]) == 0
    out = capsys.readouterr().out
    assert "root cause : OutOfMemoryError" in out and "CUDA out of memory." in out
    assert not any(c in out for c in "\x1b\x07\r")
    assert run(["diagnose", str(log), "--no-agent", "--json"]) == 0
    culprits = json.loads(capsys.readouterr().out)["culprit_lines"]
    assert any("CUDA out of memory." in line for line in culprits)
    assert not any(c in line for line in culprits for c in "\x1b\x07\r")
    assert run(["rules", "test", str(log)]) == 0
    out = capsys.readouterr().out
    assert "CUDA out of memory." in out and "\x1b" not in out


def test_a_directory_is_not_called_missing(state, capsys, tmp_path):
    assert run(["diagnose", str(tmp_path), "--no-agent"]) == 2
    err = capsys.readouterr().err
    assert "is a directory; give a log file" in err and "does not exist" not in err
    assert run(["rules", "test", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
