"""What the SDK adapters (``openai``, ``anthropic``) share: one streaming call, start to end.

``SDKAdapter.stream`` opens the vendor SDK's stream, checks that the answer is an event
stream, hands each event to the adapter's ``StreamParser`` and closes the response however
the stream ends (done, failed, or left early by its consumer). Every failure becomes the
``UpstreamError`` that ``pooling.providers.errors`` builds for its kind: an error status, a
timeout or a failed connection, a connection lost mid-stream, an error event inside a 200
stream, a stream that does not decode, and one that ends before the provider said the
reply is complete. An adapter keeps only what differs by protocol: its client class, the
request's arguments, the parser of its events and the body of an error event.

SDK retries are off (``max_retries=0``): retrying is the run's decision, made from the
``retryable`` flag of the error we raise, not the SDK's.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Iterable, Iterator, Mapping
from types import ModuleType
from typing import Any, ClassVar

import httpx2  # the SDKs' own HTTP transport

from .base import ModelRequest, StreamItem, ToolSpec
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


def record_options(record: Any) -> dict[str, Any]:
    """The record's ``options`` as a dict (missing or null options give ``{}``)."""
    options = getattr(record, "options", None)
    return dict(options) if isinstance(options, Mapping) else {}


def conversation(request: ModelRequest) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """The request's normalized messages with their roles, in order; a role other than
    ``user``, ``assistant`` or ``tool`` raises ``ValueError`` when reached."""
    for message in request.messages:
        role = message.get("role")
        if role not in ("user", "assistant", "tool"):
            raise ValueError(f"unsupported message role {role!r}")
        yield role, message


def message_text(message: Mapping[str, Any]) -> str:
    """A user or tool message's content as text (``""`` when it has none)."""
    return str(message.get("content", ""))


def tool_schema(tool: ToolSpec) -> dict:
    """A tool's parameters schema; a tool without parameters takes an empty object."""
    return tool.parameters or {"type": "object", "properties": {}}


def stream_text(value: Any) -> str:
    """A piece of text from a vendor's stream; anything but a string is a malformed event,
    raised as ``TypeError`` (the adapters report it as an invalid response)."""
    if not isinstance(value, str):
        raise TypeError(f"expected text in the stream, got {type(value).__name__}")
    return value


def parse_arguments(raw: str) -> dict:
    """Tool-call arguments parsed from JSON; anything but a JSON object gives ``{"_raw": raw}``."""
    if not raw.strip():
        return {}
    try:
        value = json.loads(raw)
    except ValueError:
        return {"_raw": raw}
    return value if isinstance(value, dict) else {"_raw": raw}


def parsed_body(exc: Any) -> str:
    """The body an SDK error parsed, as JSON text (``""`` when it parsed none)."""
    return json.dumps(exc.body) if exc.body is not None else ""


def status_body(exc: Any) -> bytes | str:
    """The body of an SDK's HTTP status error: the response's text, or what the SDK parsed
    when the response was streamed and its body never read."""
    try:
        return exc.response.text
    except httpx2.ResponseNotRead:
        return parsed_body(exc)


class StreamParser(ABC):
    """One stream's state: turns the vendor's events into stream items."""

    @property
    @abstractmethod
    def complete(self) -> bool:
        """Whether the provider said the reply is complete (a stop or finish reason)."""

    @abstractmethod
    def feed(self, event: Any) -> Iterable[StreamItem]:
        """The items one event yields. An event of the wrong shape raises ``ValueError``,
        ``AttributeError`` or ``TypeError`` (reported as an invalid response)."""

    @abstractmethod
    def finish(self) -> Iterable[StreamItem]:
        """The items that follow the last event of a complete stream, ending in
        ``StreamEnd``."""


class SDKAdapter(ABC):
    """A provider adapter over a vendor SDK whose streams are iterated event by event.

    Subclasses set ``protocol``, ``sdk`` (the SDK module: its ``APIStatusError``,
    ``APITimeoutError``, ``APIConnectionError`` and ``APIError``), ``client_class`` and
    ``keyless_api_key`` (the key of a record without one), and build a call's arguments,
    open its stream and parse its events.
    """

    protocol: ClassVar[str]
    sdk: ClassVar[ModuleType]
    client_class: ClassVar[type]
    keyless_api_key: ClassVar[str | None] = None
    #: What the stream's events are called in the log line of a stream that ended early.
    event_noun: ClassVar[str] = "events"

    async def create_client(self, record: Any) -> Any:
        """The SDK client for ``record`` (no request is sent); never retries on its own.

        ``options["timeout"]`` (seconds) bounds each request; default 600.
        """
        options = record_options(record)
        return self.client_class(
            api_key=getattr(record, "api_key", None) or self.keyless_api_key,
            base_url=getattr(record, "base_url", None) or None,
            max_retries=0,
            timeout=float(options.get("timeout", DEFAULT_TIMEOUT_SECONDS)),
        )

    async def close_client(self, client: Any) -> None:
        """Close the client's HTTP connection pool."""
        await client.close()

    def transform_error(self, status: int, body: bytes | str) -> str | None:
        """The vetted short reason of an error body — the provider's error type or code —
        else ``None`` (see ``parse_error_body``)."""
        return parse_error_body(body)

    @abstractmethod
    def arguments(self, request: ModelRequest) -> dict[str, Any]:
        """The SDK call's keyword arguments for ``request`` (a streaming call)."""

    @abstractmethod
    def open_stream(self, client: Any, arguments: dict[str, Any]) -> Awaitable[Any]:
        """Start the streaming call; its result iterates the events and has ``response``."""

    @abstractmethod
    def parser(self) -> StreamParser:
        """A fresh parser for one stream."""

    @abstractmethod
    def event_error_body(self, exc: Any) -> str:
        """The error envelope (JSON text) of an error event the SDK raised mid-stream."""

    def status_and_body(self, exc: Any) -> tuple[int, bytes | str]:
        """The upstream status and body of the SDK's ``APIStatusError``."""
        return exc.status_code, status_body(exc)

    async def stream(self, client: Any, request: ModelRequest) -> AsyncIterator[StreamItem]:
        """Stream one call: the parser's items as the events come, then its final items.

        Raises ``UpstreamError`` (see ``pooling.providers.errors``) for HTTP errors, error
        events inside the stream, connection failures and timeouts, and an invalid
        response: a 200 that is not an event stream, an undecodable or malformed stream,
        or one that ends before the provider said the reply is complete.
        """
        arguments = self.arguments(request)
        parser = self.parser()
        secrets = client_secrets(client)
        events = 0
        last: Any = None
        sdk = self.sdk
        try:
            stream = await self.open_stream(client, arguments)
            try:
                await require_event_stream(stream.response, adapter=self, secrets=secrets)
                async for event in stream:
                    last = event
                    events += 1
                    for item in parser.feed(event):
                        yield item
            except (ValueError, AttributeError, TypeError) as exc:
                # Bytes that are not UTF-8, broken JSON, an event of the wrong shape: the
                # provider's fault, never an internal error of the run.
                raise broken_stream(exc, event=last, adapter=self, secrets=secrets) from None
            finally:
                # Ends the HTTP response even when the consumer stops early (aclose/cancel).
                await stream.close()
        except sdk.APIStatusError as exc:
            raise self._status_error(exc, secrets) from None
        except sdk.APITimeoutError as exc:
            raise connection_error("timed out", cause=exc, secrets=secrets) from None
        except sdk.APIConnectionError as exc:
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
        except sdk.APIError as exc:
            # An error event inside an otherwise successful (200) stream.
            body = self.event_error_body(exc)
            raise upstream_error(None, body, adapter=self, secrets=secrets) from None

        if not parser.complete:
            # A body that ended without saying the reply is complete (no events at all, or
            # cut off mid-token) is never a success: the answer may be missing or partial.
            raise invalid_response(
                NO_EVENTS if events == 0 else ENDED_EARLY,
                adapter=self,
                secrets=secrets,
                **{self.event_noun: events},
            )
        for item in parser.finish():
            yield item

    def _status_error(self, exc: Any, secrets: tuple[str, ...]) -> Exception:
        status, body = self.status_and_body(exc)
        return upstream_error(
            status,
            body,
            adapter=self,
            retry_after=retry_after_from_headers(exc.response.headers),
            secrets=secrets,
        )
