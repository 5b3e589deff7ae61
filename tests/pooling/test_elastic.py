"""Tests for pooling.elastic: the production shapes of seed 003, plus the failure edges."""

from __future__ import annotations

import asyncio
import itertools
import logging

import pytest

from pooling.elastic import (
    ElasticPool,
    Janitor,
    PoolStats,
    SpareFactory,
    grow_step_for,
    pool_with_spares,
    shrink_step_for,
    spares_for,
)
from sageproject.errors import SageError
from tests.pooling.helpers import cancel
from tests.waiting import turns_until


class Boots:
    """A fake state source: counts boots and closes; boots can be held at a gate."""

    def __init__(self, *, ticks: int = 1) -> None:
        self.ticks = ticks
        self.gate: asyncio.Event | None = None
        self.started = asyncio.Event()
        self.fail_next = 0
        self.booted = 0
        self.closed: list[int] = []
        self._ids = itertools.count(1)

    async def factory(self) -> int:
        self.started.set()
        if self.gate is not None:
            await self.gate.wait()
        for _ in range(self.ticks):
            await asyncio.sleep(0)
        if self.fail_next:
            self.fail_next -= 1
            raise RuntimeError("boot failed")
        self.booted += 1
        return next(self._ids)

    async def closer(self, state: int) -> None:
        self.closed.append(state)


def make_pool(boots: Boots, **kwargs: object) -> ElasticPool[int]:
    kwargs.setdefault("max_size", 64)
    return ElasticPool(boots.factory, boots.closer, **kwargs)  # type: ignore[arg-type]


async def hold_many(
    pool: ElasticPool[int], n: int
) -> tuple[list[asyncio.Task[None]], asyncio.Event]:
    """Start ``n`` callers that each hold a state until the returned event is set."""
    release = asyncio.Event()
    holding = 0
    all_holding = asyncio.Event()

    async def hold() -> None:
        nonlocal holding
        async with pool.checkout():
            holding += 1
            if holding == n:
                all_holding.set()
            await release.wait()

    tasks = [asyncio.create_task(hold()) for _ in range(n)]
    await all_holding.wait()
    return tasks, release


async def grow_to(pool: ElasticPool[int], n: int) -> None:
    tasks, release = await hold_many(pool, n)
    release.set()
    await asyncio.gather(*tasks)


async def wait_for_waiters(pool: ElasticPool[int], n: int) -> None:
    await turns_until(lambda: pool.stats().waiting >= n)


def checkout_task(pool: ElasticPool[int]) -> asyncio.Task[None]:
    """A caller, as a task, that checks one state out of ``pool`` and straight back in."""

    async def checkout() -> None:
        async with pool.checkout():
            pass

    return asyncio.create_task(checkout())


async def queued_checkout(pool: ElasticPool[int]) -> asyncio.Task[None]:
    """A ``checkout_task`` of a full pool, once it waits in the queue."""
    waiting = pool.stats().waiting
    task = checkout_task(pool)
    await wait_for_waiters(pool, waiting + 1)
    return task


def test_it_derives_the_grow_step_from_the_ceiling() -> None:
    assert [grow_step_for(n) for n in (1, 8, 9, 64, 76, 1000)] == [1, 1, 2, 8, 8, 8]


def test_it_derives_the_shrink_step_from_the_live_in_use_count() -> None:
    assert shrink_step_for(created=10, in_use=0, resident=1, idle_headroom=1) == 9
    assert shrink_step_for(created=10, in_use=1, resident=1, idle_headroom=1) == 4
    assert shrink_step_for(created=10, in_use=7, resident=1, idle_headroom=1) == 1
    assert shrink_step_for(created=2, in_use=1, resident=1, idle_headroom=1) == 0


def test_it_rejects_a_ceiling_below_one() -> None:
    boots = Boots()
    with pytest.raises(ValueError):
        make_pool(boots, max_size=0)


async def test_it_reuses_one_state_for_a_sequential_caller() -> None:
    boots = Boots()
    pool = make_pool(boots, max_size=76)
    for _ in range(5):
        async with pool.checkout():
            pass
    assert pool.stats().created == 1
    assert boots.booted == 1


async def test_it_creates_exactly_two_states_for_two_overlapping_requests_on_76_wide() -> None:
    boots = Boots()
    boots.gate = asyncio.Event()
    pool = make_pool(boots, max_size=76)
    first_in = asyncio.Event()
    release = asyncio.Event()

    async def request(entered: asyncio.Event | None) -> None:
        async with pool.checkout():
            if entered is not None:
                entered.set()
            await release.wait()

    a = asyncio.create_task(request(first_in))
    await boots.started.wait()
    b = asyncio.create_task(request(None))
    await wait_for_waiters(pool, 1)
    boots.gate.set()
    await first_in.wait()
    await turns_until(lambda: pool.stats().in_use == 2)
    release.set()
    await asyncio.gather(a, b)
    assert pool.stats().created == 2
    assert boots.booted == 2


async def test_it_stays_far_below_the_ceiling_for_50_concurrent_requests() -> None:
    boots = Boots(ticks=5)
    pool = make_pool(boots, max_size=64)

    async def request() -> None:
        async with pool.checkout():
            await asyncio.sleep(0)

    await asyncio.gather(*(request() for _ in range(50)))
    stats = pool.stats()
    # Growth follows the queue in steps of 8, not the ceiling: well under half of it.
    assert stats.created <= stats.max // 2
    assert 1 < stats.peak_in_use <= stats.created
    assert stats.in_use == 0 and stats.waiting == 0
    await pool.close()
    assert pool.stats().created == 0
    assert len(boots.closed) == boots.booted


async def test_it_never_prewarms_more_than_the_callers_waiting() -> None:
    boots = Boots()
    pool = make_pool(boots, max_size=64)
    await grow_to(pool, 1)
    tasks, release = await hold_many(pool, 1)
    boots.gate = asyncio.Event()
    # A miss (every state checked out) boots one for its caller; three more queue behind it.
    extra, release_extra = [], asyncio.Event()

    async def request() -> None:
        async with pool.checkout():
            await release_extra.wait()

    extra.append(asyncio.create_task(request()))
    await boots.started.wait()
    extra += [asyncio.create_task(request()) for _ in range(3)]
    await wait_for_waiters(pool, 3)
    boots.gate.set()
    await turns_until(lambda: pool.stats().in_use == 5)
    assert pool.stats().created == 5
    release.set()
    release_extra.set()
    await asyncio.gather(*tasks, *extra)


async def test_it_returns_to_the_resident_floor_after_quiet_rounds() -> None:
    boots = Boots()
    pool = make_pool(boots, max_size=64)
    await grow_to(pool, 9)
    assert pool.stats().created == 9
    assert await pool.reclaim_once() == 0  # first quiet round: grace
    assert await pool.reclaim_once() == 8
    assert pool.stats().created == 1
    assert sorted(boots.closed) != []


async def test_it_falls_back_to_the_floor_under_one_request_per_janitor_round() -> None:
    boots = Boots()
    pool = make_pool(boots, max_size=64)
    await grow_to(pool, 9)
    for _ in range(4):
        async with pool.checkout():
            pass
        await pool.reclaim_once()
    assert pool.stats().created == pool.stats().resident == 1


async def test_it_shrinks_one_state_per_round_while_busy_keeping_the_headroom() -> None:
    boots = Boots()
    pool = make_pool(boots, max_size=64)
    await grow_to(pool, 9)
    tasks, release = await hold_many(pool, 1)
    sizes = []
    for _ in range(6):
        await pool.reclaim_once()
        sizes.append(pool.stats().created)
    release.set()
    await asyncio.gather(*tasks)
    # in_use=1: excess 7 -> step 4, excess 3 -> step 2, excess 1 -> step 1, then the floor 2.
    assert sizes == [9, 5, 3, 2, 2, 2]


async def test_it_resets_grace_on_growth() -> None:
    boots = Boots()
    pool = make_pool(boots, max_size=64)
    await grow_to(pool, 4)
    await pool.reclaim_once()
    await grow_to(pool, 5)  # growth: one more state had to boot
    assert await pool.reclaim_once() == 0
    assert await pool.reclaim_once() == 4


async def test_it_does_not_reset_grace_on_checkouts() -> None:
    boots = Boots()
    pool = make_pool(boots, max_size=64)
    await grow_to(pool, 4)
    await pool.reclaim_once()
    for _ in range(3):
        async with pool.checkout():
            pass
    assert await pool.reclaim_once() == 3


async def test_it_closes_idle_states_above_a_lowered_ceiling_at_once() -> None:
    boots = Boots()
    pool = make_pool(boots, max_size=64)
    await grow_to(pool, 6)
    pool.set_max(2)
    assert pool.stats().created == 2
    await pool.close()
    assert len(boots.closed) == 6


async def test_it_closes_a_state_returned_after_the_ceiling_was_lowered() -> None:
    boots = Boots()
    pool = make_pool(boots, max_size=64)
    tasks, release = await hold_many(pool, 4)
    pool.set_max(1)
    assert pool.stats().created == 4  # all checked out; nothing idle to close yet
    release.set()
    await asyncio.gather(*tasks)
    stats = pool.stats()
    assert (stats.created, stats.idle) == (1, 1)
    await pool.close()
    assert len(boots.closed) == 4


async def test_it_does_not_leak_a_slot_when_a_boot_fails() -> None:
    boots = Boots()
    boots.fail_next = 1
    pool = make_pool(boots, max_size=1)
    with pytest.raises(RuntimeError):
        async with pool.checkout():
            pass
    assert pool.stats().created == 0
    async with pool.checkout() as state:
        assert state == 1
    assert pool.stats().created == 1


async def test_it_does_not_leak_when_a_waiter_is_cancelled() -> None:
    boots = Boots()
    pool = make_pool(boots, max_size=1)
    tasks, release = await hold_many(pool, 1)
    waiter = await queued_checkout(pool)
    await cancel(waiter)
    release.set()
    await asyncio.gather(*tasks)
    stats = pool.stats()
    assert (stats.created, stats.idle, stats.in_use, stats.waiting) == (1, 1, 0, 0)


async def test_it_parks_the_state_when_its_booting_caller_is_cancelled() -> None:
    boots = Boots()
    boots.gate = asyncio.Event()
    pool = make_pool(boots, max_size=4)
    caller = checkout_task(pool)
    await boots.started.wait()
    await cancel(caller)
    boots.gate.set()
    await pool.close()
    assert pool.stats().created == 0
    assert boots.closed == [1]


async def test_it_decrements_created_on_shutdown_and_fails_waiters() -> None:
    boots = Boots()
    pool = make_pool(boots, max_size=1)
    tasks, release = await hold_many(pool, 1)
    waiter = await queued_checkout(pool)
    closing = asyncio.create_task(pool.close())
    with pytest.raises(SageError) as info:
        await waiter
    assert info.value.code == "server.elastic_pool_closed"
    release.set()
    await asyncio.gather(*tasks)
    await closing
    await pool.close()
    assert pool.stats().created == 0
    assert boots.closed == [1]


async def test_it_reports_stats_as_a_frozen_value() -> None:
    boots = Boots()
    pool = make_pool(boots, max_size=76, resident=1)
    await grow_to(pool, 3)
    stats = pool.stats()
    assert isinstance(stats, PoolStats)
    assert stats.as_dict() == {
        "created": 3, "idle": 3, "in_use": 0, "waiting": 0, "max": 76, "resident": 1,
        "grow_step": 8, "shrink_step": 2, "peak_in_use": 3,
    }
    with pytest.raises(AttributeError):
        stats.created = 9  # type: ignore[misc]


async def test_it_samples_history_on_growth_and_on_janitor_rounds() -> None:
    boots = Boots()
    pool = make_pool(boots, max_size=8)
    await grow_to(pool, 2)
    grown = len(pool.history())
    await pool.reclaim_once()
    history = pool.history()
    assert grown >= 2
    assert len(history) == grown + 1
    assert history[-1][1:] == (2, 0)


async def test_it_keeps_the_janitor_running_when_a_pool_fails(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Broken(ElasticPool[int]):
        async def reclaim_once(self) -> int:
            raise RuntimeError("broken pool")

    boots = Boots()
    broken = Broken(boots.factory, boots.closer, max_size=4)
    healthy = make_pool(boots, max_size=8, shrink_grace_rounds=1)
    await grow_to(healthy, 3)
    janitor = Janitor(interval=30.0)
    janitor.register(broken)
    janitor.register(healthy)
    with caplog.at_level(logging.ERROR, logger="pooling.elastic"):
        closed = await janitor.run_round()
    assert closed == 2
    assert "reclaim failed" in caplog.text


async def test_it_runs_janitor_rounds_in_its_own_task_until_stopped() -> None:
    shrunk = asyncio.Event()

    class Watched(ElasticPool[int]):
        async def reclaim_once(self) -> int:
            closed = await super().reclaim_once()
            if self.stats().created == 1:
                shrunk.set()
            return closed

    boots = Boots()
    pool = Watched(boots.factory, boots.closer, max_size=8, shrink_grace_rounds=1)
    await grow_to(pool, 3)
    janitor = Janitor(interval=0.001)
    janitor.register(pool)
    janitor.start()
    await asyncio.wait_for(shrunk.wait(), timeout=10)
    await janitor.stop()
    janitor.unregister(pool)
    assert janitor.rounds >= 1
    assert pool.stats().created == 1


async def test_it_never_grows_past_the_ceiling_and_serves_every_waiter() -> None:
    boots = Boots(ticks=3)
    pool = make_pool(boots, max_size=4)
    served = 0

    async def request() -> None:
        nonlocal served
        async with pool.checkout():
            assert pool.stats().created <= 4
            await asyncio.sleep(0)
            served += 1

    await asyncio.gather(*(request() for _ in range(40)))
    assert served == 40
    assert pool.stats().created == pool.stats().peak_in_use == 4


async def test_it_lets_queued_callers_grow_when_the_ceiling_is_raised() -> None:
    boots = Boots()
    pool = make_pool(boots, max_size=1)
    tasks, release = await hold_many(pool, 1)
    got = asyncio.Event()

    async def request() -> None:
        async with pool.checkout():
            got.set()

    waiter = asyncio.create_task(request())
    await wait_for_waiters(pool, 1)
    pool.set_max(2)
    await got.wait()
    assert pool.stats().created == 2
    release.set()
    await asyncio.gather(*tasks, waiter)


# --- spares booted ahead of demand -------------------------------------------------------------


def spare_pool(
    spares: int, **kwargs: object
) -> tuple[Boots, ElasticPool[int], SpareFactory[int]]:
    """A pool of new ``Boots`` with ``spares`` spares (``kwargs`` as ``pool_with_spares``
    takes them; a ceiling of 64 unless given): the boots, the pool and its spare factory."""
    boots = Boots()
    kwargs.setdefault("max_size", 64)
    pool, factory = pool_with_spares(boots.factory, boots.closer, spares=spares, **kwargs)
    assert factory is not None
    return boots, pool, factory


async def test_it_boots_on_demand_only_without_spares() -> None:
    boots = Boots()
    pool, factory = pool_with_spares(boots.factory, boots.closer, spares=0, max_size=4)
    assert factory is None
    await grow_to(pool, 1)
    for _ in range(10):
        await asyncio.sleep(0)
    assert boots.booted == pool.stats().created == 1


def test_it_derives_the_spares_from_the_grow_step() -> None:
    assert [spares_for(n) for n in (1, 8, 9, 17, 64, 76)] == [1, 1, 2, 3, 3, 3]


async def test_it_hands_a_miss_the_spare_booted_ahead() -> None:
    boots, pool, factory = spare_pool(1)
    tasks, release = await hold_many(pool, 1)  # boots state 1 and, ahead of demand, spare 2
    await turns_until(lambda: boots.booted == 2)
    boots.gate = asyncio.Event()  # from now on no boot can finish
    async with pool.checkout() as state:
        # The miss got the booted spare without waiting for a boot; a refill is under way.
        assert state == 2
        assert factory.held == 1
    release.set()
    await asyncio.gather(*tasks)
    boots.gate.set()
    await pool.close()


async def test_it_keeps_the_pool_policy_with_spares_two_overlapping_requests_make_two() -> None:
    _, pool, factory = spare_pool(1, max_size=76)
    await grow_to(pool, 2)
    assert pool.stats().created == 2  # the spare is not a pool state
    assert factory.held == 1
    await pool.close()


async def test_it_trims_spares_to_one_once_the_pool_sits_idle_and_regrows_them() -> None:
    boots, pool, factory = spare_pool(3)
    await grow_to(pool, 2)
    await turns_until(lambda: boots.booted == 5)  # two states, three spares
    assert factory.held == 3
    await pool.reclaim_once()  # the round that saw the checkouts
    await pool.reclaim_once()  # first idle round: grace
    assert factory.held == 3
    await pool.reclaim_once()  # second idle round
    assert (pool.stats().created, factory.held) == (1, 1)  # the floor plus one spare at rest
    assert len(boots.closed) == 3
    tasks, release = await hold_many(pool, 2)  # the second caller misses and takes the spare
    await turns_until(lambda: factory.held == 3)
    release.set()
    await asyncio.gather(*tasks)
    await pool.close()


async def test_it_keeps_the_spares_under_steady_traffic_that_does_not_grow_the_pool() -> None:
    _, pool, factory = spare_pool(2)
    await grow_to(pool, 1)
    await turns_until(lambda: factory.held == 2)
    for _ in range(4):  # one checkout per janitor round: never idle, never growing
        async with pool.checkout():
            pass
        await pool.reclaim_once()
    assert factory.held == 2
    await pool.close()


async def test_it_closes_the_spares_with_the_pool() -> None:
    boots, pool, factory = spare_pool(2)
    await grow_to(pool, 1)
    await pool.close()
    assert factory.held == 0
    assert sorted(boots.closed) == [1, 2, 3]  # the pool's state and both spares
    with pytest.raises(SageError) as info:
        await factory()
    assert info.value.code == "server.elastic_pool_closed"


async def test_it_keeps_a_spare_whose_caller_was_cancelled() -> None:
    boots = Boots()
    boots.gate = asyncio.Event()
    factory = SpareFactory(boots.factory, boots.closer, spares=0)
    call = asyncio.create_task(factory())
    await boots.started.wait()
    await cancel(call)
    assert factory.held == 1  # the boot goes on and becomes the next caller's state
    boots.gate.set()
    assert await factory() == 1
    await factory.close()
