"""What ``bench_mcp`` stands on: an MCP server on loopback built with the official SDK's
server side (one tool, ``echo``) that counts the sessions open at once, and the
``overhead`` path (a bare SDK session's calls and our `McpRuntime`'s, in pairs).

The server runs under uvicorn in a thread of the benchmark's process. A session opens
when the server first answers with its ``mcp-session-id`` and closes on the client's
``DELETE`` (the SDK sends one when a session ends, as the pool's eviction does).
"""

from __future__ import annotations

import asyncio
import socket
import statistics
import threading
import time
from typing import Any

import uvicorn
from mcp.server.mcpserver import MCPServer

TOOL = "echo"
SERVER = "bench"
START_SECONDS = 10.0
SESSION_HEADER = b"mcp-session-id"


class EchoServer:
    """An MCP server with the tool ``echo`` on a free loopback port (`start`, `stop`);
    ``calls``: tool calls answered; ``max_open``: the most sessions open at once."""

    def __init__(self) -> None:
        self.calls = 0
        self.open: set[bytes] = set()
        self.max_open = 0
        self.sessions = 0
        mcp = MCPServer("sage-bench")

        def echo(text: str) -> str:
            """Return the text."""
            self.calls += 1
            return text

        mcp.add_tool(echo)
        app = mcp.streamable_http_app()

        async def counted(scope: dict[str, Any], receive: Any, send: Any) -> None:
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            sent = dict(scope["headers"]).get(SESSION_HEADER)
            if scope["method"] == "DELETE" and sent is not None:
                self.open.discard(sent)

            async def noted(message: dict[str, Any]) -> None:
                if message["type"] == "http.response.start":
                    found = dict(message.get("headers") or ()).get(SESSION_HEADER)
                    if found is not None and found not in self.open and scope["method"] != "DELETE":
                        if sent is None:  # the initialize request: a new session
                            self.sessions += 1
                            self.open.add(found)
                            self.max_open = max(self.max_open, len(self.open))
                await send(message)

            await app(scope, receive, noted)

        self._socket = socket.socket()
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind(("127.0.0.1", 0))
        self.port: int = self._socket.getsockname()[1]
        config = uvicorn.Config(counted, log_level="warning", lifespan="on", backlog=2048)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"

    def start(self) -> EchoServer:
        self._thread.start()
        deadline = time.monotonic() + START_SECONDS
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the benchmark's MCP server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(START_SECONDS)
        self._socket.close()


def figures(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    return {
        "p50_ms": round(statistics.median(ordered) * 1000, 3),
        "p99_ms": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1000, 3),
        "mean_ms": round(statistics.fmean(ordered) * 1000, 3),
    }


async def _overhead(url: str, calls: int, warm: int) -> dict[str, list[float]]:
    """``calls`` timed calls each way, alternating one by one (so a machine that slows
    down mid-way skews both alike), after ``warm`` untimed ones each:

    - bare: ``call_tool`` on one SDK ``ClientSession`` with a plain httpx2 client;
    - ours: as the engine calls an MCP tool — the agent's tools listed once for the user
      through `McpRuntime` (credential headers, the guarded outbound client, the pooled
      session), then per call the tool's handler with its `ToolContext` (the per-user call
      slot, the ``_meta`` idempotency key, the output cap, the figures).
    """
    import httpx2
    from mcp.client.session import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    from agents.mcp.runtime import McpRuntime
    from agents.tools import ToolContext

    async def credentials(owner_id: int, server_url: str) -> dict[str, str]:
        return {"Authorization": f"Bearer bench-user-{owner_id}"}

    runtime = McpRuntime(credentials=credentials, max_sessions=16)
    bare: list[float] = []
    ours: list[float] = []
    try:
        async with (
            httpx2.AsyncClient(headers={"Authorization": "Bearer bench-bare"}) as client,
            streamable_http_client(url, http_client=client) as (read, write),
            ClientSession(read, write) as session,
        ):
            await session.initialize()
            (tool,) = (await runtime.agent_tools(1, [{"name": SERVER, "url": url}])).tools

            async def bare_call(index: int) -> float:
                started = time.perf_counter()
                result = await session.call_tool(TOOL, {"text": f"hello {index}"})
                elapsed = time.perf_counter() - started
                if result.is_error:
                    raise RuntimeError(f"the bare call failed: {result.content}")
                return elapsed

            async def our_call(index: int) -> float:
                ctx = ToolContext(owner_id=1, run_id="bench-run", call_id=f"call_{index}")
                started = time.perf_counter()
                await tool.handler({"text": f"hello {index}"}, ctx)
                return time.perf_counter() - started

            for index in range(warm + calls):
                # Each goes first every other time: neither always follows the other.
                if index % 2:
                    theirs, mine = await bare_call(index), await our_call(index)
                else:
                    mine, theirs = await our_call(index), await bare_call(index)
                if index >= warm:
                    bare.append(theirs)
                    ours.append(mine)
    finally:
        await runtime.close()
    return {"bare": bare, "ours": ours}


def overhead(url: str, calls: int, warm: int) -> dict[str, Any]:
    """The ``overhead`` line: bare SDK calls and ours, and the p50 ours adds."""
    timed = asyncio.run(_overhead(url, calls, warm))
    bare, ours = figures(timed["bare"]), figures(timed["ours"])
    return {
        "path": "overhead",
        "calls": calls,
        "warmup": warm,
        "bare_sdk": bare,
        "sage": ours,
        "added_p50_ms": round(ours["p50_ms"] - bare["p50_ms"], 3),
        "added_mean_ms": round(ours["mean_ms"] - bare["mean_ms"], 3),
        # The median of each pair's difference: the two calls of a pair ran back to back.
        "added_paired_p50_ms": round(
            statistics.median(o - b for o, b in zip(timed["ours"], timed["bare"], strict=True))
            * 1000,
            3,
        ),
        "target_added_p50_ms": 2,
    }
