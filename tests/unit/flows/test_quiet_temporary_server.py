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
import sys
if sys.argv[1] == "quiet":
    from flows.cli import temporary_server_defaults
    temporary_server_defaults()
import prefect.server.services.telemetry  # registers the telemetry heartbeat service
from prefect.server.services.perpetual_services import get_enabled_perpetual_services
print(sorted(c.function.__name__ for c in get_enabled_perpetual_services(ephemeral=True)))
from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS
print("startup timeout", PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value())
"""


def _enabled_services(mode: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k != "PREFECT_SERVER_ANALYTICS_ENABLED"}
    proc = subprocess.run([sys.executable, "-c", _SERVICES, mode], cwd=ROOT, env={**clean, **env},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_forgeflow_turns_the_temporary_servers_telemetry_off():
    assert "send_telemetry_heartbeat" in _enabled_services("plain")      # Prefect's default: on
    quiet = _enabled_services("quiet")
    assert "send_telemetry_heartbeat" not in quiet  # forgeflow's: off
    assert "startup timeout 180" in quiet  # and time for a fresh home's migrations on a busy machine


def test_a_users_own_setting_wins():
    from flows.cli import temporary_server_defaults

    environ = {"PREFECT_SERVER_ANALYTICS_ENABLED": "true", "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "30"}
    temporary_server_defaults(environ)
    assert environ == {"PREFECT_SERVER_ANALYTICS_ENABLED": "true", "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "30"}
