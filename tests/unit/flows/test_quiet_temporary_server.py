"""The temporary Prefect server a `forgeflow` command starts (no PREFECT_API_URL) sends no
telemetry, so an offline machine's demo shows no `Failed to send telemetry` errors, and is
given time to start on a busy machine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

# What the temporary server (a subprocess inheriting this environment) would run.
_SERVICES = """
from flows.cli import temporary_server_defaults
temporary_server_defaults()
import prefect.server.services.telemetry  # registers the telemetry heartbeat service
from prefect.server.services.perpetual_services import get_enabled_perpetual_services
print(sorted(c.function.__name__ for c in get_enabled_perpetual_services(ephemeral=True)))
from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS
print("startup timeout", PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value())
"""
# Prefect's own default, which the service's switch reads (cheap: no server import).
_DEFAULT = "from prefect.settings import get_current_settings; print(get_current_settings().server.analytics_enabled)"


def _run(code: str) -> str:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("PREFECT_SERVER_ANALYTICS_ENABLED", "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS")}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=clean, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_forgeflow_turns_the_temporary_servers_telemetry_off():
    assert _run(_DEFAULT).strip() == "True"  # Prefect's default: telemetry on
    quiet = _run(_SERVICES)
    # the registry answers (another service the module registers is on), without the heartbeat
    assert "schedule_event_vacuum_tasks" in quiet and "send_telemetry_heartbeat" not in quiet
    assert "startup timeout 180" in quiet  # and time for a fresh home's migrations on a busy machine


def test_a_users_own_setting_wins():
    from flows.cli import temporary_server_defaults

    environ = {"PREFECT_SERVER_ANALYTICS_ENABLED": "true", "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "30"}
    temporary_server_defaults(environ)
    assert environ == {"PREFECT_SERVER_ANALYTICS_ENABLED": "true", "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "30"}
