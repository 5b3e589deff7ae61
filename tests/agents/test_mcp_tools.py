"""Remote MCP servers' tools in real runs: a real worker (in a thread), the scripted model
calling ``mcp__<server>__<tool>``, and an MCP server built with the official SDK on
loopback (`tests.agents.mcp_fixtures`)."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from agents import services
from agents.services import packages
from agents.services.mcp import mcp_connection_save
from scheduling.models import Event, Run, RunStatus
from tests.agents.mcp_fixtures import (
    McpTestServer,
    allow_loopback,
    mcp_server_fixture,  # noqa: F401  (registers "mcp_server")
)
from tests.conftest import client_for, scripted_model
from tests.e2e import conftest as e2e
from tests.e2e.conftest import wait_for
from tests.e2e.test_live_stream import _completed, _read

pytestmark = [pytest.mark.storage, pytest.mark.django_db(transaction=True)]

start_worker = e2e.start_worker  # the fixture: a real worker in a thread


def call(tool: str, call_id: str | None = None, **arguments: Any) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": f"mcp__crm__{tool}", "arguments": arguments}
    if call_id:
        entry["id"] = call_id
    return entry


def agent(user, url: str, *steps: dict[str, Any], name: str = "mcp", **server: Any):
    """A package whose agent uses the MCP server ``crm`` at ``url`` and a scripted model
    taking ``steps``; returns a new session of ``user``."""
    scripted_model(name, *steps)
    packages.package_create(owner=user, manifest=manifest(name, url, **server))
    return services.session_create(owner=user, package=name, agent="assistant")


def manifest(name: str, url: str, **server: Any) -> dict[str, Any]:
    return {
        "name": name,
        "version": "1.0.0",
        "entrypoint": "assistant",
        "agents": {
            "assistant": {
                "model": name,
                "instructions": "Use the CRM.",
                "mcp_servers": [{"name": "crm", "url": url, **server}],
            }
        },
    }


def connect(user, server: McpTestServer, token: str | None = None) -> None:
    mcp_connection_save(
        user=user, server_url=server.url, bearer_token=token or f"{user.username}-token"
    )


def submit(user, session, text: str = "go") -> Run:
    run, _ = services.run_submit(owner=user, session_id=session.pk, input=text)
    return run


def ends(run: Run, status: str = RunStatus.COMPLETED) -> Run:
    wait_for(
        lambda: Run.objects.get(pk=run.pk).status == status,
        message=f"the run to be {status}",
    )
    return Run.objects.get(pk=run.pk)


def events(run: Run, etype: str) -> list[dict[str, Any]]:
    return [e.payload for e in Event.objects.filter(run_id=run.pk, type=etype).order_by("seq")]


def test_it_calls_a_pure_and_a_side_effecting_tool(alice, mcp_server, start_worker):
    start_worker()
    connect(alice, mcp_server)
    session = agent(
        alice,
        mcp_server.url,
        {"text": "", "tool_calls": [call("lookup", key="a"), call("bump", by=2)]},
        {"text": "Done."},
    )
    run = ends(submit(alice, session))
    assert run.result["text"] == "Done."
    succeeded = events(run, "tool.call.succeeded")
    assert [(p["name"], p["output"]) for p in succeeded] == [
        ("mcp__crm__lookup", "value of a"),
        ("mcp__crm__bump", "counter is 2"),
    ]
    assert mcp_server.bumps == 2
    # The user's token, and the call's idempotency key: run id and tool-call id.
    assert [(c.tool, c.authorization, c.key) for c in mcp_server.calls] == [
        ("lookup", "Bearer alice-token", f"{run.pk}:call_0_0"),
        ("bump", "Bearer alice-token", f"{run.pk}:call_0_1"),
    ]


def test_a_run_without_a_connection_waits_for_one(alice, mcp_server, start_worker):
    start_worker()
    session = agent(
        alice, mcp_server.url, {"text": "", "tool_calls": [call("bump")]}, {"text": "ok"}
    )
    run = ends(submit(alice, session), RunStatus.SUSPENDED)
    interaction = run.interaction
    assert interaction["type"] == "mcp_auth"
    assert interaction["code"] == "mcp.auth_required"
    assert interaction["server"] == "crm" and interaction["url"] == mcp_server.url
    assert interaction["allowed_decisions"] == ["retry", "cancel"]
    assert mcp_server.calls == []

    connect(alice, mcp_server)
    services.run_reply(run=run, decision="retry")
    run = ends(run)
    assert run.result["text"] == "ok"
    assert mcp_server.bumps == 1


def test_a_refused_token_suspends_the_run_the_same_way(alice, mcp_server, start_worker):
    start_worker()
    connect(alice, mcp_server, token="stale-token")
    session = agent(
        alice, mcp_server.url, {"text": "", "tool_calls": [call("bump")]}, {"text": "ok"}
    )
    run = ends(submit(alice, session), RunStatus.SUSPENDED)
    assert run.interaction["code"] == "mcp.auth_required"
    assert mcp_server.refused >= 1
    connect(alice, mcp_server)
    services.run_reply(run=run, decision="retry")
    assert ends(run).result["text"] == "ok"
    assert [c.authorization for c in mcp_server.called("bump")] == ["Bearer alice-token"]


def test_two_users_tokens_are_never_mixed(alice, bob, mcp_server, start_worker):
    start_worker()
    connect(alice, mcp_server)
    connect(bob, mcp_server)
    steps = ({"text": "", "tool_calls": [call("bump")]}, {"text": "ok"})
    alice_session = agent(alice, mcp_server.url, *steps)
    packages.package_create(owner=bob, manifest=manifest("mcp", mcp_server.url))
    bob_session = services.session_create(owner=bob, package="mcp", agent="assistant")
    runs = {"alice": submit(alice, alice_session), "bob": submit(bob, bob_session)}
    for who, run in runs.items():
        ended = ends(run)
        [sent] = [c for c in mcp_server.called("bump") if c.key.startswith(str(ended.pk))]
        assert sent.authorization == f"Bearer {who}-token"


@pytest.mark.parametrize("decision", ["approve", "reject"])
def test_an_always_approval_waits_for_the_user(alice, mcp_server, start_worker, decision):
    start_worker()
    connect(alice, mcp_server)
    session = agent(
        alice,
        mcp_server.url,
        {"text": "", "tool_calls": [call("bump")]},
        {"text": "ok"},
        approval={"always": ["bump"]},
    )
    run = ends(submit(alice, session), RunStatus.SUSPENDED)
    assert run.interaction["type"] == "approval"
    assert [c["name"] for c in run.interaction["tool_calls"]] == ["mcp__crm__bump"]
    assert mcp_server.called("bump") == []
    services.run_reply(run=run, decision=decision)
    ends(run)
    assert mcp_server.bumps == (1 if decision == "approve" else 0)


def test_an_edited_call_is_sent_with_the_users_arguments(alice, mcp_server, start_worker):
    start_worker()
    connect(alice, mcp_server)
    session = agent(
        alice,
        mcp_server.url,
        {"text": "", "tool_calls": [call("bump", by=1)]},
        {"text": "ok"},
        approval={"always": ["bump"]},
    )
    run = ends(submit(alice, session), RunStatus.SUSPENDED)
    [call_id] = run.interaction["waiting"]
    services.run_reply(run=run, decision="edit", edits={call_id: {"by": 5}})
    ends(run)
    [sent] = mcp_server.called("bump")
    assert (sent.arguments, sent.key) == ({"by": 5}, f"{run.pk}:{call_id}")
    assert [p["arguments"] for p in events(run, "tool.call.started")] == [{"by": 5}]
    assert mcp_server.bumps == 5


def test_a_tool_outside_allowed_tools_is_never_called(alice, mcp_server, start_worker):
    start_worker()
    connect(alice, mcp_server)
    session = agent(
        alice,
        mcp_server.url,
        {"text": "", "tool_calls": [call("hidden"), call("lookup", key="k")]},
        {"text": "ok"},
        allowed_tools=["lookup"],
    )
    run = ends(submit(alice, session))
    [failed] = events(run, "tool.call.failed")
    assert failed["name"] == "mcp__crm__hidden" and "unknown tool" in failed["error"]
    assert [c.tool for c in mcp_server.calls] == ["lookup"]


def test_a_tool_error_goes_back_to_the_model(alice, mcp_server, start_worker):
    start_worker()
    connect(alice, mcp_server)
    session = agent(
        alice, mcp_server.url, {"text": "", "tool_calls": [call("fail")]}, {"text": "ok"}
    )
    run = ends(submit(alice, session))
    [failed] = events(run, "tool.call.failed")
    # The SDK's text for a tool that raised (it keeps the exception's own text to itself).
    assert failed["error"].startswith("Error executing tool fail")
    assert run.result["text"] == "ok"


def test_an_oversized_output_is_cut_with_a_marker(alice, mcp_server, start_worker):
    start_worker()
    connect(alice, mcp_server)
    session = agent(
        alice,
        mcp_server.url,
        {"text": "", "tool_calls": [call("big", size=100_000)]},
        {"text": "ok"},
    )
    run = ends(submit(alice, session))
    [done] = events(run, "tool.call.succeeded")
    assert done["output"].endswith("[output truncated: 100000 bytes, the first 65536 shown]")
    assert done["output"].count("x") == 65536


def test_a_slow_call_times_out_with_an_unknown_outcome(alice, mcp_server, start_worker):
    start_worker()
    connect(alice, mcp_server)
    session = agent(
        alice,
        mcp_server.url,
        {"text": "", "tool_calls": [call("slow", seconds=5)]},
        {"text": "ok"},
        timeout_seconds=1,
    )
    run = ends(submit(alice, session))
    [failed] = events(run, "tool.call.failed")
    assert failed["error"] == (
        "the MCP server 'crm' did not answer within 1 s; the call's effect is unknown"
    )


def test_a_server_that_is_down_fails_the_run_clearly(alice, start_worker, monkeypatch):
    allow_loopback(monkeypatch)
    start_worker()
    down = McpTestServer()  # never started: nothing listens on its port
    mcp_connection_save(user=alice, server_url=down.url, bearer_token="alice-token")
    session = agent(alice, down.url, {"text": "", "tool_calls": [call("bump")]})
    run = ends(submit(alice, session), RunStatus.FAILED)
    assert run.error["code"] == "mcp.unreachable"
    assert "'crm'" in run.error["message"]


def test_progress_notifications_reach_the_session_stream(alice, mcp_server, start_worker):

    start_worker()
    connect(alice, mcp_server)
    session = agent(
        alice, mcp_server.url, {"text": "", "tool_calls": [call("bump")]}, {"text": "ok"}
    )
    api = client_for(alice)
    response = api.get(f"/api/v1/sessions/{session.pk}/stream/", {"timeout": 60})
    run = submit(alice, session)
    messages = asyncio.run(_read(response, _completed))
    kinds = [m["event"] for m in messages]
    [progress] = [orjson.loads(m["data"]) for m in messages if m["event"] == "tool.progress"]
    assert progress["run"] == str(run.pk)
    assert progress["payload"]["name"] == "mcp__crm__bump"
    assert progress["payload"]["message"] == "half way"
    assert kinds.index("tool.call.started") < kinds.index("tool.progress")
    assert kinds.index("tool.progress") < kinds.index("tool.call.succeeded")
    assert not Event.objects.filter(session_id=session.pk, type="tool.progress").exists()


def test_a_server_on_a_refused_address_fails_the_run_with_the_reason(alice, start_worker):
    start_worker()
    refused = McpTestServer()  # 127.0.0.1, and SAGE_MCP_ALLOWED_HOSTS does not list it
    mcp_connection_save(user=alice, server_url=refused.url, bearer_token="alice-token")
    session = agent(alice, refused.url, {"text": "", "tool_calls": [call("bump")]})
    run = ends(submit(alice, session), RunStatus.FAILED)
    assert run.error["code"] == "outbound.url_refused"
    assert "SAGE_MCP_ALLOWED_HOSTS" in run.error["message"]


def test_a_401_mid_run_suspends_and_a_new_connection_resumes(alice, mcp_server, start_worker):
    start_worker()
    connect(alice, mcp_server)
    session = agent(
        alice,
        mcp_server.url,
        # The listing and this call carry the token; the server then forgets it.
        {"text": "", "tool_calls": [call("revoke")]},
        {"text": "", "tool_calls": [call("bump"), call("lookup", key="k")]},
        # After the retry the model reads "not run" and calls again.
        {"text": "", "tool_calls": [call("bump")]},
        {"text": "ok"},
    )
    run = ends(submit(alice, session), RunStatus.SUSPENDED)
    assert run.interaction["type"] == "mcp_auth"
    assert run.interaction["code"] == "mcp.auth_required"
    assert "refused the saved credentials" in run.interaction["message"]
    # The refused call and the rest of its step: answered, never sent.
    not_run = "not run: the run waited for the user (mcp.auth_required); call it again"
    assert [(p["id"], p["error"]) for p in events(run, "tool.call.failed")] == [
        ("call_1_0", not_run),
        ("call_1_1", not_run),
    ]
    assert [c.tool for c in mcp_server.calls] == ["revoke"]

    mcp_server.tokens.add("alice-new-token")
    connect(alice, mcp_server, token="alice-new-token")
    services.run_reply(run=run, decision="retry")
    run = ends(run)
    assert run.result["text"] == "ok"
    assert mcp_server.bumps == 1
    assert [(c.tool, c.authorization) for c in mcp_server.calls] == [
        ("revoke", "Bearer alice-token"),
        ("bump", "Bearer alice-new-token"),
    ]
    # The call sent again is a new call: its own id and idempotency key.
    assert [c.key for c in mcp_server.calls] == [f"{run.pk}:call_0_0", f"{run.pk}:call_2_0"]
    assert_every_call_answered(run)


def assert_every_call_answered(run: Run) -> None:
    """Each ``tool.call.started`` has exactly one answer."""
    started = [p["id"] for p in events(run, "tool.call.started")]
    answers = [p["id"] for p in events(run, "tool.call.succeeded")]
    answers += [p["id"] for p in events(run, "tool.call.failed")]
    assert sorted(started) == sorted(answers), (started, answers)


def test_a_connection_closed_mid_call_is_a_clear_tool_error(alice, mcp_server, start_worker):
    start_worker()
    connect(alice, mcp_server)
    session = agent(
        alice,
        mcp_server.url,
        {"text": "", "tool_calls": [call("drop")]},
        {"text": "", "tool_calls": [call("lookup", key="k")]},
        {"text": "ok"},
    )
    run = ends(submit(alice, session))
    # The server ran the tool, then the connection carrying the call closed.
    assert [c.tool for c in mcp_server.calls] == ["drop", "lookup"]
    [failed] = events(run, "tool.call.failed")
    assert failed["id"] == "call_0_0"
    assert failed["error"] == (
        "the connection to the MCP server 'crm' closed during the call; "
        "the call's effect is unknown"
    )
    # The next call goes through (on a fresh session), and the run completes.
    [done] = events(run, "tool.call.succeeded")
    assert (done["id"], done["output"]) == ("call_1_0", "value of k")
    assert run.result["text"] == "ok"
    assert_every_call_answered(run)
