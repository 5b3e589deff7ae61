"""The upstream fault catalogue: a run against each broken upstream ends as documented.

Each case is an ``openai``-protocol model record pointing at a real HTTP server on
loopback, ``tests.pooling.upstream.UpstreamServer``, scripted with the case's replies. A
run is submitted through the API and followed through the API until it ends (or suspends):

- garbage, HTML, a broken or non-UTF-8 event stream, a 502 page, a reset, a cut or dropped
  stream: ``failed`` with ``upstream.error``, retryable;
- 401: ``failed`` with ``upstream.auth``, not retryable;
- 429, with and without ``Retry-After``: ``suspended`` with a resumable
  ``upstream.rate_limited`` interaction; the reply ``retry`` then completes the run against
  the recovered upstream.

Every body carries a unique marker outside the part a reason may be parsed from (an HTML
page's title, an error envelope's message); the marker must reach no API response about
the run: the run, its events, its archive, its session's export.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.conftest import demo_manifest
from tests.pooling.upstream import (  # noqa: F401  (upstream_fixture registers "upstream")
    AnyReply,
    ErrorReply,
    Reply,
    Reset,
    UpstreamServer,
    upstream_fixture,
)
from tests.torture.host import TERMINAL, LiveHost, make_user

CHECK = "upstream-faults"
pytestmark = [pytest.mark.torture, pytest.mark.django_db(transaction=True)]

MARK = f"zqx{uuid.uuid4().hex[:12]}"


def _page(marker: str) -> str:
    return (
        "<!DOCTYPE html><html><head><title>502 Bad Gateway</title></head><body>"
        f"<h1>502 Bad Gateway</h1><p>request id {marker}</p><hr>nginx</body></html>"
    )


def _envelope(message: str, marker: str, code: str) -> str:
    import json

    return json.dumps(
        {"error": {"message": message, "type": "error", "param": marker, "code": code}}
    )


def _chunk(content: str) -> str:
    return (
        '{"id":"chatcmpl-t","object":"chat.completion.chunk","created":0,"model":"m",'
        f'"choices":[{{"index":0,"delta":{{"content":"{content}"}},"finish_reason":null}}]}}'
    )


_DONE = (
    'data: {"id":"chatcmpl-t","object":"chat.completion.chunk","created":0,"model":"m",'
    '"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'
)


@dataclass(frozen=True, slots=True)
class Case:
    replies: tuple[AnyReply, ...] = ()  # UpstreamServer's queue, then `default`
    default: AnyReply | None = None
    code: str = "upstream.error"
    retryable: bool = True
    suspends: bool = False


def _cases(m: str) -> dict[str, Case]:
    rate_limited = _envelope("Rate limit reached for requests", m, "rate_limit_exceeded")
    return {
        "502-html": Case(default=ErrorReply(status=502, body=_page(m))),
        "200-garbage": Case(
            default=ErrorReply(
                status=200, body=f"{{garbage {m} ]]\x00", content_type="application/json"
            )
        ),
        "200-html": Case(default=ErrorReply(status=200, body=_page(m), content_type="text/html")),
        "broken-stream": Case(
            default=ErrorReply(
                status=200,
                body=f'data: {_chunk("Hi")}\n\ndata: {{"choices": [{{"delta": {m}\n\n',
                content_type="text/event-stream",
            )
        ),
        "non-utf8": Case(
            default=ErrorReply(
                status=200,
                body=(f"data: {_chunk('@@')}\n\n{_DONE}")
                .encode()
                .replace(b"@@", b"\xff\xfe\xc3(" + m.encode()),
                content_type="text/event-stream; charset=utf-8",
            )
        ),
        "429-retry-after": Case(
            replies=(ErrorReply(status=429, body=rate_limited, headers={"Retry-After": "7"}),),
            default=Reply(text="recovered"),
            code="upstream.rate_limited",
            suspends=True,
        ),
        "429-no-retry-after": Case(
            replies=(ErrorReply(status=429, body=rate_limited),),
            default=Reply(text="recovered"),
            code="upstream.rate_limited",
            suspends=True,
        ),
        "401": Case(
            default=ErrorReply(
                status=401, body=_envelope("Incorrect API key provided", m, "invalid_api_key")
            ),
            code="upstream.auth",
            retryable=False,
        ),
        "connection-reset": Case(default=Reset()),
        "cut-mid-token": Case(default=Reply(text="Hel", cut_mid_event=True, drop_after_text=True)),
        "stream-dropped": Case(default=Reply(text=f"partial answer {m}", drop_after_text=True)),
    }


CASES = _cases(MARK)


def _leaks(api: httpx.Client, run: dict[str, Any], marker: str) -> list[str]:
    """The API responses about ``run`` whose text holds ``marker``."""
    urls = [
        f"/api/v1/runs/{run['id']}/",
        f"/api/v1/sessions/{run['session']}/events/?limit=200",
        f"/api/v1/archives/{run['id']}/",
        f"/api/v1/sessions/{run['session']}/export/",
        f"/api/v1/runs/?session={run['session']}",
    ]
    return [url for url in urls if marker in api.get(url).text]


@pytest.mark.parametrize("case", list(CASES))
def test_a_broken_upstream_ends_the_run_as_documented(
    case: str,
    live_host: LiveHost,
    upstream: UpstreamServer,
    figures: dict[str, Any],
) -> None:
    from agents.services import packages

    spec = CASES[case]
    live_host.ensure_worker()
    upstream.default = spec.default or Reply()
    upstream.enqueue(*spec.replies)
    user, token = make_user(f"faults-{case}")
    upstream.model_record(
        owner=user, name="faulty", api_key="sk-torture-faults", model="torture", timeout=15
    )
    name = f"faults-{case}"
    manifest = demo_manifest(name=name, model="faulty", tools=[])
    packages.package_create(owner=user, manifest=manifest)

    began = time.monotonic()
    with live_host.client(token) as api:
        session = api.post("/api/v1/sessions/", json={"package": name, "agent": "assistant"})
        assert session.status_code == 201, session.text
        submitted = api.post(
            "/api/v1/runs/", json={"session": session.json()["id"], "input": "hello"}
        )
        assert submitted.status_code == 202, submitted.text
        run = live_host.wait_run(api, submitted.json()["id"], until=TERMINAL | {"suspended"})
        first = run
        error = run.get("interaction") if run["status"] == "suspended" else run.get("error")
        error = error or {}
        resumed_status = None
        if spec.suspends and run["status"] == "suspended":
            reply = api.post(f"/api/v1/runs/{run['id']}/reply/", json={"decision": "retry"})
            assert reply.status_code == 202, reply.text
            run = live_host.wait_run(api, run["id"])
            resumed_status = run["status"]
        leaks = _leaks(api, run, MARK)
    figures.update(
        status=first["status"],
        code=error.get("code"),
        retryable=error.get("retryable"),
        requests=len(upstream.requests),
        leaked_into=leaks,
        seconds=round(time.monotonic() - began, 1),
    )
    if resumed_status is not None:
        figures["after_retry"] = resumed_status

    assert upstream.requests, "the upstream was never asked: the case tested nothing"
    assert not leaks, f"the upstream body reached {leaks}"
    if spec.suspends:
        assert first["status"] == "suspended", first
        assert error.get("code") == spec.code and error.get("resumable") is True, error
        assert resumed_status == "completed", run
    else:
        assert first["status"] in ("failed", "suspended"), first
        assert error.get("code") == spec.code, error
        assert error.get("retryable") is spec.retryable, error
