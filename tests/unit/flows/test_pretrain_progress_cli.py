"""`forgeflow pretrain`'s live progress: the run directory's steps and the flow's warnings
(failure, diagnosis, action) reach the display; --json keeps it silent."""

from __future__ import annotations

import io
import logging

import yaml

from flows.commands import training_progress
from infra import runfiles
from training.config import load_job_spec
from training.runlog import format_event_line, format_step_line


def _job(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({
        "name": "p", "run_dir": str(tmp_path / "run"),
        "model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 128,
                  "vocab_size": 512, "seq_length": 64},
        "training": {"global_batch_size": 8, "micro_batch_size": 2, "steps": 50}}))
    return path


def _log(tmp_path, *lines):
    path = runfiles.log_path(tmp_path / "run", 0)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write("".join(line + "\n" for line in lines))


def test_steps_and_the_flows_failure_warnings_show(tmp_path):
    from rich.console import Console

    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=250)
    with training_progress(load_job_spec(_job(tmp_path)), console=console) as live:
        _log(tmp_path, format_step_line(0, 10, 4.25, 1e-4, 0.5, 1500.0, 5.0))
        live.show()
        # what the pretrain flow logs after deciding (flows/pretrain.py, step 6)
        logging.getLogger("prefect.flow_runs").warning(
            "attempt %d %s at step %d: %s -> %s (%s)", 0, "failed", 10, "CUDAError", "restart in place", "transient")
        live.show()
        _log(tmp_path, format_event_line(0, "resumed", step=10, skipped_batches=0))
    text = out.getvalue()
    assert "attempt 0 | step 10/50 (20%) | loss 4.2500 | 1,500 tok/s" in text
    assert "| attempt 0 failed at step 10: CUDAError -> restart in place (transient)" in text
    assert text.splitlines()[-1].startswith("attempt 1 | step 10/50") and "resumed from checkpoint 10" in text
    assert not any(isinstance(h, logging.Handler) and h.__class__.__name__ == "_CallbackHandler"
                   for h in logging.getLogger("prefect.flow_runs").handlers)  # removed afterwards


def test_json_mode_prints_nothing(tmp_path, capsys):
    with training_progress(load_job_spec(_job(tmp_path)), "off") as live:
        _log(tmp_path, format_step_line(0, 1, 4.0, 1e-4, 0.5, 1500.0, 1.0))
        logging.getLogger("prefect.flow_runs").warning("attempt 0 failed")
        live.show()
    captured = capsys.readouterr()
    assert "attempt 0 |" not in captured.err + captured.out


def test_prefect_log_lines_scroll_above_the_live_panel(tmp_path):
    """On a terminal, a log handler printing through its own rich console (as Prefect's does) is
    pointed at the panel's stderr while it shows, and restored after."""
    from rich.console import Console

    class ConsoleHandler(logging.Handler):  # the shape of Prefect's PrefectConsoleHandler
        def __init__(self, file):
            super().__init__()
            self.console = Console(file=file, width=200)

        def emit(self, record):
            self.console.print(record.getMessage())

    elsewhere = io.StringIO()
    handler = ConsoleHandler(elsewhere)
    logger = logging.getLogger("prefect.uxview-test")
    logger.addHandler(handler)
    terminal = Console(file=io.StringIO(), force_terminal=True, width=200)
    try:
        with training_progress(load_job_spec(_job(tmp_path)), console=terminal) as live:
            assert live.mode == "live"
            logger.warning("[SUCCESS] a log line of the flow")
        assert handler.console.file is elsewhere  # restored
    finally:
        logger.removeHandler(handler)
    assert "[SUCCESS] a log line of the flow" in terminal.file.getvalue() and elsewhere.getvalue() == ""
