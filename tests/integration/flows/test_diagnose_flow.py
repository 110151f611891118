"""The diagnose-failure flow on a log from a path and from S3 (moto's server on 127.0.0.1)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from flows.diagnose import diagnose_failure

LOG = Path(__file__).resolve().parents[2] / "data" / "failures" / "ecc_uncorrectable.log"


def test_diagnoses_a_local_log_and_alerts(prefect_api, slack):
    result = diagnose_failure(str(LOG), job_family="diag-flow", alert=True)
    assert (result["root_cause"], result["kind"], result["restart_helps"]) == ("ECCError", "infrastructure", True)
    assert "node-a01" in result["suspect_nodes"]
    assert any("ECCError" in text for text in slack.texts())


def test_diagnoses_a_log_in_s3(prefect_api, monkeypatch):
    import boto3
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        endpoint = f"http://127.0.0.1:{port}"
        for key, value in {"AWS_ACCESS_KEY_ID": "moto", "AWS_SECRET_ACCESS_KEY": "moto",
                           "AWS_DEFAULT_REGION": "us-east-1"}.items():
            monkeypatch.setenv(key, value)
        s3 = boto3.client("s3", endpoint_url=endpoint)
        s3.create_bucket(Bucket="failed-jobs")
        s3.upload_file(str(LOG), "failed-jobs", "job-7/attempt-0.log")
        result = diagnose_failure("s3://failed-jobs/job-7/attempt-0.log", endpoint_url=endpoint)
        assert result["root_cause"] == "ECCError"
        with pytest.raises(Exception, match="no log file"):
            diagnose_failure(str(LOG.with_name("missing.log")))
    finally:
        server.stop()
