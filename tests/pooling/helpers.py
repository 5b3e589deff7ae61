"""Small helpers shared by the pooling tests (and any test that waits on a loop)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import pytest

from pooling.providers import (
    ModelRequest,
    ProviderAdapter,
    TextDelta,
    ToolSpec,
    close_client,
    create_client,
    get_adapter,
)
from sageproject.errors import UpstreamError

# The calculator tool as a request offers it to a model.
CALCULATOR = ToolSpec(
    name="calculator",
    description="Evaluate an arithmetic expression",
    parameters={"type": "object", "properties": {"expression": {"type": "string"}}},
)


async def cancel(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` and wait for it to end; fails unless it ends cancelled."""
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def texts(items: Iterable[object]) -> list[str]:
    """The text of each ``TextDelta`` among a stream's items, in stream order."""
    return [item.text for item in items if isinstance(item, TextDelta)]


def text_of(items: Iterable[object]) -> str:
    """The text a stream's items spell."""
    return "".join(texts(items))


def _adapter(adapter: ProviderAdapter | str) -> ProviderAdapter:
    return get_adapter(adapter) if isinstance(adapter, str) else adapter


async def collect(adapter: ProviderAdapter | str, client: Any, request: ModelRequest) -> list:
    """Every item ``adapter`` (an adapter or its protocol's name) streams for ``request``."""
    return [item async for item in _adapter(adapter).stream(client, request)]


async def through_the_package(record: Any, request: ModelRequest) -> tuple[list, Any]:
    """The items streamed for ``request`` through a client for ``record`` that the package's
    ``create_client`` built and its ``close_client`` then closed, and that client."""
    client = await create_client(record)
    items = await collect(record.protocol, client, request)
    await close_client(client)
    return items, client


async def failure(
    adapter: ProviderAdapter | str,
    client: Any,
    request: ModelRequest,
    expected: type[BaseException] = UpstreamError,
) -> tuple[list, Any]:
    """The items ``adapter`` streams for ``request`` before the stream fails, and the error
    (fails unless it raises ``expected``)."""
    received: list = []
    with pytest.raises(expected) as caught:
        async for item in _adapter(adapter).stream(client, request):
            received.append(item)
    return received, caught.value
