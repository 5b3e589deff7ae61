"""An agent's ``mcp_servers`` in the manifest, and the names the model sees."""

from __future__ import annotations

import re
from typing import Any

import pytest

from agents.manifest import parse_manifest
from agents.mcp.naming import NAME_RE, split_name, tool_name
from sageproject.errors import ValidationError


def manifest(*servers: Any) -> dict[str, Any]:
    return {
        "name": "support",
        "version": "1.0.0",
        "entrypoint": "assistant",
        "agents": {"assistant": {"model": "scripted", "mcp_servers": list(servers)}},
    }


def problems(data: dict[str, Any]) -> dict[str, str]:
    with pytest.raises(ValidationError) as caught:
        parse_manifest(data)
    assert caught.value.code == "package.invalid"
    return {e["field"]: e["message"] for e in caught.value.details["errors"]}


def test_it_fills_in_the_defaults() -> None:
    parsed = parse_manifest(manifest({"name": "crm", "url": "https://crm.example/mcp"}))
    assert parsed.agent("assistant")["mcp_servers"] == [
        {
            "name": "crm",
            "url": "https://crm.example/mcp",
            "timeout_seconds": 30,
            "approval": "never",
        }
    ]


def test_it_keeps_the_optional_lists_and_approval_forms() -> None:
    entry = {
        "name": "crm",
        "url": "http://127.0.0.1:9000/mcp",
        "allowed_tools": ["lookup", "create.ticket"],
        "idempotent": ["lookup"],
        "approval": {"always": ["create.ticket"]},
        "timeout_seconds": 300,
    }
    parsed = parse_manifest(
        manifest(entry, {"name": "b", "url": "https://b/", "approval": "always"})
    )
    servers = parsed.agent("assistant")["mcp_servers"]
    assert servers[0] == entry
    assert servers[1]["approval"] == "always"


def test_a_manifest_without_servers_keeps_its_ref() -> None:
    plain = manifest()
    del plain["agents"]["assistant"]["mcp_servers"]
    assert parse_manifest(plain).ref == parse_manifest(manifest()).ref
    assert "mcp_servers" not in parse_manifest(manifest()).agent("assistant")


@pytest.mark.parametrize("name", ["CRM", "", "a" * 33, "a.b", "a b", 7])
def test_it_refuses_a_bad_server_name(name: Any) -> None:
    assert "agents.assistant.mcp_servers.0.name" in problems(
        manifest({"name": name, "url": "https://x/"})
    )


def test_it_refuses_a_server_named_twice() -> None:
    found = problems(
        manifest({"name": "a", "url": "https://x/"}, {"name": "a", "url": "https://y/"})
    )
    assert "twice" in found["agents.assistant.mcp_servers.1.name"]


@pytest.mark.parametrize(
    "url",
    [
        None,
        "",
        "ftp://x/mcp",
        "https://",
        "https://user:pw@x/mcp",
        "https://x/#frag",
        "x/mcp",
        "https://x:99999/",
        "https://x/ a",
    ],
)
def test_it_refuses_a_bad_url(url: Any) -> None:
    assert "agents.assistant.mcp_servers.0.url" in problems(manifest({"name": "a", "url": url}))


@pytest.mark.parametrize(
    "approval", ["sometimes", ["x"], {"always": "x"}, {"never": []}, {"always": [1]}]
)
def test_it_refuses_a_bad_approval(approval: Any) -> None:
    found = problems(manifest({"name": "a", "url": "https://x/", "approval": approval}))
    assert any(f.startswith("agents.assistant.mcp_servers.0.approval") for f in found)


@pytest.mark.parametrize("timeout", [0, 301, "30", True, None])
def test_it_refuses_a_timeout_out_of_range(timeout: Any) -> None:
    found = problems(manifest({"name": "a", "url": "https://x/", "timeout_seconds": timeout}))
    assert "agents.assistant.mcp_servers.0.timeout_seconds" in found


@pytest.mark.parametrize("key", ["allowed_tools", "idempotent"])
@pytest.mark.parametrize("value", ["lookup", [""], ["a b"], [3], ["x", "x"]])
def test_it_refuses_a_bad_tool_list(key: str, value: Any) -> None:
    found = problems(manifest({"name": "a", "url": "https://x/", key: value}))
    assert any(f.startswith(f"agents.assistant.mcp_servers.0.{key}") for f in found)


def test_it_refuses_unknown_keys_and_non_objects() -> None:
    found = problems(manifest({"name": "a", "url": "https://x/", "token": "s3cret"}, "b"))
    assert "agents.assistant.mcp_servers.0.token" in found
    assert "agents.assistant.mcp_servers.1" in found
    assert "agents.assistant.mcp_servers" in problems(
        manifest() | {"agents": {"assistant": {"model": "scripted", "mcp_servers": {"name": "a"}}}}
    )


def test_a_plain_tool_name_is_kept() -> None:
    assert tool_name("crm", "lookup_customer") == "mcp__crm__lookup_customer"
    assert split_name("mcp__crm__lookup_customer") == ("crm", "lookup_customer")
    assert split_name("clock") is None


def test_a_name_outside_the_rule_is_made_to_fit_deterministically() -> None:
    for tool in ("create.ticket", "x" * 200, "ünïcode", "a/b c"):
        name = tool_name("a" * 32, tool)
        assert NAME_RE.match(name), name
        assert name == tool_name("a" * 32, tool)
    long_a, long_b = "y" * 100 + "a", "y" * 100 + "b"
    assert tool_name("crm", long_a) != tool_name("crm", long_b)
    assert re.fullmatch(r"mcp__crm__create_ticket_[0-9a-f]{8}", tool_name("crm", "create.ticket"))


def test_it_refuses_a_server_name_outside_the_rule() -> None:
    with pytest.raises(ValueError):
        tool_name("CRM", "x")
