from __future__ import annotations

import uuid

import pytest
from rest_framework.test import APIClient

from agents import archives, services
from scheduling.models import Event, Run, RunStatus
from tests.conftest import demo_manifest

pytestmark = pytest.mark.django_db


def _session(api: APIClient) -> dict:
    response = api.post(
        "/api/v1/sessions/", {"package": "demo", "agent": "assistant"}, format="json"
    )
    assert response.status_code == 201, response.content
    return response.json()


@pytest.fixture
def alice_session(alice, alice_api, make_session):
    return make_session(alice)


def _finish(run: Run, text: str = "done") -> None:
    """Mark a run completed with an archive, as the worker would."""
    Run.objects.filter(pk=run.pk).update(status=RunStatus.COMPLETED, result={"text": text})
    run.refresh_from_db()
    archives.archive_terminal(run)


def test_it_requires_authentication():
    response = APIClient().get("/api/v1/runs/")
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "auth.required"
    assert response.json()["error"]["category"] == "AUTHENTICATION"


def test_it_rejects_a_bad_token():
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Token nope")
    assert client.get("/api/v1/runs/").status_code == 401


def test_it_creates_a_session_and_submits_a_run(alice_api, alice_session):
    response = alice_api.post(
        "/api/v1/runs/", {"session": str(alice_session.pk), "input": "hello"}, format="json"
    )
    assert response.status_code == 202
    body = response.json()
    assert body["status"] == "queued"
    assert body["session"] == str(alice_session.pk)
    fetched = alice_api.get(f"/api/v1/runs/{body['id']}/").json()
    for key in (
        "id",
        "session",
        "status",
        "result",
        "error",
        "created_at",
        "started_at",
        "finished_at",
    ):
        assert key in fetched


def test_it_answers_404_for_bob_on_alice_objects(alice, alice_api, bob_api, alice_session):
    run, _ = services.run_submit(owner=alice, session_id=alice_session.pk, input="hi")
    _finish(run)
    for url in (
        f"/api/v1/runs/{run.pk}/",
        f"/api/v1/sessions/{alice_session.pk}/",
        f"/api/v1/sessions/{alice_session.pk}/events/",
        f"/api/v1/archives/{run.pk}/",
    ):
        assert alice_api.get(url).status_code == 200, url
        response = bob_api.get(url)
        assert response.status_code == 404, url
        assert response.json()["error"]["category"] == "NOT_FOUND"
    assert bob_api.post(f"/api/v1/runs/{run.pk}/cancel/").status_code == 404
    submit = bob_api.post(
        "/api/v1/runs/", {"session": str(alice_session.pk), "input": "x"}, format="json"
    )
    assert submit.status_code == 404
    assert bob_api.get("/api/v1/runs/").json()["count"] == 0


def test_an_archive_lookup_answers_404_only_for_what_is_not_there(alice, alice_api, monkeypatch):
    malformed = alice_api.get("/api/v1/archives/not-a-run-id/")
    assert malformed.status_code == 404
    assert malformed.json()["error"]["code"] == "archive.not_found"

    def broken(**kwargs):
        raise RuntimeError("the database went away")

    # A failure of the server is a 500, never dressed up as a missing archive.
    monkeypatch.setattr(archives, "archive_read", broken)
    alice_api.raise_request_exception = False
    failed = alice_api.get(f"/api/v1/archives/{uuid.uuid4()}/")
    assert failed.status_code == 500
    assert failed.json()["error"]["category"] == "INTERNAL"


def test_it_answers_malformed_json_with_a_400_envelope(alice_api):
    response = alice_api.generic(
        "POST", "/api/v1/runs/", "{not json", content_type="application/json"
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "request.malformed"
    assert error["category"] == "VALIDATION"
    assert set(error) == {"code", "category", "message", "retryable", "resumable", "details"}


def test_it_rejects_unknown_fields(alice_api, alice_session):
    response = alice_api.post(
        "/api/v1/runs/",
        {"session": str(alice_session.pk), "input": "x", "priorty": 3},
        format="json",
    )
    assert response.status_code == 400
    assert response.json()["error"]["details"]["fields"] == {"priorty": ["unknown field"]}
    assert Run.objects.count() == 0


def test_it_reports_missing_fields_by_name(alice_api):
    response = alice_api.post("/api/v1/sessions/", {"agent": "assistant"}, format="json")
    assert response.status_code == 400
    assert "package" in response.json()["error"]["details"]["fields"]


def test_it_rejects_an_unknown_agent(alice_api, alice_session):
    response = alice_api.post(
        "/api/v1/sessions/", {"package": "demo", "agent": "ghost"}, format="json"
    )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "session.agent_not_found"


def test_it_rejects_a_huge_payload(alice_api, alice_session, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 10_000
    response = alice_api.post(
        "/api/v1/runs/", {"session": str(alice_session.pk), "input": "x" * 20_000}, format="json"
    )
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request.too_large"
    assert Run.objects.count() == 0


def test_it_returns_the_same_run_for_a_repeated_idempotency_key(alice_api, alice_session):
    payload = {"session": str(alice_session.pk), "input": "once"}
    first = alice_api.post("/api/v1/runs/", payload, format="json", HTTP_IDEMPOTENCY_KEY="k1")
    second = alice_api.post("/api/v1/runs/", payload, format="json", HTTP_IDEMPOTENCY_KEY="k1")
    assert first.status_code == 202
    assert second.status_code == 200
    assert first.json()["id"] == second.json()["id"]
    assert Run.objects.count() == 1


def test_it_answers_429_with_retry_after_when_the_queue_is_full(alice_api, alice_session, settings):
    settings.SAGE = {**settings.SAGE, "SAGE_SERVER_MAX_PENDING_RUNS": 2}
    payload = {"session": str(alice_session.pk), "input": "x"}
    assert alice_api.post("/api/v1/runs/", payload, format="json").status_code == 202
    assert alice_api.post("/api/v1/runs/", payload, format="json").status_code == 202
    response = alice_api.post("/api/v1/runs/", payload, format="json")
    assert response.status_code == 429
    assert int(response["Retry-After"]) >= 1
    error = response.json()["error"]
    assert (error["code"], error["retryable"]) == ("scheduler.queue_full", True)
    assert Run.objects.count() == 2


def test_it_pages_events_by_after_and_limit(alice, alice_api, alice_session):
    run, _ = services.run_submit(owner=alice, session_id=alice_session.pk, input="x")
    Event.objects.bulk_create(
        Event(
            session=alice_session,
            seq=i,
            run=run,
            type="message.completed",
            data=f'{{"role": "user", "content": "m{i}"}}',
        )
        for i in range(1, 8)
    )
    url = f"/api/v1/sessions/{alice_session.pk}/events/"
    page = alice_api.get(url, {"limit": 3}).json()
    assert [e["seq"] for e in page["results"]] == [1, 2, 3]
    assert page["results"][0]["payload"] == {"role": "user", "content": "m1"}
    assert page["results"][0]["run"] == str(run.pk)
    assert page["next"].endswith("?after=3&limit=3")
    page = alice_api.get(url, {"after": 6, "limit": 3}).json()
    assert [e["seq"] for e in page["results"]] == [7]
    assert page["next"] is None
    assert alice_api.get(url, {"limit": 0}).status_code == 400
    assert alice_api.get(url, {"limit": 201}).status_code == 400


def test_it_paginates_lists(alice, alice_api, alice_session):
    for i in range(5):
        services.run_submit(owner=alice, session_id=alice_session.pk, input=f"r{i}")
    body = alice_api.get("/api/v1/runs/", {"page_size": 2}).json()
    assert set(body) == {"count", "next", "previous", "results"}
    assert body["count"] == 5
    assert len(body["results"]) == 2
    assert body["next"] is not None


def test_it_cancels_a_queued_run_and_archives_it(alice, alice_api, alice_session):
    run, _ = services.run_submit(owner=alice, session_id=alice_session.pk, input="x")
    response = alice_api.post(f"/api/v1/runs/{run.pk}/cancel/")
    assert response.status_code == 202
    assert response.json()["status"] == "cancelled"
    archive = alice_api.get(f"/api/v1/archives/{run.pk}/").json()
    assert archive["status"] == "cancelled"
    assert archive["error"]["code"] == "run.cancelled"
    again = alice_api.post(f"/api/v1/runs/{run.pk}/cancel/")
    assert again.json()["status"] == "cancelled"


def test_it_never_returns_model_credentials(alice_api):
    response = alice_api.post(
        "/api/v1/model-records/",
        {
            "name": "mine",
            "protocol": "openai",
            "base_url": "http://127.0.0.1:9/v1",
            "model": "gpt-test",
            "api_key": "sk-secret-123",
        },
        format="json",
    )
    assert response.status_code == 201, response.content
    assert "sk-secret-123" not in response.content.decode()
    assert response.json()["has_credentials"] is True
    listing = alice_api.get("/api/v1/model-records/")
    assert "sk-secret-123" not in listing.content.decode()
    from pooling.models import ModelRecord

    record = ModelRecord.objects.get(name="mine")
    assert "sk-secret-123" not in record.encrypted_credentials
    assert record.api_key == "sk-secret-123"


def test_it_creates_packages_and_rejects_a_changed_version(alice_api):
    created = alice_api.post("/api/v1/packages/", {"manifest": demo_manifest()}, format="json")
    assert created.status_code == 201
    assert created.json()["reused"] is False
    again = alice_api.post("/api/v1/packages/", {"manifest": demo_manifest()}, format="json")
    assert again.status_code == 200
    assert again.json()["reused"] is True
    changed = alice_api.post(
        "/api/v1/packages/", {"manifest": demo_manifest(instructions="Different.")}, format="json"
    )
    assert changed.status_code == 409
    assert changed.json()["error"]["code"] == "package.version_conflict"


def test_it_rejects_an_invalid_manifest_with_the_field(alice_api):
    manifest = demo_manifest(max_steps=100_000)
    response = alice_api.post("/api/v1/packages/", {"manifest": manifest}, format="json")
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "package.invalid"
    assert "max_steps" in error["details"]["field"]


def test_it_restricts_capacity_to_staff(alice_api, staff_api):
    assert alice_api.get("/api/v1/capacity").status_code == 403
    assert staff_api.get("/api/v1/capacity").status_code == 200


def test_it_serves_the_openapi_schema_and_docs(alice_api):
    schema = alice_api.get("/api/schema/")
    assert schema.status_code == 200
    assert b"/api/v1/runs/" in schema.content
    assert alice_api.get("/api/docs/").status_code == 200


def test_it_answers_unknown_urls_with_the_envelope(alice_api):
    response = alice_api.get("/api/v1/nothing-here/")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "not_found"


def test_it_exports_a_session_as_json_lines(alice, alice_api, alice_session):
    import orjson

    run, _ = services.run_submit(owner=alice, session_id=alice_session.pk, input="x")
    Event.objects.create(session=alice_session, seq=1, run=run, type="message.completed",
                         data='{"role": "user", "content": "hi"}')
    response = alice_api.get(f"/api/v1/sessions/{alice_session.pk}/export/")
    assert response.status_code == 200
    assert response["Content-Type"] == "application/x-ndjson"
    lines = [orjson.loads(line) for line in b"".join(response.streaming_content).splitlines()]
    assert len(lines) >= 2
    assert any("hi" in str(line) for line in lines)


@pytest.mark.django_db(transaction=True)
def test_it_streams_events_as_server_sent_events(alice, alice_api, alice_session):
    import asyncio

    run, _ = services.run_submit(owner=alice, session_id=alice_session.pk, input="x")
    for seq in (1, 2, 3):
        Event.objects.create(session=alice_session, seq=seq, run=run, type="message.completed",
                             data=f'{{"n": {seq}}}')
    response = alice_api.get(f"/api/v1/sessions/{alice_session.pk}/stream/",
                             {"timeout": 1}, HTTP_LAST_EVENT_ID="1")
    assert response.status_code == 200
    assert response["Content-Type"] == "text/event-stream"

    async def collect() -> bytes:
        return b"".join([chunk async for chunk in response.streaming_content])

    body = asyncio.run(collect())
    assert b"id: 2\nevent: message.completed\n" in body
    assert b"id: 3\n" in body
    assert b"id: 1\n" not in body  # resumed after Last-Event-ID


def test_it_hides_another_users_export_and_stream(bob_api, alice_session):
    for url in (f"/api/v1/sessions/{alice_session.pk}/export/",
                f"/api/v1/sessions/{alice_session.pk}/stream/"):
        assert bob_api.get(url).status_code == 404


def test_it_keeps_one_user_from_filling_the_queue_for_everyone(
    alice, bob, alice_api, bob_api, make_session, settings
):
    settings.SAGE = {**settings.SAGE, "SAGE_SERVER_MAX_PENDING_RUNS": 10,
                     "SAGE_SERVER_MAX_PENDING_RUNS_PER_USER": 3}
    alice_session, bob_session = make_session(alice), make_session(bob)
    for _ in range(3):
        assert alice_api.post("/api/v1/runs/", {"session": str(alice_session.pk), "input": "x"},
                              format="json").status_code == 202
    refused = alice_api.post("/api/v1/runs/", {"session": str(alice_session.pk), "input": "x"},
                             format="json")
    assert refused.status_code == 429
    assert refused.json()["error"]["details"]["max_pending_per_user"] == 3
    assert bob_api.post("/api/v1/runs/", {"session": str(bob_session.pk), "input": "x"},
                        format="json").status_code == 202
