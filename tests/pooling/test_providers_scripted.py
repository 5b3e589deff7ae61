"""The built-in ``scripted`` provider: deterministic, keyless, streamed word by word."""

from __future__ import annotations

import asyncio
import json
import logging
from types import SimpleNamespace

import pytest

from pooling.providers import (
    ModelRequest,
    StreamEnd,
    TextDelta,
    ToolCall,
    ToolCallDelta,
    ToolSpec,
    get_adapter,
    scripted,
)
from pooling.providers.scripted import ScriptedClient, tokenize
from sageproject.errors import ErrorCategory, ValidationError
from tests.pooling.helpers import CALCULATOR, collect, failure, text_of, texts, through_the_package
from tests.pooling.upstream import HTML_502

CLOCK = ToolSpec(
    name="clock", description="Current time", parameters={"type": "object", "properties": {}}
)
RECORD = SimpleNamespace(
    id=1, protocol="scripted", base_url="", model="scripted-1", api_key="", options={}
)


@pytest.fixture
def adapter():
    return get_adapter("scripted")


@pytest.fixture
async def client(adapter):
    client = await adapter.create_client(RECORD)
    yield client
    await adapter.close_client(client)


def user(text):
    return {"role": "user", "content": text}


def test_it_tokenizes_words_keeping_spaces():
    tokens = tokenize("  You said:  hi there ")
    assert tokens == ["  ", "You ", "said:  ", "hi ", "there "]
    assert "".join(tokens) == "  You said:  hi there "


async def test_it_echoes_the_last_user_message(adapter, client):
    request = ModelRequest(
        model="m", messages=(user("first"), {"role": "assistant", "content": "x"}, user("hello"))
    )
    items = await collect(adapter, client, request)
    assert text_of(items) == "You said: hello"
    assert items[-1] == StreamEnd(
        stop_reason="end_turn", usage={"input_tokens": 3, "output_tokens": 3}
    )


async def test_it_streams_one_delta_per_word(adapter, client):
    items = await collect(adapter, client, ModelRequest(model="m", messages=(user("a b c"),)))
    assert texts(items) == ["You ", "said: ", "a ", "b ", "c"]


async def test_it_calls_the_calculator_when_asked_to_calculate(adapter, client):
    request = ModelRequest(
        model="m", messages=(user("Please calculate 2 + 3*4 now"),), tools=(CALCULATOR,)
    )
    items = await collect(adapter, client, request)
    pieces = [i for i in items if isinstance(i, ToolCallDelta)]
    assert [i for i in items if not isinstance(i, ToolCallDelta)] == [
        ToolCall(id="call_0_0", name="calculator", arguments={"expression": "2 + 3*4"}),
        StreamEnd(stop_reason="tool_use", usage={"input_tokens": 6, "output_tokens": 0}),
    ]
    # The arguments streamed first, in pieces of the call's JSON.
    assert len(pieces) > 1 and items.index(pieces[-1]) < len(pieces)
    assert json.loads("".join(p.arguments for p in pieces)) == {"expression": "2 + 3*4"}


async def test_it_echoes_a_calculation_when_no_calculator_is_offered(adapter, client):
    items = await collect(adapter, client, ModelRequest(model="m", messages=(user("what is 2+2"),)))
    assert text_of(items) == "You said: what is 2+2"


async def test_it_answers_with_the_tool_result(adapter, client):
    messages = (
        user("compute (1+2)^2"),
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "call_0_0", "name": "calculator", "arguments": {"expression": "(1+2)^2"}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_0_0", "name": "calculator", "content": "9"},
    )
    items = await collect(
        adapter, client, ModelRequest(model="m", messages=messages, tools=(CALCULATOR,))
    )
    assert text_of(items) == "The result is 9."
    assert items[-1].stop_reason == "end_turn"


async def test_it_runs_a_whole_calculator_tool_loop(adapter, client):
    messages: list[dict] = [user("What is 6*7?")]
    for _ in range(3):
        items = await collect(
            adapter, client, ModelRequest(model="m", messages=tuple(messages), tools=(CALCULATOR,))
        )
        calls = [i for i in items if isinstance(i, ToolCall)]
        messages.append(
            {
                "role": "assistant",
                "content": text_of(items),
                "tool_calls": [
                    {"id": c.id, "name": c.name, "arguments": c.arguments} for c in calls
                ],
            }
        )
        if not calls:
            break
        for call in calls:
            messages.append(
                {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": "42"}
            )
    assert messages[1]["tool_calls"][0]["arguments"] == {"expression": "6*7"}
    assert messages[-1]["content"] == "The result is 42."
    assert len(messages) == 4


async def test_it_calls_the_clock_when_asked_the_time(adapter, client):
    request = ModelRequest(model="m", messages=(user("What time is it?"),), tools=(CLOCK,))
    items = await collect(adapter, client, request)
    assert [i for i in items if isinstance(i, ToolCall)] == [
        ToolCall(id="call_0_0", name="clock", arguments={})
    ]


async def test_it_answers_the_time_from_the_clock_result(adapter, client):
    messages = (
        user("what time is it"),
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "call_0_0", "name": "clock", "arguments": {}}],
        },
        {"role": "tool", "tool_call_id": "call_0_0", "name": "clock", "content": "10:30 UTC"},
    )
    items = await collect(
        adapter, client, ModelRequest(model="m", messages=messages, tools=(CLOCK,))
    )
    assert text_of(items) == "It is 10:30 UTC."


async def test_it_follows_the_script_step_by_step(adapter, client):
    script = [
        {"text": "Let me look.", "tool_calls": [{"name": "search", "arguments": {"q": "x"}}]},
        {"text": "Found it."},
    ]
    options = {"script": script}
    first = await collect(
        adapter, client, ModelRequest(model="m", messages=(user("go"),), options=options)
    )
    assert text_of(first) == "Let me look."
    assert first[-2] == ToolCall(id="call_0_0", name="search", arguments={"q": "x"})
    assert first[-1].stop_reason == "tool_use"
    messages = (
        user("go"),
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [{"id": "call_0_0", "name": "search", "arguments": {"q": "x"}}],
        },
        {"role": "tool", "tool_call_id": "call_0_0", "name": "search", "content": "hit"},
    )
    second = await collect(
        adapter, client, ModelRequest(model="m", messages=messages, options=options)
    )
    assert text_of(second) == "Found it."
    assert second[-1].stop_reason == "end_turn"


async def test_it_restarts_the_script_after_a_new_user_message(adapter, client):
    options = {"script": [{"text": "one"}, {"text": "two"}]}
    messages = (user("a"), {"role": "assistant", "content": "one"}, user("b"))
    items = await collect(
        adapter, client, ModelRequest(model="m", messages=messages, options=options)
    )
    assert text_of(items) == "one"


async def test_it_falls_back_to_the_default_reply_past_the_script(adapter, client):
    options = {"script": [{"text": "only step"}]}
    messages = (user("hey"), {"role": "assistant", "content": "only step"})
    items = await collect(
        adapter, client, ModelRequest(model="m", messages=messages, options=options)
    )
    assert text_of(items) == "You said: hey"


async def test_it_rejects_a_malformed_script(adapter, client):
    with pytest.raises(ValidationError) as caught:
        await collect(
            adapter,
            client,
            ModelRequest(
                model="m", messages=(user("x"),), options={"script": [{"tool_calls": [{}]}]}
            ),
        )
    assert caught.value.code == "model.options_invalid"


async def test_it_sleeps_the_token_delay_between_tokens(adapter, client, monkeypatch):
    real_sleep = asyncio.sleep
    slept = []

    async def recording_sleep(seconds):
        slept.append(seconds)
        await real_sleep(0)

    monkeypatch.setattr(scripted.asyncio, "sleep", recording_sleep)
    request = ModelRequest(model="m", messages=(user("slow"),), options={"token_delay_ms": 250})
    assert text_of(await collect(adapter, client, request)) == "You said: slow"
    assert slept == [0, 0.25, 0.25]


async def test_it_rejects_a_negative_token_delay(adapter, client):
    request = ModelRequest(model="m", messages=(user("x"),), options={"token_delay_ms": -5})
    with pytest.raises(ValidationError):
        await collect(adapter, client, request)


async def test_it_can_be_cancelled_between_tokens(adapter, client):
    request = ModelRequest(
        model="m", messages=(user("one two three"),), options={"token_delay_ms": 60_000}
    )
    first_token = asyncio.Event()
    received = []

    async def consume():
        async for item in adapter.stream(client, request):
            received.append(item)
            first_token.set()

    task = asyncio.create_task(consume())
    await first_token.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert received == [TextDelta(text="You ")]


async def test_it_raises_the_injected_error_before_any_token(adapter, client, caplog):
    request = ModelRequest(
        model="m", messages=(user("hi"),), options={"error": {"status": 502, "body": HTML_502}}
    )
    with caplog.at_level(logging.WARNING, logger="sage.upstream"):
        received, error = await failure(adapter, client, request)
    assert received == []
    assert (error.code, error.retryable) == ("upstream.error", True)
    assert error.message == "the provider failed (status 502, HTML error page)"
    assert "nginx/1.25.3" in caplog.text
    assert "nginx" not in str(error.to_dict())


async def test_it_raises_the_injected_error_after_some_tokens(adapter, client):
    request = ModelRequest(
        model="m",
        messages=(user("a b c d"),),
        options={"error": {"status": 429, "body": "", "retry_after": 2}, "error_after_tokens": 2},
    )
    received, error = await failure(adapter, client, request)
    assert [i.text for i in received] == ["You ", "said: "]
    assert error.code == "upstream.rate_limited"
    assert error.category == ErrorCategory.RATE_LIMITED
    assert error.details == {"status": 429, "retry_after": 2.0}
    assert error.message == "the provider's rate limit was reached; retry later (status 429)"


async def test_it_injects_a_connection_failure(adapter, client):
    request = ModelRequest(model="m", messages=(user("x"),), options={"error": {"status": None}})
    _, error = await failure(adapter, client, request)
    assert (error.code, error.retryable) == ("upstream.error", True)


async def test_it_closes_its_client(adapter):
    client = await adapter.create_client(RECORD)
    assert isinstance(client, ScriptedClient)
    await adapter.close_client(client)
    assert client.closed
    with pytest.raises(RuntimeError):
        await collect(adapter, client, ModelRequest(model="m", messages=(user("x"),)))


async def test_it_builds_and_closes_through_the_package_helpers():
    items, client = await through_the_package(
        RECORD, ModelRequest(model="m", messages=(user("hi"),))
    )
    assert text_of(items) == "You said: hi"
    assert client.closed
