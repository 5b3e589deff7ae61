"""`agents.mcp.runtime.McpRuntime` on its own: an agent's MCP tools and their calls
against the SDK-built loopback server, without a database or a worker."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from agents.mcp.runtime import McpAuthRequired, McpRuntime, cap_output
from agents.tools import ToolContext, ToolError
from scheduling.figures import MCP_CALLS
from tests.agents.mcp_fixtures import mcp_server_fixture  # noqa: F401  (registers "mcp_server")
from tests.waiting import awaited_until

TOKENS = {1: {"Authorization": "Bearer alice-token"}}


def runtime(**options: Any) -> McpRuntime:
    async def credentials(owner_id: int, url: str) -> dict[str, str] | None:
        return TOKENS.get(owner_id)

    return McpRuntime(credentials=credentials, **options)


def server(url: str, **options: Any) -> dict[str, Any]:
    return {"name": "crm", "url": url, "timeout_seconds": 10, "approval": "never", **options}


def ctx(call_id: str = "c1") -> ToolContext:
    return ToolContext(owner_id=1, session_id="s1", run_id="r1", call_id=call_id)


async def test_it_offers_the_servers_tools_with_their_schemas(mcp_server) -> None:
    mcp = runtime()
    try:
        found = await mcp.agent_tools(1, [server(mcp_server.url, approval={"always": ["bump"]})])
        by_name = {t.name: t for t in found.tools}
        assert {"mcp__crm__lookup", "mcp__crm__bump", "mcp__crm__hidden"} <= set(by_name)
        lookup = by_name["mcp__crm__lookup"]
        assert lookup.description == "Look a key up (no side effect)."
        assert lookup.parameters["required"] == ["key"]
        assert lookup.server == "crm" and lookup.capped
        assert found.approval == {"mcp__crm__bump"}
    finally:
        await mcp.close()


async def test_it_offers_only_the_allowed_tools(mcp_server) -> None:
    mcp = runtime()
    try:
        found = await mcp.agent_tools(1, [server(mcp_server.url, allowed_tools=["lookup"])])
        assert [t.name for t in found.tools] == ["mcp__crm__lookup"]
    finally:
        await mcp.close()


async def test_a_user_without_a_connection_is_asked_to_connect(mcp_server) -> None:
    mcp = runtime()
    try:
        with pytest.raises(McpAuthRequired) as waiting:
            await mcp.agent_tools(2, [server(mcp_server.url)])
        assert waiting.value.code == "mcp.auth_required"
        assert waiting.value.interaction() == {"server": "crm", "url": mcp_server.url}
    finally:
        await mcp.close()


async def test_progress_is_published_live_and_calls_are_counted(mcp_server) -> None:
    published: list[dict[str, Any]] = []
    mcp = runtime(publish=published.append)
    try:
        found = await mcp.agent_tools(1, [server(mcp_server.url)])
        bump = next(t for t in found.tools if t.name == "mcp__crm__bump")
        assert await bump.handler({"by": 1}, ctx()) == "counter is 1"
        [progress] = [m for m in published if m["type"] == "tool.progress"]
        assert progress["session"] == "s1" and progress["run"] == "r1"
        assert progress["payload"] == {
            "id": "c1",
            "name": "mcp__crm__bump",
            "progress": 1.0,
            "total": 2.0,
            "message": "half way",
        }
        counters = mcp.metrics.snapshot()["counters"][MCP_CALLS]
        assert counters == [[{"server": "crm", "outcome": "ok"}, 1]]
        [recent] = mcp.snapshot()["recent"]
        assert (recent["owner"], recent["tool"], recent["outcome"]) == (1, "bump", "ok")
        assert "by" not in str(recent)  # never the arguments
    finally:
        await mcp.close()


async def test_one_users_calls_are_bounded(mcp_server) -> None:
    mcp = runtime(max_calls_per_user=1)
    try:
        found = await mcp.agent_tools(1, [server(mcp_server.url)])
        slow = next(t for t in found.tools if t.name == "mcp__crm__slow")
        calls = [slow.handler({"seconds": 0.3}, ctx(f"c{i}")) for i in range(3)]
        assert await asyncio.gather(*calls) == ["slept"] * 3
        # One at a time reached the server: the others waited for the user's slot.
        assert mcp_server.max_running == 1
    finally:
        await mcp.close()


async def test_a_call_waits_for_a_slot_no_longer_than_its_timeout(mcp_server) -> None:
    mcp = runtime(max_calls_per_user=1)
    try:
        found = await mcp.agent_tools(1, [server(mcp_server.url, timeout_seconds=1)])
        lookup = next(t for t in found.tools if t.name == "mcp__crm__lookup")
        holder = mcp._slot(1)
        await holder.acquire()  # the user's one slot, taken
        try:
            with pytest.raises(ToolError) as busy:
                await lookup.handler({"key": "k"}, ctx("b"))
        finally:
            holder.release()
        assert busy.value.message.startswith("not run: 1 MCP calls of this user")
        assert mcp_server.calls == []
    finally:
        await mcp.close()



async def test_a_call_waits_while_every_session_is_leased(mcp_server) -> None:
    TOKENS[2] = {"Authorization": "Bearer bob-token"}
    mcp = runtime(max_sessions=1)
    try:
        alice = await mcp.agent_tools(1, [server(mcp_server.url)])
        bob = await mcp.agent_tools(2, [server(mcp_server.url)])
        slow = next(t for t in alice.tools if t.name == "mcp__crm__slow")
        lookup = next(t for t in bob.tools if t.name == "mcp__crm__lookup")
        running = asyncio.create_task(slow.handler({"seconds": 0.5}, ctx("a")))
        await awaited_until(lambda: mcp_server.max_running == 1, within=10)
        # The pool's one session is alice's, leased: bob's call waits for it to end.
        answer = await lookup.handler({"key": "k"}, ctx("b"))
        assert running.done() and await running == "slept"
        assert answer
    finally:
        TOKENS.pop(2, None)
        await mcp.close()


async def test_sessions_are_shared_per_user_and_credentials(mcp_server) -> None:
    mcp = runtime()
    try:
        for _ in range(3):
            await mcp.agent_tools(1, [server(mcp_server.url)])
        figures = await mcp.pool.snapshot()
        assert figures["constructions"] == 1 and figures["entries"] == 1
    finally:
        await mcp.close()


def test_the_output_cap_counts_bytes_and_says_so() -> None:
    assert cap_output("abc", 3) == "abc"
    capped = cap_output("é" * 4, 5)  # 8 bytes; a cut never splits a character
    assert capped == "éé\n[output truncated: 8 bytes, the first 5 shown]"
