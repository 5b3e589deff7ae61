"""Users' connections to remote MCP servers: the API, the service and the admin."""

from __future__ import annotations

import pytest
from django.urls import reverse
from django.utils import timezone

from agents.models import McpConnection
from agents.services.mcp import mcp_connection_save, mcp_credentials_sync

pytestmark = pytest.mark.django_db

URL = "/api/v1/mcp-connections/"
SECRET = "tok-s3cret-value"


def save(api, **body):
    return api.post(URL, {"server_url": "https://crm.example/mcp", **body}, format="json")


def test_it_saves_a_bearer_token_and_never_returns_it(alice_api, alice):
    response = save(alice_api, bearer_token=SECRET)
    assert response.status_code == 201, response.content
    assert set(response.json()) == {
        "id",
        "server_url",
        "kind",
        "created_at",
        "updated_at",
        "last_used_at",
    }
    listed = alice_api.get(URL)
    assert listed.json()["count"] == 1
    for text in (response.content, listed.content):
        assert SECRET.encode() not in text
    row = McpConnection.objects.get()
    assert SECRET not in row.encrypted_secret
    assert mcp_credentials_sync(alice.pk, "HTTPS://crm.example:443/mcp") == {
        "Authorization": f"Bearer {SECRET}"
    }


def test_a_second_save_replaces_the_live_connection(alice_api, alice):
    save(alice_api, bearer_token="first")
    second = save(alice_api, headers={"X-Api-Key": SECRET})
    assert second.status_code == 201
    assert second.json()["kind"] == "headers"
    assert McpConnection.objects.count() == 1
    assert mcp_credentials_sync(alice.pk, "https://crm.example/mcp") == {"X-Api-Key": SECRET}


def test_another_users_connection_answers_404(alice_api, bob_api, bob):
    row = mcp_connection_save(user=bob, server_url="https://crm.example/mcp", bearer_token="b")
    assert alice_api.get(f"{URL}{row.pk}/").status_code == 404
    assert alice_api.delete(f"{URL}{row.pk}/").status_code == 404
    assert alice_api.get(URL).json()["count"] == 0
    assert bob_api.get(URL).json()["count"] == 1


def test_revoking_wipes_the_secret_and_frees_the_server(alice_api, alice):
    first = save(alice_api, bearer_token=SECRET).json()
    assert alice_api.delete(f"{URL}{first['id']}/").status_code == 204
    row = McpConnection.objects.get(pk=first["id"])
    assert row.revoked_at is not None and row.encrypted_secret == "" and row.active is None
    assert mcp_credentials_sync(alice.pk, "https://crm.example/mcp") is None
    assert alice_api.get(URL).json()["count"] == 0
    again = save(alice_api, bearer_token="new")
    assert again.status_code == 201 and again.json()["id"] != first["id"]
    assert McpConnection.objects.count() == 2


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"bearer_token": "a", "headers": {"X": "y"}},
        {"bearer_token": "two words"},
        {"headers": {}},
        {"headers": {"Content-Type": "text/plain"}},
        {"headers": {"bad name": "x"}},
        {"headers": {"X-Key": "line\r\nInjected: 1"}},
        {"headers": ["X-Key"]},
        {"bearer_token": "t", "token": "unknown field"},
        {"bearer_token": "t", "server_url": "ftp://crm.example/"},
        {"bearer_token": "t", "server_url": "https://user:pw@crm.example/"},
    ],
)
def test_it_refuses_bad_input_with_the_envelope(alice_api, body):
    response = save(alice_api, **body)
    assert response.status_code == 400, response.content
    assert "error" in response.json()
    assert b"Injected" not in response.content


def test_it_needs_authentication(client):
    assert client.get(URL).status_code == 401


def test_the_schema_documents_the_endpoint(alice_api):
    schema = alice_api.get("/api/schema/", HTTP_ACCEPT="application/json").json()
    operations = schema["paths"]["/api/v1/mcp-connections/"]
    assert {"get", "post"} <= set(operations)
    assert "400" in operations["post"]["responses"]


def test_operators_see_and_revoke_any_connection_in_the_admin(client, staff, alice):
    row = mcp_connection_save(user=alice, server_url="https://crm.example/mcp", bearer_token=SECRET)
    client.force_login(staff)
    listing = client.get(reverse("admin:agents_mcpconnection_changelist"))
    assert listing.status_code == 200 and b"crm.example" in listing.content
    page = client.get(reverse("admin:agents_mcpconnection_change", args=[row.pk]))
    assert page.status_code == 200
    for text in (listing.content, page.content):
        assert SECRET.encode() not in text and row.encrypted_secret.encode() not in text
    client.post(
        reverse("admin:agents_mcpconnection_changelist"),
        {"action": "revoke", "_selected_action": [row.pk]},
    )
    row.refresh_from_db()
    assert row.revoked_at is not None


def test_the_mcp_page_shows_servers_connections_and_recent_calls(client, staff, alice):
    from agents.services import packages
    from scheduling.models import WorkerSnapshot
    from tests.conftest import demo_manifest

    url = "https://crm.example/mcp"
    manifest = demo_manifest(name="crm-agent", mcp_servers=[{"name": "crm", "url": url}])
    packages.package_create(owner=alice, manifest=manifest)
    mcp_connection_save(user=alice, server_url=url, bearer_token=SECRET)
    recent = {
        "at": "2026-12-07T03:00:00+00:00",
        "owner": alice.pk,
        "server": "crm",
        "url": url,
        "tool": "lookup",
        "outcome": "timeout",
        "ms": 1234,
    }
    WorkerSnapshot.objects.create(
        worker_id="w1",
        host="h",
        pid=1,
        started_at=timezone.now(),
        heartbeat_at=timezone.now(),
        capacity={"executor": {"mcp_sessions": {"recent": [recent]}}},
    )
    client.force_login(staff)
    page = client.get(reverse("admin:mcp"))
    assert page.status_code == 200
    text = page.content.decode()
    assert "crm-agent@1.0.0" in text and url in text
    assert "<strong>timeout</strong>" in text and "1234" in text and "alice" in text
    assert SECRET not in text
    assert reverse("admin:mcp") in client.get(reverse("admin:index")).content.decode()
