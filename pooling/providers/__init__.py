"""Model provider adapters: ``openai``, ``anthropic`` and the keyless built-in ``scripted``.

``get_adapter(protocol)`` returns the shared adapter for a model record's protocol. Vendor
SDKs are imported on first use only, so a worker that serves just the ``scripted`` model
never pays for importing them.
"""

from __future__ import annotations

import asyncio
import importlib
import threading
from typing import Any

from sageproject.errors import ValidationError

from .base import (
    ModelRequest,
    ProviderAdapter,
    StreamEnd,
    StreamItem,
    TextDelta,
    ToolCall,
    ToolCallDelta,
    ToolSpec,
)
from .errors import connection_error, parse_error_body, upstream_error

__all__ = [
    "PROTOCOLS",
    "ModelRequest",
    "ProviderAdapter",
    "StreamEnd",
    "StreamItem",
    "TextDelta",
    "ToolCall",
    "ToolCallDelta",
    "ToolSpec",
    "close_client",
    "connection_error",
    "create_client",
    "get_adapter",
    "load_adapter",
    "parse_error_body",
    "upstream_error",
]

# protocol -> (module, class); modules are imported lazily by get_adapter.
_REGISTRY: dict[str, tuple[str, str]] = {
    "scripted": ("pooling.providers.scripted", "ScriptedAdapter"),
    "openai": ("pooling.providers.openai_adapter", "OpenAIAdapter"),
    "anthropic": ("pooling.providers.anthropic_adapter", "AnthropicAdapter"),
}
PROTOCOLS: tuple[str, ...] = tuple(_REGISTRY)

_adapters: dict[str, ProviderAdapter] = {}
# get_adapter may be called from sync_to_async threads as well as the worker loop.
_lock = threading.Lock()


def get_adapter(protocol: str) -> ProviderAdapter:
    """The shared adapter for ``protocol`` (adapters are stateless, so one per process).

    Raises ``ValidationError("model.protocol_unsupported")`` for an unknown protocol.
    """
    entry = _REGISTRY.get(protocol) if isinstance(protocol, str) else None
    if entry is None:
        raise ValidationError(
            "model.protocol_unsupported",
            f"unsupported model protocol {protocol!r}; expected one of {', '.join(PROTOCOLS)}",
            details={"protocol": str(protocol), "supported": list(PROTOCOLS)},
        )
    adapter = _adapters.get(protocol)
    if adapter is None:
        with _lock:
            adapter = _adapters.get(protocol)
            if adapter is None:
                module_name, class_name = entry
                adapter = getattr(importlib.import_module(module_name), class_name)()
                _adapters[protocol] = adapter
    return adapter


async def load_adapter(protocol: str) -> ProviderAdapter:
    """`get_adapter` for async callers: the first use of a protocol imports its vendor SDK
    in a thread (close to a second for ``openai``), so the event loop — and every lease
    renewer on it — never stalls on the import."""
    adapter = _adapters.get(protocol) if isinstance(protocol, str) else None
    if adapter is not None:
        return adapter
    return await asyncio.to_thread(get_adapter, protocol)


async def create_client(record: Any) -> Any:
    """Build the SDK client for a model record: the model client pool's ``factory``.

    ``record`` is any object with ``id``, ``protocol``, ``base_url``, ``model``, ``api_key``
    and ``options``. Raises ``ValidationError("model.protocol_unsupported")``.
    """
    return await (await load_adapter(record.protocol)).create_client(record)


async def close_client(client: Any) -> None:
    """Close a client built by ``create_client``: the model client pool's ``closer``.

    Every built-in client (SDK or scripted) closes with ``await client.close()``.
    """
    await client.close()
