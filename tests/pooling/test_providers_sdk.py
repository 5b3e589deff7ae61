"""The openai and anthropic adapters, through the official SDKs, against a real HTTP server.

Every test here reaches ``tests.pooling.upstream.UpstreamServer`` on loopback through the
adapter's SDK client; nothing is mocked inside the SDKs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
from types import SimpleNamespace

import pytest

from pooling.providers import (
    ModelRequest,
    StreamEnd,
    TextDelta,
    ToolCall,
    ToolCallDelta,
    get_adapter,
)
from sageproject.errors import ErrorCategory
from tests.pooling.helpers import CALCULATOR, collect, failure, text_of, texts, through_the_package
from tests.pooling.upstream import (  # noqa: F401  (upstream_fixture registers "upstream")
    HTML_502,
    ErrorReply,
    Reply,
    UpstreamServer,
    anthropic_error,
    gemini_error,
    mistral_error,
    ollama_error,
    openai_error,
    upstream_fixture,
)

PROTOCOLS = ["openai", "anthropic"]
API_KEY = "sk-test-alice-0123456789"
HELLO = ModelRequest(model="test-model", system="Be brief.",
                     messages=({"role": "user", "content": "Say hello"},))


def make_record(url: str, protocol: str, **options):
    return SimpleNamespace(id=7, protocol=protocol, base_url=url, model="test-model",
                           api_key=API_KEY, options=options)


@pytest.fixture(params=PROTOCOLS)
def protocol(request):
    return request.param


@contextlib.asynccontextmanager
async def sdk_client(protocol: str, url: str, **options):
    """A client of ``protocol``'s adapter for a record at ``url``, closed on exit."""
    adapter = get_adapter(protocol)
    client = await adapter.create_client(make_record(url, protocol, **options))
    try:
        yield client
    finally:
        await adapter.close_client(client)


@pytest.fixture
async def client(upstream, protocol):
    async with sdk_client(protocol, upstream.base_url(protocol)) as client:
        yield client


async def sent_for(upstream: UpstreamServer, protocol: str, request: ModelRequest):
    """The one request streaming ``request`` through a fresh ``protocol`` client sent."""
    async with sdk_client(protocol, upstream.base_url(protocol)) as client:
        await collect(protocol, client, request)
    (sent,) = upstream.requests
    return sent


# -- streaming ---------------------------------------------------------------------------


async def test_it_streams_text_deltas_in_order(upstream, protocol, client):
    upstream.enqueue(Reply(text="Hello there, Alice!"))
    items = await collect(protocol, client, HELLO)
    assert texts(items) == ["Hello ", "there, ", "Alice!"]


async def test_it_ends_with_usage_and_end_turn(upstream, protocol, client):
    upstream.enqueue(Reply(text="Hi", usage=(21, 4)))
    items = await collect(protocol, client, HELLO)
    assert items[-1] == StreamEnd(stop_reason="end_turn",
                                  usage={"input_tokens": 21, "output_tokens": 4})


async def test_it_assembles_a_tool_call_from_fragmented_arguments(upstream, protocol, client):
    upstream.enqueue(Reply(text="Let me compute.", fragments=7, tool_calls=(
        {"id": "call_abc", "name": "calculator", "arguments": {"expression": "(2 + 3) * 4"}},)))
    items = await collect(protocol, client, ModelRequest(
        model="m", messages=HELLO.messages, tools=(CALCULATOR,)))
    calls = [i for i in items if isinstance(i, ToolCall)]
    assert calls == [ToolCall(id="call_abc", name="calculator",
                              arguments={"expression": "(2 + 3) * 4"})]
    assert items[-1].stop_reason == "tool_use"


async def test_it_passes_argument_fragments_on_before_the_complete_call(
    upstream, protocol, client
):
    upstream.enqueue(Reply(text="", fragments=5, tool_calls=(
        {"id": "c1", "name": "calculator", "arguments": {"expression": "(2 + 3) * 4"}},
        {"id": "c2", "name": "clock", "arguments": {"zone": "UTC"}},
    )))
    items = await collect(protocol, client, ModelRequest(
        model="m", messages=HELLO.messages, tools=(CALCULATOR,)))
    deltas = [i for i in items if isinstance(i, ToolCallDelta)]
    by_call: dict[int, list[ToolCallDelta]] = {}
    for delta in deltas:
        by_call.setdefault(delta.index, []).append(delta)
    assert len(by_call) == 2 and all(len(pieces) > 1 for pieces in by_call.values())
    joined = {
        (pieces[-1].id, pieces[-1].name): json.loads("".join(p.arguments for p in pieces))
        for pieces in by_call.values()
    }
    assert joined == {("c1", "calculator"): {"expression": "(2 + 3) * 4"},
                      ("c2", "clock"): {"zone": "UTC"}}
    # Each call's pieces come before the call itself.
    for call in (i for i in items if isinstance(i, ToolCall)):
        last_piece = max(n for n, i in enumerate(items)
                         if isinstance(i, ToolCallDelta) and i.id == call.id)
        assert last_piece < items.index(call)


async def test_it_keeps_several_tool_calls_apart_and_in_order(upstream, protocol, client):
    upstream.enqueue(Reply(text="", fragments=4, tool_calls=(
        {"id": "c1", "name": "calculator", "arguments": {"expression": "1+1"}},
        {"id": "c2", "name": "clock", "arguments": {}},
        {"id": "c3", "name": "calculator", "arguments": {"expression": "9/3"}},
    )))
    items = await collect(protocol, client, HELLO)
    assert [(i.id, i.name, i.arguments) for i in items if isinstance(i, ToolCall)] == [
        ("c1", "calculator", {"expression": "1+1"}),
        ("c2", "clock", {}),
        ("c3", "calculator", {"expression": "9/3"}),
    ]


async def test_it_keeps_unparseable_arguments_raw(upstream, protocol, client):
    upstream.enqueue(Reply(text="", tool_calls=(
        {"id": "c1", "name": "calculator", "arguments": '{"expression": "1+'},)))
    items = await collect(protocol, client, HELLO)
    assert [i.arguments for i in items if isinstance(i, ToolCall)] == [
        {"_raw": '{"expression": "1+'}]


async def test_it_sends_the_api_key(upstream, protocol, client):
    await collect(protocol, client, HELLO)
    headers = upstream.requests[0].headers
    # Both SDKs (anthropic since 2.x) send the key as a bearer token.
    assert headers.get("authorization") == f"Bearer {API_KEY}" or (
        protocol == "anthropic" and headers.get("x-api-key") == API_KEY
    )


async def test_it_sends_no_request_when_building_a_client(upstream, protocol, client):
    assert upstream.requests == []


async def test_it_lets_the_consumer_stop_a_stream_early(upstream, protocol, client):
    gate = threading.Event()
    upstream.enqueue(Reply(text="one two three", gate=gate))
    stream = get_adapter(protocol).stream(client, HELLO)
    first = await anext(stream)
    # Closing while the server still holds the rest of the reply must not wait for it.
    await stream.aclose()
    assert first == TextDelta(text="one ")
    gate.set()


# -- request shape -----------------------------------------------------------------------

TOOL_LOOP = ModelRequest(
    model="test-model",
    system="You are a calculator.",
    messages=(
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "Computing.",
         "tool_calls": [{"id": "call_1", "name": "calculator",
                         "arguments": {"expression": "2+2"}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "calculator", "content": "4"},
    ),
    tools=(CALCULATOR,),
    max_tokens=321,
    options={"temperature": 0.2, "not_a_parameter": True},
)


async def test_it_sends_the_conversation_in_chat_completions_shape(upstream):
    sent = await sent_for(upstream, "openai", TOOL_LOOP)
    body = sent.json
    assert sent.path == "/v1/chat/completions"
    assert body["messages"] == [
        {"role": "system", "content": "You are a calculator."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "Computing.",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "calculator",
                                      "arguments": '{"expression": "2+2"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "4"},
    ]
    assert body["tools"] == [{"type": "function", "function": {
        "name": "calculator", "description": CALCULATOR.description,
        "parameters": CALCULATOR.parameters}}]
    assert (body["stream"], body["stream_options"]) == (True, {"include_usage": True})
    assert (body["max_tokens"], body["temperature"]) == (321, 0.2)
    assert "not_a_parameter" not in body


async def test_it_sends_the_conversation_in_messages_shape(upstream):
    sent = await sent_for(upstream, "anthropic", TOOL_LOOP)
    body = sent.json
    assert sent.path == "/v1/messages"
    assert body["system"] == "You are a calculator."
    assert body["messages"] == [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Computing."},
            {"type": "tool_use", "id": "call_1", "name": "calculator",
             "input": {"expression": "2+2"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "call_1", "content": "4"}]},
    ]
    assert body["tools"] == [{"name": "calculator", "description": CALCULATOR.description,
                              "input_schema": CALCULATOR.parameters}]
    assert (body["stream"], body["max_tokens"], body["temperature"]) == (True, 321, 0.2)
    assert "not_a_parameter" not in body


# -- errors ------------------------------------------------------------------------------

REJECTED = "the provider rejected the request (status 400"
ENVELOPES = [
    ("openai", openai_error("Invalid 'messages': empty array", code="invalid_value"),
     f"{REJECTED}, invalid_value)"),
    ("openai", ollama_error("model \"llama9\" not found, try pulling it first"), f"{REJECTED})"),
    ("openai", gemini_error("Request contains an invalid argument."),
     f"{REJECTED}, INVALID_ARGUMENT)"),
    ("openai", mistral_error("Prompt contains 40000 tokens, too large for model"),
     f"{REJECTED}, invalid_request_error)"),
    ("openai", json.dumps({"detail": "Model not found"}), f"{REJECTED})"),
    ("anthropic", anthropic_error("max_tokens: must be positive"),
     f"{REJECTED}, invalid_request_error)"),
    ("anthropic", openai_error("route not allowed", type="gateway_error"),
     f"{REJECTED}, gateway_error)"),
]


@pytest.mark.parametrize(("protocol", "body", "message"), ENVELOPES)
async def test_it_turns_an_error_envelope_into_our_message_and_its_code(
    upstream, protocol, body, message, client
):
    upstream.enqueue(ErrorReply(status=400, body=body))
    received, error = await failure(protocol, client, HELLO)
    assert received == []
    assert (error.code, error.message, error.retryable) == ("upstream.error", message, False)
    assert error.details == {"status": 400}


async def test_it_reports_an_html_502_as_a_retryable_error(upstream, protocol, client):
    upstream.enqueue(ErrorReply(status=502, body=HTML_502))
    _, error = await failure(protocol, client, HELLO)
    assert (error.code, error.category, error.retryable) == (
        "upstream.error", ErrorCategory.UPSTREAM, True)
    assert error.message == "the provider failed (status 502, HTML error page)"


async def test_it_reports_429_with_retry_after(upstream, protocol, client):
    upstream.enqueue(ErrorReply(status=429, body=openai_error("Rate limit reached",
                                                              type="requests"),
                                headers={"Retry-After": "17"}))
    _, error = await failure(protocol, client, HELLO)
    assert (error.code, error.category, error.retryable, error.resumable) == (
        "upstream.rate_limited", ErrorCategory.RATE_LIMITED, True, True)
    assert error.details == {"status": 429, "retry_after": 17.0}


async def test_it_reports_401_as_a_final_auth_error(upstream, protocol, client):
    upstream.enqueue(ErrorReply(status=401, body=anthropic_error(
        "invalid x-api-key", type="authentication_error")))
    _, error = await failure(protocol, client, HELLO)
    assert (error.code, error.category, error.retryable) == (
        "upstream.auth", ErrorCategory.UPSTREAM, False)
    assert error.message == (
        "the provider rejected the credentials (status 401, authentication_error)"
    )


async def test_it_reports_403_as_a_final_auth_error(upstream, protocol, client):
    upstream.enqueue(ErrorReply(status=403, body=HTML_502.replace("502 Bad Gateway",
                                                                   "403 Forbidden")))
    _, error = await failure(protocol, client, HELLO)
    assert (error.code, error.retryable) == ("upstream.auth", False)
    assert error.message == "the provider rejected the credentials (status 403, HTML error page)"


async def test_it_uses_our_message_alone_for_an_unrecognised_body(upstream, protocol, client):
    upstream.enqueue(ErrorReply(status=503, body="upstream connect error or disconnect",
                                content_type="text/plain"))
    _, error = await failure(protocol, client, HELLO)
    assert (error.code, error.retryable) == ("upstream.error", True)
    assert error.message == "the provider failed (status 503)"


async def test_it_sends_exactly_one_request_for_a_failing_call(upstream, protocol, client):
    # SDK retries are off: retrying is the run's decision, not the SDK's.
    upstream.enqueue(ErrorReply(status=503, body=HTML_502), ErrorReply(status=503, body=HTML_502))
    await failure(protocol, client, HELLO)
    assert len(upstream.requests) == 1


async def test_it_logs_the_raw_body_but_never_returns_it(upstream, protocol, client, caplog):
    body = openai_error("The server had an error processing your request.",
                        type="server_error") + "\n<!-- trace 5f1e-internal-node-42 -->"
    upstream.enqueue(ErrorReply(status=500, body=body, content_type="application/json"))
    with caplog.at_level(logging.WARNING, logger="sage.upstream"):
        _, error = await failure(protocol, client, HELLO)
    assert "5f1e-internal-node-42" not in json.dumps(error.to_dict())
    assert error.message == "the provider failed (status 500)"
    logged = [r.getMessage() for r in caplog.records if r.name == "sage.upstream"]
    assert any("5f1e-internal-node-42" in line for line in logged)


async def test_it_reports_an_error_event_inside_the_stream(upstream, protocol, client):
    upstream.enqueue(Reply(text="Partial answer", error_after_text={
        "type": "overloaded_error", "message": "Overloaded TRACE-31"}))
    received, error = await failure(protocol, client, HELLO)
    assert [i.text for i in received] == ["Partial ", "answer"]
    assert (error.code, error.retryable) == ("upstream.error", True)
    # Anthropic's error event maps to the status its type has as an HTTP response.
    status = "status 529, " if protocol == "anthropic" else ""
    assert error.message == f"the provider failed ({status}overloaded_error)"


async def test_it_reports_a_dropped_stream_as_retryable(upstream, protocol, client):
    upstream.enqueue(Reply(text="cut off here", drop_after_text=True))
    received, error = await failure(protocol, client, HELLO)
    assert len(received) == 3
    assert (error.code, error.retryable) == ("upstream.error", True)


@pytest.mark.timing
async def test_it_reports_a_read_timeout_as_retryable(upstream, protocol):
    gate = threading.Event()
    upstream.enqueue(Reply(text="slow reply here", gate=gate))
    async with sdk_client(protocol, upstream.base_url(protocol), timeout=0.3) as client:
        try:
            received, error = await failure(protocol, client, HELLO)
        finally:
            gate.set()
    assert received == [TextDelta(text="slow ")]
    assert (error.code, error.message, error.retryable) == (
        "upstream.error", "upstream timed out", True)


def refused_url() -> str:
    # Bind then close: nothing listens on this port afterwards, so connecting is refused.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


async def test_it_reports_connection_refused_as_retryable(protocol, caplog):
    url = refused_url()
    async with sdk_client(protocol, url + "/v1" if protocol == "openai" else url) as client:
        with caplog.at_level(logging.WARNING, logger="sage.upstream"):
            received, error = await failure(protocol, client, HELLO)
    assert received == []
    assert (error.code, error.category, error.retryable) == (
        "upstream.error", ErrorCategory.UPSTREAM, True)
    assert error.message == "upstream connection failed"
    assert error.details == {"status": None}
    assert "upstream connection failed" in caplog.text


async def test_it_closes_the_client(upstream, protocol):
    adapter = get_adapter(protocol)
    client = await adapter.create_client(make_record(upstream.base_url(protocol), protocol))
    await adapter.close_client(client)
    assert client.is_closed()


async def test_it_serves_concurrent_streams_on_one_client(upstream, protocol, client):
    upstream.enqueue(*(Reply(text=f"reply {n}") for n in range(5)))
    results = await asyncio.gather(*(collect(protocol, client, HELLO) for _ in range(5)))
    assert sorted(text_of(r) for r in results) == [f"reply {n}" for n in range(5)]


@pytest.mark.parametrize(("protocol", "vendor_reason"), [("openai", "length"),
                                                          ("anthropic", "max_tokens")])
async def test_it_normalizes_a_truncated_reply_to_max_tokens(upstream, protocol, vendor_reason,
                                                             client):
    upstream.enqueue(Reply(text="cut", stop_reason=vendor_reason))
    items = await collect(protocol, client, HELLO)
    assert items[-1].stop_reason == "max_tokens"


async def test_it_reports_tool_use_when_a_server_finishes_tool_calls_with_stop(upstream):
    # Ollama's OpenAI-compatible endpoint ends a tool-calling turn with finish_reason "stop".
    upstream.enqueue(Reply(text="", stop_reason="stop",
                           tool_calls=({"name": "clock", "arguments": {}},)))
    async with sdk_client("openai", upstream.openai_base_url) as client:
        items = await collect("openai", client, HELLO)
    assert [i for i in items if isinstance(i, ToolCall)] == [
        ToolCall(id="call_fake_0", name="clock", arguments={})]
    assert items[-1].stop_reason == "tool_use"


async def test_it_builds_and_closes_clients_through_the_package_helpers(upstream, protocol):
    upstream.enqueue(Reply(text="pooled"))
    record = make_record(upstream.base_url(protocol), protocol)
    items, client = await through_the_package(record, HELLO)
    assert text_of(items) == "pooled"
    assert client.is_closed()
