"""The ``openai`` protocol: Chat Completions streaming through the official ``openai`` SDK.

``AsyncOpenAI`` takes the record's ``base_url``, so any OpenAI-compatible server (vLLM,
Ollama, LM Studio, gateways) works. SDK retries are off (``max_retries=0``): retrying is the
run's decision, made from the ``retryable`` flag of the error we raise, not the SDK's.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx2  # the SDKs' own HTTP transport
import openai

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

DEFAULT_TIMEOUT_SECONDS = 600.0
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
    for message in request.messages:
        role = message.get("role")
        if role == "user":
            out.append({"role": "user", "content": str(message.get("content", ""))})
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
        elif role == "tool":
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": message["tool_call_id"],
                    "content": str(message.get("content", "")),
                }
            )
        else:
            raise ValueError(f"unsupported message role {role!r}")
    return out


def to_openai_tools(request: ModelRequest) -> list[dict[str, Any]]:
    """The offered tools as Chat Completions function tools."""
    return [
        {
            "type": "function",
            "function": {
                "name": tool.name,
                "description": tool.description,
                "parameters": tool.parameters or {"type": "object", "properties": {}},
            },
        }
        for tool in request.tools
    ]


def parse_arguments(raw: str) -> dict:
    """Tool-call arguments parsed from JSON; anything but a JSON object gives ``{"_raw": raw}``."""
    if not raw.strip():
        return {}
    try:
        value = json.loads(raw)
    except ValueError:
        return {"_raw": raw}
    return value if isinstance(value, dict) else {"_raw": raw}


class OpenAIAdapter:
    """Adapter for the ``openai`` protocol (OpenAI and every OpenAI-compatible server)."""

    protocol = "openai"

    async def create_client(self, record: Any) -> openai.AsyncOpenAI:
        """An ``AsyncOpenAI`` for ``record`` (no request is sent); never retries on its own.

        ``options["timeout"]`` (seconds) bounds each request; default 600.
        """
        options = record_options(record)
        return openai.AsyncOpenAI(
            api_key=getattr(record, "api_key", None) or KEYLESS,
            base_url=getattr(record, "base_url", None) or None,
            max_retries=0,
            timeout=float(options.get("timeout", DEFAULT_TIMEOUT_SECONDS)),
        )

    async def close_client(self, client: Any) -> None:
        """Close the client's HTTP connection pool."""
        await client.close()

    def transform_error(self, status: int, body: bytes | str) -> str | None:
        """The vetted short reason of an OpenAI-compatible (or other known) error body — the
        provider's error code or type — else ``None`` (see ``parse_error_body``)."""
        return parse_error_body(body)

    async def stream(self, client: Any, request: ModelRequest) -> AsyncIterator[StreamItem]:
        """Stream one chat completion: ``TextDelta``s and ``ToolCallDelta``s as they come,
        then ``ToolCall``s, then ``StreamEnd``.

        Tool-call argument fragments are passed on (``ToolCallDelta``) and accumulated by
        index, and parsed at the end. Raises ``UpstreamError`` (see
        ``pooling.providers.errors``) for HTTP errors, error events inside the stream,
        connection failures and timeouts, and an invalid response: a 200 that is not an
        event stream, an undecodable or malformed stream, or one that ends without a
        ``finish_reason``.
        """
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

        secrets = client_secrets(client)
        calls: dict[int, dict[str, Any]] = {}
        finish_reason: str | None = None
        usage = {"input_tokens": 0, "output_tokens": 0}
        chunks = 0
        last: Any = None
        try:
            stream = await client.chat.completions.create(**kwargs)
            try:
                await require_event_stream(stream.response, adapter=self, secrets=secrets)
                async for chunk in stream:
                    last = chunk
                    chunks += 1
                    if chunk.usage is not None:
                        usage = {
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
                            call = calls.setdefault(
                                fragment.index, {"id": None, "name": "", "arguments": []}
                            )
                            if fragment.id:
                                call["id"] = fragment.id
                            function = fragment.function
                            if function is not None:
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
                        if choice.finish_reason:
                            finish_reason = str(choice.finish_reason)
            except (ValueError, AttributeError, TypeError) as exc:
                # Bytes that are not UTF-8, broken JSON, an event of the wrong shape: the
                # provider's fault, never an internal error of the run.
                raise broken_stream(exc, event=last, adapter=self, secrets=secrets) from None
            finally:
                # Ends the HTTP response even when the consumer stops early (aclose/cancel).
                await stream.close()
        except openai.APIStatusError as exc:
            raise self._status_error(exc, secrets) from None
        except openai.APITimeoutError as exc:
            raise connection_error("timed out", cause=exc, secrets=secrets) from None
        except openai.APIConnectionError as exc:
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
        except openai.APIError as exc:
            # An error event inside an otherwise successful (200) stream.
            body = json.dumps({"error": exc.body if exc.body is not None else exc.message})
            raise upstream_error(None, body, adapter=self, secrets=secrets) from None

        if finish_reason is None:
            # A body that ended without saying the reply is complete (no events at all, or
            # cut off mid-token) is never a success: the answer may be missing or partial.
            raise invalid_response(
                NO_EVENTS if chunks == 0 else ENDED_EARLY,
                adapter=self,
                secrets=secrets,
                chunks=chunks,
            )
        for index in sorted(calls):
            call = calls[index]
            yield ToolCall(
                id=call["id"] or f"call_{index}",
                name=call["name"],
                arguments=parse_arguments("".join(call["arguments"])),
            )
        stop = STOP_REASONS.get(finish_reason, finish_reason)
        if calls and stop == "end_turn":
            # Some compatible servers (Ollama) finish a tool-calling turn with "stop".
            stop = "tool_use"
        yield StreamEnd(stop_reason=stop, usage=usage)

    def _status_error(self, exc: openai.APIStatusError, secrets: tuple[str, ...]) -> Exception:
        response = exc.response
        try:
            body: bytes | str = response.text
        except httpx2.ResponseNotRead:
            # A streamed response whose body was never read; the SDK's parsed body remains.
            body = json.dumps(exc.body) if exc.body is not None else ""
        return upstream_error(
            exc.status_code,
            body,
            adapter=self,
            retry_after=retry_after_from_headers(response.headers),
            secrets=secrets,
        )
