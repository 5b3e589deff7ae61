"""A small MCP server on loopback, built with the official SDK, for the MCP tool tests.

`McpTestServer` serves Streamable HTTP under uvicorn in a thread on a free port. Its tools:
``lookup`` (pure), ``bump`` (a side effect: counts its calls, reports progress), ``fail``
(``isError``), ``big`` (a large output), ``slow`` (sleeps) and ``hidden`` (for the
``allowed_tools`` tests), ``revoke`` (the server forgets the caller's token: its next
request is answered 401) and ``drop`` (the connection carrying the call is closed while
the tool runs). Every call is recorded with the bearer token it carried and its
``_meta`` idempotency key. Requests whose ``Authorization`` is not one of ``tokens`` get
401 before the SDK sees them (``tokens=None`` accepts anything).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
import uvicorn
from mcp.server.mcpserver import Context, MCPServer


@dataclass
class Call:
    tool: str
    authorization: str | None
    key: str | None
    arguments: dict[str, Any] = field(default_factory=dict)


class McpTestServer:
    def __init__(self, *, tokens: set[str] | None = None) -> None:
        self.tokens = tokens
        self.calls: list[Call] = []
        self.bumps = 0
        self.refused = 0
        # ``slow`` calls running at once, and the most there ever were.
        self.running = 0
        self.max_running = 0
        # Set while a ``drop`` call runs (created in the server's loop).
        self._dropping: asyncio.Event | None = None
        server = MCPServer("sage-test")

        def record(ctx: Context, tool: str, **arguments: Any) -> None:
            headers = dict(ctx.headers or {})
            meta = ctx.request_context.meta
            key = meta.get("sage/idempotency_key") if isinstance(meta, dict) else None
            if key is None and meta is not None:
                key = getattr(meta, "model_extra", {}).get("sage/idempotency_key")
            self.calls.append(Call(tool, headers.get("authorization"), key, arguments))

        @server.tool()
        async def lookup(key: str, ctx: Context) -> str:
            """Look a key up (no side effect)."""
            record(ctx, "lookup", key=key)
            return f"value of {key}"

        @server.tool()
        async def bump(ctx: Context, by: int = 1) -> str:
            """Add to the counter (a side effect)."""
            record(ctx, "bump", by=by)
            await ctx.report_progress(1, 2, "half way")
            self.bumps += by
            return f"counter is {self.bumps}"

        @server.tool()
        async def fail(ctx: Context) -> str:
            """Always fails."""
            record(ctx, "fail")
            raise ValueError("the widget is broken")

        @server.tool()
        async def big(ctx: Context, size: int = 100_000) -> str:
            """A large output."""
            record(ctx, "big")
            return "x" * size

        @server.tool()
        async def slow(ctx: Context, seconds: float = 5.0) -> str:
            """Sleeps."""
            record(ctx, "slow")
            self.running += 1
            self.max_running = max(self.max_running, self.running)
            try:
                await asyncio.sleep(seconds)
            finally:
                self.running -= 1
            return "slept"

        @server.tool()
        async def hidden(ctx: Context) -> str:
            """Not allowed in the tests' manifests."""
            record(ctx, "hidden")
            return "should never run"

        @server.tool()
        async def revoke(ctx: Context) -> str:
            """Forget the caller's token (its next request gets 401)."""
            record(ctx, "revoke")
            auth = dict(ctx.headers or {}).get("authorization", "")
            if self.tokens is not None:
                self.tokens.discard(auth.removeprefix("Bearer "))
            return "revoked"

        @server.tool()
        async def drop(ctx: Context) -> str:
            """Runs until the gate closes the connection carrying it."""
            record(ctx, "drop")
            self.dropping().set()
            await asyncio.sleep(10)
            return "should never arrive"

        app = server.streamable_http_app()

        async def dropped(scope: dict, receive: Any, send: Any) -> None:
            """Serve a ``drop`` call until the tool runs, then close the connection: the
            exception makes uvicorn cut the response off."""
            task = asyncio.create_task(app(scope, receive, send))
            try:
                await asyncio.wait_for(self.dropping().wait(), 10)
            finally:
                task.cancel()
            raise ConnectionAbortedError("the test server dropped the call's connection")

        async def gate(scope: dict, receive: Any, send: Any) -> None:
            if scope["type"] == "http" and self.tokens is not None:
                auth = dict(scope["headers"]).get(b"authorization", b"").decode()
                if auth.removeprefix("Bearer ") not in self.tokens:
                    self.refused += 1
                    await send(
                        {
                            "type": "http.response.start",
                            "status": 401,
                            "headers": [(b"content-type", b"application/json")],
                        }
                    )
                    await send({"type": "http.response.body", "body": b'{"error": "no"}'})
                    return
            if scope["type"] == "http" and scope["method"] == "POST":
                body, more = b"", True
                while more:
                    message = await receive()
                    body += message.get("body", b"")
                    more = message.get("more_body", False)
                receive = _replay(body, receive)
                if _called_tool(body) == "drop":
                    await dropped(scope, receive, send)
                    return
            await app(scope, receive, send)

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        sock.close()
        self.url = f"http://127.0.0.1:{self.port}/mcp"
        self._server = uvicorn.Server(
            uvicorn.Config(gate, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self._thread = threading.Thread(target=self._server.run, daemon=True, name="mcp-test")

    def start(self) -> McpTestServer:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            assert time.monotonic() < deadline, "the MCP test server did not start"
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)

    def called(self, tool: str) -> list[Call]:
        return [c for c in self.calls if c.tool == tool]

    def dropping(self) -> asyncio.Event:
        if self._dropping is None:
            self._dropping = asyncio.Event()
        return self._dropping


def _replay(body: bytes, receive: Any) -> Any:
    """An ASGI ``receive`` that gives the body read already, then the real one's messages."""
    replayed = False

    async def replay() -> dict:
        nonlocal replayed
        if replayed:
            return await receive()
        replayed = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


def _called_tool(body: bytes) -> str | None:
    """The tool a ``tools/call`` request names (None for anything else)."""
    try:
        message = json.loads(body)
    except ValueError:
        return None
    if isinstance(message, dict) and message.get("method") == "tools/call":
        return (message.get("params") or {}).get("name")
    return None


def allow_loopback(monkeypatch) -> None:
    """The test servers listen on 127.0.0.1, which the MCP policy refuses by default."""
    from django.conf import settings

    monkeypatch.setitem(settings.SAGE, "SAGE_MCP_ALLOWED_HOSTS", ("127.0.0.1",))


@pytest.fixture(name="mcp_server")
def mcp_server_fixture(monkeypatch):
    allow_loopback(monkeypatch)
    server = McpTestServer(tokens={"alice-token", "bob-token"}).start()
    yield server
    server.stop()
