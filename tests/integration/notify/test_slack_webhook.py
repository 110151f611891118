"""Slack alerts against a real HTTP receiver on 127.0.0.1."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from infra.notify import Alert, Notifier


class _Receiver:
    def __init__(self, status: int = 200):
        self.status = status
        self.bodies: list[dict] = []
        self.paths: list[str] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                length = int(self.headers.get("Content-Length", 0))
                receiver.bodies.append(json.loads(self.rfile.read(length)))
                receiver.paths.append(self.path)
                self.send_response(receiver.status)
                self.end_headers()
                self.wfile.write(b"ok" if receiver.status == 200 else b"invalid_payload")

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/services/T000/B000/SECRETTOKEN"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    r = _Receiver()
    yield r
    r.close()


def _alert() -> Alert:
    return Alert(
        title="tiny-cpu failed at step 120: CUDAError",
        severity="error",
        fields={"root cause": "CUDAError", "action": "node check, restart from step 100"},
        evidence=["[default1]:RuntimeError: CUDA error: an illegal memory access was encountered"],
        link="http://127.0.0.1:4200/runs/flow-run/abc",
    )


def test_alert_reaches_the_webhook_as_blocks(receiver):
    notifier = Notifier(receiver.url)
    delivery = notifier.send(_alert())
    assert delivery.ok and delivery.channel == "slack"
    body = receiver.bodies[0]
    assert receiver.paths == ["/services/T000/B000/SECRETTOKEN"]
    assert "CUDAError" in body["text"]
    assert any("illegal memory access" in json.dumps(b) for b in body["blocks"])
    # the flow run's page: a link in the message, and in the notification's text
    assert any("<http://127.0.0.1:4200/runs/flow-run/abc|details>" in json.dumps(b) for b in body["blocks"])
    assert "http://127.0.0.1:4200/runs/flow-run/abc" in body["text"]


def test_a_diagnosis_alert_reaches_the_webhook_with_its_flow_run_link(receiver):
    from diagnosis.slack_format import to_alert
    from diagnosis.vocabulary import Diagnosis
    from infra.notify import flow_run_url

    diagnosis = Diagnosis("CUDAError", "infrastructure", True, confidence=0.9, rule_name="cuda-error",
                          suspect_nodes=["node-b"], suspect_ranks=[1],
                          culprit_lines=["[default0]:[rank1]: torch.AcceleratorError: CUDA error: <illegal>"])
    link = flow_run_url("6f0c", {"PREFECT_API_URL": "http://127.0.0.1:4200/api"})
    assert Notifier(receiver.url).send(to_alert(diagnosis, "two-nodes", "node check, restart", link)).ok
    blocks = json.dumps(receiver.bodies[0]["blocks"])
    assert "Confidence*\\n90% (rule: cuda-error)" in blocks and "rule rule" not in blocks
    assert "Suspect nodes*\\nnode-b" in blocks and "Suspect ranks*\\n1" in blocks
    assert "&lt;illegal&gt;" in blocks and "<http://127.0.0.1:4200/runs/flow-run/6f0c|details>" in blocks


def test_failing_webhook_does_not_raise_and_does_not_leak_the_secret(receiver, capsys):
    receiver.status = 500
    notifier = Notifier(receiver.url, retries=1)
    delivery = notifier.send(_alert())
    assert not delivery.ok and "HTTP 500" in delivery.detail
    out = capsys.readouterr()
    assert "SECRETTOKEN" not in delivery.detail + out.err + out.out + repr(notifier)
    assert "CUDAError" in out.err  # still printed where a person will look


def test_unreachable_webhook_does_not_raise(free_port):
    delivery = Notifier(f"http://127.0.0.1:{free_port}/services/SECRETTOKEN", timeout_s=2, retries=0).send(_alert())
    assert not delivery.ok and "SECRETTOKEN" not in delivery.detail


def test_without_webhook_alerts_are_printed_and_kept(monkeypatch, capsys):
    monkeypatch.delenv("SLACK_WEBHOOK_URL", raising=False)
    notifier = Notifier()
    notifier.send(_alert())
    assert notifier.target == "console"
    assert notifier.sent[0].channel == "console"
    printed = capsys.readouterr().err
    assert "CUDAError" in printed and "link: http://127.0.0.1:4200/runs/flow-run/abc" in printed
