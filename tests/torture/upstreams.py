"""A loopback model server for the upstream faults ``tests.pooling.upstream.UpstreamServer``
does not script: a connection reset, a stream cut in the middle of a token, and error
bodies that echo the caller's API key back (the credential canary).

The behaviour is chosen by the path's first segment, so one server serves every record
(``base_url`` = ``<url>/<mode>/v1``):

- ``reset``: reads the request and closes the socket with ``SO_LINGER`` 0 (a TCP RST);
- ``cut``: answers 200 ``text/event-stream``, sends one chunk, then half of the next
  chunk's JSON (``"content": "Hel``) and closes the connection mid-body;
- ``echo``: reads the instruction ``canary:<case>`` from the last user message and answers
  with an error whose body carries the key of the request's ``Authorization`` header
  (`ECHO_CASES`), or a plain streamed ``ok`` for ``canary:ok``.

Every request is recorded (``requests``: path, headers, body) so a check can prove the key
was sent and echoed. Standard library only.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

ECHO_CASES = ("401", "400", "500", "502-html", "429", "stream-error", "ok")


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def _sse(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data).encode() + b"\n\n"


def _delta(text: str, finish: str | None = None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-torture",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "torture",
        "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}],
    }


class FaultUpstream:
    """See the module docstring. ``with FaultUpstream() as server: server.url``."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> FaultUpstream:
        owner = self

        class Handler(_Handler):
            server_owner = owner

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            daemon=True,
            name="torture-upstream",
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None

    def __enter__(self) -> FaultUpstream:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        assert self._server is not None, "FaultUpstream is not started"
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def base_url(self, mode: str) -> str:
        """The ``base_url`` of a model record served in ``mode``."""
        return f"{self.url}/{mode}/v1"

    def record(self, path: str, headers: dict[str, str], body: bytes) -> None:
        with self._lock:
            self.requests.append({"path": path, "headers": headers, "body": body})

    def requests_for(self, mode: str) -> list[dict[str, Any]]:
        with self._lock:
            return [r for r in self.requests if r["path"].startswith(f"/{mode}/")]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 10
    server_owner: FaultUpstream

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        headers = {k.lower(): v for k, v in self.headers.items()}
        self.server_owner.record(self.path, headers, body)
        mode = self.path.strip("/").split("/", 1)[0]
        try:
            if mode == "reset":
                self._reset()
            elif mode == "cut":
                self._cut()
            elif mode == "echo":
                self._echo(headers, body)
            else:
                self._send(404, "application/json", b'{"error": {"message": "no such mode"}}')
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def _reset(self) -> None:
        # SO_LINGER with a zero timeout makes close() send RST instead of FIN.
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True
        self.connection.close()

    def _cut(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.wfile.write(_chunk(_sse(_delta(""))))
        whole = _sse(_delta("Hello there"))
        half = whole[: whole.index(b"Hel") + 3]  # ... "content": "Hel
        self.wfile.write(f"{len(whole):x}\r\n".encode() + half)
        self.wfile.flush()
        self.close_connection = True
        self.connection.shutdown(socket.SHUT_RDWR)

    def _echo(self, headers: dict[str, str], body: bytes) -> None:
        key = headers.get("authorization", "").removeprefix("Bearer ").strip()
        try:
            messages = json.loads(body).get("messages") or []
        except ValueError:
            messages = []
        text = next(
            (str(m.get("content")) for m in reversed(messages) if m.get("role") == "user"), ""
        )
        case = text.removeprefix("canary:").strip()
        envelope = {
            "error": {
                "message": f"Incorrect API key provided: {key}. Check the key {key}.",
                "type": "invalid_request_error",
                "param": key,
                "code": "invalid_api_key",
            }
        }
        raw = json.dumps(envelope).encode()
        if case == "401":
            self._send(401, "application/json", raw)
        elif case == "400":
            self._send(400, "application/json", raw)
        elif case == "500":
            self._send(500, "application/json", raw)
        elif case == "429":
            self._send(429, "application/json", raw, {"Retry-After": "1"})
        elif case == "502-html":
            page = (
                f"<html><head><title>Bad gateway for {key}</title></head><body>"
                f"<h1>502 {key}</h1><p>upstream rejected {key}</p></body></html>"
            )
            self._send(502, "text/html", page.encode())
        elif case == "stream-error":
            events = _sse(_delta("partial ")) + _sse(envelope)
            self._send(200, "text/event-stream", events)
        else:
            events = _sse(_delta("all good", "stop")) + b"data: [DONE]\n\n"
            self._send(200, "text/event-stream", events)

    def _send(
        self, status: int, content_type: str, raw: bytes, headers: dict[str, str] | None = None
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(raw)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(raw)
