"""The catalogue of broken upstreams, through the official SDKs, against a real HTTP server.

Every fault of ``tests.pooling.upstream.FAULTS`` must end a stream with the documented
``UpstreamError`` — never a successful ``StreamEnd``, never an exception of another type —
whose message and details hold nothing from the body, while the body (redacted) is in the
``sage.upstream`` log.
"""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest

from pooling.providers import ModelRequest, StreamEnd, TextDelta, get_adapter
from pooling.providers.errors import DEFAULT_RETRY_AFTER_SECONDS
from sageproject.errors import ErrorCategory, UpstreamError
from tests.pooling.helpers import failure
from tests.pooling.upstream import (  # noqa: F401  (upstream_fixture registers "upstream")
    FAULTS,
    RawStream,
    Reply,
    UpstreamServer,
    fault_catalogue,
    upstream_fixture,
)

# Not shaped like any known key: only the record's own secrets can redact it.
API_KEY = "alice-key-7Qm2vX9pL4"
OTHER_KEY = "sk-proj-Zx81TRACEotherkey"
HELLO = ModelRequest(model="test-model", messages=({"role": "user", "content": "Say hello"},))
INVALID = "invalid response from the provider (status 200, "

# fault -> (code, retryable, message, a marker of the body the log must hold, or None)
EXPECTED: dict[str, tuple[str, bool, str, str | None]] = {
    "html_502": (
        "upstream.error", True, "the provider failed (status 502, HTML error page)",
        "nginx/1.25.3",
    ),
    "garbage_json_200": (
        "upstream.error", True, INVALID + "not an event stream)", "TRACE-garbage-5e1d",
    ),
    "html_200": ("upstream.error", True, INVALID + "not an event stream)", "TRACE-portal-77aa"),
    "eventless_stream_200": ("upstream.error", True, INVALID + "no events)", None),
    "broken_event_stream": (
        "upstream.error", True, INVALID + "broken event stream)", "TRACE-broken-31c0",
    ),
    "non_utf8_bytes": ("upstream.error", True, INVALID + "not UTF-8)", "TRACE-bytes"),
    "rate_limited_with_retry_after": (
        "upstream.rate_limited", True,
        "the provider's rate limit was reached; retry later (status 429, rate_limit_exceeded)",
        "TRACE-org-4411",
    ),
    "rate_limited_without_retry_after": (
        "upstream.rate_limited", True,
        "the provider's rate limit was reached; retry later (status 429, rate_limit_exceeded)",
        "TRACE-org-4411",
    ),
    "unauthorized_echoing_the_key": (
        "upstream.auth", False,
        "the provider rejected the credentials (status 401, invalid_api_key)",
        "TRACE-auth-0c3e",
    ),
    "connection_reset": ("upstream.error", True, "upstream connection failed", None),
    "stops_mid_token": ("upstream.error", True, INVALID + "stream ended early)", None),
}
# A connection dropped inside an event: the openai SDK reports a failed connection, the
# anthropic SDK lets the transport's error through (a connection lost mid-stream).
DROPPED_MID_EVENT = {
    "openai": "upstream connection failed",
    "anthropic": "upstream connection lost",
}
# Text of the bodies that must never leave the log.
BODY_TEXT = ("TRACE", "nginx", "Bad Gateway", "Hotel Wi-Fi", "portal.example", "<html",
             "Rate limit reached", "Incorrect API key", API_KEY, OTHER_KEY)


def test_it_expects_something_of_every_fault_in_the_catalogue():
    assert set(EXPECTED) == set(FAULTS)


@pytest.fixture(params=["openai", "anthropic"])
def protocol(request):
    return request.param


@pytest.fixture
async def client(upstream, protocol):
    adapter = get_adapter(protocol)
    record = SimpleNamespace(id=7, protocol=protocol, base_url=upstream.base_url(protocol),
                             model="test-model", api_key=API_KEY, options={"timeout": 10})
    client = await adapter.create_client(record)
    yield client
    await adapter.close_client(client)


async def stream_fault(upstream: UpstreamServer, protocol: str, client, fault: str,
                       caplog) -> tuple[list, BaseException]:
    upstream.enqueue(fault_catalogue(API_KEY)[fault])
    with caplog.at_level(logging.DEBUG):
        return await failure(protocol, client, HELLO, Exception)


@pytest.mark.parametrize("fault", FAULTS)
async def test_it_fails_each_fault_with_its_documented_error(upstream, protocol, client,
                                                             fault, caplog):
    received, error = await stream_fault(upstream, protocol, client, fault, caplog)
    code, retryable, message, _ = EXPECTED[fault]
    assert isinstance(error, UpstreamError), repr(error)
    assert (error.code, error.retryable, error.message) == (code, retryable, message)
    assert not any(isinstance(item, StreamEnd) for item in received)


@pytest.mark.parametrize("fault", FAULTS)
async def test_it_keeps_the_body_out_of_the_error(upstream, protocol, client, fault, caplog):
    _, error = await stream_fault(upstream, protocol, client, fault, caplog)
    exposed = json.dumps(error.to_dict())
    for text in BODY_TEXT:
        assert text not in exposed


@pytest.mark.parametrize("fault", [f for f in FAULTS if EXPECTED[f][3] is not None])
async def test_it_logs_the_body_to_the_server_log(upstream, protocol, client, fault, caplog):
    await stream_fault(upstream, protocol, client, fault, caplog)
    logged = [r.getMessage() for r in caplog.records
              if r.name == "sage.upstream" and r.levelno == logging.WARNING]
    assert any(EXPECTED[fault][3] in line for line in logged), logged


@pytest.mark.parametrize("fault", FAULTS)
async def test_it_never_logs_the_records_key_or_anything_shaped_like_one(
    upstream, protocol, client, fault, caplog
):
    await stream_fault(upstream, protocol, client, fault, caplog)
    assert caplog.records
    everything = caplog.text + "\n".join(r.getMessage() for r in caplog.records)
    assert API_KEY not in everything
    assert OTHER_KEY not in everything


async def test_it_makes_a_429_with_retry_after_resumable_after_its_delay(
    upstream, protocol, client, caplog
):
    _, error = await stream_fault(upstream, protocol, client, "rate_limited_with_retry_after",
                                  caplog)
    assert (error.category, error.resumable) == (ErrorCategory.RATE_LIMITED, True)
    assert error.details == {"status": 429, "retry_after": 17.0}


async def test_it_gives_a_429_without_retry_after_the_documented_default_delay(
    upstream, protocol, client, caplog
):
    _, error = await stream_fault(upstream, protocol, client,
                                  "rate_limited_without_retry_after", caplog)
    assert (error.category, error.resumable) == (ErrorCategory.RATE_LIMITED, True)
    assert error.details == {"status": 429, "retry_after": DEFAULT_RETRY_AFTER_SECONDS}


async def test_it_passes_on_the_text_of_a_stream_that_stops_mid_token_but_never_ends_it(
    upstream, protocol, client, caplog
):
    received, error = await stream_fault(upstream, protocol, client, "stops_mid_token", caplog)
    assert received == [TextDelta(text="Partial "), TextDelta(text="answer")]
    assert error.code == "upstream.error"


async def test_it_passes_on_the_text_of_a_stream_dropped_mid_token_and_fails_it(
    upstream, protocol, client
):
    upstream.enqueue(Reply(text="Partial answer", cut_mid_event=True, drop_after_text=True))
    received, error = await failure(protocol, client, HELLO)
    assert received == [TextDelta(text="Partial "), TextDelta(text="answer")]
    assert (error.code, error.retryable, error.message) == (
        "upstream.error", True, DROPPED_MID_EVENT[protocol]
    )


@pytest.mark.parametrize(("chunk", "label"), [
    ('data: [1, 2]\n\nevent: content_block_start\ndata: {"type": "content_block_start", '
     '"index": 0}\n\n', "malformed event"),
    ('data: {"choices": [{"index": 0, "delta": {"content": 5}}]}\n\n'
     'event: content_block_delta\ndata: {"type": "content_block_delta", "index": 0, '
     '"delta": {"type": "text_delta", "text": 5}}\n\n', "malformed event"),
])
async def test_it_reports_an_event_of_the_wrong_shape_as_an_invalid_response(
    upstream, protocol, client, chunk, label
):
    upstream.enqueue(RawStream(chunks=(chunk,)))
    _, error = await failure(protocol, client, HELLO)
    assert (error.code, error.retryable) == ("upstream.error", True)
    assert error.message == f"{INVALID}{label})"
