"""S3 retries are botocore's (standard mode), bounded by `retry_deadline_s`, and the
error classification on top of them is unchanged: a real HTTP server on 127.0.0.1
answers the PUTs with scripted S3 errors."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from infra.storage import InvalidCredentials, StorageOptions, StorageUnavailable, attempts_within, open_storage

_ERROR = '<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>scripted</Message></Error>'


class _ScriptedS3:
    """Answers each request with the next scripted (status, code); then 200 OK."""

    def __init__(self, script: list[tuple[int, str]]):
        self.script = list(script)
        self.requests: list[str] = []
        self.body = bytes(range(256)) * 64  # what GET serves
        self.cut_bodies = 0
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_PUT(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                owner.requests.append(self.path)
                status, code = owner.script.pop(0) if owner.script else (200, "")
                body = _ERROR.format(code=code).encode() if status != 200 else b""
                self.send_response(status)
                self.send_header("ETag", '"0123456789abcdef"')
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_HEAD(self):
                owner.requests.append("HEAD " + self.path)
                self._object_headers()

            def do_GET(self):
                owner.requests.append("GET " + self.path)
                self._object_headers()
                if owner.cut_bodies > 0:  # the connection drops half-way through the body
                    owner.cut_bodies -= 1
                    self.wfile.write(owner.body[: len(owner.body) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(owner.body)

            def _object_headers(self):
                self.send_response(200)
                self.send_header("Content-Length", str(len(owner.body)))
                self.send_header("ETag", '"0123456789abcdef"')
                self.send_header("Last-Modified", "Mon, 23 Nov 2026 19:00:00 GMT")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def storage(self, deadline_s: float):
        options = StorageOptions(endpoint_url=self.endpoint, access_key="k", secret_key="s", region="us-east-1",
                                 retry_deadline_s=deadline_s)
        return open_storage("s3://bucket/run", options)

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def scripted():
    servers = []

    def make(script):
        servers.append(_ScriptedS3(script))
        return servers[-1]

    yield make
    for server in servers:
        server.close()


def test_attempts_fit_the_deadline_at_the_longest_backoff():
    assert [attempts_within(d) for d in (0, 1, 3, 7, 90, 120)] == [1, 2, 3, 4, 8, 10]


def test_throttling_is_retried_by_botocore_until_it_passes(scripted):
    server = scripted([(503, "SlowDown"), (500, "InternalError")])
    server.storage(deadline_s=3).put_bytes("manifest.json", b"{}")
    assert len(server.requests) == 3  # two failures, then the success


def test_a_server_that_stays_down_is_given_up_on_as_unavailable(scripted):
    server = scripted([(503, "SlowDown")] * 10)
    with pytest.raises(StorageUnavailable, match="is the storage server reachable"):
        server.storage(deadline_s=3).put_bytes("manifest.json", b"{}")
    assert len(server.requests) == attempts_within(3) == 3


def test_bad_credentials_are_not_retried(scripted):
    server = scripted([(403, "InvalidAccessKeyId")])
    with pytest.raises(InvalidCredentials, match="AWS_ACCESS_KEY_ID"):
        server.storage(deadline_s=90).put_bytes("manifest.json", b"{}")
    assert len(server.requests) == 1


def test_a_reply_cut_off_mid_body_is_read_again(scripted):
    """botocore retries requests, not a body that stops half-way: the transfer manager does."""
    server = scripted([])
    server.cut_bodies = 1
    assert server.storage(deadline_s=3).get_bytes("step-00000010/rank-0-of-1.bin") == server.body
    assert [r.split()[0] for r in server.requests].count("GET") == 2
