"""The web process's ASGI handler (`sageproject.handler`): a request's middleware and view
run on a pool thread, several requests of one process at once, and the session event
stream is still sent from the event loop."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from asgiref.testing import ApplicationCommunicator
from rest_framework.authtoken.models import Token

from sageproject.handler import ThreadedASGIHandler
from scheduling.models import Run

pytestmark = pytest.mark.django_db(transaction=True)


def _scope(method: str, path: str, token: str, query: str, length: int) -> dict[str, Any]:
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
        "headers": [
            (b"host", b"127.0.0.1"),
            (b"authorization", f"Token {token}".encode()),
            (b"content-type", b"application/json"),
            (b"content-length", str(length).encode()),
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }


async def _request(
    handler: ThreadedASGIHandler, method: str, path: str, token: str, body: Any = None, query=""
) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else b""
    app = ApplicationCommunicator(handler, _scope(method, path, token, query, len(data)))
    await app.send_input({"type": "http.request", "body": data, "more_body": False})
    start = await app.receive_output(timeout=10)
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
