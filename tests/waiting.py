"""The tests' one way to wait for something that has no event to wait on.

Wait on the event itself where the code under test can signal one (an ``asyncio.Event`` a
fake sets, a ``Condition``, a future): these helpers are for state that lives elsewhere —
another process, the database, the kernel, Redis. Each polls a predicate until it holds
and fails with a message, never hangs:

- ``wait_until``: from a thread, checked every ``interval`` seconds up to ``timeout``;
- ``awaited_until``: the same from the event loop (the predicate may be a coroutine);
- ``turns_until``: on the loop, a bounded number of turns and no wall clock, for state
  that other tasks reach within a few turns of the loop.

A failed wait raises ``WaitTimeout``, an ``AssertionError`` (a failed test, not an error)
that is also a ``TimeoutError``.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any

Message = str | Callable[[], str]


class WaitTimeout(AssertionError, TimeoutError):
    """A wait that ran out: what was awaited, and why it stopped."""


def _text(message: Message) -> str:
    return message() if callable(message) else message


def wait_until(
    predicate: Callable[[], Any],
    *,
    timeout: float = 30.0,
    interval: float = 0.05,
    message: Message = "the condition",
    abort: Callable[[], str | None] | None = None,
) -> Any:
    """Poll ``predicate`` until it returns something truthy, and return that. ``abort``
    (optional) names a reason to give up at once (a process it waits on has exited)."""
    deadline = time.monotonic() + timeout
    while True:
        if value := predicate():
            return value
        if abort is not None and (reason := abort()):
            raise WaitTimeout(f"{reason} while waiting for {_text(message)}")
        if time.monotonic() >= deadline:
            raise WaitTimeout(f"timed out after {timeout:g}s waiting for {_text(message)}")
        time.sleep(interval)


async def awaited_until(
    predicate: Callable[[], Awaitable[Any] | Any],
    *,
    within: float = 20.0,
    interval: float = 0.01,
    message: Message = "the condition",
) -> Any:
    """``wait_until`` from the event loop, up to ``within`` seconds: ``predicate`` may
    return an awaitable."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if loop.time() >= deadline:
            raise WaitTimeout(f"timed out after {within:g}s waiting for {_text(message)}")
        await asyncio.sleep(interval)


async def turns_until(
    predicate: Callable[[], Any],
    *,
    rounds: int = 10_000,
    interval: float = 0.0,
    message: Message = "the condition",
) -> None:
    """Check ``predicate`` at most ``rounds`` times, yielding one turn of the loop between
    checks (``interval`` 0: no wall-clock sleep)."""
    for _ in range(rounds):
        if predicate():
            return
        await asyncio.sleep(interval)
    raise WaitTimeout(f"{_text(message)} never held in {rounds} turns of the loop")
