"""Pure tests of the normalized-message conversions (no network)."""

from __future__ import annotations

import pytest

from pooling.providers import ModelRequest
from pooling.providers.anthropic_adapter import to_anthropic_messages
from pooling.providers.openai_adapter import to_openai_messages
from pooling.providers.streaming import parse_arguments


def test_it_merges_parallel_tool_results_and_a_follow_up_into_one_user_turn():
    request = ModelRequest(model="m", messages=(
        {"role": "user", "content": "time and 2+2?"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "a", "name": "clock", "arguments": {}},
                        {"id": "b", "name": "calculator", "arguments": {"expression": "2+2"}}]},
        {"role": "tool", "tool_call_id": "a", "name": "clock", "content": "noon"},
        {"role": "tool", "tool_call_id": "b", "name": "calculator", "content": "4"},
        {"role": "user", "content": "thanks"},
    ))
    converted = to_anthropic_messages(request)
    assert [m["role"] for m in converted] == ["user", "assistant", "user"]
    assert converted[1]["content"] == [
        {"type": "tool_use", "id": "a", "name": "clock", "input": {}},
        {"type": "tool_use", "id": "b", "name": "calculator", "input": {"expression": "2+2"}},
    ]
    assert converted[2]["content"] == [
        {"type": "tool_result", "tool_use_id": "a", "content": "noon"},
        {"type": "tool_result", "tool_use_id": "b", "content": "4"},
        {"type": "text", "text": "thanks"},
    ]


def test_it_merges_consecutive_user_messages_for_anthropic():
    request = ModelRequest(model="m", messages=({"role": "user", "content": "one"},
                                                {"role": "user", "content": "two"}))
    assert to_anthropic_messages(request) == [{"role": "user", "content": [
        {"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]


def test_it_sends_an_empty_assistant_message_to_openai_as_empty_text():
    request = ModelRequest(model="m", messages=({"role": "assistant", "content": ""},))
    assert to_openai_messages(request) == [{"role": "assistant", "content": ""}]


def test_it_omits_the_system_message_when_there_is_no_system_prompt():
    request = ModelRequest(model="m", messages=({"role": "user", "content": "hi"},))
    assert to_openai_messages(request) == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("convert", [to_openai_messages, to_anthropic_messages])
def test_it_rejects_an_unknown_role(convert):
    with pytest.raises(ValueError, match="unsupported message role"):
        convert(ModelRequest(model="m", messages=({"role": "robot", "content": "x"},)))


@pytest.mark.parametrize(("raw", "parsed"), [
    ('{"a": 1}', {"a": 1}),
    ("", {}),
    ("  ", {}),
    ('{"a": ', {"_raw": '{"a": '}),
    ("[1, 2]", {"_raw": "[1, 2]"}),
])
def test_it_parses_tool_arguments(raw, parsed):
    assert parse_arguments(raw) == parsed
