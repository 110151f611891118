"""A small OpenAI-compatible HTTP server whose replies a test scripts.

Real HTTP on 127.0.0.1 (port 0, standard library only), so the `openai` client and
llama-index talk to it exactly as they would to vLLM or OpenAI: /v1/chat/completions
(plain and streamed), /v1/completions (plain and streamed) and /v1/models.

A test scripts it with a queue of replies (`server.script([...])`) or a function of
the request (`server.respond_with(fn)`). A reply is a string (the message content)
or a `Reply` that can also fail with an HTTP status or sleep past the client's
timeout. Every request is recorded in `server.requests`.
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterable

MODEL_ID = "scripted-llm"


@dataclass
class Reply:
    """One scripted answer."""

    content: str = ""
    status: int = 200
    delay_s: float = 0.0  # sleep before answering (to exceed a client timeout)


@dataclass
class LLMRequest:
    """What a client sent, as the script sees it."""

    path: str
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def messages(self) -> list[dict[str, Any]]:
        return list(self.body.get("messages") or [])

    @property
    def text(self) -> str:
        """All prompt text: chat messages' content joined, or the completion prompt."""
        if "messages" in self.body:
            parts = []
            for message in self.messages:
                content = message.get("content")
                if isinstance(content, list):  # content parts form
                    content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
                parts.append(str(content or ""))
            return "\n".join(parts)
        prompt = self.body.get("prompt", "")
        return "\n".join(prompt) if isinstance(prompt, list) else str(prompt)

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))


Responder = Callable[[LLMRequest], "Reply | str"]


@dataclass
class ScriptedLLMServer:
    """Start with `start()` (or as a context manager); `base_url` ends in /v1."""

    host: str = "127.0.0.1"
    requests: list[LLMRequest] = field(default_factory=list)
    unscripted: int = 0  # requests that arrived with nothing scripted: a test bug

    def __post_init__(self) -> None:
        self._queue: deque[Reply | str] = deque()
        self._responder: Responder | None = None
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ---- scripting -------------------------------------------------------
    def script(self, replies: Iterable[Reply | str]) -> None:
        """Answer the next requests with these replies, in order (replaces any script)."""
        with self._lock:
            self._queue = deque(replies)
            self._responder = None

    def respond_with(self, responder: Responder) -> None:
        """Answer every request with `responder(request)` (replaces any script)."""
        with self._lock:
            self._queue.clear()
            self._responder = responder

    def reset(self) -> None:
        with self._lock:
            self._queue.clear()
            self._responder = None
            self.requests.clear()
            self.unscripted = 0

    def _next_reply(self, request: LLMRequest) -> Reply:
        with self._lock:
            self.requests.append(request)
            if self._responder is not None:
                responder = self._responder
            elif self._queue:
                reply = self._queue.popleft()
                return reply if isinstance(reply, Reply) else Reply(content=reply)
            else:
                self.unscripted += 1
                return Reply(status=500, content="no scripted reply left for this request")
        reply = responder(request)
        return reply if isinstance(reply, Reply) else Reply(content=reply)

    # ---- lifecycle -------------------------------------------------------
    @property
    def base_url(self) -> str:
        assert self._httpd is not None, "server not started"
        return f"http://{self.host}:{self._httpd.server_address[1]}/v1"

    def start(self) -> "ScriptedLLMServer":
        server = self

        class Handler(_Handler):
            scripted = server

        self._httpd = ThreadingHTTPServer((self.host, 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="scripted-llm", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()  # wakes handlers sleeping in a scripted delay
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def __enter__(self) -> "ScriptedLLMServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _Handler(BaseHTTPRequestHandler):
    scripted: ScriptedLLMServer

    def log_message(self, format: str, *args: Any) -> None:  # keep test output quiet
        pass

    def do_GET(self) -> None:
        if self.path.rstrip("/").endswith("/v1/models"):
            self._send_json(
                200,
                {
                    "object": "list",
                    "data": [{"id": MODEL_ID, "object": "model", "created": 0, "owned_by": "test"}],
                },
            )
        else:
            self._send_json(404, {"error": {"message": f"no route {self.path}"}})

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
        except json.JSONDecodeError:
            self._send_json(400, {"error": {"message": "request body is not JSON"}})
            return
        path = self.path.rstrip("/")
        if not (path.endswith("/v1/chat/completions") or path.endswith("/v1/completions")):
            self._send_json(404, {"error": {"message": f"no route {self.path}"}})
            return
        request = LLMRequest(path=path, body=body, headers={k.lower(): v for k, v in self.headers.items()})
        reply = self.scripted._next_reply(request)
        if reply.delay_s and self.scripted._stopping.wait(reply.delay_s):
            return
        try:
            if reply.status != 200:
                self._send_json(
                    reply.status,
                    {"error": {"message": reply.content or "scripted failure", "type": "server_error"}},
                )
            elif path.endswith("/chat/completions"):
                self._chat(request, reply.content)
            else:
                self._completion(request, reply.content)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (timeout): nothing to answer

    def _chat(self, request: LLMRequest, content: str) -> None:
        ident, created = f"chatcmpl-{uuid.uuid4().hex[:12]}", int(time.time())
        model = request.body.get("model", MODEL_ID)
        usage = {"prompt_tokens": len(request.text.split()), "completion_tokens": len(content.split())}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        if not request.stream:
            self._send_json(
                200,
                {
                    "id": ident,
                    "object": "chat.completion",
                    "created": created,
                    "model": model,
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": content},
                            "finish_reason": "stop",
                        }
                    ],
                    "usage": usage,
                },
            )
            return
        chunks = [{"role": "assistant", "content": ""}] + [
            {"content": piece} for piece in _pieces(content)
        ]
        events = [
            {
                "id": ident,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": None}],
            }
            for delta in chunks
        ]
        events.append(
            {
                "id": ident,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
            }
        )
        self._send_events(events)

    def _completion(self, request: LLMRequest, content: str) -> None:
        ident, created = f"cmpl-{uuid.uuid4().hex[:12]}", int(time.time())
        model = request.body.get("model", MODEL_ID)

        def event(text: str, finish: str | None) -> dict[str, Any]:
            return {
                "id": ident,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}],
            }

        if not request.stream:
            self._send_json(200, event(content, "stop"))
            return
        self._send_events([event(piece, None) for piece in _pieces(content)] + [event("", "stop")])

    def _send_json(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _send_events(self, events: list[dict[str, Any]]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        for payload in events:
            self.wfile.write(f"data: {json.dumps(payload)}\n\n".encode())
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()
        self.close_connection = True


def _pieces(text: str, size: int = 16) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


# ---------------------------------------------------------------- reading a RAG prompt

_RETRIEVED = re.compile(r"Past failures with their diagnoses, most similar first:\n-+\n(.*?)\n-+\n", re.S)


def retrieved_failures(prompt: str) -> list[dict[str, Any]]:
    """The past failures a failure-agent prompt carries, in the order sent (llama-index
    renders each as its visible metadata lines, a blank line, then the stored text)."""
    match = _RETRIEVED.search(prompt)
    nodes: list[dict[str, Any]] = []
    for line in (match.group(1) if match else "").splitlines():
        if line.startswith("root_cause: "):
            nodes.append({"root_cause": line.split(": ", 1)[1], "lines": []})
        elif nodes and line.startswith("kind: "):
            nodes[-1]["kind"] = line.split(": ", 1)[1]
        elif nodes and line.startswith("restart_helps: "):
            nodes[-1]["restart_helps"] = line.split(": ", 1)[1].strip() == "True"
        elif nodes and line.startswith("mitigation: "):
            nodes[-1]["mitigation"] = line.split(": ", 1)[1]
        elif nodes and line.strip():
            nodes[-1]["lines"].append(line)
    return nodes
