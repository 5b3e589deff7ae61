"""The ``anthropic`` protocol: Messages streaming through the official ``anthropic`` SDK.

SDK retries are off (``max_retries=0``) for the same reason as the openai adapter: whether
to retry is decided by the run from the error's ``retryable`` flag.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx2  # the SDKs' own HTTP transport

from .base import (
    ModelRequest,
    StreamEnd,
    StreamItem,
    TextDelta,
    ToolCall,
    ToolCallDelta,
    record_options,
    stream_text,
)
from .errors import (
    ANTHROPIC_ERROR_STATUS,
    ENDED_EARLY,
    NO_EVENTS,
    UNDECODABLE_BODY,
    broken_stream,
    client_secrets,
    connection_error,
    invalid_response,
    parse_error_body,
    require_event_stream,
    retry_after_from_headers,
    upstream_error,
)
from .openai_adapter import parse_arguments

DEFAULT_TIMEOUT_SECONDS = 600.0
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

    for message in request.messages:
        role = message.get("role")
        if role == "user":
            append("user", _blocks(str(message.get("content", ""))))
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
        elif role == "tool":
            append(
                "user",
                [
                    {
                        "type": "tool_result",
                        "tool_use_id": message["tool_call_id"],
                        "content": str(message.get("content", "")),
                    }
                ],
            )
        else:
            raise ValueError(f"unsupported message role {role!r}")
    return out


def to_anthropic_tools(request: ModelRequest) -> list[dict[str, Any]]:
    """The offered tools as Messages API tool definitions."""
    return [
        {
            "name": tool.name,
            "description": tool.description,
            "input_schema": tool.parameters or {"type": "object", "properties": {}},
        }
        for tool in request.tools
    ]


class AnthropicAdapter:
    """Adapter for the ``anthropic`` protocol."""

    protocol = "anthropic"

    async def create_client(self, record: Any) -> anthropic.AsyncAnthropic:
        """An ``AsyncAnthropic`` for ``record`` (no request is sent); never retries on its own.

        ``options["timeout"]`` (seconds) bounds each request; default 600.
        """
        options = record_options(record)
        return anthropic.AsyncAnthropic(
            api_key=getattr(record, "api_key", None) or None,
            base_url=getattr(record, "base_url", None) or None,
            max_retries=0,
            timeout=float(options.get("timeout", DEFAULT_TIMEOUT_SECONDS)),
        )

    async def close_client(self, client: Any) -> None:
        """Close the client's HTTP connection pool."""
        await client.close()

    def transform_error(self, status: int, body: bytes | str) -> str | None:
        """The vetted short reason of an Anthropic (or other known) error body — the
        provider's error type or code — else ``None`` (see ``parse_error_body``)."""
        return parse_error_body(body)

    async def stream(self, client: Any, request: ModelRequest) -> AsyncIterator[StreamItem]:
        """Stream one message: ``TextDelta``s, ``ToolCallDelta``s and ``ToolCall``s in block
        order, then ``StreamEnd``.

        ``input_json_delta`` fragments are passed on (``ToolCallDelta``) and accumulated per
        block, and parsed when the block stops. Raises ``UpstreamError`` for HTTP errors,
        ``error`` events inside the stream, connection failures and timeouts, and an invalid
        response: a 200 that is not an event stream, an undecodable or malformed stream, or
        one that ends without a stop reason or ``message_stop``.
        """
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

        secrets = client_secrets(client)
        tools: dict[int, dict[str, Any]] = {}
        stop_reason = "end_turn"
        usage = {"input_tokens": 0, "output_tokens": 0}
        events = 0
        finished = False
        last: Any = None
        try:
            stream = await client.messages.create(**kwargs)
            try:
                await require_event_stream(stream.response, adapter=self, secrets=secrets)
                async for event in stream:
                    last = event
                    events += 1
                    kind = getattr(event, "type", None)
                    if kind == "message_start":
                        message_usage = getattr(event.message, "usage", None)
                        if message_usage is not None:
                            usage["input_tokens"] = int(message_usage.input_tokens or 0)
                            usage["output_tokens"] = int(message_usage.output_tokens or 0)
                    elif kind == "content_block_start":
                        block = event.content_block
                        if block.type == "tool_use":
                            tools[event.index] = {"id": block.id, "name": block.name, "parts": []}
                        elif block.type == "text" and block.text:
                            yield TextDelta(text=stream_text(block.text))
                    elif kind == "content_block_delta":
                        delta = event.delta
                        if delta.type == "text_delta" and delta.text:
                            yield TextDelta(text=stream_text(delta.text))
                        elif delta.type == "input_json_delta" and event.index in tools:
                            call = tools[event.index]
                            call["parts"].append(stream_text(delta.partial_json or ""))
                            if delta.partial_json:
                                yield ToolCallDelta(
                                    index=event.index,
                                    id=call["id"],
                                    name=call["name"],
                                    arguments=delta.partial_json,
                                )
                    elif kind == "content_block_stop":
                        call = tools.pop(event.index, None)
                        if call is not None:
                            yield ToolCall(
                                id=call["id"],
                                name=call["name"],
                                arguments=parse_arguments("".join(call["parts"])),
                            )
                    elif kind == "message_delta":
                        if event.delta.stop_reason:
                            stop_reason = str(event.delta.stop_reason)
                            finished = True
                        if event.usage is not None and event.usage.output_tokens is not None:
                            usage["output_tokens"] = int(event.usage.output_tokens)
                        input_tokens = getattr(event.usage, "input_tokens", None)
                        if input_tokens:
                            usage["input_tokens"] = int(input_tokens)
                    elif kind == "message_stop":
                        finished = True
            except (ValueError, AttributeError, TypeError) as exc:
                # Bytes that are not UTF-8, broken JSON, an event of the wrong shape: the
                # provider's fault, never an internal error of the run.
                raise broken_stream(exc, event=last, adapter=self, secrets=secrets) from None
            finally:
                # Ends the HTTP response even when the consumer stops early (aclose/cancel).
                await stream.close()
        except anthropic.APIStatusError as exc:
            raise self._status_error(exc, secrets) from None
        except anthropic.APITimeoutError as exc:
            raise connection_error("timed out", cause=exc, secrets=secrets) from None
        except anthropic.APIConnectionError as exc:
            raise connection_error("connection failed", cause=exc, secrets=secrets) from None
        except httpx2.TimeoutException as exc:
            # Mid-stream read timeouts escape the SDK unwrapped.
            raise connection_error("timed out", cause=exc, secrets=secrets) from None
        except httpx2.DecodingError as exc:
            # A body whose content encoding (gzip, ...) does not decode.
            raise invalid_response(
                UNDECODABLE_BODY, adapter=self, secrets=secrets, error=repr(exc)
            ) from None
        except httpx2.TransportError as exc:
            # So does a connection dropped mid-stream.
            raise connection_error("connection lost", cause=exc, secrets=secrets) from None
        except anthropic.APIError as exc:
            body = json.dumps({"type": "error", "error": exc.body if exc.body else exc.message})
            raise upstream_error(None, body, adapter=self, secrets=secrets) from None

        if not finished:
            # A body that ended without a stop reason or ``message_stop`` (no events at all,
            # or cut off mid-token) is never a success: the answer may be missing or partial.
            raise invalid_response(
                NO_EVENTS if events == 0 else ENDED_EARLY,
                adapter=self,
                secrets=secrets,
                events=events,
            )
        yield StreamEnd(stop_reason=stop_reason, usage=usage)

    def _status_error(self, exc: anthropic.APIStatusError, secrets: tuple[str, ...]) -> Exception:
        status = exc.status_code
        body: bytes | str
        if status < 400:
            # An ``event: error`` inside a 200 stream: the SDK raises it with the stream's
            # status, so take the status the same error type has as an HTTP response.
            body = json.dumps(exc.body) if exc.body is not None else ""
            error_type = ""
            if isinstance(exc.body, dict) and isinstance(exc.body.get("error"), dict):
                error_type = str(exc.body["error"].get("type", ""))
            status = ANTHROPIC_ERROR_STATUS.get(error_type, 500)
        else:
            try:
                body = exc.response.text
            except httpx2.ResponseNotRead:
                # A streamed response whose body was never read; the SDK's parsed body remains.
                body = json.dumps(exc.body) if exc.body is not None else ""
        return upstream_error(
            status,
            body,
            adapter=self,
            retry_after=retry_after_from_headers(exc.response.headers),
            secrets=secrets,
        )
