"""The diagnose-failure flow on a log from a path and from S3 (moto's server on 127.0.0.1)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from flows.diagnose import diagnose_failure

LOG = Path(__file__).resolve().parents[2] / "data" / "failures" / "ecc_uncorrectable.log"


@pytest.fixture
def job_log(tmp_path, monkeypatch) -> Path:
    """LOG inside a job's run directory (a job queued in a state database of its own)."""
    from scheduler.orchestrator.seat import queue_spec
    from training.config import load_job_spec

    monkeypatch.setenv("FORGEFLOW_DB_URL", f"sqlite:///{tmp_path / 'state.db'}")
    spec = load_job_spec("configs/tiny-cpu.yaml", {"run_dir": str(tmp_path / "runs/{name}/{job}")})
    job = queue_spec(spec, "configs/clusters/frenzy-testbed.yaml", gpu_type="A800-80G", gpus=4)
    path = job.spec.resolved_run_dir / "diagnosis" / "attempt-0.log"
    path.parent.mkdir(parents=True)
    path.write_bytes(LOG.read_bytes())
    return path


def test_diagnoses_a_local_log_and_alerts(prefect_api, slack, job_log):
    result = diagnose_failure(str(job_log), alert=True)
    assert (result["root_cause"], result["kind"], result["restart_helps"]) == ("ECCError", "infrastructure", True)
    assert "node-a01" in result["suspect_nodes"]
    assert any("ECCError" in text for text in slack.texts())


def test_the_job_family_is_the_logs_job_not_a_parameter(prefect_api, job_log):
    """The learned rules that apply are those of the job whose run directory holds the log (its
    recorded name, tiny-cpu), and no parameter can name another family (issue 29)."""
    from diagnosis.rules import DiagnosisLibrary

    line = "An uncorrectable double bit error (DBE) has been detected on GPU"
    for family, pattern, cause in (("tiny-cpu", r"uncorrectable double bit error \(DBE\)", "NodeFailure"),
                                   ("someone-else", r"double bit error \(DBE\) has been", "OutOfMemoryError")):
        DiagnosisLibrary.load(job_family=family).add_rule(pattern, cause, True, must_match=[line],
                                                          name=f"dbe-{family}", source="agent")
    result = diagnose_failure(str(job_log))
    assert (result["root_cause"], result["rule_name"]) == ("NodeFailure", "dbe-tiny-cpu")
    with pytest.raises(Exception, match="job_family"):
        diagnose_failure(str(job_log), job_family="someone-else")


def test_reads_no_file_outside_a_job(prefect_api, job_log, tmp_path):
    """A parameter naming any readable file (or a symlink from a job's folder to one) is refused."""
    from flows.diagnose import fetch_log

    secret = tmp_path / "secret.txt"
    secret.write_text("RuntimeError: CUDA error: the password is hunter2\n")
    (job_log.parent / "link.log").symlink_to(secret)
    with pytest.raises(PermissionError, match="it is in no job's run directory"):
        diagnose_failure(str(secret))  # the flow, end to end
    for path in (job_log.parent / "link.log", Path("/etc/passwd")):  # the check it makes, directly
        with pytest.raises(PermissionError, match="it is in no job's run directory"):
            fetch_log(str(path), str(tmp_path))
    assert fetch_log(f"file://{job_log}", str(tmp_path)) == job_log


def test_diagnoses_a_log_in_s3(prefect_api, monkeypatch, tmp_path):
    """A log under a job's checkpoint prefix, fetched from the endpoint its spec names; any other
    bucket, prefix or endpoint is refused before anything is fetched."""
    import boto3
    from moto.server import ThreadedMotoServer

    from scheduler.orchestrator.seat import queue_spec
    from training.config import load_job_spec

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
        monkeypatch.setenv("FORGEFLOW_DB_URL", f"sqlite:///{tmp_path / 'state.db'}")
        spec = load_job_spec("configs/tiny-cpu.yaml", {"run_dir": str(tmp_path / "runs/{name}/{job}"),
                                                       "checkpoint": {"url": "s3://failed-jobs/job-7",
                                                                      "endpoint_url": endpoint}})
        queue_spec(spec, "configs/clusters/frenzy-testbed.yaml", gpu_type="A800-80G", gpus=4)
        s3 = boto3.client("s3", endpoint_url=endpoint)
        s3.create_bucket(Bucket="failed-jobs")
        s3.upload_file(str(LOG), "failed-jobs", "job-7/attempt-0.log")
        s3.upload_file(str(LOG), "failed-jobs", "other/attempt-0.log")
        result = diagnose_failure("s3://failed-jobs/job-7/attempt-0.log")  # the job's endpoint, from its spec
        assert result["root_cause"] == "ECCError"
        with pytest.raises(PermissionError, match="under no job's checkpoint prefix"):
            diagnose_failure("s3://failed-jobs/other/attempt-0.log")
        with pytest.raises(PermissionError, match="refusing endpoint_url http://169.254.169.254"):
            diagnose_failure("s3://failed-jobs/job-7/attempt-0.log", endpoint_url="http://169.254.169.254")
        with pytest.raises(Exception, match="no log file"):
            diagnose_failure(str(LOG.with_name("missing.log")))
    finally:
        server.stop()
