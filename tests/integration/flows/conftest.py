"""Fixtures for pretrain-flow tests: a tiny job over data prepared once, a Prefect test API,
and a Slack-compatible HTTP receiver on 127.0.0.1."""

from __future__ import annotations

import copy
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

TINY_JOB = {
    "name": "flow-tiny",
    "model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
              "ffn_hidden_size": 128, "vocab_size": 512, "seq_length": 64},
    "training": {"global_batch_size": 8, "micro_batch_size": 2, "steps": 40, "lr": 1.0e-3,
                 "min_lr": 1.0e-4, "warmup_steps": 2, "seed": 1234,
                 "lr_decay_steps": 40},  # fixed, so a reference run cut at step 20 keeps the schedule
    "data": {"corpus": ["stdlib"], "max_corpus_mb": 1.0, "val_fraction": 0.05},
    "checkpoint": {"interval": 10, "keep_last": 10, "async_save": True},
    "spike": {"window": 20, "min_history": 5, "patience": 3},
}


@pytest.fixture(scope="session")
def flow_data_dir(tmp_path_factory) -> Path:
    from training.config import parse_job_spec
    from training.data import prepare_data

    data_dir = tmp_path_factory.mktemp("flow-data")
    job = copy.deepcopy(TINY_JOB)
    job["data"]["data_dir"] = str(data_dir)
    prepare_data(parse_job_spec(job), progress=False)
    return data_dir


@pytest.fixture
def make_job(flow_data_dir: Path, tmp_path: Path):
    """Write a job spec under tmp_path (its own run dir and checkpoints); returns its path."""

    def make(name: str = "flow-tiny", **sections) -> Path:
        job = copy.deepcopy(TINY_JOB)
        job["name"] = name
        job["data"]["data_dir"] = str(flow_data_dir)
        job["checkpoint"]["url"] = str(tmp_path / name / "checkpoints")
        job["run_dir"] = str(tmp_path / name / "run")
        for section, values in sections.items():
            job.setdefault(section, {}).update(values)
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(job, sort_keys=False))
        return path

    return make


@pytest.fixture(scope="session")
def prefect_api():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


class SlackReceiver:
    def __init__(self, status: int = 200):
        self.status = status
        self.messages: list[dict] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                receiver.messages.append(json.loads(body))
                self.send_response(receiver.status)
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/services/T0/B0/SECRET"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def texts(self) -> list[str]:
        return [m.get("text", "") for m in self.messages]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def slack(monkeypatch):
    receiver = SlackReceiver()
    monkeypatch.setenv("SLACK_WEBHOOK_URL", receiver.url)
    yield receiver
    receiver.close()
