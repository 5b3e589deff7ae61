"""ModelConcurrencyBudget: bounds, FIFO hand-off, timeouts, cancellation, wrap()."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import gc
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from pooling.budget import BoundedModelProvider, ModelConcurrencyBudget
from sageproject.errors import ErrorCategory, SageError
from tests.pooling.helpers import cancel
from tests.waiting import turns_until

SNAPSHOT_KEYS = [
    "limit",
    "active",
    "waiting",
    "max_waiting",
    "wait_timeout_seconds",
    "rejected",
    "timed_out",
]


class Holder:
    """Holds one budget slot until ``release()``; lets tests stage queues precisely."""

    def __init__(self, budget: ModelConcurrencyBudget) -> None:
        self.budget = budget
        self.entered = asyncio.Event()
        self.done = asyncio.Event()
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        async with self.budget.lease():
            self.entered.set()
            await self.done.wait()

    async def release(self) -> None:
        self.done.set()
        await self.task


async def queue_waiter(
    budget: ModelConcurrencyBudget, order: list[str], name: str, hold: asyncio.Event | None = None
) -> None:
    async with budget.lease():
        order.append(name)
        if hold is not None:
            await hold.wait()


async def enqueue(budget: ModelConcurrencyBudget, coro: Any) -> asyncio.Task[Any]:
    """Start ``coro`` and wait until it has joined the budget's queue."""
    before = budget.waiting
    task = asyncio.create_task(coro)
    await turns_until(lambda: budget.waiting == before + 1)
    return task


async def body_held_budget() -> tuple[ModelConcurrencyBudget, Callable[[], Awaitable[Any]]]:
    """A budget of one slot that the test body itself holds, and the release of that slot:
    unlike ``Holder.release`` it does not yield, so the slot passes to the first waiter
    before that waiter has resumed."""
    budget = ModelConcurrencyBudget(1)
    held = budget.lease()
    await held.__aenter__()
    return budget, functools.partial(held.__aexit__, None, None, None)


async def full_budget(**options: Any) -> tuple[ModelConcurrencyBudget, Holder]:
    """A budget of one slot (``options`` as the budget takes them), held by the returned
    ``Holder``: every other caller queues."""
    budget = ModelConcurrencyBudget(1, **options)
    holder = Holder(budget)
    await holder.entered.wait()
    return budget, holder


async def refusal(budget: ModelConcurrencyBudget, code: str) -> dict[str, Any]:
    """Ask ``budget`` for a slot, which it must refuse with ``code`` (a rate limit the run
    may retry and resume); returns the budget's snapshot the error carries."""
    with pytest.raises(SageError) as caught:
        async with budget.lease():
            pass
    error = caught.value
    assert error.code == code
    assert error.category is ErrorCategory.RATE_LIMITED
    assert error.retryable and error.resumable
    return error.details["model_budget"]


class Line:
    """Named callers joining a budget's queue, and the order in which they got a slot."""

    def __init__(self, budget: ModelConcurrencyBudget) -> None:
        self.budget = budget
        self.order: list[str] = []

    async def join(self, name: str) -> asyncio.Task[None]:
        """Start the caller ``name`` (see ``queue_waiter``); returns once it queues."""
        return await enqueue(self.budget, queue_waiter(self.budget, self.order, name))


# -- validation ------------------------------------------------------------------------


@pytest.mark.parametrize("limit", [0, -1, 1.0, True, "2", None])
def test_it_rejects_an_invalid_limit(limit: Any) -> None:
    with pytest.raises(ValueError):
        ModelConcurrencyBudget(limit)


@pytest.mark.parametrize("max_waiting", [-1, 1.5, False, "3", None])
def test_it_rejects_an_invalid_max_waiting(max_waiting: Any) -> None:
    with pytest.raises(ValueError):
        ModelConcurrencyBudget(2, max_waiting=max_waiting)


@pytest.mark.parametrize("timeout", [0, -1, math.inf, math.nan, True, "5", None])
def test_it_rejects_an_invalid_wait_timeout(timeout: Any) -> None:
    with pytest.raises(ValueError):
        ModelConcurrencyBudget(2, wait_timeout_seconds=timeout)


def test_it_has_the_documented_defaults_and_snapshot_order() -> None:
    snapshot = ModelConcurrencyBudget().snapshot()
    assert list(snapshot) == SNAPSHOT_KEYS
    assert snapshot == {
        "limit": 8,
        "active": 0,
        "waiting": 0,
        "max_waiting": 128,
        "wait_timeout_seconds": 60,
        "rejected": 0,
        "timed_out": 0,
    }


# -- admission ---------------------------------------------------------------------------


async def test_it_admits_up_to_the_limit_without_waiting() -> None:
    budget = ModelConcurrencyBudget(2)
    async with budget.lease(), budget.lease():
        assert budget.snapshot()["active"] == 2
        assert budget.snapshot()["waiting"] == 0
    assert budget.snapshot()["active"] == 0


# An error of the body, and an upstream timeout (not a wait for a slot: never counted).
@pytest.mark.parametrize("error", [RuntimeError("boom"), TimeoutError("upstream read timed out")])
async def test_it_returns_the_slot_and_passes_an_error_of_the_body_through_uncounted(
    error: Exception,
) -> None:
    budget = ModelConcurrencyBudget(1)
    with pytest.raises(type(error)):
        async with budget.lease():
            raise error
    assert budget.snapshot()["timed_out"] == 0
    assert budget.snapshot()["active"] == 0


async def test_it_queues_a_caller_when_every_slot_is_held() -> None:
    budget, holder = await full_budget()
    line = Line(budget)
    waiter = await line.join("w")
    assert budget.snapshot()["waiting"] == 1
    assert line.order == []
    await holder.release()
    await waiter
    assert line.order == ["w"]
    assert budget.snapshot()["active"] == 0
    assert budget.snapshot()["waiting"] == 0


async def test_it_rejects_the_third_waiter_when_the_queue_is_full() -> None:
    budget, holder = await full_budget(max_waiting=2)
    line = Line(budget)
    waiters = [await line.join(f"w{i}") for i in range(2)]
    refused = await refusal(budget, "model.queue_full")
    assert refused == {
        "limit": 1,
        "active": 1,
        "waiting": 2,
        "max_waiting": 2,
        "wait_timeout_seconds": 60,
        "rejected": 1,
        "timed_out": 0,
    }
    await holder.release()
    await asyncio.gather(*waiters)
    assert line.order == ["w0", "w1"]
    assert budget.snapshot()["rejected"] == 1


async def test_it_admits_only_immediate_calls_when_max_waiting_is_zero() -> None:
    budget = ModelConcurrencyBudget(1, max_waiting=0)
    async with budget.lease():
        with pytest.raises(SageError) as caught:
            async with budget.lease():
                pass
    assert caught.value.code == "model.queue_full"
    async with budget.lease():
        assert budget.snapshot()["active"] == 1


# -- FIFO --------------------------------------------------------------------------------


async def test_it_hands_released_slots_to_waiters_in_arrival_order() -> None:
    budget, holder = await full_budget()
    line = Line(budget)
    waiters = [await line.join(f"w{i}") for i in range(5)]
    await holder.release()
    await asyncio.gather(*waiters)
    assert line.order == ["w0", "w1", "w2", "w3", "w4"]


async def test_it_never_lets_a_newcomer_jump_the_queue_after_a_release() -> None:
    budget, release = await body_held_budget()
    line = Line(budget)
    first = await line.join("queued")
    await release()
    # The slot now belongs to the queued waiter even though it has not resumed yet.
    assert budget.snapshot()["active"] == 1
    newcomer = asyncio.create_task(queue_waiter(budget, line.order, "newcomer"))
    await asyncio.gather(first, newcomer)
    assert line.order == ["queued", "newcomer"]


# -- timeouts ------------------------------------------------------------------------------


@pytest.mark.timing
async def test_it_times_out_a_waiter_that_gets_no_slot() -> None:
    budget, holder = await full_budget(wait_timeout_seconds=0.05)
    refused = await refusal(budget, "model.queue_timeout")
    assert (refused["timed_out"], refused["waiting"]) == (1, 0)
    await holder.release()
    assert budget.snapshot()["active"] == 0
    assert budget.snapshot()["timed_out"] == 1


@pytest.mark.timing
async def test_it_times_out_every_expired_waiter_and_serves_the_later_ones() -> None:
    budget, holder = await full_budget(wait_timeout_seconds=0.05)
    results = await asyncio.gather(
        *(queue_waiter(budget, [], str(i)) for i in range(3)), return_exceptions=True
    )
    assert [getattr(r, "code", None) for r in results] == ["model.queue_timeout"] * 3
    assert budget.snapshot()["timed_out"] == 3
    line = Line(budget)
    late = await line.join("late")
    await holder.release()
    await late
    assert line.order == ["late"]
    assert budget.snapshot()["active"] == 0


@pytest.mark.timing
async def test_it_never_cuts_off_an_admitted_call_at_the_wait_timeout() -> None:
    budget = ModelConcurrencyBudget(1, wait_timeout_seconds=0.05)
    outcome: list[str] = []

    async def long_call() -> None:
        async with budget.lease():
            # The body outlives the wait timeout: another caller times out waiting for us.
            with pytest.raises(SageError) as caught:
                async with budget.lease():
                    pass
            assert caught.value.code == "model.queue_timeout"
            outcome.append("finished")

    await long_call()
    assert outcome == ["finished"]
    assert budget.snapshot()["active"] == 0


# -- cancellation --------------------------------------------------------------------------


async def test_it_drops_a_cancelled_waiter_from_the_queue() -> None:
    budget, holder = await full_budget()
    line = Line(budget)
    doomed = await line.join("doomed")
    survivor = await line.join("survivor")
    await cancel(doomed)
    assert budget.snapshot()["waiting"] == 1
    await holder.release()
    await survivor
    assert line.order == ["survivor"]
    assert budget.snapshot()["active"] == 0


async def test_it_does_not_leak_a_slot_when_a_waiter_is_cancelled_during_hand_off() -> None:
    budget, release = await body_held_budget()
    line = Line(budget)
    handed = await line.join("handed")
    nxt = await line.join("next")
    # Releasing does not yield, so ``handed`` owns the slot but has not resumed yet.
    await release()
    assert budget.snapshot()["waiting"] == 1
    # The slot has been handed to ``handed`` but it has not resumed: cancel it now.
    assert budget.snapshot()["active"] == 1
    await cancel(handed)
    # A leaked slot would leave ``next`` queued forever; fail instead of hanging.
    async with asyncio.timeout(5):
        await nxt
    assert line.order == ["next"]
    assert budget.snapshot()["active"] == 0
    assert budget.snapshot()["waiting"] == 0


async def test_it_returns_the_slot_when_the_body_is_cancelled() -> None:
    budget, holder = await full_budget()
    await cancel(holder.task)
    assert budget.snapshot()["active"] == 0


async def test_it_keeps_counters_consistent_under_random_cancellations() -> None:
    import random

    rng = random.Random(7)
    budget = ModelConcurrencyBudget(3, max_waiting=40)
    peak = 0

    async def call(i: int) -> None:
        nonlocal peak
        async with budget.lease():
            peak = max(peak, budget.active)
            for _ in range(rng.randint(0, 3)):
                await asyncio.sleep(0)

    for _wave in range(10):
        tasks = [asyncio.create_task(call(i)) for i in range(30)]
        for _ in range(rng.randint(0, 5)):
            await asyncio.sleep(0)
        for task in rng.sample(tasks, 10):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert budget.snapshot()["active"] == 0
        assert budget.snapshot()["waiting"] == 0
    assert peak <= 3


# -- wrap ------------------------------------------------------------------------------------


class FakeProvider:
    """A stand-in model provider: streams ``items`` and records how each stream ended."""

    name = "fake"

    def __init__(
        self, items: list[str], *, fail_after: int | None = None, gate: asyncio.Event | None = None
    ) -> None:
        self.items = items
        self.fail_after = fail_after
        self.gate = gate
        self.closed_streams = 0
        self.requests: list[Any] = []

    async def stream(self, request: Any) -> AsyncIterator[str]:
        self.requests.append(request)
        try:
            for index, item in enumerate(self.items):
                if self.fail_after is not None and index == self.fail_after:
                    raise ConnectionError("upstream reset")
                if self.gate is not None:
                    await self.gate.wait()
                yield item
        finally:
            self.closed_streams += 1

    def capabilities(self) -> dict[str, bool]:
        return {"tools": True}


async def test_it_holds_one_slot_for_the_whole_stream_and_returns_it_at_the_end() -> None:
    budget = ModelConcurrencyBudget(1)
    bounded = budget.wrap(FakeProvider(["a", "b", "c"]))
    seen: list[tuple[str, int]] = []
    async for item in bounded.stream({"prompt": "hi"}):
        seen.append((item, budget.active))
    assert seen == [("a", 1), ("b", 1), ("c", 1)]
    assert budget.snapshot()["active"] == 0


async def test_it_takes_no_slot_before_the_stream_is_first_read() -> None:
    budget = ModelConcurrencyBudget(1)
    provider = FakeProvider(["a"])
    stream = budget.wrap(provider).stream({})
    assert budget.active == 0
    assert provider.requests == []
    assert await anext(stream) == "a"
    assert budget.active == 1
    await stream.aclose()


async def test_it_returns_the_slot_when_the_stream_fails() -> None:
    budget = ModelConcurrencyBudget(1)
    provider = FakeProvider(["a", "b"], fail_after=1)
    with pytest.raises(ConnectionError):
        async for _item in budget.wrap(provider).stream({}):
            pass
    assert budget.snapshot()["active"] == 0
    assert provider.closed_streams == 1


async def test_it_returns_the_slot_when_the_consumer_closes_the_stream_early() -> None:
    budget = ModelConcurrencyBudget(1)
    provider = FakeProvider(["a", "b", "c"])
    stream = budget.wrap(provider).stream({})
    assert await anext(stream) == "a"
    assert budget.active == 1
    await stream.aclose()
    assert budget.snapshot()["active"] == 0
    assert provider.closed_streams == 1


async def test_it_returns_the_slot_when_the_consumer_breaks_out_of_an_aclosing_loop() -> None:
    budget = ModelConcurrencyBudget(1)
    provider = FakeProvider(["a", "b", "c"])
    async with contextlib.aclosing(budget.wrap(provider).stream({})) as stream:
        async for _item in stream:
            break
    assert budget.snapshot()["active"] == 0
    assert provider.closed_streams == 1


async def test_it_returns_the_slot_when_the_consumer_drops_the_stream() -> None:
    budget = ModelConcurrencyBudget(1)
    provider = FakeProvider(["a", "b", "c"])
    stream = budget.wrap(provider).stream({})
    assert await anext(stream) == "a"
    del stream
    gc.collect()  # the loop's async-generator hook closes a dropped stream
    await turns_until(lambda: budget.active == 0)
    assert provider.closed_streams == 1


async def test_it_returns_the_slot_when_the_streaming_task_is_cancelled() -> None:
    budget = ModelConcurrencyBudget(1)
    gate = asyncio.Event()
    provider = FakeProvider(["a"], gate=gate)
    started = asyncio.Event()

    async def consume() -> None:
        stream = budget.wrap(provider).stream({})
        started.set()
        async for _item in stream:
            pass

    task = asyncio.create_task(consume())
    await started.wait()
    await turns_until(lambda: budget.active == 1)
    await cancel(task)
    assert budget.snapshot()["active"] == 0
    assert provider.closed_streams == 1


async def test_it_sends_no_upstream_request_when_the_queue_is_full() -> None:
    budget = ModelConcurrencyBudget(1, max_waiting=0)
    provider = FakeProvider(["a"])
    async with budget.lease():
        with pytest.raises(SageError) as caught:
            async for _item in budget.wrap(provider).stream({"n": 1}):
                pass
    assert caught.value.code == "model.queue_full"
    assert provider.requests == []
    assert budget.snapshot()["active"] == 0


async def test_it_holds_one_slot_when_a_provider_is_wrapped_twice() -> None:
    budget = ModelConcurrencyBudget(1, max_waiting=0)
    twice = budget.wrap(budget.wrap(FakeProvider(["a", "b"])))
    seen = [(item, budget.active) async for item in twice.stream({})]
    assert seen == [("a", 1), ("b", 1)]
    assert budget.snapshot()["active"] == 0


def test_it_wraps_idempotently_for_the_same_budget() -> None:
    budget = ModelConcurrencyBudget(1)
    other = ModelConcurrencyBudget(1)
    bounded = budget.wrap(FakeProvider([]))
    assert budget.wrap(bounded) is bounded
    assert other.wrap(bounded) is not bounded


async def test_it_forwards_other_attributes_to_the_wrapped_provider() -> None:
    budget = ModelConcurrencyBudget(1)
    provider = FakeProvider([])
    bounded = budget.wrap(provider)
    assert isinstance(bounded, BoundedModelProvider)
    assert bounded.name == "fake"
    assert bounded.capabilities() == {"tools": True}
    assert bounded.wrapped is provider
    with pytest.raises(AttributeError):
        _ = bounded.no_such_attribute


def test_it_copies_a_wrapped_provider_without_recursing() -> None:
    budget = ModelConcurrencyBudget(1)
    bounded = budget.wrap(FakeProvider(["a"]))
    duplicate = copy.copy(bounded)
    assert duplicate.budget is budget
    assert duplicate.wrapped is bounded.wrapped
