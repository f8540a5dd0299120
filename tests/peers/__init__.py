"""Loopback HTTP peers that speak real model-server wire formats, for tests and benchmarks.

`OpenAIPeer` answers `POST /v1/chat/completions` and `POST /v1/completions` (JSON or SSE
streaming, `n` choices) and `GET /v1/models` the way OpenAI-compatible servers (OpenAI, vLLM,
Ollama, llama.cpp server) do; `AnthropicPeer` answers `POST /v1/messages` with the Messages
API's streaming events. Both run a real HTTP server on 127.0.0.1 in a thread, so sync and
async callers alike can use them:

    with OpenAIPeer(reply="df.head()") as peer:
        peer.fail(Fault.error(429, retry_after=1))   # the next request gets a 429
        ... point a client at peer.url ...
        peer.requests                                  # what the client sent

Faults are consumed one per request, in order; after them every request succeeds with
`reply` (a string, or a callable taking the request body and returning a string or a list of
strings, one per choice).
"""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["AnthropicPeer", "Fault", "OpenAIPeer"]

Reply = str | list[str] | Callable[[dict[str, Any]], "str | list[str]"]


@dataclass
class Fault:
    """One misbehaviour for one request.

    kind: "status" (answer `status` with the API's error body and optional Retry-After),
    "hang" (sleep `delay` seconds before any byte), "malformed" (invalid JSON where the API
    sends JSON), "cut" (start streaming, send `after_chunks` chunks, close the connection
    without the end marker), "slow" (stream with `delay` seconds between chunks; notes in
    `peer.disconnects` when the client went away), "stream_error" (an error event mid-stream),
    "endless_line" (one `data:` line that never ends), "huge_event" (one event of endless short
    `data:` lines, never closed by a blank line), "endless_events" (valid small events, never an
    end marker), "gzip_line" (an endless line, gzip-compressed about 1000 to 1 whatever the
    request asked). The endless kinds stop when the client goes away (noted in `disconnects`,
    bytes written in `sent_bytes`) or after `limit` bytes.
    """

    kind: str
    status: int = 500
    retry_after: float | None = None
    delay: float = 0.0
    after_chunks: int = 1
    message: str = ""
    limit: int = 8 << 30

    @classmethod
    def error(cls, status: int, *, retry_after: float | None = None, message: str = "") -> Fault:
        return cls("status", status=status, retry_after=retry_after, message=message)

    @classmethod
    def hang(cls, seconds: float) -> Fault:
        return cls("hang", delay=seconds)

    @classmethod
    def malformed(cls) -> Fault:
        return cls("malformed")

    @classmethod
    def cut(cls, after_chunks: int = 1) -> Fault:
        return cls("cut", after_chunks=after_chunks)

    @classmethod
    def stream_error(cls, after_chunks: int = 1) -> Fault:
        """An error reported inside the stream after some chunks (Anthropic's `event: error`,
        an `{"error": …}` chunk for OpenAI-compatible servers such as vLLM)."""
        return cls("stream_error", after_chunks=after_chunks)

    @classmethod
    def slow(cls, delay: float) -> Fault:
        return cls("slow", delay=delay)

    @classmethod
    def endless_line(cls, limit: int = 8 << 30) -> Fault:
        return cls("endless_line", limit=limit)

    @classmethod
    def huge_event(cls, limit: int = 8 << 30) -> Fault:
        return cls("huge_event", limit=limit)

    @classmethod
    def endless_events(cls, limit: int = 8 << 30) -> Fault:
        return cls("endless_events", limit=limit)

    @classmethod
    def gzip_line(cls, limit: int = 8 << 30) -> Fault:
        return cls("gzip_line", limit=limit)


@dataclass
class _Request:
    method: str
    path: str
    headers: dict[str, str]
    body: Any


@dataclass
class _PeerState:
    faults: deque[Fault] = field(default_factory=deque)
    requests: list[_Request] = field(default_factory=list)
    disconnects: list[str] = field(default_factory=list)
    sent_bytes: list[int] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class _Peer:
    """A threaded loopback HTTP server; subclasses implement `handle`."""

    def __init__(
        self, *, reply: Reply = "print('hello')", api_key: str | None = None, chunk_size: int = 4
    ) -> None:
        self.reply = reply
        self.api_key = api_key
        self.chunk_size = chunk_size
        self.state = _PeerState()
        peer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # keep test output clean
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                peer._dispatch(self, "GET")

            def do_POST(self) -> None:  # noqa: N802
                peer._dispatch(self, "POST")

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        """The base URL a client is configured with (…/v1)."""
        return f"{self.base}/v1"

    def start(self) -> _Peer:
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- scripting ---------------------------------------------------------------------------

    def fail(self, *faults: Fault) -> None:
        """Queue faults for the next requests, one each."""
        with self.state.lock:
            self.state.faults.extend(faults)

    @property
    def requests(self) -> list[_Request]:
        return list(self.state.requests)

    @property
    def disconnects(self) -> list[str]:
        return list(self.state.disconnects)

    @property
    def sent_bytes(self) -> list[int]:
        """Bytes written by each answer of an endless fault, in order."""
        return list(self.state.sent_bytes)

    def _next_fault(self) -> Fault | None:
        with self.state.lock:
            return self.state.faults.popleft() if self.state.faults else None

    def _texts(self, body: dict[str, Any], n: int) -> list[str]:
        reply = self.reply(body) if callable(self.reply) else self.reply
        texts = [reply] if isinstance(reply, str) else list(reply)
        while len(texts) < n:
            texts.append(texts[-1])
        return texts[:n]

    # -- HTTP --------------------------------------------------------------------------------

    def _dispatch(self, h: BaseHTTPRequestHandler, method: str) -> None:
        length = int(h.headers.get("Content-Length") or 0)
        raw = h.rfile.read(length) if length else b""
        try:
            body: Any = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode("utf-8", "replace")
        with self.state.lock:
            self.state.requests.append(_Request(method, h.path, dict(h.headers.items()), body))
        try:
            self.handle(h, method, body)
        except (BrokenPipeError, ConnectionResetError):
            with self.state.lock:
                self.state.disconnects.append(h.path)

    def handle(self, h: BaseHTTPRequestHandler, method: str, body: Any) -> None:
        raise NotImplementedError

    def _send_json(
        self, h: BaseHTTPRequestHandler, status: int, obj: Any, headers: dict | None = None
    ) -> None:
        data = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.end_headers()
        h.wfile.write(data)
        h.wfile.flush()

    def _start_sse(self, h: BaseHTTPRequestHandler) -> None:
        # Close-delimited body, as many servers send SSE: no Content-Length, no chunking.
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream; charset=utf-8")
        h.send_header("Cache-Control", "no-cache")
        h.send_header("Connection", "close")
        h.end_headers()
        h.close_connection = True
        h.wfile.flush()

    def _send_event(self, h: BaseHTTPRequestHandler, data: str, event: str | None = None) -> None:
        frame = (f"event: {event}\n" if event else "") + f"data: {data}\n\n"
        h.wfile.write(frame.encode())
        h.wfile.flush()

    def _pieces(self, text: str) -> list[str]:
        size = max(1, self.chunk_size)
        return [text[i : i + size] for i in range(0, len(text), size)] or [""]

    def _limited(self, text: str, body: dict[str, Any]) -> tuple[list[str], bool]:
        """The pieces the answer is streamed in (a piece counts as a token), at most the
        request's `max_tokens` of them, and whether that limit cut the answer."""
        pieces = self._pieces(text)
        limit = body.get("max_tokens")
        if isinstance(limit, int) and 0 < limit < len(pieces):
            return pieces[:limit], True
        return pieces, False

    def _pre_fault(self, h: BaseHTTPRequestHandler, fault: Fault | None) -> bool:
        """Apply faults that happen before the answer; True if the request is answered."""
        if fault is None:
            return False
        if fault.kind == "hang":
            time.sleep(fault.delay)
            return False
        if fault.kind == "status":
            headers = {}
            if fault.retry_after is not None:
                headers["Retry-After"] = f"{fault.retry_after:g}"
            self._send_json(h, fault.status, self.error_body(fault.status, fault.message), headers)
            return True
        return False

    def error_body(self, status: int, message: str) -> dict[str, Any]:
        raise NotImplementedError

    def _endless(
        self, h: BaseHTTPRequestHandler, fault: Fault, delta: str, event: str | None
    ) -> None:
        """Answer with one of the endless faults (see Fault); `delta` is one valid event's data."""
        head = f"event: {event}\n" if event else ""
        if fault.kind == "gzip_line":
            h.send_response(200)
            h.send_header("Content-Type", "text/event-stream; charset=utf-8")
            h.send_header("Content-Encoding", "gzip")
            h.send_header("Connection", "close")
            h.end_headers()
            h.close_connection = True
            gz = zlib.compressobj(9, zlib.DEFLATED, 31)
            block = gz.compress(b"data: " + b"a" * (1 << 20)) + gz.flush(zlib.Z_SYNC_FLUSH)
            more = gz.compress(b"a" * (1 << 20)) + gz.flush(zlib.Z_SYNC_FLUSH)
            sent = 0
            try:
                h.wfile.write(block)
                while sent < fault.limit:
                    h.wfile.write(more)
                    sent += len(more)
                h.wfile.flush()
            finally:
                with self.state.lock:
                    self.state.sent_bytes.append(sent)
            return
        self._start_sse(h)
        if fault.kind == "endless_line":
            opening, piece = f"{head}data: {delta[: len(delta) // 2]}", b"a" * 65536
        elif fault.kind == "huge_event":
            opening, piece = head, b"data: " + b"b" * 1018 + b"\n"
            piece *= 64
        else:
            opening, piece = "", (f"{head}data: {delta}\n\n" * 256).encode()
        sent = 0
        try:
            h.wfile.write(opening.encode())
            while sent < fault.limit:
                h.wfile.write(piece)
                sent += len(piece)
            h.wfile.flush()
        finally:
            with self.state.lock:
                self.state.sent_bytes.append(sent)


_OPENAI_ERRORS = {
    400: ("invalid_request_error", None),
    401: ("invalid_request_error", "invalid_api_key"),
    404: ("invalid_request_error", "model_not_found"),
    429: ("requests", "rate_limit_exceeded"),
    500: ("server_error", None),
    503: ("server_error", None),
}


class OpenAIPeer(_Peer):
    """An OpenAI-compatible server: /v1/chat/completions, /v1/completions, /v1/models."""

    model = "loopback-model"

    def error_body(self, status: int, message: str) -> dict[str, Any]:
        kind, code = _OPENAI_ERRORS.get(status, ("server_error", None))
        default = {
            401: "Incorrect API key provided.",
            429: "Rate limit reached for requests. Please try again later.",
        }.get(status, "The server had an error while processing your request.")
        return {"error": {"message": message or default, "type": kind, "param": None, "code": code}}

    def handle(self, h: BaseHTTPRequestHandler, method: str, body: Any) -> None:
        path = h.path.split("?")[0]
        if self.api_key is not None:
            if h.headers.get("Authorization") != f"Bearer {self.api_key}":
                self._send_json(h, 401, self.error_body(401, ""))
                return
        if method == "GET" and path == "/v1/models":
            self._send_json(
                h, 200, {"object": "list", "data": [{"id": self.model, "object": "model"}]}
            )
            return
        if method != "POST" or path not in ("/v1/chat/completions", "/v1/completions"):
            self._send_json(h, 404, self.error_body(404, f"Unknown path {path}"))
            return
        if not isinstance(body, dict):
            self._send_json(h, 400, self.error_body(400, "We could not parse the JSON body."))
            return
        fault = self._next_fault()
        if self._pre_fault(h, fault):
            return
        chat = path.endswith("/chat/completions")
        n = int(body.get("n") or 1)
        texts = self._texts(body, n)
        model = body.get("model") or self.model
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:12]
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        if not body.get("stream"):
            if fault is not None and fault.kind == "malformed":
                self._send_json(h, 200, b'{"id": "cmpl-broken", "choices": [')
                return
            choices = [
                (
                    {"index": i, "message": {"role": "assistant", "content": t}}
                    if chat
                    else {"index": i, "text": t, "logprobs": None}
                )
                | {"finish_reason": "stop"}
                for i, t in enumerate(texts)
            ]
            self._send_json(
                h,
                200,
                {
                    "id": rid,
                    "object": obj,
                    "created": created,
                    "model": model,
                    "choices": choices,
                    "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
                },
            )
            return
        sent = 0

        def chunk(i: int, text: str | None, finish: str | None, first: bool = False) -> str:
            if chat:
                delta: dict[str, Any] = {}
                if first:
                    delta["role"] = "assistant"
                if text is not None:
                    delta["content"] = text
                choice: dict[str, Any] = {"index": i, "delta": delta}
            else:
                choice = {"index": i, "text": text or "", "logprobs": None}
            choice["finish_reason"] = finish
            return json.dumps(
                {
                    "id": rid,
                    "object": obj + ".chunk" if chat else obj,
                    "created": created,
                    "model": model,
                    "choices": [choice],
                }
            )

        if fault is not None and fault.kind.startswith(("endless", "huge", "gzip")):
            self._endless(h, fault, chunk(0, "x", None), None)
            return
        self._start_sse(h)
        for i, text in enumerate(texts):
            if chat:
                self._send_event(h, chunk(i, "", None, first=True))
            pieces, cut = self._limited(text, body)
            for piece in pieces:
                if fault is not None and fault.kind == "cut" and sent >= fault.after_chunks:
                    return  # the connection closes without [DONE]
                if fault is not None and fault.kind == "malformed" and sent >= 1:
                    self._send_event(h, '{"id": "' + rid + '", "choices": [{"delta": {"cont')
                    return
                if (
                    fault is not None
                    and fault.kind == "stream_error"
                    and sent >= fault.after_chunks
                ):
                    err = self.error_body(500, "The model crashed while generating.")
                    self._send_event(h, json.dumps(err))
                    return
                if fault is not None and fault.kind == "slow":
                    time.sleep(fault.delay)
                self._send_event(h, chunk(i, piece, None))
                sent += 1
            self._send_event(h, chunk(i, None if chat else "", "length" if cut else "stop"))
        self._send_event(h, "[DONE]")


_ANTHROPIC_ERRORS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}


class AnthropicPeer(_Peer):
    """The Anthropic Messages API: POST /v1/messages (JSON or streaming events)."""

    model = "claude-loopback"

    def error_body(self, status: int, message: str) -> dict[str, Any]:
        kind = _ANTHROPIC_ERRORS.get(status, "api_error")
        default = {
            401: "invalid x-api-key",
            429: "Number of request tokens has exceeded your per-minute rate limit",
            529: "Overloaded",
        }.get(status, "Internal server error")
        return {"type": "error", "error": {"type": kind, "message": message or default}}

    def handle(self, h: BaseHTTPRequestHandler, method: str, body: Any) -> None:
        path = h.path.split("?")[0]
        if method != "POST" or path != "/v1/messages":
            self._send_json(h, 404, self.error_body(404, f"Not found: {path}"))
            return
        if self.api_key is not None and h.headers.get("x-api-key") != self.api_key:
            self._send_json(h, 401, self.error_body(401, ""))
            return
        if not h.headers.get("anthropic-version"):
            self._send_json(h, 400, self.error_body(400, "anthropic-version: header is required"))
            return
        if not isinstance(body, dict) or "max_tokens" not in body or "messages" not in body:
            self._send_json(h, 400, self.error_body(400, "max_tokens: Field required"))
            return
        fault = self._next_fault()
        if self._pre_fault(h, fault):
            return
        text = self._texts(body, 1)[0]
        mid = "msg_" + uuid.uuid4().hex[:20]
        model = body.get("model") or self.model
        if not body.get("stream"):
            if fault is not None and fault.kind == "malformed":
                self._send_json(h, 200, b'{"id": "msg_broken", "content": [')
                return
            self._send_json(
                h,
                200,
                {
                    "id": mid,
                    "type": "message",
                    "role": "assistant",
                    "model": model,
                    "content": [{"type": "text", "text": text}],
                    "stop_reason": "end_turn",
                    "stop_sequence": None,
                    "usage": {"input_tokens": 10, "output_tokens": 5},
                },
            )
            return
        if fault is not None and fault.kind.startswith(("endless", "huge", "gzip")):
            delta = {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta"}}
            delta["delta"]["text"] = "x"
            self._endless(h, fault, json.dumps(delta), "content_block_delta")
            return
        self._start_sse(h)
        start = {
            "type": "message_start",
            "message": {
                "id": mid,
                "type": "message",
                "role": "assistant",
                "content": [],
                "model": model,
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {"input_tokens": 10, "output_tokens": 1},
            },
        }
        self._send_event(h, json.dumps(start), "message_start")
        block = {
            "type": "content_block_start",
            "index": 0,
            "content_block": {"type": "text", "text": ""},
        }
        self._send_event(h, json.dumps(block), "content_block_start")
        self._send_event(h, json.dumps({"type": "ping"}), "ping")
        sent = 0
        pieces, cut = self._limited(text, body)
        for piece in pieces:
            if fault is not None and fault.kind == "cut" and sent >= fault.after_chunks:
                return
            if fault is not None and fault.kind == "malformed" and sent >= 1:
                self._send_event(h, '{"type": "content_block_delta", "ind', "content_block_delta")
                return
            if fault is not None and fault.kind == "stream_error" and sent >= fault.after_chunks:
                self._send_event(h, json.dumps(self.error_body(529, "")), "error")
                return
            if fault is not None and fault.kind == "slow":
                time.sleep(fault.delay)
            delta = {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "text_delta", "text": piece},
            }
            self._send_event(h, json.dumps(delta), "content_block_delta")
            sent += 1
        self._send_event(
            h, json.dumps({"type": "content_block_stop", "index": 0}), "content_block_stop"
        )
        self._send_event(
            h,
            json.dumps(
                {
                    "type": "message_delta",
                    "delta": {
                        "stop_reason": "max_tokens" if cut else "end_turn",
                        "stop_sequence": None,
                    },
                    "usage": {"output_tokens": max(1, sent)},
                }
            ),
            "message_delta",
        )
        self._send_event(h, json.dumps({"type": "message_stop"}), "message_stop")


def free_port() -> int:
    """A TCP port nobody listens on right now (for connection-refused tests)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
