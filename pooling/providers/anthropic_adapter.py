"""The ``anthropic`` protocol: Messages streaming through the official ``anthropic`` SDK.

The call, its errors and its end are ``pooling.providers.streaming``'s, as for the openai
adapter; this module builds the request and parses the events.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Iterator
from typing import Any

import anthropic

from .base import ModelRequest, StreamEnd, StreamItem, TextDelta, ToolCall, ToolCallDelta
from .errors import ANTHROPIC_ERROR_STATUS
from .streaming import (
    SDKAdapter,
    StreamParser,
    conversation,
    message_text,
    parse_arguments,
    parsed_body,
    stream_text,
    tool_schema,
)

# Record options passed as typed SDK arguments, and sampling options sent in the JSON body
# (recent SDKs no longer declare them, while the API and compatible servers accept them).
# Anything else in options is ignored so a typo cannot reach the SDK call.
SDK_OPTIONS = ("stop_sequences", "tool_choice", "thinking", "metadata", "service_tier")
BODY_OPTIONS = ("temperature", "top_p", "top_k")


def _blocks(content: Any) -> list[dict[str, Any]]:
    if isinstance(content, list):
        return content
    return [{"type": "text", "text": str(content)}] if content else []


def to_anthropic_messages(request: ModelRequest) -> list[dict[str, Any]]:
    """The normalized conversation as Messages API turns.

    Tool results become ``tool_result`` blocks of a user turn and assistant tool calls
    ``tool_use`` blocks; consecutive turns of one role are merged because the API expects
    user and assistant turns to alternate.
    """
    out: list[dict[str, Any]] = []

    def append(role: str, blocks: list[dict[str, Any]]) -> None:
        if not blocks:
            return
        if out and out[-1]["role"] == role:
            out[-1]["content"] = _blocks(out[-1]["content"]) + blocks
        elif role == "user" and len(blocks) == 1 and blocks[0]["type"] == "text":
            out.append({"role": role, "content": blocks[0]["text"]})
        else:
            out.append({"role": role, "content": blocks})

    for role, message in conversation(request):
        if role == "user":
            append("user", _blocks(message_text(message)))
        elif role == "assistant":
            blocks = _blocks(message.get("content") or "")
            for call in message.get("tool_calls") or []:
                blocks.append(
                    {
                        "type": "tool_use",
                        "id": call["id"],
                        "name": call["name"],
                        "input": call.get("arguments") or {},
                    }
                )
            append("assistant", blocks)
        else:
            append(
                "user",
                [
                    {
                        "type": "tool_result",
                        "tool_use_id": message["tool_call_id"],
                        "content": message_text(message),
                    }
                ],
            )
    return out


def to_anthropic_tools(request: ModelRequest) -> list[dict[str, Any]]:
    """The offered tools as Messages API tool definitions."""
    return [
        {
            "name": tool.name,
            "description": tool.description,
            "input_schema": tool_schema(tool),
        }
        for tool in request.tools
    ]


class MessagesParser(StreamParser):
    """One Messages stream: text and ``input_json_delta`` fragments as they come, each tool
    call, parsed, when its block stops, and ``StreamEnd`` once a stop reason or
    ``message_stop`` came."""

    def __init__(self) -> None:
        # Open tool_use blocks by index: their id, name and argument fragments so far.
        self.tools: dict[int, dict[str, Any]] = {}
        self.stop_reason = "end_turn"
        self.usage = {"input_tokens": 0, "output_tokens": 0}
        self.finished = False

    @property
    def complete(self) -> bool:
        return self.finished

    def feed(self, event: Any) -> Iterator[StreamItem]:
        kind = getattr(event, "type", None)
        if kind == "message_start":
            self._message_start(event)
        elif kind == "content_block_start":
            yield from self._block_start(event)
        elif kind == "content_block_delta":
            yield from self._block_delta(event)
        elif kind == "content_block_stop":
            call = self.tools.pop(event.index, None)
            if call is not None:
                yield ToolCall(
                    id=call["id"],
                    name=call["name"],
                    arguments=parse_arguments("".join(call["parts"])),
                )
        elif kind == "message_delta":
            self._message_delta(event)
        elif kind == "message_stop":
            self.finished = True

    def _message_start(self, event: Any) -> None:
        message_usage = getattr(event.message, "usage", None)
        if message_usage is not None:
            self.usage["input_tokens"] = int(message_usage.input_tokens or 0)
            self.usage["output_tokens"] = int(message_usage.output_tokens or 0)

    def _block_start(self, event: Any) -> Iterator[StreamItem]:
        block = event.content_block
        if block.type == "tool_use":
            self.tools[event.index] = {"id": block.id, "name": block.name, "parts": []}
        elif block.type == "text" and block.text:
            yield TextDelta(text=stream_text(block.text))

    def _block_delta(self, event: Any) -> Iterator[StreamItem]:
        delta = event.delta
        if delta.type == "text_delta" and delta.text:
            yield TextDelta(text=stream_text(delta.text))
        elif delta.type == "input_json_delta" and event.index in self.tools:
            call = self.tools[event.index]
            call["parts"].append(stream_text(delta.partial_json or ""))
            if delta.partial_json:
                yield ToolCallDelta(
                    index=event.index,
                    id=call["id"],
                    name=call["name"],
                    arguments=delta.partial_json,
                )

    def _message_delta(self, event: Any) -> None:
        if event.delta.stop_reason:
            self.stop_reason = str(event.delta.stop_reason)
            self.finished = True
        if event.usage is not None and event.usage.output_tokens is not None:
            self.usage["output_tokens"] = int(event.usage.output_tokens)
        input_tokens = getattr(event.usage, "input_tokens", None)
        if input_tokens:
            self.usage["input_tokens"] = int(input_tokens)

    def finish(self) -> Iterator[StreamItem]:
        yield StreamEnd(stop_reason=self.stop_reason, usage=self.usage)


class AnthropicAdapter(SDKAdapter):
    """Adapter for the ``anthropic`` protocol.

    ``stream`` yields ``TextDelta``s, ``ToolCallDelta``s and ``ToolCall``s in block order,
    then ``StreamEnd``; a stream that ends without a stop reason or ``message_stop`` is an
    invalid response.
    """

    protocol = "anthropic"
    sdk = anthropic
    client_class = anthropic.AsyncAnthropic

    def arguments(self, request: ModelRequest) -> dict[str, Any]:
        """A streaming message, the record's allowed options passed on (sampling options in
        the JSON body)."""
        options = request.options or {}
        kwargs: dict[str, Any] = {
            "model": request.model,
            "max_tokens": request.max_tokens,
            "messages": to_anthropic_messages(request),
            "stream": True,
        }
        if request.system:
            kwargs["system"] = request.system
        if request.tools:
            kwargs["tools"] = to_anthropic_tools(request)
        for name in SDK_OPTIONS:
            if name in options:
                kwargs[name] = options[name]
        extra_body = options.get("extra_body")
        extra_body = dict(extra_body) if isinstance(extra_body, dict) else {}
        extra_body.update({name: options[name] for name in BODY_OPTIONS if name in options})
        if extra_body:
            kwargs["extra_body"] = extra_body
        return kwargs

    def open_stream(self, client: Any, arguments: dict[str, Any]) -> Awaitable[Any]:
        return client.messages.create(**arguments)

    def parser(self) -> MessagesParser:
        return MessagesParser()

    def event_error_body(self, exc: Any) -> str:
        return json.dumps({"type": "error", "error": exc.body if exc.body else exc.message})

    def status_and_body(self, exc: Any) -> tuple[int, bytes | str]:
        """An HTTP error's status and body; for an ``event: error`` inside a 200 stream
        (the SDK raises it with the stream's status) the status the same error type has as
        an HTTP response, so it maps like any other."""
        if exc.status_code >= 400:
            return super().status_and_body(exc)
        error_type = ""
        if isinstance(exc.body, dict) and isinstance(exc.body.get("error"), dict):
            error_type = str(exc.body["error"].get("type", ""))
        return ANTHROPIC_ERROR_STATUS.get(error_type, 500), parsed_body(exc)
