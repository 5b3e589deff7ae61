"""A real model upstream on loopback, for tests that go through the official SDKs.

``UpstreamServer`` is a small ``ThreadingHTTPServer`` on ``127.0.0.1`` (port 0) that speaks
the OpenAI Chat Completions streaming protocol (``POST .../chat/completions``: SSE ``data:``
chunks ending in ``[DONE]``) and the Anthropic Messages streaming protocol (``POST
.../messages``: ``message_start``, ``content_block_*``, ``message_delta``, ``message_stop``).
The protocol is chosen by the request path, so one queued ``Reply`` serves either SDK.

Usage::

    with UpstreamServer() as upstream:           # or the ``upstream`` pytest fixture
        upstream.enqueue(Reply(text="Hello there"))
        upstream.enqueue(ErrorReply(status=429, body=openai_error("slow down"),
                                    headers={"Retry-After": "7"}))
        record.base_url = upstream.openai_base_url   # or upstream.anthropic_base_url
        ...
        assert upstream.requests[0].json["tools"][0]["function"]["name"] == "calculator"

Broken upstreams are scripted the same way: ``RawStream`` sends a 200 (or any status)
whose body is whatever bytes it is given, ``Reset`` resets the connection,
``Reply(drop_after_text=True)`` drops it after the text, and ``Reply(cut_mid_event=True)``
ends a stream in the middle of an event: cleanly, or by dropping the connection there with
``drop_after_text`` too. ``fault_catalogue(api_key)`` names one reply per known fault (see
``FAULTS``). ``EchoUpstream`` answers each request with an error that echoes the key the
request carried (the credential canary, ``ECHO_CASES``).

Replies are served in FIFO order; with the queue empty the server answers ``default``
(``Reply(text="ok")`` unless given); a subclass may answer from the request instead
(``reply_for``). Every request is recorded (``requests``), so a test can also assert that
no request was sent. The server runs in a daemon thread of the test process, so a worker
or web process of a live host reaches it on loopback like any upstream; ``base_url(protocol)``
is what a model record of either protocol points at, and ``model_record(...)`` saves one.
To use the fixture from another test module::

    from tests.pooling.upstream import upstream_fixture  # noqa: F401  (registers "upstream")

It depends on nothing but the standard library and pytest (``model_record`` alone imports
the project's ``ModelRecord``, and needs the database).
"""

from __future__ import annotations

import json
import re
import socket
import struct
import sys
import threading
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

HTML_502 = (
    "<!DOCTYPE html>\n<html>\n<head><title>502 Bad Gateway</title></head>\n"
    "<body>\n<center><h1>502 Bad Gateway</h1></center>\n<hr><center>nginx/1.25.3</center>\n"
    "</body>\n</html>\n"
)
HTML_FIREWALL = (
    "<html><head><meta charset='utf-8'></head><body><h1>Access denied</h1>"
    "<p>Your request was blocked by the web application firewall. Ray ID: 8f2c1a.</p>"
    "</body></html>"
)


def openai_error(message: str, *, type: str = "invalid_request_error", code: Any = None) -> str:
    """An OpenAI-compatible error envelope."""
    return json.dumps({"error": {"message": message, "type": type, "param": None, "code": code}})


def anthropic_error(message: str, *, type: str = "invalid_request_error") -> str:
    """An Anthropic error envelope."""
    return json.dumps({"type": "error", "error": {"type": type, "message": message}})


def gemini_error(message: str, *, code: int = 400, status: str = "INVALID_ARGUMENT") -> str:
    """A Gemini (Google AI) error envelope."""
    return json.dumps({"error": {"code": code, "message": message, "status": status}})


def ollama_error(message: str) -> str:
    """An Ollama error envelope."""
    return json.dumps({"error": message})


def mistral_error(message: Any, *, type: str = "invalid_request_error") -> str:
    """A Mistral error envelope."""
    return json.dumps({"object": "error", "message": message, "type": type, "param": None,
                       "code": None})


@dataclass(frozen=True, slots=True, kw_only=True)
class Reply:
    """A successful streamed reply.

    ``tool_calls`` items are ``{"name", "arguments"}`` (plus optional ``"id"``);
    ``arguments`` is a dict (sent as JSON) or a raw string sent as is (to test bad JSON).
    Arguments are sent in ``fragments`` pieces. ``usage`` is ``(input, output)`` tokens.
    With ``gate`` set, the server sends the first text chunk, then waits for the event
    (at most 30 s) before sending the rest, so a test can hold a stream open.
    ``error_after_text`` sends a vendor error event after the text instead of finishing;
    ``drop_after_text`` closes the connection abruptly after the text (a dropped stream);
    ``cut_mid_event`` sends the first half of the next event after the text and then ends
    the body cleanly (a stream that stops mid-token, with no finish and no error) or, with
    ``drop_after_text``, drops the connection there (a stream cut mid-token).
    """

    text: str = "ok"
    tool_calls: tuple[Mapping[str, Any], ...] = ()
    fragments: int = 3
    usage: tuple[int, int] = (11, 7)
    stop_reason: str | None = None
    gate: threading.Event | None = None
    error_after_text: Mapping[str, Any] | None = None
    drop_after_text: bool = False
    cut_mid_event: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class ErrorReply:
    """An HTTP error response with a raw body (a JSON envelope or an HTML page)."""

    status: int
    body: str | bytes = ""
    headers: Mapping[str, str] = field(default_factory=dict)
    content_type: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class RawStream:
    """A response whose body is exactly ``chunks``, sent one HTTP chunk each (chunked
    transfer encoding) and ended cleanly: garbage in a 200, a broken event stream, bytes
    that are not UTF-8."""

    chunks: tuple[str | bytes, ...]
    status: int = 200
    content_type: str = "text/event-stream"


@dataclass(frozen=True, slots=True, kw_only=True)
class Reset:
    """The connection is reset (TCP RST) once the request is read, before any response."""


AnyReply = Reply | ErrorReply | RawStream | Reset


@dataclass(frozen=True, slots=True, kw_only=True)
class RecordedRequest:
    """One request the server received."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    @property
    def json(self) -> Any:
        """The body parsed as JSON (``None`` if it is not JSON)."""
        try:
            return json.loads(self.body)
        except ValueError:
            return None


def _tokens(text: str) -> list[str]:
    return re.findall(r"\S+\s*|\s+", text)


def _split(text: str, pieces: int) -> list[str]:
    pieces = max(1, min(pieces, len(text) or 1))
    size = -(-len(text) // pieces) if text else 1
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


class UpstreamServer:
    """A scripted OpenAI + Anthropic streaming server on loopback (see the module docstring)."""

    def __init__(self, *, default: AnyReply | None = None) -> None:
        self.default: AnyReply = default or Reply()
        self._queue: deque[AnyReply] = deque()
        self._requests: list[RecordedRequest] = []
        self._cond = threading.Condition()
        # Gates of replies being served, released by stop() so no handler waits them out.
        self._gates: list[threading.Event] = []
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> UpstreamServer:
        """Bind ``127.0.0.1`` on a free port and serve in a daemon thread; returns self."""
        owner = self

        class Handler(_Handler):
            server_owner = owner

        server = _Server(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True,
            name="fake-upstream",
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and release the port; open gates are released first."""
        with self._cond:
            for item in self._queue:
                if isinstance(item, Reply) and item.gate is not None:
                    item.gate.set()
            for gate in self._gates:
                gate.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> UpstreamServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- addresses -------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>``."""
        assert self._server is not None, "UpstreamServer is not started"
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def openai_base_url(self) -> str:
        """The ``base_url`` for ``AsyncOpenAI`` (ends in ``/v1``)."""
        return f"{self.url}/v1"

    @property
    def anthropic_base_url(self) -> str:
        """The ``base_url`` for ``AsyncAnthropic`` (the SDK adds ``/v1/messages``)."""
        return self.url

    def base_url(self, protocol: str) -> str:
        """The ``base_url`` of a record of ``protocol`` (``openai`` or ``anthropic``)."""
        return self.openai_base_url if protocol == "openai" else self.anthropic_base_url

    def model_record(
        self,
        *,
        name: str,
        api_key: str,
        owner: Any = None,
        protocol: str = "openai",
        model: str = "test-model",
        **options: Any,
    ) -> Any:
        """A saved ``pooling.models.ModelRecord`` (shared when ``owner`` is ``None``) that
        reaches this server over ``protocol`` with ``api_key``; ``options`` are the
        record's options. Needs the database."""
        from pooling.models import ModelRecord

        record = ModelRecord(
            owner=owner,
            name=name,
            protocol=protocol,
            base_url=self.base_url(protocol),
            model=model,
            options=options,
        )
        record.api_key = api_key
        record.save()
        return record

    # -- scripting and inspection ----------------------------------------------------------

    def enqueue(self, *replies: AnyReply) -> None:
        """Queue replies, served one per request in FIFO order."""
        with self._cond:
            self._queue.extend(replies)

    @property
    def pending(self) -> int:
        """Queued replies not served yet."""
        with self._cond:
            return len(self._queue)

    @property
    def requests(self) -> list[RecordedRequest]:
        """A copy of the requests received so far, in arrival order."""
        with self._cond:
            return list(self._requests)

    def wait_for_requests(self, count: int, timeout: float = 5.0) -> list[RecordedRequest]:
        """Block until ``count`` requests arrived (``TimeoutError`` after ``timeout`` s)."""
        with self._cond:
            if not self._cond.wait_for(lambda: len(self._requests) >= count, timeout=timeout):
                raise TimeoutError(f"expected {count} requests, got {len(self._requests)}")
            return list(self._requests)

    def clear(self) -> None:
        """Forget recorded requests and queued replies."""
        with self._cond:
            self._requests.clear()
            self._queue.clear()

    def reply_for(self, request: RecordedRequest) -> AnyReply:
        """The reply to ``request`` (already recorded): the next queued one, else
        ``default``. A subclass may answer from the request instead."""
        return self._queue.popleft() if self._queue else self.default

    def _next(self, request: RecordedRequest) -> AnyReply:
        with self._cond:
            self._requests.append(request)
            self._cond.notify_all()
            reply = self.reply_for(request)
            if isinstance(reply, Reply) and reply.gate is not None:
                self._gates.append(reply.gate)
            return reply


class _Server(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that stops reading a reply it refused (an invalid response) closes or
        # resets the connection; that is the test's point, not a server error to print.
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Idle keep-alive connections end on their own, so no handler thread outlives a test.
    timeout = 10
    server_owner: UpstreamServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._body()
        self._send_json(404, {"error": {"message": "not found", "type": "not_found"}})

    def do_POST(self) -> None:
        body = self._body()
        request = RecordedRequest(
            method="POST",
            path=self.path,
            headers={k.lower(): v for k, v in self.headers.items()},
            body=body,
        )
        path = self.path.split("?", 1)[0].rstrip("/")
        if path.endswith("/chat/completions"):
            protocol = "openai"
        elif path.endswith("/messages"):
            protocol = "anthropic"
        else:
            self._send_json(404, {"error": {"message": f"no route {path}", "type": "not_found"}})
            return
        reply = self.server_owner._next(request)
        try:
            if isinstance(reply, ErrorReply):
                self._send_error_reply(reply)
                return
            if isinstance(reply, RawStream):
                self._send_raw_stream(reply)
                return
            if isinstance(reply, Reset):
                self._reset()
                return
            payload = request.json or {}
            model = str(payload.get("model", "test-model"))
            if not payload.get("stream"):
                self._send_json(200, _whole(protocol, reply, model))
            elif protocol == "openai":
                self._stream(_openai_events(reply, model), reply)
            else:
                self._stream(_anthropic_events(reply, model), reply)
        except (BrokenPipeError, ConnectionResetError):
            # The client went away mid-reply (a cancelled stream); nothing left to do.
            self.close_connection = True

    # -- helpers ---------------------------------------------------------------------------

    def _body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _send_json(self, status: int, data: Any) -> None:
        raw = json.dumps(data).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def _send_error_reply(self, reply: ErrorReply) -> None:
        raw = reply.body.encode() if isinstance(reply.body, str) else reply.body
        content_type = reply.content_type
        if content_type is None:
            content_type = "text/html" if raw.lstrip()[:1] == b"<" else "application/json"
        self.send_response(reply.status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(raw)))
        for name, value in reply.headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(raw)

    def _send_raw_stream(self, reply: RawStream) -> None:
        self.send_response(reply.status)
        self.send_header("Content-Type", reply.content_type)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for chunk in reply.chunks:
            self._chunk(chunk.encode() if isinstance(chunk, str) else chunk)
        self._chunk(b"")

    def _reset(self) -> None:
        # SO_LINGER with a zero timeout makes close() send RST instead of FIN.
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True
        self.connection.close()

    def _stream(self, events: Iterator[str], reply: Reply) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for event in events:
            if event == _GATE:
                if reply.gate is not None:
                    reply.gate.wait(timeout=30)
                continue
            if event == _DROP:
                self.close_connection = True
                return
            self._chunk(event.encode())
        self._chunk(b"")

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


_GATE = "\x00gate"
_DROP = "\x00drop"


def _half(event: str) -> str:
    return event[: len(event) // 2]


def _breaks_off(reply: Reply) -> bool:
    return reply.drop_after_text or reply.cut_mid_event


def _break_off(reply: Reply, next_event: str) -> Iterator[str]:
    """The end of a reply that breaks off after its text: the first half of ``next_event``
    when it is cut mid-event, then the connection drops or (a cut alone) the body ends."""
    if reply.cut_mid_event:
        yield _half(next_event)
    if reply.drop_after_text:
        # No terminating chunk: the client sees the stream cut off mid-body.
        yield _DROP


def _arguments_text(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments)


def _openai_events(reply: Reply, model: str) -> Iterator[str]:
    base = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 0, "model": model}

    def chunk(delta: dict[str, Any] | None, finish: str | None = None, **extra: Any) -> str:
        choices = [] if delta is None else [
            {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        ]
        return "data: " + json.dumps({**base, "choices": choices, **extra}) + "\n\n"

    yield chunk({"role": "assistant", "content": ""})
    for index, token in enumerate(_tokens(reply.text)):
        yield chunk({"content": token})
        if index == 0:
            yield _GATE
    if _breaks_off(reply):
        yield from _break_off(reply, chunk({"content": " and then"}))
        return
    if reply.error_after_text is not None:
        yield "data: " + json.dumps({"error": dict(reply.error_after_text)}) + "\n\n"
        return
    for index, call in enumerate(reply.tool_calls):
        call_id = call.get("id") or f"call_fake_{index}"
        pieces = _split(_arguments_text(call.get("arguments", {})), reply.fragments)
        yield chunk({"tool_calls": [{"index": index, "id": call_id, "type": "function",
                                     "function": {"name": call["name"], "arguments": ""}}]})
        for piece in pieces:
            yield chunk({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
    finish = reply.stop_reason or ("tool_calls" if reply.tool_calls else "stop")
    yield chunk({}, finish)
    prompt, completion = reply.usage
    yield chunk(None, usage={"prompt_tokens": prompt, "completion_tokens": completion,
                             "total_tokens": prompt + completion})
    yield "data: [DONE]\n\n"


def _sse(event: str, data: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {json.dumps({'type': event, **data})}\n\n"


def _anthropic_events(reply: Reply, model: str) -> Iterator[str]:
    prompt, completion = reply.usage
    yield _sse("message_start", {"message": {
        "id": "msg_fake", "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": prompt, "output_tokens": 1}}})
    index = 0
    if reply.text:
        yield _sse("content_block_start", {"index": 0, "content_block": {"type": "text",
                                                                          "text": ""}})
        yield _sse("ping", {})
        for position, token in enumerate(_tokens(reply.text)):
            yield _sse("content_block_delta", {"index": 0, "delta": {"type": "text_delta",
                                                                      "text": token}})
            if position == 0:
                yield _GATE
        yield _sse("content_block_stop", {"index": 0})
        index = 1
    if _breaks_off(reply):
        yield from _break_off(reply, _sse("content_block_delta", {"index": 0, "delta": {
            "type": "text_delta", "text": " and then"}}))
        return
    if reply.error_after_text is not None:
        yield _sse("error", {"error": dict(reply.error_after_text)})
        return
    for offset, call in enumerate(reply.tool_calls):
        block = index + offset
        yield _sse("content_block_start", {"index": block, "content_block": {
            "type": "tool_use", "id": call.get("id") or f"toolu_fake_{offset}",
            "name": call["name"], "input": {}}})
        for piece in _split(_arguments_text(call.get("arguments", {})), reply.fragments):
            yield _sse("content_block_delta", {"index": block, "delta": {
                "type": "input_json_delta", "partial_json": piece}})
        yield _sse("content_block_stop", {"index": block})
    stop = reply.stop_reason or ("tool_use" if reply.tool_calls else "end_turn")
    yield _sse("message_delta", {"delta": {"stop_reason": stop, "stop_sequence": None},
                                 "usage": {"output_tokens": completion}})
    yield _sse("message_stop", {})


def _whole(protocol: str, reply: Reply, model: str) -> dict[str, Any]:
    prompt, completion = reply.usage
    if protocol == "openai":
        message: dict[str, Any] = {"role": "assistant", "content": reply.text}
        if reply.tool_calls:
            message["tool_calls"] = [
                {"id": call.get("id") or f"call_fake_{i}", "type": "function",
                 "function": {"name": call["name"],
                              "arguments": _arguments_text(call.get("arguments", {}))}}
                for i, call in enumerate(reply.tool_calls)
            ]
        return {"id": "chatcmpl-fake", "object": "chat.completion", "created": 0, "model": model,
                "choices": [{"index": 0, "message": message,
                             "finish_reason": "tool_calls" if reply.tool_calls else "stop"}],
                "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                          "total_tokens": prompt + completion}}
    content: list[dict[str, Any]] = [{"type": "text", "text": reply.text}] if reply.text else []
    for i, call in enumerate(reply.tool_calls):
        arguments = call.get("arguments", {})
        content.append({"type": "tool_use", "id": call.get("id") or f"toolu_fake_{i}",
                        "name": call["name"],
                        "input": arguments if isinstance(arguments, dict) else {}})
    return {"id": "msg_fake", "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": "tool_use" if reply.tool_calls else "end_turn",
            "stop_sequence": None,
            "usage": {"input_tokens": prompt, "output_tokens": completion}}


# -- the fault catalogue ------------------------------------------------------------------

GARBAGE_JSON = json.dumps({"status": "ok", "note": "TRACE-garbage-5e1d: not a completion"})
HTML_PORTAL = (
    "<!DOCTYPE html><html><head><title>Hotel Wi-Fi: sign in at portal.example</title></head>"
    "<body><h1>Welcome</h1><p>TRACE-portal-77aa accept the terms to continue</p></body></html>"
)
# A syntactically broken event stream: the event's JSON never closes.
BROKEN_EVENT_STREAM = (
    'event: message_start\ndata: {"type": "message_start", "TRACE-broken-31c0": \n\n',
)
NON_UTF8_EVENT_STREAM = (
    b'event: message_start\ndata: {"type": "message_start", "note": "TRACE-bytes \xff\xfe"}\n\n',
)
# An event-stream content type with a body that holds no event at all.
EVENTLESS_STREAM = ("TRACE-eventless-9b02 upstream maintenance\n",)

FAULTS = (
    "html_502",
    "garbage_json_200",
    "html_200",
    "eventless_stream_200",
    "broken_event_stream",
    "non_utf8_bytes",
    "rate_limited_with_retry_after",
    "rate_limited_without_retry_after",
    "unauthorized_echoing_the_key",
    "connection_reset",
    "stops_mid_token",
)


def fault_catalogue(api_key: str) -> dict[str, AnyReply]:
    """One reply per known upstream fault (the names of ``FAULTS``); the 401 echoes
    ``api_key`` and a second, key-shaped secret, as some gateways do."""
    return {
        "html_502": ErrorReply(status=502, body=HTML_502),
        "garbage_json_200": ErrorReply(status=200, body=GARBAGE_JSON,
                                       content_type="application/json"),
        "html_200": ErrorReply(status=200, body=HTML_PORTAL, content_type="text/html"),
        "eventless_stream_200": RawStream(chunks=EVENTLESS_STREAM),
        "broken_event_stream": RawStream(chunks=BROKEN_EVENT_STREAM),
        "non_utf8_bytes": RawStream(chunks=NON_UTF8_EVENT_STREAM),
        "rate_limited_with_retry_after": ErrorReply(
            status=429, headers={"Retry-After": "17"},
            body=openai_error("Rate limit reached for TRACE-org-4411", type="requests",
                              code="rate_limit_exceeded")),
        "rate_limited_without_retry_after": ErrorReply(
            status=429,
            body=openai_error("Rate limit reached for TRACE-org-4411", type="requests",
                              code="rate_limit_exceeded")),
        "unauthorized_echoing_the_key": ErrorReply(
            status=401,
            body=openai_error(f"Incorrect API key provided: {api_key} (also tried "
                              "sk-proj-Zx81TRACEotherkey). TRACE-auth-0c3e",
                              code="invalid_api_key")),
        "connection_reset": Reset(),
        "stops_mid_token": Reply(text="Partial answer", cut_mid_event=True),
    }


# -- the credential canary ------------------------------------------------------------------

# What ``EchoUpstream`` answers, by the instruction ``canary:<case>`` of a request's last
# user message.
ECHO_CASES = ("401", "400", "500", "502-html", "429", "stream-error", "ok")


def echo_reply(request: RecordedRequest) -> AnyReply:
    """The reply to the instruction ``canary:<case>`` in ``request``'s last user message
    (``ECHO_CASES``): an error whose body carries the key of the request's
    ``Authorization`` header — a JSON envelope with a 401, 400, 500 or 429 (``Retry-After:
    1``), a 502 HTML page, an error event after some text in a 200 stream — or, for ``ok``
    (and anything else), a plain streamed reply."""
    key = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
    messages = (request.json or {}).get("messages") or []
    text = next((str(m.get("content")) for m in reversed(messages) if m.get("role") == "user"), "")
    case = text.removeprefix("canary:").strip()
    error = {
        "message": f"Incorrect API key provided: {key}. Check the key {key}.",
        "type": "invalid_request_error",
        "param": key,
        "code": "invalid_api_key",
    }
    envelope = json.dumps({"error": error})
    if case in ("401", "400", "500"):
        return ErrorReply(status=int(case), body=envelope)
    if case == "429":
        return ErrorReply(status=429, body=envelope, headers={"Retry-After": "1"})
    if case == "502-html":
        page = (
            f"<html><head><title>Bad gateway for {key}</title></head><body>"
            f"<h1>502 {key}</h1><p>upstream rejected {key}</p></body></html>"
        )
        return ErrorReply(status=502, body=page, content_type="text/html")
    if case == "stream-error":
        return Reply(text="partial ", error_after_text=error)
    return Reply(text="all good")


class EchoUpstream(UpstreamServer):
    """An ``UpstreamServer`` answering every request with ``echo_reply``: the credential
    canary's upstream, which puts the key it receives into every error body."""

    def reply_for(self, request: RecordedRequest) -> AnyReply:
        return echo_reply(request)


@pytest.fixture(name="upstream")
def upstream_fixture() -> Iterator[UpstreamServer]:
    """A started ``UpstreamServer``, stopped after the test."""
    with UpstreamServer() as server:
        yield server
