"""Values and the adapter protocol shared by every model provider.

Everything here is Django-free: the agent engine builds a ``ModelRequest`` from a model
record and a conversation, and an adapter turns it into one streaming call of its vendor's
SDK, yielding ``TextDelta`` and ``ToolCallDelta`` pieces as they stream, the complete
``ToolCall``s and a final ``StreamEnd``.

Normalized messages (the only shapes adapters accept)::

    {"role": "user", "content": str}
    {"role": "assistant", "content": str,
     "tool_calls": [{"id": str, "name": str, "arguments": dict}]}
    {"role": "tool", "tool_call_id": str, "name": str, "content": str}

``tool_calls`` is optional on assistant messages.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolSpec:
    """A tool offered to the model; ``parameters`` is a JSON schema object."""

    name: str
    description: str
    parameters: dict


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelRequest:
    """One model call: the conversation so far, the tools offered and the record's options."""

    model: str
    system: str = ""
    messages: tuple[dict, ...] = ()
    tools: tuple[ToolSpec, ...] = ()
    max_tokens: int = 1024
    # The model record's options JSON (sampling parameters, scripted behaviour, ...).
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class TextDelta:
    """A piece of the assistant's text, in stream order."""

    text: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCallDelta:
    """A piece of a tool call as the model streams it: ``arguments`` is the next fragment
    of the call's JSON arguments text; ``id`` and ``name`` as far as the stream has said
    them (``index`` tells the calls of one turn apart). For live display only: the complete
    ``ToolCall`` follows."""

    index: int
    id: str | None
    name: str
    arguments: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCall:
    """A complete tool call; ``arguments`` is the parsed JSON object."""

    id: str
    name: str
    arguments: dict


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamEnd:
    """The last item of every successful stream.

    ``stop_reason`` is normalized to ``end_turn``, ``tool_use`` or ``max_tokens`` where the
    vendor's reason maps onto one of them (otherwise the vendor's own string); ``usage`` is
    ``{"input_tokens": n, "output_tokens": m}``.
    """

    stop_reason: str
    usage: dict


StreamItem = TextDelta | ToolCallDelta | ToolCall | StreamEnd


@runtime_checkable
class ProviderAdapter(Protocol):
    """What the pool and the agent engine need from a model vendor.

    ``create_client`` builds the vendor client for a model record (any object with ``id``,
    ``protocol``, ``base_url``, ``model``, ``api_key`` and ``options``); the client owns an
    HTTP connection pool, which is why the pool shares it. ``stream`` raises
    ``sageproject.errors.UpstreamError`` for every upstream failure.
    """

    protocol: str

    async def create_client(self, record: Any) -> Any: ...

    async def close_client(self, client: Any) -> None: ...

    def stream(self, client: Any, request: ModelRequest) -> AsyncIterator[StreamItem]: ...

    def transform_error(self, status: int, body: bytes | str) -> str | None: ...
