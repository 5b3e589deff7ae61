"""One open MCP session per (user, server, credentials), kept in a keyed pool.

Django-free. `McpSession` opens a Streamable HTTP ``ClientSession`` (the official ``mcp``
SDK) with the user's credential headers and keeps it open in a task of its own: the SDK's
transport lives in anyio task groups that must be entered and left by one task, while
runs in many tasks borrow the session. `McpSessionPool` is `pooling.keyed.KeyedPool` with
the MCP codes: sessions are built once per key however many runs ask, the least recently
borrowed idle one is evicted when the pool is full, and a full pool is a retryable error.

Errors, each a `SageError` with a stable code (the server's raw body goes only to the
``sage.mcp`` log, redacted):

- ``mcp.auth_required`` (AUTHENTICATION, resumable): the server answered 401 — the
  user's credentials are missing, expired or revoked; the run asks the user to connect;
- ``mcp.unreachable`` (UNAVAILABLE, retryable): no connection, or it broke (during a
  call: the call's effect is unknown, and the message says so);
- ``mcp.timeout`` (UPSTREAM, retryable): no answer within the server's ``timeout_seconds``;
- ``mcp.error`` (UPSTREAM): the server answered with an error of the protocol (not a tool
  error: those, ``isError``, are results the model sees).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx2
from mcp import types
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from agents.mcp.transport import http_client
from pooling.keyed import KeyedPool, Lease
from pooling.providers.errors import redact
from sageproject.errors import ErrorCategory, SageError

logger = logging.getLogger("sage.mcp")

# How long a session's tool list is trusted before it is listed again (seconds).
TOOLS_TTL_SECONDS = 60.0
# At most this much of an error body reaches the log.
MAX_LOGGED_BODY = 2048

Progress = Callable[[float, float | None, str | None], Awaitable[None]]


class McpError(SageError):
    """A transport, protocol or auth failure of an MCP server (see the module text)."""

    def __init__(self, code: str, message: str, *, server: str = "", **kwargs: Any) -> None:
        details = (
            {"server": server, **kwargs.pop("details", {})} if server else kwargs.pop("details", {})
        )
        super().__init__(code, message, details=details, **kwargs)


def auth_required(server: str, url: str, *, refused: bool = False) -> McpError:
    why = "refused the saved credentials" if refused else "needs a connection"
    return McpError(
        "mcp.auth_required",
        f"the MCP server {server!r} {why}: connect it, then reply retry",
        server=server,
        category=ErrorCategory.AUTHENTICATION,
        resumable=True,
        details={"url": url},
    )


def unreachable(server: str) -> McpError:
    return McpError(
        "mcp.unreachable",
        f"the MCP server {server!r} could not be reached",
        server=server,
        category=ErrorCategory.UNAVAILABLE,
        retryable=True,
    )


def connection_lost(server: str) -> McpError:
    """The call was sent, then its connection closed before the answer came."""
    return McpError(
        "mcp.unreachable",
        f"the connection to the MCP server {server!r} closed during the call; "
        "the call's effect is unknown",
        server=server,
        category=ErrorCategory.UNAVAILABLE,
        retryable=True,
    )


def timed_out(server: str, seconds: float) -> McpError:
    return McpError(
        "mcp.timeout",
        f"the MCP server {server!r} did not answer within {seconds:g} s",
        server=server,
        category=ErrorCategory.UPSTREAM,
        retryable=True,
    )


def protocol_error(server: str) -> McpError:
    return McpError(
        "mcp.error",
        f"the MCP server {server!r} answered with an error",
        server=server,
        category=ErrorCategory.UPSTREAM,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class RemoteTool:
    """A tool an MCP server lists: its own name, description and input schema."""

    name: str
    description: str
    input_schema: dict[str, Any]


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionSpec:
    """What a session is opened with (the pool's build argument)."""

    server: str
    url: str
    headers: Mapping[str, str] = field(repr=False)
    timeout: float


def session_key(owner_id: Any, url: str, headers: Mapping[str, str]) -> str:
    """The pool key: user, server and credentials (a digest: never shows a secret), so a
    saved new token gets a new session while calls on the old one finish."""
    payload = json.dumps([owner_id, url, sorted(headers.items())], separators=(",", ":"))
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


class McpSession:
    """An initialised MCP client session, owned by a task of its own (see the module)."""

    def __init__(self, spec: SessionSpec) -> None:
        self.spec = spec
        self.session: ClientSession | None = None
        self.broken = False
        # Set by the response hook: the server refused the credentials (401).
        self.auth_refused = False
        self._closing = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._tools: tuple[float, list[RemoteTool]] | None = None
        self._tools_lock = asyncio.Lock()

    @classmethod
    async def open(cls, spec: SessionSpec) -> McpSession:
        """Connect and initialise; raises `McpError` (auth_required, unreachable, timeout)."""
        self = cls(spec)
        ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._own(ready), name=f"mcp-session-{spec.server}")
        try:
            await asyncio.wait_for(asyncio.shield(ready), spec.timeout)
        except TimeoutError:
            await self.close()
            raise timed_out(spec.server, spec.timeout) from None
        except BaseException as exc:
            await self.close()
            raise self._mapped(exc) from None
        return self

    async def _on_response(self, response: httpx2.Response) -> None:
        if response.status_code == 401:
            self.auth_refused = True
        if response.status_code >= 400:
            # The body may carry anything (a token echoed back): the log only, redacted.
            with contextlib.suppress(Exception):
                body = (await response.aread())[:MAX_LOGGED_BODY].decode("utf-8", "replace")
                logger.warning(
                    "MCP server %s answered %s: %s",
                    self.spec.server,
                    response.status_code,
                    redact(body, [v.split(" ")[-1] for v in self.spec.headers.values()]),
                )

    async def _own(self, ready: asyncio.Future[None]) -> None:
        try:
            # Inside the try: a URL the policy refuses must reach `open` as its error.
            client = http_client(
                self.spec.url,
                headers=self.spec.headers,
                timeout=self.spec.timeout,
                on_response=self._on_response,
            )
            async with (
                client,
                streamable_http_client(self.spec.url, http_client=client) as (read, write),
                ClientSession(read, write) as session,
            ):
                await session.initialize()
                self.session = session
                ready.set_result(None)
                await self._closing.wait()
        except BaseException as exc:  # the owner task ends; borrowers see `broken`
            self.broken = True
            if not ready.done():
                ready.set_exception(exc if isinstance(exc, Exception) else RuntimeError(str(exc)))
            elif not isinstance(exc, asyncio.CancelledError):
                logger.info("MCP session to %s ended: %s", self.spec.server, type(exc).__name__)
        finally:
            self.broken = True

    def _mapped(self, exc: BaseException) -> SageError:
        """Our error for what the SDK or the transport raised."""
        if self.auth_refused:
            return auth_required(self.spec.server, self.spec.url, refused=True)
        for leaf in _leaves(exc):
            if isinstance(leaf, SageError):
                return leaf
            if isinstance(leaf, httpx2.TimeoutException | TimeoutError):
                return timed_out(self.spec.server, self.spec.timeout)
            if isinstance(leaf, httpx2.TransportError | OSError):
                return unreachable(self.spec.server)
        if any(isinstance(leaf, MCPError) for leaf in _leaves(exc)):
            return protocol_error(self.spec.server)
        logger.warning("MCP session to %s failed: %r", self.spec.server, exc)
        return unreachable(self.spec.server)

    async def list_tools(self, *, ttl: float = TOOLS_TTL_SECONDS) -> list[RemoteTool]:
        """The server's tools (every page), cached for ``ttl`` seconds."""
        async with self._tools_lock:  # one listing at a time: the others take its answer
            cached = self._tools
            if cached is not None and time.monotonic() - cached[0] < ttl:
                return cached[1]
            session = self._live()
            tools: list[RemoteTool] = []
            cursor = None
            try:
                async with asyncio.timeout(self.spec.timeout):
                    while True:
                        params = None
                        if cursor is not None:
                            params = types.PaginatedRequestParams(cursor=cursor)
                        page = await session.list_tools(params=params)
                        tools.extend(
                            RemoteTool(
                                name=t.name,
                                description=t.description or "",
                                input_schema=dict(t.input_schema or {"type": "object"}),
                            )
                            for t in page.tools
                        )
                        cursor = page.next_cursor
                        if not cursor:
                            break
            except TimeoutError:
                self.broken = True
                raise timed_out(self.spec.server, self.spec.timeout) from None
            except Exception as exc:
                self.broken = True
                raise self._mapped(exc) from None
            self._tools = (time.monotonic(), tools)
            return tools

    async def call_tool(
        self,
        name: str,
        arguments: dict[str, Any],
        *,
        seconds: float,
        meta: dict[str, Any],
        progress: Progress | None = None,
    ) -> Any:
        """Send one ``tools/call``; returns the SDK's ``CallToolResult``. Raises
        `McpError` for what is not the tool's own answer."""
        session = self._live()
        try:
            async with asyncio.timeout(seconds):
                return await session.call_tool(
                    name, arguments, progress_callback=progress, meta=meta
                )
        except TimeoutError:
            raise timed_out(self.spec.server, seconds) from None
        except MCPError as exc:
            # The SDK answers a stream that ended without the response with this code.
            if exc.code == types.CONNECTION_CLOSED and not self.auth_refused:
                self.broken = True
                raise connection_lost(self.spec.server) from None
            if self.auth_refused:
                self.broken = True
            raise self._mapped(exc) from None
        except Exception as exc:
            self.broken = True
            raise self._mapped(exc) from None

    def _live(self) -> ClientSession:
        if self.broken or self.session is None:
            raise unreachable(self.spec.server)
        return self.session

    async def close(self) -> None:
        """End the session (its owner task leaves the SDK's contexts)."""
        self._closing.set()
        task = self._task
        if task is not None and not task.done():
            try:
                await asyncio.wait_for(asyncio.shield(task), 5.0)
            except TimeoutError:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task


class McpSessionLease(Lease):
    __slots__ = ()


class McpSessionPool(KeyedPool):
    """At most ``max_sessions`` open MCP sessions, by (user, server, credentials)."""

    lease_class = McpSessionLease
    label = "mcp session"
    full_code = "mcp.session_pool_full"
    full_message = "all MCP session slots are in use"
    closed_code = "mcp.session_pool_closed"
    closed_message = "the MCP session pool is closed"
    cleanup_code = "mcp.session_pool_cleanup_failed"
    cleanup_message = "MCP session pool cleanup failed"
    size_name = "max_sessions"

    def __init__(self, *, max_sessions: int = 64) -> None:
        super().__init__(McpSession.open, _close_session, max_entries=max_sessions)

    async def acquire(self, owner_id: Any, spec: SessionSpec) -> McpSessionLease:
        """Borrow the session of ``owner_id`` with ``spec`` (opened on first use; a broken
        one is discarded and opened again). Raises `McpError` or the pool's errors."""
        key = session_key(owner_id, spec.url, spec.headers)
        for _ in range(2):
            lease = await self.acquire_key(key, spec)
            if not lease.provider.broken:
                assert isinstance(lease, McpSessionLease)
                return lease
            lease.discard()
            await lease.close()
        raise unreachable(spec.server)


async def _close_session(session: McpSession) -> None:
    await session.close()
