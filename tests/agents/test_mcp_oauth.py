"""OAuth 2.1 connections to remote MCP servers in real runs: a real worker (in a thread),
the scripted model calling ``mcp__crm__whoami``, and an OAuth-protected MCP server built
with the SDK's server auth on loopback (`tests.agents.mcp_oauth_fixtures`). The browser
is played by httpx: it follows the authorization URL to the server's redirect, then the
test calls our ``/mcp/oauth/callback`` with its code and state."""

from __future__ import annotations

import asyncio
import logging
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx2
import orjson
import pytest
from django.db import connection
from django.test import Client

from agents import services
from agents.models import McpConnection, McpOAuthClient, McpOAuthPending
from agents.services import packages
from agents.services.mcp_oauth import mcp_oauth_credentials
from scheduling.models import Event, Run, RunStatus
from tests.agents.mcp_fixtures import allow_loopback
from tests.agents.mcp_oauth_fixtures import OAuthTestServer
from tests.conftest import client_for, scripted_model
from tests.e2e import conftest as e2e
from tests.e2e.conftest import wait_for

pytestmark = [pytest.mark.storage, pytest.mark.django_db(transaction=True)]

start_worker = e2e.start_worker  # the fixture: a real worker in a thread

WHOAMI = {"text": "", "tool_calls": [{"name": "mcp__crm__whoami", "arguments": {}}]}


@pytest.fixture(autouse=True)
def _loopback_allowed(monkeypatch):
    """The MCP and authorization servers listen on 127.0.0.1, refused by default."""
    allow_loopback(monkeypatch)


@pytest.fixture(name="oauth_server")
def oauth_server_fixture():
    server = OAuthTestServer().start()
    yield server
    server.stop()


def session_of(user, url: str, *steps: dict[str, Any], name: str = "crm"):
    if steps:
        scripted_model(name, *steps)
    manifest = {
        "name": name,
        "version": "1.0.0",
        "entrypoint": "assistant",
        "agents": {
            "assistant": {
                "model": name,
                "instructions": "Use the CRM.",
                "mcp_servers": [{"name": "crm", "url": url}],
            }
        },
    }
    packages.package_create(owner=user, manifest=manifest)
    return another_session(user, name)


def another_session(user, name: str = "crm"):
    return services.session_create(owner=user, package=name, agent="assistant")


def submit(user, session) -> Run:
    run, _ = services.run_submit(owner=user, session_id=session.pk, input="go")
    return run


def ends(run: Run, status: str = RunStatus.COMPLETED) -> Run:
    wait_for(
        lambda: Run.objects.get(pk=run.pk).status == status,
        message=f"the run to be {status}",
    )
    return Run.objects.get(pk=run.pk)


def authorize(server: OAuthTestServer, url: str, subject: str) -> dict[str, str]:
    """Play the browser: open ``url`` as ``subject``; the code and state it brings back."""
    server.provider.subject = subject
    response = httpx2.get(url, follow_redirects=False)
    assert response.status_code == 302, response.text
    query = parse_qs(urlsplit(response.headers["location"]).query)
    return {"code": query["code"][0], "state": query["state"][0]}


def callback(params: dict[str, str], *, json: bool = True) -> Any:
    headers = {"HTTP_ACCEPT": "application/json"} if json else {}
    return Client().get("/mcp/oauth/callback", params, **headers)


def connect(server: OAuthTestServer, run: Run, subject: str) -> Run:
    """The run suspended for authorization: authorize, call back, and see it resumed."""
    run = ends(run, RunStatus.SUSPENDED)
    asked.append(run.interaction["authorization_url"])
    response = callback(authorize(server, asked[-1], subject))
    assert response.status_code == 200, response.content
    assert response.json()["resumed"] is True
    return run


asked: list[str] = []  # the authorization URLs runs asked for, in order


def test_it_suspends_with_an_authorization_url(alice, oauth_server, start_worker):
    start_worker()
    run = ends(submit(alice, session_of(alice, oauth_server.url, WHOAMI)), RunStatus.SUSPENDED)
    interaction = run.interaction
    assert interaction["type"] == "mcp_auth"
    assert interaction["code"] == "mcp.auth_required"
    assert interaction["server"] == "crm" and interaction["url"] == oauth_server.url
    assert interaction["allowed_decisions"] == ["retry", "cancel"]
    url = urlsplit(interaction["authorization_url"])
    assert url.path == "/authorize"
    query = parse_qs(url.query)
    [client_id] = oauth_server.provider.clients
    assert query["client_id"] == [client_id]
    assert query["code_challenge_method"] == ["S256"] and len(query["code_challenge"][0]) >= 43
    assert len(query["state"][0]) >= 32
    assert query["redirect_uri"] == ["http://localhost:8000/mcp/oauth/callback"]
    # The REST API shows the same interaction (the reply path is the usual one).
    shown = client_for(alice).get(f"/api/v1/runs/{run.pk}/").json()["interaction"]
    assert shown["authorization_url"] == interaction["authorization_url"]
    # One registration per authorization server, one pending authorization per request.
    assert McpOAuthClient.objects.count() == 1
    assert McpOAuthPending.objects.filter(owner=alice, run=run).count() == 1


def test_the_callback_stores_the_tokens_and_resumes_the_run(alice, oauth_server, start_worker):
    start_worker()
    run = connect(
        oauth_server,
        submit(alice, session_of(alice, oauth_server.url, WHOAMI, {"text": "ok"})),
        "alice",
    )
    run = ends(run)
    assert run.result["text"] == "ok"
    [called] = oauth_server.calls
    assert called.subject == "alice"
    assert called.token in oauth_server.provider.access
    row = McpConnection.objects.get(owner=alice)
    assert row.kind == "oauth" and row.secret["access_token"] == called.token
    assert not McpOAuthPending.objects.exists()  # single use


def test_an_expired_access_token_is_refreshed(alice, oauth_server, start_worker):
    start_worker()
    session = session_of(alice, oauth_server.url, WHOAMI, {"text": "ok"})
    ends(connect(oauth_server, submit(alice, session), "alice"))
    oauth_server.provider.expire()  # the server now answers 401 to the stored token
    run = ends(submit(alice, another_session(alice)))
    assert run.result["text"] == "ok"
    assert oauth_server.provider.grants == ["authorization_code", "refresh_token"]
    first, second = oauth_server.calls
    assert second.subject == "alice" and second.token != first.token
    assert McpConnection.objects.get(owner=alice).secret["access_token"] == second.token


def test_a_token_about_to_expire_is_refreshed_before_use(alice, oauth_server, start_worker):
    start_worker()
    oauth_server.provider.ttl = 5  # within the refresh margin: refreshed before each use
    session = session_of(alice, oauth_server.url, WHOAMI, {"text": "ok"})
    ends(connect(oauth_server, submit(alice, session), "alice"))
    assert ends(submit(alice, another_session(alice))).result["text"] == "ok"
    assert "refresh_token" in oauth_server.provider.grants
    assert all(c.subject == "alice" for c in oauth_server.calls)


def test_a_revoked_token_with_a_refused_refresh_asks_again(alice, oauth_server, start_worker):
    start_worker()
    session = session_of(alice, oauth_server.url, WHOAMI, {"text": "ok"})
    ends(connect(oauth_server, submit(alice, session), "alice"))
    oauth_server.provider.revoke()
    run = ends(submit(alice, another_session(alice)), RunStatus.SUSPENDED)
    assert run.interaction["code"] == "mcp.auth_required"
    assert run.interaction["authorization_url"] != asked[-1]
    assert not McpConnection.objects.live().filter(owner=alice).exists()
    oauth_server.provider.refuse_refresh = False
    assert ends(connect(oauth_server, run, "alice")).result["text"] == "ok"


def test_revoking_the_connection_asks_again(alice, oauth_server, start_worker):
    start_worker()
    session = session_of(alice, oauth_server.url, WHOAMI, {"text": "ok"})
    ends(connect(oauth_server, submit(alice, session), "alice"))
    row = McpConnection.objects.get(owner=alice)
    listed = client_for(alice).get("/api/v1/mcp-connections/").json()
    assert [(c["id"], c["kind"]) for c in listed["results"]] == [(row.pk, "oauth")]
    assert client_for(alice).delete(f"/api/v1/mcp-connections/{row.pk}/").status_code == 204
    row.refresh_from_db()
    assert row.encrypted_secret == ""
    run = ends(submit(alice, another_session(alice)), RunStatus.SUSPENDED)
    assert "authorization_url" in run.interaction


def test_two_users_never_use_each_others_tokens(alice, bob, oauth_server, start_worker):
    start_worker()
    scripted_model("crm", WHOAMI, {"text": "ok"})
    runs = {
        "alice": submit(alice, session_of(alice, oauth_server.url)),
        "bob": submit(bob, session_of(bob, oauth_server.url)),
    }
    for who, run in runs.items():
        ends(connect(oauth_server, run, who))
    for run in runs.values():
        ends(run)
    assert sorted(c.subject for c in oauth_server.calls) == ["alice", "bob"]
    for who, user in (("alice", alice), ("bob", bob)):
        [sent] = [c for c in oauth_server.calls if c.subject == who]
        assert McpConnection.objects.get(owner=user).secret["access_token"] == sent.token


@pytest.mark.parametrize("case", ["unknown", "reused", "expired"])
def test_a_bad_state_is_refused(alice, oauth_server, start_worker, case):
    start_worker()
    run = ends(submit(alice, session_of(alice, oauth_server.url, WHOAMI)), RunStatus.SUSPENDED)
    params = authorize(oauth_server, run.interaction["authorization_url"], "alice")
    if case == "unknown":
        params["state"] = "not-a-state-we-issued"
    elif case == "reused":
        assert callback(params).status_code == 200
    else:
        McpOAuthPending.objects.update(expires_at="2000-01-01T00:00:00Z")
    response = callback(params)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "mcp.oauth_state_invalid"
    page = callback(params, json=False)
    assert page.status_code == 400 and b"<html" in page.content


def test_a_refused_code_exchange_is_a_502(alice, oauth_server, start_worker):
    start_worker()
    run = ends(submit(alice, session_of(alice, oauth_server.url, WHOAMI)), RunStatus.SUSPENDED)
    params = authorize(oauth_server, run.interaction["authorization_url"], "alice")
    params["code"] = "a-code-the-server-never-issued"
    response = callback(params)
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "mcp.oauth_exchange_failed"
    assert not McpConnection.objects.filter(owner=alice).exists()


def test_the_page_says_connected(alice, oauth_server, start_worker):
    start_worker()
    run = ends(submit(alice, session_of(alice, oauth_server.url, WHOAMI)), RunStatus.SUSPENDED)
    page = callback(
        authorize(oauth_server, run.interaction["authorization_url"], "alice"), json=False
    )
    assert page.status_code == 200
    assert b"Connected" in page.content and b"close this tab" in page.content


def test_no_token_is_ever_shown_or_stored_in_clear(alice, oauth_server, start_worker, caplog):
    caplog.set_level(logging.DEBUG)
    start_worker()
    session = session_of(alice, oauth_server.url, WHOAMI, {"text": "ok"})
    run = ends(connect(oauth_server, submit(alice, session), "alice"))
    oauth_server.provider.expire()
    second = ends(submit(alice, another_session(alice)))
    provider = oauth_server.provider
    secrets = [*provider.access, *provider.refresh, *(c.token for c in oauth_server.calls)]
    assert secrets
    api = client_for(alice)
    shown = [
        api.get("/api/v1/mcp-connections/").content,
        api.get(f"/api/v1/runs/{run.pk}/").content,
        api.get(f"/api/v1/runs/{second.pk}/").content,
        orjson.dumps([e.payload for e in Event.objects.all()]),
        caplog.text.encode(),
    ]
    with connection.cursor() as cursor:
        for table in (
            McpConnection._meta.db_table,
            McpOAuthClient._meta.db_table,
            McpOAuthPending._meta.db_table,
        ):
            cursor.execute(f"SELECT * FROM {table}")
            shown.append(repr(cursor.fetchall()).encode())
    for secret in secrets:
        assert all(secret.encode() not in text for text in shown), secret


def test_a_signed_in_user_cannot_use_another_users_state(alice, bob, oauth_server, start_worker):
    start_worker()
    run = ends(submit(alice, session_of(alice, oauth_server.url, WHOAMI)), RunStatus.SUSPENDED)
    params = authorize(oauth_server, run.interaction["authorization_url"], "alice")
    browser = Client()
    browser.force_login(bob)
    refused = browser.get("/mcp/oauth/callback", params, HTTP_ACCEPT="application/json")
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "mcp.oauth_state_invalid"
    assert not McpConnection.objects.exists()
    assert callback(params).status_code == 200  # alice's own browser still can
    assert McpConnection.objects.get().owner == alice


def test_concurrent_refreshes_of_one_user_and_server_coalesce(alice, oauth_server, start_worker):
    start_worker()
    oauth_server.provider.ttl = 5  # within the refresh margin: every read wants a refresh
    run = submit(alice, session_of(alice, oauth_server.url, WHOAMI, {"text": "ok"}))
    ends(connect(oauth_server, run, "alice"))
    before = oauth_server.provider.grants.count("refresh_token")

    async def five_reads():
        return await asyncio.gather(
            *(mcp_oauth_credentials(alice.pk, oauth_server.url) for _ in range(5))
        )

    headers = asyncio.run(five_reads())
    assert oauth_server.provider.grants.count("refresh_token") == before + 1
    assert len({h["Authorization"] for h in headers}) == 1


def test_a_denied_authorization_is_a_400(alice, oauth_server, start_worker):
    start_worker()
    run = ends(submit(alice, session_of(alice, oauth_server.url, WHOAMI)), RunStatus.SUSPENDED)
    params = authorize(oauth_server, run.interaction["authorization_url"], "alice")
    response = callback({"state": params["state"], "error": "access_denied"})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "mcp.oauth_denied"
    assert callback(params).status_code == 400  # the state was used up


def test_without_dynamic_registration_the_run_asks_for_a_connection(alice, start_worker):
    server = OAuthTestServer(registration=False).start()
    try:
        start_worker()
        run = submit(alice, session_of(alice, server.url, WHOAMI))
        interaction = ends(run, RunStatus.SUSPENDED).interaction
        assert interaction["code"] == "mcp.auth_required"
        assert "authorization_url" not in interaction
        assert not McpOAuthPending.objects.exists()
    finally:
        server.stop()
