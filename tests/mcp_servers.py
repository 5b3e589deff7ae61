"""A real MCP server on loopback, for tests that go through the official MCP SDK.

``McpServer`` serves the SDK's own server side (``MCPServer``, streamable HTTP) with
uvicorn in a daemon thread, on a free port of ``127.0.0.1``. Give it plain functions;
each becomes a tool named after the function (the SDK reads the signature and the
docstring)::

    def add(a: int, b: int) -> int:
        \"\"\"Add two numbers.\"\"\"
        return a + b

    with McpServer(tools=[add]) as server:
        ...  # streamable_http_client(server.url, http_client=...)
        assert server.requests  # every HTTP request it saw: (method, path)

``server.url`` is the MCP endpoint (``http://127.0.0.1:<port>/mcp``). The server stops
when the block ends. It depends on the SDK, uvicorn and the standard library only.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable
from typing import Any

import uvicorn
from mcp.server.mcpserver import MCPServer

from tests.waiting import wait_until

START_SECONDS = 10.0


class McpServer:
    """An MCP server with ``tools``, started on entry and stopped on exit."""

    def __init__(
        self, tools: Iterable[Callable[..., Any]] = (), *, name: str = "test-tools"
    ) -> None:
        self.mcp = MCPServer(name)
        for tool in tools:
            self.mcp.add_tool(tool)
        self.requests: list[tuple[str, str]] = []
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind(("127.0.0.1", 0))
        self.port: int = self._socket.getsockname()[1]
        config = uvicorn.Config(
            self._recording(self.mcp.streamable_http_app()),
            log_level="warning",
            lifespan="on",
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"

    def _recording(self, app: Any) -> Any:
        async def recorded(scope: dict[str, Any], receive: Any, send: Any) -> None:
            if scope["type"] == "http":
                self.requests.append((scope["method"], scope["path"]))
            await app(scope, receive, send)

        return recorded

    def start(self) -> McpServer:
        self._thread.start()
        wait_until(
            lambda: self._server.started or not self._thread.is_alive(),
            timeout=START_SECONDS,
            interval=0.01,
            message="the MCP test server did not start",
        )
        if not self._server.started:
            raise RuntimeError("the MCP test server stopped before it listened")
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(START_SECONDS)
        self._socket.close()

    def __enter__(self) -> McpServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
