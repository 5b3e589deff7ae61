"""Whole runs against broken upstreams: a worker, the real SDKs and the loopback server.

Each fault of the catalogue must give the run its documented status and error code, and
nothing from the upstream's body may reach the run's error, its events, the API, the
admin or the database; the body goes to the server log, without the record's key.
"""

from __future__ import annotations

import json
import logging

import pytest
from django.test import Client

from agents.models import ManagedAgentRecord
from agents.services import packages
from pooling.models import ModelRecord
from pooling.providers.errors import DEFAULT_RETRY_AFTER_SECONDS
from scheduling.models import TERMINAL_STATUSES, Event, Run, RunStatus
from tests.conftest import client_for, demo_manifest
from tests.e2e.conftest import wait_for
from tests.pooling.upstream import Reply, fault_catalogue, upstream_fixture

upstream = upstream_fixture  # the loopback model server fixture
pytestmark = [pytest.mark.storage, pytest.mark.django_db(transaction=True)]

# Not shaped like any known key: only the record's own credentials can redact it.
API_KEY = "alice-key-7Qm2vX9pL4"
BODY_TEXT = ("TRACE", "nginx", "Bad Gateway", "Hotel Wi-Fi", "portal.example", "<html",
             "Rate limit reached", "Incorrect API key", API_KEY, "sk-proj-Zx81")
INVALID = "invalid response from the provider (status 200, "

# fault -> (code, message) of a run that fails with a retryable upstream.error
FAILING = {
    "html_502": "the provider failed (status 502, HTML error page)",
    "garbage_json_200": INVALID + "not an event stream)",
    "html_200": INVALID + "not an event stream)",
    "eventless_stream_200": INVALID + "no events)",
    "broken_event_stream": INVALID + "broken event stream)",
    "non_utf8_bytes": INVALID + "not UTF-8)",
    "connection_reset": "upstream connection failed",
    "stops_mid_token": INVALID + "stream ended early)",
}


@pytest.fixture(params=["openai", "anthropic"])
def protocol(request):
    return request.param


@pytest.fixture
def model(alice, upstream, protocol) -> ModelRecord:
    url = upstream.openai_base_url if protocol == "openai" else upstream.anthropic_base_url
    record = ModelRecord(owner=alice, name="gpt", protocol=protocol, base_url=url,
                         model="test-model", options={"timeout": 10})
    record.api_key = API_KEY
    record.save()
    packages.package_create(owner=alice, manifest=demo_manifest(name="pkg", model="gpt"))
    return record


def _submit(api) -> tuple[str, str]:
    session = api.post("/api/v1/sessions/", {"package": "pkg", "agent": "assistant"},
                       format="json").json()["id"]
    response = api.post("/api/v1/runs/", {"session": session, "input": "hello"}, format="json")
    assert response.status_code == 202, response.content
    return session, response.json()["id"]


def _settled(run_id: str) -> bool:
    status = Run.objects.get(pk=run_id).status
    return status in TERMINAL_STATUSES or status == RunStatus.SUSPENDED


def _settle(api, start_worker, caplog) -> tuple[str, str, Run]:
    """Submit a run, start the worker (logging at INFO) and wait until the run settles."""
    session, run_id = _submit(api)
    with caplog.at_level(logging.INFO):
        start_worker()
        wait_for(lambda: _settled(run_id), message="the run to end")
    return session, run_id, Run.objects.get(pk=run_id)


def _everything_exposed(api, staff, session: str, run_id: str) -> str:
    """What clients, the admin and the database hold of the run."""
    admin = Client()
    admin.force_login(staff)
    run = Run.objects.get(pk=run_id)
    pages = [
        api.get(f"/api/v1/runs/{run_id}/"),
        api.get(f"/api/v1/sessions/{session}/events/"),
        admin.get(f"/admin/scheduling/run/{run_id}/change/"),
        admin.get(f"/admin/scheduling/event/?session__id__exact={session}"),
    ]
    assert [page.status_code for page in pages] == [200, 200, 200, 200]
    export = api.get(f"/api/v1/sessions/{session}/export/")
    parts = [
        *(page.content.decode() for page in pages),
        b"".join(export.streaming_content).decode(),
        json.dumps([run.error, run.result, run.interaction]),
        json.dumps(list(Event.objects.filter(session_id=session).values_list("type", "data")),
                   default=str),
        json.dumps(list(ManagedAgentRecord.objects.filter(run_id=run_id)
                        .values_list("error", "result")), default=str),
    ]
    return "\n".join(parts)


def _assert_nothing_of_the_body(exposed: str) -> None:
    for text in BODY_TEXT:
        # The admin page is HTML of its own; only the upstream's page must not be in it.
        if text == "<html":
            continue
        assert text not in exposed, text


def _assert_logged_without_the_key(caplog) -> None:
    everything = caplog.text + "\n".join(r.getMessage() for r in caplog.records)
    assert API_KEY not in everything
    assert "sk-proj-Zx81" not in everything


@pytest.mark.parametrize("fault", sorted(FAILING))
def test_it_fails_the_run_with_a_retryable_upstream_error(alice, staff, start_worker, upstream,
                                                          model, fault, caplog):
    upstream.enqueue(fault_catalogue(API_KEY)[fault])
    api = client_for(alice)
    session, run_id, run = _settle(api, start_worker, caplog)
    assert run.status == RunStatus.FAILED
    assert run.result is None
    assert {k: run.error[k] for k in ("code", "category", "message", "retryable")} == {
        "code": "upstream.error", "category": "UPSTREAM", "message": FAILING[fault],
        "retryable": True}
    types = list(Event.objects.filter(run_id=run_id).order_by("seq")
                 .values_list("type", flat=True))
    # The user's message and the failure; no answer, not even a partial one.
    assert types == ["run.started", "message.completed", "run.failed"]
    _assert_nothing_of_the_body(_everything_exposed(api, staff, session, run_id))
    _assert_logged_without_the_key(caplog)


def test_it_fails_the_run_on_a_401_echoing_the_key_without_logging_the_key(
    alice, staff, start_worker, upstream, model, caplog
):
    upstream.enqueue(fault_catalogue(API_KEY)["unauthorized_echoing_the_key"])
    api = client_for(alice)
    session, run_id, run = _settle(api, start_worker, caplog)
    assert run.status == RunStatus.FAILED
    assert (run.error["code"], run.error["retryable"], run.error["message"]) == (
        "upstream.auth", False,
        "the provider rejected the credentials (status 401, invalid_api_key)")
    _assert_nothing_of_the_body(_everything_exposed(api, staff, session, run_id))
    upstream_lines = [r.getMessage() for r in caplog.records if r.name == "sage.upstream"]
    assert any("TRACE-auth-0c3e" in line for line in upstream_lines), upstream_lines
    _assert_logged_without_the_key(caplog)


@pytest.mark.parametrize(("fault", "retry_after"), [
    ("rate_limited_with_retry_after", 17.0),
    ("rate_limited_without_retry_after", DEFAULT_RETRY_AFTER_SECONDS),
])
def test_it_suspends_a_rate_limited_run_and_resumes_it_on_retry(
    alice, staff, start_worker, upstream, model, fault, retry_after, caplog
):
    upstream.enqueue(fault_catalogue(API_KEY)[fault], Reply(text="Hello after the wait."))
    api = client_for(alice)
    session, run_id = _submit(api)
    with caplog.at_level(logging.INFO):
        start_worker()
        wait_for(lambda: _settled(run_id), message="the run to be suspended")
        run = Run.objects.get(pk=run_id)
        assert run.status == RunStatus.SUSPENDED, run.error
        interaction = api.get(f"/api/v1/runs/{run_id}/").json()["interaction"]
        assert {k: interaction[k] for k in ("code", "category", "message", "retryable",
                                            "resumable", "retry_after", "allowed_decisions")} == {
            "code": "upstream.rate_limited",
            "category": "RATE_LIMITED",
            "message": "the provider's rate limit was reached; retry later "
                       "(status 429, rate_limit_exceeded)",
            "retryable": True,
            "resumable": True,
            "retry_after": retry_after,
            "allowed_decisions": ["retry", "cancel"],
        }
        _assert_nothing_of_the_body(_everything_exposed(api, staff, session, run_id))
        reply = api.post(f"/api/v1/runs/{run_id}/reply/", {"decision": "retry"}, format="json")
        assert reply.status_code == 202, reply.content
        wait_for(lambda: _settled(run_id), message="the resumed run to finish")
    run = Run.objects.get(pk=run_id)
    assert run.status == RunStatus.COMPLETED, run.error
    assert run.result["text"] == "Hello after the wait."
    types = list(Event.objects.filter(run_id=run_id).order_by("seq")
                 .values_list("type", flat=True))
    assert types == ["run.started", "message.completed", "run.suspended",
                     "interaction.requested", "interaction.resolved", "run.resumed",
                     "run.started", "message.completed", "run.completed"]
    _assert_logged_without_the_key(caplog)
