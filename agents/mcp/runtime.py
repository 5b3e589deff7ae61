"""MCP servers' tools offered to an agent's model, and their calls (Django-free).

`McpRuntime` is the worker's one door to remote MCP servers (owned by the `RunExecutor`):
for one run it reads the user's credentials for each server the agent declares (the
``credentials`` callable, a database read in a thread), borrows a session from the
`McpSessionPool`, lists the tools (cached per session, `TOOLS_TTL_SECONDS`) and turns each
allowed one into a `Tool` named ``mcp__<server>__<tool>``. A tool outside a server's
``allowed_tools`` is never offered, so the engine answers a model naming it "unknown tool".

A call waits for one of the user's `max_calls_per_user` slots (within the server's
timeout), carries its idempotency key in ``_meta`` (``sage/idempotency_key``: run id and
tool-call id), shows the server's progress notifications as live ``tool.progress``
messages, and caps the output at `max_output_bytes` with a marker the model sees. A tool's
own error (``isError``) is a failed tool result; a server that refuses the credentials
(401) raises `McpAuthRequired` (the run suspends until the user connects) unless the
``refused`` callable saved new credentials (an OAuth refresh): then the refused request,
which the server never acted on, is sent once more with them; a timeout or a
lost connection is a failed result saying what happened — after a timeout, or a
connection closed while the call ran, the effect is unknown, and the model is told so.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from agents.mcp.client import McpError, McpSessionPool, RemoteTool, SessionSpec
from agents.mcp.naming import tool_name
from agents.mcp.transport import normalize_server_url
from agents.tools import Tool, ToolContext, ToolError, ToolSuspends
from sageproject.errors import SageError
from scheduling.faults import crash_point
from scheduling.figures import MCP_CALL_SECONDS, MCP_CALLS, Figures

logger = logging.getLogger("sage.mcp")

IDEMPOTENCY_META_KEY = "sage/idempotency_key"
# The last calls a worker shows operators (its snapshot; the admin's MCP page).
RECENT_CALLS = 50
# The crash point between a call's answer and its result being durable (fault tests).
CALL_SENT_POINT = "mcp.call.sent"

# (owner id, normalised URL) → the connection's request headers, or None (not connected).
Credentials = Callable[[int, str], Awaitable[Mapping[str, str] | None]]
Publish = Callable[[dict[str, Any]], None]
# (owner id, normalised URL, the refused headers) → True when new credentials were saved
# (an OAuth refresh): the refused request is tried once more with them.
Refused = Callable[[int, str, Mapping[str, str]], Awaitable[bool]]


class McpAuthRequired(ToolSuspends):
    """The user has no working connection to a server the run needs: the run suspends
    with an ``mcp_auth`` interaction until the user connects and replies ``retry``."""

    interaction_type = "mcp_auth"

    def __init__(self, server: str, url: str, *, refused: bool = False) -> None:
        why = "refused the saved credentials" if refused else "needs a connection"
        super().__init__(
            "mcp.auth_required",
            f"the MCP server {server!r} {why}: connect it, then reply retry",
            resumable=True,
            details={"server": server, "url": url},
        )
        self.server = server
        self.url = url
        # Where the user authorizes, for a server that uses OAuth (set by the executor).
        self.authorization_url: str | None = None

    def interaction(self) -> dict[str, Any]:
        found = {"server": self.server, "url": self.url}
        if self.authorization_url:
            found["authorization_url"] = self.authorization_url
        return found


@dataclass(frozen=True, slots=True, kw_only=True)
class McpTools:
    """An agent's MCP tools for one run, and which of them wait for approval or may be
    sent again after a crash (model-facing names)."""

    tools: tuple[Tool, ...] = ()
    approval: frozenset[str] = frozenset()
    idempotent: frozenset[str] = frozenset()


NO_TOOLS = McpTools()


def _text_of(result: Any) -> str:
    """A ``CallToolResult`` as the text the model reads: its text parts, other parts
    named, the structured content when there is no text."""
    parts: list[str] = []
    for item in result.content or ():
        kind = getattr(item, "type", "")
        if kind == "text":
            parts.append(item.text)
        elif kind == "resource_link":
            parts.append(f"[resource: {getattr(item, 'uri', '')}]")
        else:
            parts.append(f"[{kind}: {getattr(item, 'mime_type', '') or 'content'} omitted]")
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content, default=str))
    return "\n".join(parts)


def cap_output(text: str, max_bytes: int) -> str:
    """``text`` cut to ``max_bytes`` of UTF-8 and a marker the model sees."""
    data = text.encode("utf-8")
    if len(data) <= max_bytes:
        return text
    kept = data[:max_bytes].decode("utf-8", "ignore")
    return f"{kept}\n[output truncated: {len(data)} bytes, the first {max_bytes} shown]"


class McpRuntime:
    """The worker's MCP sessions, call slots and figures (see the module text)."""

    def __init__(
        self,
        *,
        credentials: Credentials,
        max_sessions: int = 64,
        max_calls_per_user: int = 4,
        max_output_bytes: int = 65536,
        publish: Publish | None = None,
        metrics: Figures | None = None,
        refused: Refused | None = None,
    ) -> None:
        self.pool = McpSessionPool(max_sessions=max_sessions)
        self.credentials = credentials
        self.refused = refused
        self.max_calls_per_user = max_calls_per_user
        self.max_output_bytes = max_output_bytes
        self.publish = publish
        self.metrics = metrics if metrics is not None else Figures()
        self._slots: dict[Any, asyncio.Semaphore] = {}
        self._slot_users: dict[Any, int] = {}
        self._recent: deque[dict[str, Any]] = deque(maxlen=RECENT_CALLS)

    async def agent_tools(self, owner_id: int, servers: Sequence[Mapping[str, Any]]) -> McpTools:
        """The tools of ``servers`` (manifest entries) for ``owner_id``'s run. Raises
        `McpAuthRequired` for a server the user has not connected (or that refuses the
        credentials), `McpError` for one that cannot be listed."""
        tools: list[Tool] = []
        approval: set[str] = set()
        idempotent: set[str] = set()
        for server in servers:
            spec = await self._spec(owner_id, server)
            for attempt in range(2):
                try:
                    lease = await self._lease(owner_id, spec)
                    async with lease:
                        listed = await self._guarded(lease, spec, lease.provider.list_tools())
                    break
                except McpAuthRequired:
                    if attempt or not await self._renewed(owner_id, spec):
                        raise
                    spec = await self._respec(owner_id, spec)
            allowed = server.get("allowed_tools")
            rule = server.get("approval", "never")
            for remote in listed:
                if allowed is not None and remote.name not in allowed:
                    continue
                tool = self._tool(owner_id, server, spec, remote)
                tools.append(tool)
                if rule == "always" or (
                    isinstance(rule, Mapping) and remote.name in rule.get("always", ())
                ):
                    approval.add(tool.name)
                if remote.name in (server.get("idempotent") or ()):
                    idempotent.add(tool.name)
        return McpTools(
            tools=tuple(tools), approval=frozenset(approval), idempotent=frozenset(idempotent)
        )

    async def _spec(self, owner_id: int, server: Mapping[str, Any]) -> SessionSpec:
        url = normalize_server_url(server["url"])
        headers = await self.credentials(owner_id, url)
        if headers is None:
            raise McpAuthRequired(server["name"], url)
        return SessionSpec(
            server=server["name"],
            url=url,
            headers=dict(headers),
            timeout=float(server.get("timeout_seconds", 30)),
        )

    async def _renewed(self, owner_id: int, spec: SessionSpec) -> bool:
        """Whether the refused credentials were replaced (an OAuth token refreshed)."""
        return self.refused is not None and await self.refused(owner_id, spec.url, spec.headers)

    async def _respec(self, owner_id: int, spec: SessionSpec) -> SessionSpec:
        headers = await self.credentials(owner_id, spec.url)
        if headers is None:
            raise McpAuthRequired(spec.server, spec.url)
        return replace(spec, headers=dict(headers))

    async def _lease(self, owner_id: int, spec: SessionSpec) -> Any:
        try:
            return await self.pool.acquire(owner_id, spec)
        except McpError as exc:
            raise self._auth(exc, spec) from None

    async def _lease_for_call(self, owner_id: int, spec: SessionSpec, deadline: float) -> Any:
        """A session for a call, waiting while the pool is full (every session leased by
        calls under way) until ``deadline`` (monotonic). A call is a step already under
        way: failing it for a moment's crowding would show the model a spurious error."""
        pause = 0.01
        while True:
            try:
                return await self._lease(owner_id, spec)
            except SageError as exc:
                if exc.code != self.pool.full_code or time.monotonic() + pause > deadline:
                    raise
            await asyncio.sleep(pause)  # room comes back when any call ends
            pause = min(pause * 2, 0.2)

    def _auth(self, exc: McpError, spec: SessionSpec) -> Exception:
        if exc.code == "mcp.auth_required":
            return McpAuthRequired(spec.server, spec.url, refused=True)
        return exc

    async def _guarded(self, lease: Any, spec: SessionSpec, work: Awaitable[Any]) -> Any:
        """``work`` on a leased session; a session that broke or was refused is taken out
        of the pool so the next borrower opens a fresh one."""
        try:
            return await work
        except McpError as exc:
            if lease.provider.broken or exc.code == "mcp.auth_required":
                lease.discard()
            raise self._auth(exc, spec) from None

    def _tool(
        self, owner_id: int, server: Mapping[str, Any], spec: SessionSpec, remote: RemoteTool
    ) -> Tool:
        name = tool_name(spec.server, remote.name)

        async def handler(arguments: dict[str, Any], ctx: ToolContext) -> str:
            return await self._call(owner_id, spec, remote.name, name, arguments, ctx)

        return Tool(
            name=name,
            description=remote.description or f"{remote.name} (MCP server {spec.server})",
            parameters=remote.input_schema,
            handler=handler,
            capped=True,
            server=spec.server,
        )

    def _slot(self, owner_id: Any) -> asyncio.Semaphore:
        slot = self._slots.get(owner_id)
        if slot is None:
            slot = self._slots[owner_id] = asyncio.Semaphore(self.max_calls_per_user)
        return slot

    async def _call(
        self,
        owner_id: int,
        spec: SessionSpec,
        remote: str,
        name: str,
        arguments: dict[str, Any],
        ctx: ToolContext,
    ) -> str:
        started = time.monotonic()
        outcome = "error"
        slot = self._slot(owner_id)
        self._slot_users[owner_id] = self._slot_users.get(owner_id, 0) + 1
        try:
            try:
                async with asyncio.timeout(spec.timeout):
                    await slot.acquire()
            except TimeoutError:
                outcome = "busy"
                raise ToolError(
                    f"not run: {self.max_calls_per_user} MCP calls of this user were "
                    f"already running for {spec.timeout:g} s"
                ) from None
            try:
                for attempt in range(2):
                    try:
                        lease = await self._lease_for_call(owner_id, spec, started + spec.timeout)
                        async with lease:
                            result = await self._guarded(
                                lease,
                                spec,
                                lease.provider.call_tool(
                                    remote,
                                    arguments,
                                    seconds=spec.timeout,
                                    meta={IDEMPOTENCY_META_KEY: ctx.idempotency_key},
                                    progress=self._progress(ctx, name),
                                ),
                            )
                        break
                    except McpAuthRequired:
                        # A 401 is answered before the server acts: safe to send again.
                        if attempt or not await self._renewed(owner_id, spec):
                            raise
                        spec = await self._respec(owner_id, spec)
            finally:
                slot.release()
            # The server acted; what follows makes its answer durable (fault tests kill here).
            crash_point(CALL_SENT_POINT)
            text = cap_output(_text_of(result), self.max_output_bytes)
            if result.is_error:
                outcome = "tool_error"
                raise ToolError(text or "the MCP tool reported an error")
            outcome = "ok"
            return text
        except McpAuthRequired:
            outcome = "auth_required"
            raise
        except McpError as exc:
            outcome = exc.code.removeprefix("mcp.")
            if exc.code == "mcp.timeout":
                raise ToolError(f"{exc.message}; the call's effect is unknown") from None
            raise ToolError(exc.message) from None
        except SageError as exc:
            if exc.code != self.pool.full_code:
                raise
            outcome = "busy"
            raise ToolError(
                f"not run: every MCP session of this worker stayed in use for {spec.timeout:g} s"
            ) from None
        finally:
            users = self._slot_users[owner_id] - 1
            if users:
                self._slot_users[owner_id] = users
            else:  # nobody waits on it: forget the user's slots
                del self._slot_users[owner_id]
                self._slots.pop(owner_id, None)
            seconds = time.monotonic() - started
            self.metrics.count(MCP_CALLS, server=spec.server, outcome=outcome)
            self.metrics.observe(MCP_CALL_SECONDS, seconds, server=spec.server)
            self._recent.append(
                {
                    "at": datetime.now(UTC).isoformat(timespec="seconds"),
                    "owner": owner_id,
                    "server": spec.server,
                    "url": spec.url,
                    "tool": remote,
                    "outcome": outcome,
                    "ms": round(seconds * 1000),
                }
            )

    def _progress(self, ctx: ToolContext, name: str) -> Any:
        if self.publish is None or ctx.session_id is None:
            return None
        publish = self.publish

        async def progress(value: float, total: float | None, message: str | None) -> None:
            publish(
                {
                    "session": ctx.session_id,
                    "run": ctx.run_id,
                    "type": "tool.progress",
                    "payload": {
                        "id": ctx.call_id,
                        "name": name,
                        "progress": value,
                        "total": total,
                        "message": message,
                    },
                }
            )

        return progress

    def snapshot(self) -> dict[str, Any]:
        """Calls waiting or running now, and the last `RECENT_CALLS` (newest last: when,
        whose, which server and tool, the outcome and milliseconds; never arguments)."""
        return {
            "calls_waiting_or_running": sum(self._slot_users.values()),
            "recent": list(self._recent),
        }

    async def close(self) -> None:
        await self.pool.close()


__all__ = ["NO_TOOLS", "McpAuthRequired", "McpRuntime", "McpTools", "cap_output"]
