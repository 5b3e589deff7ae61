"""The web process's ASGI handler (`sagehost.handler`): a request's middleware and view
run on a pool thread, several requests of one process at once, the session event stream is
still sent from the event loop, and the express lane (`sagehost.express`) answers a run
submission exactly as the full stack does."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from asgiref.testing import ApplicationCommunicator
from rest_framework.authtoken.models import Token

from sagehost.handler import ThreadedASGIHandler
from scheduling.models import Run

pytestmark = [pytest.mark.storage, pytest.mark.django_db(transaction=True)]


def _scope(
    method: str,
    path: str,
    token: str | None,
    query: str,
    length: int,
    headers: dict[str, str] | None = None,
) -> dict[str, Any]:
    given = {"host": "127.0.0.1", "content-type": "application/json", **(headers or {})}
    if token is not None:
        given.setdefault("authorization", f"Token {token}")
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query.encode(),
        "root_path": "",
        "headers": [(b"content-length", str(length).encode())]
        + [(name.encode(), value.encode()) for name, value in given.items()],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }


async def _request(
    handler: ThreadedASGIHandler,
    method: str,
    path: str,
    token: str | None,
    body: Any = None,
    query="",
    headers: dict[str, str] | None = None,
    answer: list[Any] | None = None,
) -> tuple[int, bytes]:
    """Status and body; ``answer`` (when given) also receives the response headers."""
    if body is None or isinstance(body, bytes):
        data = body or b""
    else:
        data = json.dumps(body).encode()
    app = ApplicationCommunicator(handler, _scope(method, path, token, query, len(data), headers))
    await app.send_input({"type": "http.request", "body": data, "more_body": False})
    start = await app.receive_output(timeout=10)
    if answer is not None:
        answer.extend(start["headers"])
    chunks = []
    while True:
        message = await app.receive_output(timeout=10)
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    await app.wait(timeout=5)
    return start["status"], b"".join(chunks)


async def _token(user) -> str:
    return (await sync_to_async(Token.objects.get_or_create)(user=user))[0].key


async def test_a_request_is_served_on_a_pool_thread_through_the_whole_chain(alice, make_session):
    session = await sync_to_async(make_session)(alice)
    token = await _token(alice)
    handler = ThreadedASGIHandler()
    handler.express = None  # the submission would take the express lane
    seen: list[str] = []
    respond = handler.get_response

    def recording(request):
        seen.append(threading.current_thread().name)
        return respond(request)

    handler.get_response = recording
    status, body = await _request(
        handler, "POST", "/api/v1/runs/", token, {"session": str(session.pk), "input": "hi"}
    )
    assert status == 202, body
    assert json.loads(body)["status"] == "queued"
    assert await Run.objects.filter(session_id=session.pk).acount() == 1
    assert seen and seen[0].startswith("sage-web")


async def test_one_process_serves_several_requests_at_once(alice):
    token = await _token(alice)
    handler = ThreadedASGIHandler()
    together = threading.Barrier(3, timeout=10)
    respond = handler.get_response

    def meeting(request):
        together.wait()  # passes only when three requests are inside their views at once
        return respond(request)

    handler.get_response = meeting
    answers = await asyncio.gather(
        *(_request(handler, "GET", "/api/v1/runs/", token) for _ in range(3))
    )
    assert [status for status, _ in answers] == [200, 200, 200]


async def test_the_event_stream_is_sent_from_the_event_loop(alice, make_session):
    session = await sync_to_async(make_session)(alice)
    token = await _token(alice)
    handler = ThreadedASGIHandler()
    await _request(
        handler, "POST", "/api/v1/runs/", token, {"session": str(session.pk), "input": "hi"}
    )
    status, body = await _request(
        handler, "GET", f"/api/v1/sessions/{session.pk}/stream/", token, query="timeout=1"
    )
    assert status == 200
    assert body.startswith(b"retry: "), body[:200]  # streamed from its async iterator


async def test_another_users_session_answers_404_in_the_envelope(alice, bob, make_session):
    session = await sync_to_async(make_session)(alice)
    handler = ThreadedASGIHandler()
    status, body = await _request(
        handler, "GET", f"/api/v1/sessions/{session.pk}/", await _token(bob)
    )
    assert status == 404
    assert json.loads(body)["error"]["code"]


# Express lane: each case as (body, headers, caller), where the body's "SESSION" is replaced
# by a fresh session of alice's (of bob's for "others"), and caller is alice, a wrong token
# or no token. Answered by the lane or sent the long way, the answer must be the same.
EXPRESS_CASES = {
    "submitted": ({"session": "SESSION", "input": "hi"}, {}, "alice"),
    "lowered priority": ({"session": "SESSION", "input": "hi", "priority": -5}, {}, "alice"),
    "unknown field": ({"session": "SESSION", "input": "hi", "bogus": 1}, {}, "alice"),
    "malformed": (b'{"session": ', {}, "alice"),
    "nul byte": ({"session": "SESSION", "input": "a\u0000b"}, {}, "alice"),
    "wrong type": ({"session": "SESSION", "input": "hi", "priority": "high"}, {}, "alice"),
    "not an object": (b"[]", {}, "alice"),
    "empty body": (b"", {}, "alice"),
    "deep": (b"[" * 5000 + b"]" * 5000, {}, "alice"),
    "another user's session": ({"session": "OTHERS", "input": "hi"}, {}, "alice"),
    "priority for staff only": ({"session": "SESSION", "input": "hi", "priority": 5}, {}, "alice"),
    "key too long": (
        {"session": "SESSION", "input": "hi"},
        {"idempotency-key": "k" * 201},
        "alice",
    ),
    "charset": (
        {"session": "SESSION", "input": "hi"},
        {"content-type": "application/json; charset=utf-8"},
        "alice",
    ),
    "wrong token": ({"session": "SESSION", "input": "hi"}, {}, "wrong"),
    "token with a space": (
        {"session": "SESSION", "input": "hi"},
        {"authorization": "Token two words"},
        "alice",
    ),
    "no token": ({"session": "SESSION", "input": "hi"}, {}, None),
    "html only": ({"session": "SESSION", "input": "hi"}, {"accept": "text/html"}, "alice"),
    "form": (b"session=x", {"content-type": "application/x-www-form-urlencoded"}, "alice"),
    "bad host": ({"session": "SESSION", "input": "hi"}, {"host": "evil.example"}, "alice"),
}
# Cases the lane answers itself (the others it sends the long way).
EXPRESS_TAKES = {
    "submitted",
    "lowered priority",
    "unknown field",
    "malformed",
    "nul byte",
    "wrong type",
    "not an object",
    "empty body",
    "deep",
    "another user's session",
    "priority for staff only",
    "key too long",
    "charset",
}


def _comparable(status: int, headers: list[Any], body: bytes) -> tuple[Any, ...]:
    """What must match: status, headers (the length aside: ids differ) and the body with
    the run's own values masked."""
    named = sorted(
        (n.decode().lower(), v.decode()) for n, v in headers if n.lower() != b"content-length"
    )
    data = json.loads(body) if body else None
    if isinstance(data, dict) and "id" in data:
        data = {k: "…" if k in {"id", "session", "created_at"} else v for k, v in data.items()}
    return status, named, data


async def _express_case(handler, name, alice, bob, make_session) -> tuple[Any, ...]:
    body, headers, caller = EXPRESS_CASES[name]
    mine = await sync_to_async(make_session)(alice)
    others = await sync_to_async(make_session)(bob)
    if isinstance(body, dict):
        body = json.dumps(body).replace("SESSION", str(mine.pk)).replace("OTHERS", str(others.pk))
        body = body.encode()
    token = {"alice": await _token(alice), "wrong": "0" * 40, None: None}[caller]
    answer: list[Any] = []
    status, content = await _request(
        handler, "POST", "/api/v1/runs/", token, body, headers=headers, answer=answer
    )
    return _comparable(status, answer, content)


def _recording_lane() -> tuple[ThreadedASGIHandler, list[bool]]:
    """A handler with the express lane, and the list it records into, per request it is
    offered, whether the lane answered it (False: sent the long way)."""
    lane = ThreadedASGIHandler()
    assert lane.express is not None
    answered: list[bool] = []
    answer = lane.express.answer

    def recording(route, request):
        response = answer(route, request)
        answered.append(response is not None)
        return response

    lane.express.answer = recording
    return lane, answered


@pytest.mark.parametrize("name", sorted(EXPRESS_CASES))
async def test_the_express_lane_answers_as_the_full_stack_does(name, alice, bob, make_session):
    lane, answered = _recording_lane()
    full = ThreadedASGIHandler()
    full.express = None
    expected = await _express_case(full, name, alice, bob, make_session)
    got = await _express_case(lane, name, alice, bob, make_session)
    assert got == expected
    assert any(answered) == (name in EXPRESS_TAKES)


async def test_the_express_lane_admits_without_the_middleware_chain_and_drf(alice, make_session):
    session = await sync_to_async(make_session)(alice)
    handler = ThreadedASGIHandler()
    handler.get_response = None  # the full stack would fail
    status, body = await _request(
        handler,
        "POST",
        "/api/v1/runs/",
        await _token(alice),
        {"session": str(session.pk), "input": "hi"},
    )
    assert status == 202, body
    run = await Run.objects.aget(session_id=session.pk)
    assert json.loads(body)["id"] == str(run.pk)


async def test_a_repeated_idempotency_key_answers_the_same_run_on_the_lane(alice, make_session):
    session = await sync_to_async(make_session)(alice)
    handler = ThreadedASGIHandler()
    token = await _token(alice)
    body = {"session": str(session.pk), "input": "hi"}
    first = await _request(
        handler, "POST", "/api/v1/runs/", token, body, headers={"idempotency-key": "k1"}
    )
    again = await _request(
        handler, "POST", "/api/v1/runs/", token, body, headers={"idempotency-key": "k1"}
    )
    assert (first[0], again[0]) == (202, 200)
    assert json.loads(first[1])["id"] == json.loads(again[1])["id"]
    assert await Run.objects.filter(session_id=session.pk).acount() == 1


def _lane_and_full() -> tuple[ThreadedASGIHandler, ThreadedASGIHandler]:
    """A handler with the express lane, and one that sends everything the long way."""
    full = ThreadedASGIHandler()
    full.express = None
    return ThreadedASGIHandler(), full


async def _submit_fresh(handler, user, token: str, make_session) -> tuple[Any, ...]:
    """Submit into a fresh session of ``user``'s; the answer as `_comparable` gives it."""
    session = await sync_to_async(make_session)(user)
    headers: list[Any] = []
    body = {"session": str(session.pk), "input": "hi"}
    status, content = await _request(handler, "POST", "/api/v1/runs/", token, body, answer=headers)
    return _comparable(status, headers, content)


async def test_a_full_queue_answers_429_on_the_lane_as_on_the_full_stack(
    alice, make_session, settings
):
    settings.SAGE = {**settings.SAGE, "SAGE_SERVER_MAX_PENDING_RUNS": 1}
    token = await _token(alice)
    lane, full = _lane_and_full()
    answers = [await _submit_fresh(h, alice, token, make_session) for h in (lane, lane, full)]
    assert [status for status, _, _ in answers] == [202, 429, 429]
    assert answers[1] == answers[2]
    assert "retry-after" in dict(answers[1][1])
    assert await Run.objects.acount() == 1


async def test_the_lane_reads_a_token_once_for_its_submissions(alice, make_session, monkeypatch):
    """The lane's token cache: the second submission of a token reads no token row (on
    PostgreSQL the admission's one statement checks the credential)."""
    from sageproject.authentication import TokenAuthentication

    reads = []
    row = TokenAuthentication._row

    def counting(self, key):
        reads.append(key)
        return row(self, key)

    monkeypatch.setattr(TokenAuthentication, "_row", counting)
    token = await _token(alice)
    lane = ThreadedASGIHandler()
    answers = [await _submit_fresh(lane, alice, token, make_session) for _ in range(3)]
    assert [status for status, _, _ in answers] == [202, 202, 202]
    assert reads == [token]


async def test_an_inactive_users_token_is_not_kept(alice, make_session):
    """Refused as inactive (401, the long way), the token is not cached: once the user is
    active again its next submission is admitted on the lane."""
    alice.is_active = False
    await sync_to_async(alice.save)()
    token = await _token(alice)
    lane, answered = _recording_lane()
    assert (await _submit_fresh(lane, alice, token, make_session))[0] == 401
    alice.is_active = True
    await sync_to_async(alice.save)()
    assert (await _submit_fresh(lane, alice, token, make_session))[0] == 202
    assert answered == [False, True]


async def test_an_error_whose_credential_cannot_be_checked_goes_the_long_way(
    alice, make_session, monkeypatch
):
    """A malformed body ends the request before its admission: its credential is checked
    on its own first; when that check fails (the database is down, say) the lane does not
    answer, and the long way gives DRF's answer."""
    from django.db import OperationalError

    from sagehost import express

    def down(*args, **kwargs):
        raise OperationalError("the database went away")

    token = await _token(alice)
    lane, answered = _recording_lane()
    full = _lane_and_full()[1]
    body = b'{"session": '
    await _submit_fresh(lane, alice, token, make_session)  # the token is cached now
    monkeypatch.setattr(express, "check_credential", down)
    answers = []
    for handler in (lane, full):
        headers: list[Any] = []
        status, content = await _request(
            handler, "POST", "/api/v1/runs/", token, body, answer=headers
        )
        answers.append(_comparable(status, headers, content))
    assert answers[0] == answers[1]
    assert answers[0][0] == 400
    assert answered == [True, False]


# What changes between a first submission (which puts alice's token row in the lane's cache)
# and a second one: (change, the second's body, its answer, whether it admits a run).
CHANGED_MEANWHILE = {
    "token deleted": ("token", {}, 401, False),
    "token deleted, then a malformed body": ("token", b'{"session": ', 401, False),
    "user deactivated": ("inactive", {}, 401, False),
    "staff flag removed": ("not staff", {"priority": 5}, 403, False),
    "staff flag given": ("staff", {"priority": 5}, 202, True),
    "nothing": (None, {}, 202, True),
}


@pytest.mark.parametrize("name", sorted(CHANGED_MEANWHILE))
async def test_the_lanes_cached_token_grants_nothing_the_database_no_longer_does(
    name, alice, make_session
):
    """The lane authenticates from its cache and the admission checks the credential again:
    a change made after the token was cached is answered as the full stack answers it, and
    a refused credential admits nothing."""
    change, body, status, admitted = CHANGED_MEANWHILE[name]
    alice.is_staff = change == "not staff"
    await sync_to_async(alice.save)()
    token = await _token(alice)
    lane = ThreadedASGIHandler()
    first = await _submit_fresh(lane, alice, token, make_session)
    assert first[0] == 202
    session = await sync_to_async(make_session)(alice)
    if change == "token":
        await Token.objects.filter(key=token).adelete()
    elif change is not None:
        alice.is_active = change != "inactive"
        alice.is_staff = change == "staff"
        await sync_to_async(alice.save)()
    if isinstance(body, dict):
        body = json.dumps({"session": str(session.pk), "input": "hi", **body}).encode()
    got, full = [], []
    for handler, headers in ((lane, got), (_lane_and_full()[1], full)):
        answer = await _request(handler, "POST", "/api/v1/runs/", token, body, answer=headers)
        headers[:] = _comparable(answer[0], headers, answer[1])
    assert got == full
    assert got[0] == status
    assert await Run.objects.filter(session_id=session.pk).acount() == (2 if admitted else 0)


def test_the_express_lane_is_off_with_a_middleware_it_does_not_know(settings):
    from sagehost.express import Express

    assert Express.configured() is not None
    settings.MIDDLEWARE = [*settings.MIDDLEWARE, "example.middleware.Unknown"]
    assert Express.configured() is None


@pytest.mark.parametrize("where", ["authentication", "admission"])
async def test_an_unexpected_error_is_the_same_500_envelope_on_the_lane(
    where, alice, make_session, monkeypatch
):
    from django.db import OperationalError

    from agents import services
    from sageproject.authentication import TokenAuthentication

    def down(*args, **kwargs):
        raise OperationalError("the database went away")

    token = await _token(alice)
    if where == "authentication":
        monkeypatch.setattr(TokenAuthentication, "_row", down)
    else:
        monkeypatch.setattr(services, "run_submit", down)
    answers = [await _submit_fresh(h, alice, token, make_session) for h in _lane_and_full()]
    assert answers[0] == answers[1]
    assert answers[0][0] == 500
    assert answers[0][2]["error"]["code"] == "server.internal"
    assert "went away" not in json.dumps(answers[0][2])


async def test_a_whole_response_is_sent_with_every_header_and_a_cookie_is_not_lost():
    from django.http import HttpResponse

    handler = ThreadedASGIHandler()
    for cookie in (False, True):
        response = HttpResponse(b'{"a": 1}', status=202, content_type="application/json")
        response["X-Frame-Options"] = "DENY"
        if cookie:
            response.set_cookie("flavour", "oat")
        sent: list[dict[str, Any]] = []

        async def send(message: dict[str, Any], sent: list = sent) -> None:
            sent.append(message)

        await handler._send_whole(response, send)
        start, *bodies = sent
        assert start["status"] == 202
        headers = dict(start["headers"])
        assert headers[b"Content-Type"] == b"application/json"
        assert headers[b"X-Frame-Options"] == b"DENY"
        assert (b"Set-Cookie" in headers) is cookie
        assert b"".join(m.get("body", b"") for m in bodies) == b'{"a": 1}'
        assert not bodies[-1].get("more_body", False)
