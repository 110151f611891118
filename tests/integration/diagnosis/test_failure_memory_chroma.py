"""Failure memory on real Chroma (persistent folder and a `chroma run` server) with the
real all-MiniLM-L6-v2, plus the scripted server's OpenAI protocol surface."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import openai
import pytest

from diagnosis.llm import ChatLLM, LLMConfig, MalformedReply, extract_json
from diagnosis.failure_memory import FailureMemory, MemoryConfig, retrieval_vote
from diagnosis.vocabulary import Diagnosis

CUDA = "[rank3]: RuntimeError: CUDA error: an illegal memory access was encountered"
OOM = "[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
S3 = "botocore.exceptions.ClientError: An error occurred (SlowDown) when calling the PutObject operation"


def remember_three(memory: FailureMemory) -> None:
    memory.add_many(
        [
            (CUDA, Diagnosis("CUDAError", "infrastructure", True, mitigation="cordon the node")),
            (OOM, Diagnosis("OutOfMemoryError", "framework", False, culprit_lines=[OOM])),
            (S3, Diagnosis("S3StorageError", "infrastructure", True)),
        ],
        job_family="llama-7b",
    )


def test_persistent_memory_survives_reopening_and_votes(tmp_path, embedder):
    config = MemoryConfig(path=tmp_path / "mem")
    remember_three(FailureMemory(config, embedder))
    reopened = FailureMemory(config, embedder)
    assert len(reopened) == 3
    stored = {p.diagnosis.root_cause: p for p in reopened.all()}
    assert stored["OutOfMemoryError"].diagnosis.culprit_lines == [OOM]
    assert stored["CUDAError"].job_family == "llama-7b"

    nearest = reopened.nearest("[rank6]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 8.00 GiB", k=3)
    assert nearest[0].diagnosis.root_cause == "OutOfMemoryError"
    assert nearest[0].similarity > nearest[-1].similarity
    vote = retrieval_vote(nearest, culprit_lines=["x"])
    assert (vote.root_cause, vote.restart_helps, vote.source) == ("OutOfMemoryError", False, "retrieval")
    assert 0 < vote.confidence <= 0.5


def test_empty_memory_and_empty_excerpt(tmp_path, embedder):
    memory = FailureMemory(MemoryConfig(path=tmp_path / "mem"), embedder)
    assert memory.nearest("anything") == [] and retrieval_vote([]) is None
    with pytest.raises(ValueError, match="empty log excerpt"):
        memory.add("   ", Diagnosis("Unknown", "unknown", False))


@pytest.fixture
def chroma_server(tmp_path, free_port):
    chroma = Path(sys.executable).with_name("chroma")
    if not chroma.exists():
        chroma = Path(shutil.which("chroma") or "chroma")
    process = subprocess.Popen(
        [str(chroma), "run", "--path", str(tmp_path / "chroma-server"), "--host", "127.0.0.1", "--port", str(free_port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{free_port}"
    deadline = time.monotonic() + 60
    try:
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/v2/heartbeat", timeout=2).read()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("chroma server did not start") from None
                time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_memory_on_a_chroma_server(chroma_server, embedder, tmp_path):
    config = MemoryConfig(server_url=chroma_server, path=tmp_path / "unused")
    remember_three(FailureMemory(config, embedder))
    memory = FailureMemory(config, embedder)  # a second client sees the same collection
    assert len(memory) == 3
    assert memory.nearest("CUDA error: an illegal memory access", k=1)[0].diagnosis.root_cause == "CUDAError"
    assert not (tmp_path / "unused").exists()  # the server, not a local folder, holds it


TOKEN = "chroma-t0ken-for-the-test"


@pytest.fixture
def token_checked_chroma(chroma_server):
    """The Chroma server behind a reverse proxy that requires `Authorization: Bearer TOKEN` (Chroma
    1.5.9's own server, `chroma run`, has no token authentication: what the README says to put in
    front of it). Yields (proxy URL, the Authorization headers it saw)."""
    import http.client
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from urllib.parse import urlparse

    upstream = urlparse(chroma_server)
    seen: list[str | None] = []

    class Proxy(BaseHTTPRequestHandler):
        def _forward(self):
            seen.append(self.headers.get("Authorization"))
            if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                body = b'{"error": "Unauthorized"}'
                self.send_response(401)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            length = int(self.headers.get("Content-Length") or 0)
            payload = self.rfile.read(length) if length else None
            connection = http.client.HTTPConnection(upstream.hostname, upstream.port, timeout=30)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "authorization")}
            connection.request(self.command, self.path, body=payload, headers=headers)
            reply = connection.getresponse()
            body = reply.read()
            self.send_response(reply.status)
            for name, value in reply.getheaders():
                if name.lower() not in ("transfer-encoding", "connection", "content-length"):
                    self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            connection.close()

        do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _forward

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Proxy)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()


def test_the_memory_sends_its_chroma_token(token_checked_chroma, embedder, tmp_path, monkeypatch):
    from diagnosis.failure_memory import MemoryError_

    url, seen = token_checked_chroma
    monkeypatch.setenv("FORGEFLOW_CHROMA_URL", url)
    monkeypatch.setenv("FORGEFLOW_CHROMA_TOKEN", TOKEN)
    config = MemoryConfig.from_env()
    assert TOKEN not in repr(config) and TOKEN not in str(config.model_dump())   # never printed
    remember_three(FailureMemory(config, embedder))
    assert len(FailureMemory(config, embedder)) == 3
    assert seen and set(seen) == {f"Bearer {TOKEN}"}      # every request carried it

    monkeypatch.delenv("FORGEFLOW_CHROMA_TOKEN")
    with pytest.raises(MemoryError_, match=f"cannot open failure memory at {url}") as refused:
        FailureMemory(MemoryConfig.from_env(), embedder)
    assert seen[-1] is None and TOKEN not in str(refused.value)


def test_memory_config_rejects_a_bad_server_url():
    with pytest.raises(ValueError, match="must look like http://HOST:PORT"):
        MemoryConfig(server_url="chroma.internal:8000")


# ---------------------------------------------------------------- protocol surface


def test_scripted_server_speaks_the_openai_protocol(llm_server):
    client = openai.OpenAI(base_url=llm_server.base_url, api_key="k", timeout=10, max_retries=0)
    llm_server.script(["plain chat", "streamed chat reply, in pieces", "plain completion", "streamed completion text"])
    chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert chat.choices[0].message.content == "plain chat"
    stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "streamed chat reply, in pieces"
    assert client.completions.create(model="m", prompt="p").choices[0].text == "plain completion"
    pieces = client.completions.create(model="m", prompt="p", stream=True)
    assert "".join(c.choices[0].text for c in pieces) == "streamed completion text"
    assert [m.id for m in client.models.list()] == ["scripted-llm"]
    assert [r.stream for r in llm_server.requests] == [False, True, False, True]


def test_llm_config_from_env(monkeypatch):
    for name in ("FORGEFLOW_LLM_MODEL", "FORGEFLOW_LLM_BASE_URL", "OPENAI_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    assert LLMConfig.from_env() is None  # no model: no LLM, agents fall back to retrieval
    monkeypatch.setenv("FORGEFLOW_LLM_BASE_URL", "http://127.0.0.1:9/v1")
    with pytest.raises(ValueError, match="FORGEFLOW_LLM_MODEL"):
        LLMConfig.from_env()
    monkeypatch.setenv("FORGEFLOW_LLM_MODEL", "qwen-72b")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    config = LLMConfig.from_env(timeout_s=3)
    assert (config.model, config.base_url, config.timeout_s) == ("qwen-72b", "http://127.0.0.1:9/v1", 3)
    assert config.api_key.get_secret_value() == "sk-test" and "sk-test" not in repr(config)


def test_json_extraction_is_tolerant_of_wrapping_strict_about_json():
    assert extract_json('```json\n{"a": [1, 2]}\n```') == {"a": [1, 2]}
    assert extract_json('Sure. {"a": 1} Anything else?') == {"a": 1}
    assert extract_json('```\n[{"regex": "x"}]\n```') == [{"regex": "x"}]
    for bad in ("", "no json here", "{'a': 1}", '{"a": 1,}'):
        with pytest.raises(MalformedReply):
            extract_json(bad)


def test_connection_refused_is_unavailable(free_port):
    from diagnosis.llm import LLMUnavailable

    llm = ChatLLM(LLMConfig(model="m", base_url=f"http://127.0.0.1:{free_port}/v1", timeout_s=2, max_retries=0))
    with pytest.raises(LLMUnavailable, match="cannot reach LLM"):
        llm.chat([{"role": "user", "content": "hi"}])
    assert llm.stats.unavailable == 1
