"""Small helpers shared by the pooling tests (and any test that waits on a loop)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any

import pytest

from pooling.providers import TextDelta


async def until(
    predicate: Callable[[], bool], *, rounds: int = 10_000, interval: float = 0.0
) -> None:
    """Wait until ``predicate()`` holds, checking it ``rounds`` times at most with a sleep of
    ``interval`` seconds between checks (``0``: one turn of the loop, no wall-clock sleep);
    raises ``AssertionError`` if it never holds, so a bug fails rather than hangs."""
    for _ in range(rounds):
        if predicate():
            return
        await asyncio.sleep(interval)
    raise AssertionError("condition never became true")


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
