"""The ``openai`` protocol: Chat Completions streaming through the official ``openai`` SDK.

``AsyncOpenAI`` takes the record's ``base_url``, so any OpenAI-compatible server (vLLM,
Ollama, LM Studio, gateways) works. The call, its errors and its end are
``pooling.providers.streaming``'s; this module builds the request and parses the chunks.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Iterator
from typing import Any

import openai

from .base import ModelRequest, StreamEnd, StreamItem, TextDelta, ToolCall, ToolCallDelta
from .streaming import (
    SDKAdapter,
    StreamParser,
    conversation,
    message_text,
    parse_arguments,
    stream_text,
    tool_schema,
)

# A placeholder key for keyless local servers: the SDK refuses to build a client without one.
KEYLESS = "sk-no-key-required"
# Request parameters a record's options may set; everything else in options is ignored so a
# typo cannot smuggle arbitrary arguments into the SDK call.
PASSTHROUGH_OPTIONS = (
    "temperature",
    "top_p",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "parallel_tool_calls",
    "tool_choice",
    "reasoning_effort",
    "user",
)
STOP_REASONS = {
    "stop": "end_turn",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "length": "max_tokens",
}


def to_openai_messages(request: ModelRequest) -> list[dict[str, Any]]:
    """The normalized conversation as Chat Completions messages (system first)."""
    out: list[dict[str, Any]] = []
    if request.system:
        out.append({"role": "system", "content": request.system})
    for role, message in conversation(request):
        if role == "user":
            out.append({"role": "user", "content": message_text(message)})
        elif role == "assistant":
            item: dict[str, Any] = {"role": "assistant", "content": message.get("content") or None}
            calls = message.get("tool_calls") or []
            if calls:
                item["tool_calls"] = [
                    {
                        "id": call["id"],
                        "type": "function",
                        "function": {
                            "name": call["name"],
                            "arguments": json.dumps(call.get("arguments") or {}),
                        },
                    }
                    for call in calls
                ]
            elif item["content"] is None:
                item["content"] = ""
            out.append(item)
        else:
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": message["tool_call_id"],
                    "content": message_text(message),
                }
            )
    return out


def to_openai_tools(request: ModelRequest) -> list[dict[str, Any]]:
    """The offered tools as Chat Completions function tools."""
    return [
        {
            "type": "function",
            "function": {
                "name": tool.name,
                "description": tool.description,
                "parameters": tool_schema(tool),
            },
        }
        for tool in request.tools
    ]


class ChatCompletionParser(StreamParser):
    """One Chat Completions stream: text and tool-call fragments as they come; the tool
    calls, parsed, and ``StreamEnd`` once a ``finish_reason`` came."""

    def __init__(self) -> None:
        # Tool calls by index: their id, name and argument fragments so far.
        self.calls: dict[int, dict[str, Any]] = {}
        self.finish_reason: str | None = None
        self.usage = {"input_tokens": 0, "output_tokens": 0}

    @property
    def complete(self) -> bool:
        return self.finish_reason is not None

    def feed(self, chunk: Any) -> Iterator[StreamItem]:
        if chunk.usage is not None:
            self.usage = {
                "input_tokens": int(chunk.usage.prompt_tokens or 0),
                "output_tokens": int(chunk.usage.completion_tokens or 0),
            }
        for choice in chunk.choices or ():
            if choice.index not in (0, None):
                continue
            delta = choice.delta
            if delta is not None and delta.content:
                yield TextDelta(text=stream_text(delta.content))
            for fragment in (delta.tool_calls if delta is not None else None) or ():
                yield from self._tool_fragment(fragment)
            if choice.finish_reason:
                self.finish_reason = str(choice.finish_reason)

    def _tool_fragment(self, fragment: Any) -> Iterator[StreamItem]:
        call = self.calls.setdefault(fragment.index, {"id": None, "name": "", "arguments": []})
        if fragment.id:
            call["id"] = fragment.id
        function = fragment.function
        if function is None:
            return
        if function.name and not call["name"]:
            call["name"] = stream_text(function.name)
        if function.arguments:
            call["arguments"].append(stream_text(function.arguments))
            yield ToolCallDelta(
                index=fragment.index,
                id=call["id"],
                name=call["name"],
                arguments=function.arguments,
            )

    def finish(self) -> Iterator[StreamItem]:
        for index in sorted(self.calls):
            call = self.calls[index]
            yield ToolCall(
                id=call["id"] or f"call_{index}",
                name=call["name"],
                arguments=parse_arguments("".join(call["arguments"])),
            )
        stop = STOP_REASONS.get(self.finish_reason, self.finish_reason)
        if self.calls and stop == "end_turn":
            # Some compatible servers (Ollama) finish a tool-calling turn with "stop".
            stop = "tool_use"
        yield StreamEnd(stop_reason=stop, usage=self.usage)


class OpenAIAdapter(SDKAdapter):
    """Adapter for the ``openai`` protocol (OpenAI and every OpenAI-compatible server).

    ``stream`` yields ``TextDelta``s and ``ToolCallDelta``s as they come, then the
    ``ToolCall``s (argument fragments accumulated by index, parsed at the end), then
    ``StreamEnd``; a stream that ends without a ``finish_reason`` is an invalid response.
    """

    protocol = "openai"
    sdk = openai
    client_class = openai.AsyncOpenAI
    keyless_api_key = KEYLESS
    event_noun = "chunks"

    def arguments(self, request: ModelRequest) -> dict[str, Any]:
        """A streaming chat completion with usage, the record's allowed options passed on."""
        options = request.options or {}
        kwargs: dict[str, Any] = {
            "model": request.model,
            "messages": to_openai_messages(request),
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        # Newer OpenAI models only accept max_completion_tokens; most compatible servers only
        # know max_tokens, which stays the default.
        kwargs[str(options.get("max_tokens_param", "max_tokens"))] = request.max_tokens
        if request.tools:
            kwargs["tools"] = to_openai_tools(request)
        for name in PASSTHROUGH_OPTIONS:
            if name in options:
                kwargs[name] = options[name]
        if isinstance(options.get("extra_body"), dict):
            kwargs["extra_body"] = options["extra_body"]
        return kwargs

    def open_stream(self, client: Any, arguments: dict[str, Any]) -> Awaitable[Any]:
        return client.chat.completions.create(**arguments)

    def parser(self) -> ChatCompletionParser:
        return ChatCompletionParser()

    def event_error_body(self, exc: Any) -> str:
        return json.dumps({"error": exc.body if exc.body is not None else exc.message})
