"""Readiness of agents with MCP servers: each server's tools listed with the checking
user's own credentials, unreachable or unconnected servers unverified, allowed tools a
server does not list missing; strict mode refuses what cannot be verified."""

from __future__ import annotations

from typing import Any

import pytest

from agents.manifest import parse_manifest
from agents.mcp import discovery
from agents.services import packages
from agents.services.mcp import mcp_connection_save
from sageproject.errors import ValidationError
from tests.agents.mcp_fixtures import (
    McpTestServer,
    allow_loopback,
    mcp_server_fixture,  # noqa: F401  (registers "mcp_server")
)

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _fresh_discoveries():
    discovery.forget()
    yield
    discovery.forget()


def manifest(url: str, **server: Any):
    return parse_manifest(
        {
            "name": "ready",
            "version": "1.0.0",
            "entrypoint": "assistant",
            "agents": {
                "assistant": {
                    "model": "scripted",
                    "mcp_servers": [{"name": "crm", "url": url, **server}],
                }
            },
        }
    )


def report(user, parsed, *, strict: bool = False):
    return packages.package_readiness(parsed, owner_id=user.pk, strict=strict)


def test_it_lists_the_servers_tools(alice, mcp_server, scripted_record):
    mcp_connection_save(user=alice, server_url=mcp_server.url, bearer_token="alice-token")
    result = report(alice, manifest(mcp_server.url, allowed_tools=["lookup", "bump"]))
    agent = result.agents["assistant"]
    assert {"lookup", "bump", "slow"} <= set(agent["mcp_servers"]["crm"])
    assert agent["missing_tools"] == [] and agent["unverified"] == []
    assert result.ready
    # With alice's token, never anyone else's.
    assert mcp_server.refused == 0


def test_an_allowed_tool_the_server_lacks_is_missing(alice, mcp_server, scripted_record):
    mcp_connection_save(user=alice, server_url=mcp_server.url, bearer_token="alice-token")
    result = report(alice, manifest(mcp_server.url, allowed_tools=["lookup", "nope"]))
    assert result.agents["assistant"]["missing_tools"] == ["mcp__crm__nope"]
    assert not result.ready


def test_a_server_the_user_has_not_connected_is_unverified(alice, bob, mcp_server, scripted_record):
    # Bob's connection is his: alice's check never uses it.
    mcp_connection_save(user=bob, server_url=mcp_server.url, bearer_token="bob-token")
    result = report(alice, manifest(mcp_server.url))
    [note] = result.agents["assistant"]["unverified"]
    assert note == "MCP server 'crm': not connected by the checking user"
    assert mcp_server.calls == [] and mcp_server.refused == 0


def test_an_unreachable_server_is_unverified_and_strict_mode_refuses_it(
    alice, scripted_record, monkeypatch
):
    allow_loopback(monkeypatch)
    down = McpTestServer()  # never started
    mcp_connection_save(user=alice, server_url=down.url, bearer_token="alice-token")
    parsed = manifest(down.url)
    [note] = report(alice, parsed).agents["assistant"]["unverified"]
    assert note.startswith("MCP server 'crm': mcp.unreachable")
    with pytest.raises(ValidationError) as refused:
        packages.raise_if_not_ready(report(alice, parsed, strict=True))
    assert refused.value.code == "package.not_ready"


def test_a_refused_token_is_unverified(alice, mcp_server, scripted_record):
    mcp_connection_save(user=alice, server_url=mcp_server.url, bearer_token="wrong")
    [note] = report(alice, manifest(mcp_server.url)).agents["assistant"]["unverified"]
    assert note.startswith("MCP server 'crm': mcp.auth_required")
