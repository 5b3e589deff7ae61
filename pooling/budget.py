"""A fair, bounded budget of concurrent model calls.

One ``ModelConcurrencyBudget`` is shared by every Application of a worker: it caps how many
model streams run at once, how many callers may queue for a slot, and how long they may
queue. Unlike ``asyncio.Semaphore`` it has a bounded queue, a wait deadline, counters and a
snapshot, while keeping strict FIFO hand-off and the same order of cost.

``budget.wrap(provider)`` is how a model call uses it: the wrapped provider's ``stream``
holds one slot from its first read to its end, whichever way it ends.

Design notes (why it is built this way):

* **Hand-off, not wake-and-race.** A released slot is transferred directly to the oldest
  waiter (its future is resolved with ``True`` and ``active`` is not decremented). So while
  anyone is queued, ``active == limit`` and a newcomer's fast path fails: nobody can jump
  the queue. The converse invariant, "``active < limit`` implies no pending waiter", lets
  the uncontended path be one comparison and one increment, with no lock and no task.
* **One timer for the whole queue.** Every waiter has the same timeout and joins at the
  tail, so deadlines are non-decreasing from head to tail. A single ``call_at`` timer armed
  for the head's deadline is therefore enough; when it fires it expires every waiter whose
  deadline has passed and re-arms itself for the new head. This keeps the contended path as
  cheap as a semaphore's (one future, one deque append) instead of one timer per waiter.
* **Expiry resolves, it does not cancel.** The timer resolves an expired waiter's future
  with ``False``; the waiter's task is never cancelled by the budget, so its own
  cancellation state stays untouched and an ``asyncio.timeout`` of the caller composes.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import AsyncIterator
from operator import attrgetter
from typing import Any

from sageproject.errors import ErrorCategory, RateLimitedError

__all__ = ["BoundedModelProvider", "ModelConcurrencyBudget"]

QUEUE_FULL_MESSAGE = "Model request queue is full; retry later."
QUEUE_TIMEOUT_MESSAGE = "Model request timed out waiting for capacity; retry later."


def _reader(name: str, doc: str) -> property:
    """A read-only property showing the attribute ``name``."""
    return property(attrgetter(name), doc=doc)


class _BudgetLease:
    """The async context manager behind ``budget.lease()``.

    It holds no per-use state (a slot is anonymous), so the budget hands out one shared
    instance and the uncontended path allocates nothing.
    """

    __slots__ = ("_budget",)

    def __init__(self, budget: ModelConcurrencyBudget) -> None:
        self._budget = budget

    async def __aenter__(self) -> None:
        budget = self._budget
        if budget._active < budget._limit:
            # Invariant: a free slot means nobody is queued, so taking it is fair.
            budget._active += 1
            return
        await budget._acquire_slow()

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        self._budget._release()
        return False


class ModelConcurrencyBudget:
    """Limit concurrent model calls, with a bounded FIFO queue and a wait timeout."""

    __slots__ = (
        "_active",
        "_lease",
        "_limit",
        "_max_waiting",
        "_rejected",
        "_timed_out",
        "_timer",
        "_timer_deadline",
        "_wait_timeout",
        "_waiters",
    )

    def __init__(
        self,
        limit: int = 8,
        *,
        max_waiting: int = 128,
        wait_timeout_seconds: float = 60,
    ) -> None:
        """Create a budget; raises ``ValueError`` for a non-int or < 1 ``limit``, a
        non-int or negative ``max_waiting``, or a non-finite or non-positive
        ``wait_timeout_seconds``."""
        # ``type(...) is int`` on purpose: bool is an int subclass and must be rejected.
        if type(limit) is not int or limit < 1:
            raise ValueError("model budget limit must be an integer >= 1")
        if type(max_waiting) is not int or max_waiting < 0:
            raise ValueError("model budget max_waiting must be an integer >= 0")
        if (
            isinstance(wait_timeout_seconds, bool)
            or not isinstance(wait_timeout_seconds, int | float)
            or not math.isfinite(wait_timeout_seconds)
            or wait_timeout_seconds <= 0
        ):
            raise ValueError("model budget wait_timeout_seconds must be finite and > 0")
        self._limit = limit
        self._max_waiting = max_waiting
        self._wait_timeout = wait_timeout_seconds
        self._active = 0
        self._rejected = 0
        self._timed_out = 0
        # Entries are (future, deadline); a future resolves to True (slot handed over) or
        # False (expired). Cancelled waiters remove their own entry.
        self._waiters: deque[tuple[asyncio.Future[bool], float]] = deque()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_deadline = 0.0
        self._lease = _BudgetLease(self)

    # -- public surface -------------------------------------------------------------

    limit = _reader("_limit", "The most model calls at once.")
    max_waiting = _reader("_max_waiting", "The most callers that may queue for a slot.")
    wait_timeout_seconds = _reader("_wait_timeout", "How long a caller may queue, in seconds.")
    active = _reader("_active", "Slots held now (one handed to a waiter included).")
    rejected = _reader("_rejected", "Callers refused with ``model.queue_full`` so far.")
    timed_out = _reader("_timed_out", "Callers that waited in vain (``model.queue_timeout``).")

    @property
    def waiting(self) -> int:
        """Callers queued for a slot now."""
        return len(self._waiters)

    def lease(self) -> _BudgetLease:
        """Return an async context manager that holds one model-call slot for its body.

        Entering raises ``RateLimitedError`` ``model.queue_full`` when no slot is free and
        the queue already holds ``max_waiting`` callers, or ``model.queue_timeout`` when no
        slot was handed over within ``wait_timeout_seconds``. The body itself is never
        timed; the slot is returned on any exit, including cancellation.
        """
        return self._lease

    def snapshot(self) -> dict[str, Any]:
        """Return the counters, keys in the documented order (no secrets, JSON-safe)."""
        return {
            "limit": self._limit,
            "active": self._active,
            "waiting": len(self._waiters),
            "max_waiting": self._max_waiting,
            "wait_timeout_seconds": self._wait_timeout,
            "rejected": self._rejected,
            "timed_out": self._timed_out,
        }

    def wrap(self, provider: Any) -> BoundedModelProvider:
        """Return ``provider`` bounded by this budget: its ``stream(request)`` holds a slot.

        The slot covers the stream's whole life. It is returned when the stream ends,
        fails, is cancelled or is closed early. Wrapping a provider this budget already
        bounds returns it unchanged, so one stream never takes two slots. Every other
        attribute is the wrapped provider's.
        """
        if isinstance(provider, BoundedModelProvider) and provider.budget is self:
            return provider
        return BoundedModelProvider(provider, self)

    # -- internals ------------------------------------------------------------------

    async def _acquire_slow(self) -> None:
        # No await between this capacity check and joining the queue, so the FIFO
        # position is decided atomically with respect to other callers.
        if len(self._waiters) >= self._max_waiting:
            self._rejected += 1
            raise self._error("model.queue_full", QUEUE_FULL_MESSAGE)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[bool] = loop.create_future()
        deadline = loop.time() + self._wait_timeout
        entry = (fut, deadline)
        self._waiters.append(entry)
        if self._timer is None:
            self._arm(loop, deadline)
        try:
            granted = await fut
        except BaseException:
            # Cancelled (or interrupted) while queued. If the slot was already handed
            # over (the future resolved before our task resumed), pass it on, otherwise
            # just leave the queue: either way no capacity leaks.
            if fut.done() and not fut.cancelled() and fut.result():
                self._release()
            else:
                try:
                    self._waiters.remove(entry)
                except ValueError:
                    pass  # already popped by a release or the expiry timer
            raise
        if not granted:
            self._timed_out += 1
            raise self._error("model.queue_timeout", QUEUE_TIMEOUT_MESSAGE)

    def _release(self) -> None:
        waiters = self._waiters
        while waiters:
            fut, _ = waiters.popleft()
            if not fut.done():
                # Hand the slot over: ``active`` stays the same, so nobody can jump in
                # between this release and the oldest waiter resuming.
                fut.set_result(True)
                return
        self._active -= 1

    def _arm(self, loop: asyncio.AbstractEventLoop, deadline: float) -> None:
        self._timer_deadline = deadline
        self._timer = loop.call_at(deadline, self._expire)

    def _expire(self) -> None:
        # Deadlines are non-decreasing along the queue, so everything up to the deadline
        # this timer was armed for is expired and the rest is still in time. Comparing
        # against the armed deadline (not loop.time()) avoids clock-resolution slop.
        self._timer = None
        limit = self._timer_deadline
        waiters = self._waiters
        while waiters:
            fut, deadline = waiters[0]
            if fut.done():
                waiters.popleft()
                continue
            if deadline > limit:
                self._arm(fut.get_loop(), deadline)
                return
            waiters.popleft()
            fut.set_result(False)

    def _error(self, code: str, message: str) -> RateLimitedError:
        return RateLimitedError(
            code,
            message,
            category=ErrorCategory.RATE_LIMITED,
            retryable=True,
            resumable=True,
            details={"model_budget": self.snapshot()},
        )

    def __repr__(self) -> str:
        return f"ModelConcurrencyBudget({self.snapshot()!r})"


class BoundedModelProvider:
    """A model provider whose every stream holds one slot of a ``ModelConcurrencyBudget``.

    Made by ``budget.wrap(provider)``. Only ``stream`` is bounded; any other attribute is
    read from the wrapped provider.
    """

    __slots__ = ("_budget", "_provider")

    def __init__(self, provider: Any, budget: ModelConcurrencyBudget) -> None:
        self._provider = provider
        self._budget = budget

    @property
    def budget(self) -> ModelConcurrencyBudget:
        """The budget whose slots this provider's streams hold."""
        return self._budget

    @property
    def wrapped(self) -> Any:
        """The provider this one bounds."""
        return self._provider

    async def stream(self, request: Any, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        """Yield the wrapped provider's stream items while holding one budget slot.

        The slot is taken at the first read, before the wrapped ``stream`` is called: a
        refusal means no request reached the provider. It is returned when the stream is
        exhausted, raises, is cancelled, or is closed early (``aclose()``, or dropped and
        finalised by the event loop). The inner stream is closed in every case. Raises
        ``RateLimitedError`` ``model.queue_full`` or ``model.queue_timeout``.
        """
        async with self._budget.lease():
            inner = self._provider.stream(request, *args, **kwargs)
            if not hasattr(inner, "__aiter__") and hasattr(inner, "__await__"):
                inner = await inner  # a coroutine that returns the stream
            try:
                async for item in inner:
                    yield item
            finally:
                # Close it here, inside the slot: its connection is part of the call.
                aclose = getattr(inner, "aclose", None)
                if aclose is not None:
                    await aclose()

    def __getattr__(self, name: str) -> Any:
        # Reached only for names not defined here: the wrapper stays transparent.
        # The slot names are refused so a half-built copy cannot recurse forever.
        if name in BoundedModelProvider.__slots__:
            raise AttributeError(name)
        return getattr(self._provider, name)

    def __repr__(self) -> str:
        return f"BoundedModelProvider({self._provider!r})"
