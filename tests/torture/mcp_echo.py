"""An MCP server on loopback that echoes the credential it received in its error answers,
for the credential canary (`tests.torture.test_credential_canary`).

Built with the official SDK (Streamable HTTP under uvicorn in a thread). A gate in front
of it records every ``Authorization`` header and answers, with that header in the body:

- ``/broken/mcp``: every request 500 (a failing initialise);
- a ``tools/call`` of ``expire``: 401 (the token refused mid-run, after the listing);
- a ``tools/call`` of ``boom``: 500.

Its tools' own answers never echo it: ``lookup`` answers, ``fail`` is an ``isError``
result the model sees (tool results are shown to the model by design).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

import uvicorn
from mcp.server.mcpserver import MCPServer

ECHO_TOOLS = {"expire": 401, "boom": 500}


class EchoMcpServer:
    def __init__(self) -> None:
        self.authorizations: list[str] = []
        # The error answers that carried the header back (the canary's control).
        self.echoed = 0
        server = MCPServer("sage-canary")

        @server.tool()
        async def lookup(key: str) -> str:
            """Look a key up."""
            return f"value of {key}"

        @server.tool()
        async def fail() -> str:
            """Always fails (an isError result)."""
            raise ValueError("the widget is broken")

        @server.tool()
        async def expire() -> str:
            """Answered 401 by the gate."""
            return "never"

        @server.tool()
        async def boom() -> str:
            """Answered 500 by the gate."""
            return "never"

        app = server.streamable_http_app()

        async def echo(send: Any, status: int, auth: str) -> None:
            self.echoed += 1
            body = json.dumps({"error": "refused", "you_sent": auth}).encode()
            headers = [(b"content-type", b"application/json")]
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        async def gate(scope: dict, receive: Any, send: Any) -> None:
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            auth = dict(scope["headers"]).get(b"authorization", b"").decode()
            self.authorizations.append(auth)
            if scope["path"].startswith("/broken"):
                await echo(send, 500, auth)
                return
            if scope["method"] != "POST":
                await app(scope, receive, send)
                return
            body, more = b"", True
            while more:
                message = await receive()
                body += message.get("body", b"")
                more = message.get("more_body", False)
            status = ECHO_TOOLS.get(_called_tool(body) or "")
            if status:
                await echo(send, status, auth)
                return
            replayed = False

            async def replay() -> dict:
                nonlocal replayed
                if replayed:
                    return await receive()
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}

            await app(scope, replay, send)

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        sock.close()
        self.url = f"http://127.0.0.1:{self.port}/mcp"
        self.broken_url = f"http://127.0.0.1:{self.port}/broken/mcp"
        self._server = uvicorn.Server(
            uvicorn.Config(
                gate,
                host="127.0.0.1",
                port=self.port,
                log_level="warning",
                # The worker's sessions keep a GET stream open: do not wait for it.
                timeout_graceful_shutdown=1,
            )
        )
        self._thread = threading.Thread(target=self._server.run, daemon=True, name="mcp-echo")

    def __enter__(self) -> EchoMcpServer:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            assert time.monotonic() < deadline, "the echoing MCP server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(10)


def _called_tool(body: bytes) -> str | None:
    try:
        message = json.loads(body)
    except ValueError:
        return None
    if isinstance(message, dict) and message.get("method") == "tools/call":
        return (message.get("params") or {}).get("name")
    return None
