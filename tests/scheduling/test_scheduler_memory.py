"""InMemoryScheduler: the shared contract plus behaviour only this backend has."""

from __future__ import annotations

import asyncio
from datetime import datetime

import pytest

from sageproject.errors import ErrorCategory
from scheduling.scheduler import (
    ClaimCandidate,
    InMemoryScheduler,
    LeaseReleaseReason,
    SchedulerClaimPolicy,
    SchedulerQuotaGroup,
    WorkItem,
    fair_order,
    worker_shutdown_error,
)
from tests.scheduling.scheduler_contract import (
    BOUND,
    LEASE,
    FencedExecutionContract,
    ManualClock,
    SchedulerContract,
    default_work,
    make_scheduler_fixture,
    mid_write,
    spin,
    within,
)

make_scheduler = make_scheduler_fixture(InMemoryScheduler)


class TestInMemoryScheduler(SchedulerContract, FencedExecutionContract):
    capabilities = {
        "durable_across_process_restart": False,
        "supports_atomic_tenant_quota": True,
        "supports_atomic_fenced_mutations": True,
    }


# ---------------------------------------------------------------------- construction


def test_it_rejects_a_non_positive_pending_limit():
    with pytest.raises(ValueError, match="max_pending_items must be positive"):
        InMemoryScheduler(max_pending_items=0)


def test_it_rejects_a_negative_terminal_retention():
    with pytest.raises(ValueError, match="max_retained_terminal_items must be non-negative"):
        InMemoryScheduler(max_retained_terminal_items=-1)


def test_it_rejects_invalid_group_limits():
    with pytest.raises(ValueError):
        SchedulerQuotaGroup(0, 2, 10)


def test_it_rejects_a_non_positive_tenant_limit_in_a_policy():
    with pytest.raises(ValueError):
        SchedulerClaimPolicy(max_active_per_tenant=0)


def test_it_rejects_a_priority_out_of_range():
    with pytest.raises(ValueError):
        default_work("w1", priority=101)


def test_it_rejects_a_naive_available_at():
    with pytest.raises(ValueError):
        default_work("w1", available_at=datetime(2026, 1, 1))


# ---------------------------------------------------------------------- fair_order


def _candidate(tenant: str | None, priority: int, order: int) -> ClaimCandidate:
    return ClaimCandidate(tenant_id=tenant, priority=priority, submit_order=order)


def test_it_orders_by_running_count_before_priority():
    ranked = fair_order([_candidate("alice", 50, 1), _candidate("bob", 0, 2)], {"alice": 1})
    assert [c.tenant_id for c in ranked] == ["bob", "alice"]


def test_it_orders_by_priority_then_age_under_the_plain_order():
    ranked = fair_order(
        [_candidate("alice", 0, 1), _candidate("bob", 5, 3), _candidate("carol", 5, 2)],
        {"carol": 4},
        order="oldest",
    )
    assert [c.tenant_id for c in ranked] == ["carol", "bob", "alice"]


def test_it_drops_saturated_tenants_but_not_untenanted_work():
    ranked = fair_order(
        [_candidate("alice", 0, 1), _candidate(None, 0, 2)],
        {"alice": 2, None: 5},
        max_active_per_tenant=2,
    )
    assert [c.tenant_id for c in ranked] == [None]


# ---------------------------------------------------------------------- internals


async def test_it_keeps_only_the_newest_terminal_keys():
    scheduler = InMemoryScheduler(max_retained_terminal_items=4)
    for i in range(10):
        await scheduler.submit(default_work(f"w{i}"))
        lease = await scheduler.claim("w", lease_duration=LEASE, wait_timeout=0)
        await scheduler.release(lease, LeaseReleaseReason.COMPLETED)
    assert scheduler.fence_sequence == 10
    assert len(scheduler._idempotency) == 4
    assert await scheduler.submit(default_work("w9")) is False
    assert await scheduler.submit(default_work("w0")) is True


async def test_it_leaves_the_heaps_empty_after_cancelling_delayed_work():
    clock = ManualClock()
    scheduler = InMemoryScheduler(clock=clock)
    await scheduler.submit(default_work("w1", available_at=clock.now.replace(year=2030)))
    await scheduler.cancel("w1")
    assert scheduler._delayed == [] and scheduler._ready == {}


async def test_it_leaves_no_pins_after_all_writes_finish():
    scheduler = InMemoryScheduler()
    leases = []
    for i in range(8):
        await scheduler.submit(default_work(f"w{i}", tenant_id=f"t{i}"))
        leases.append(await scheduler.claim("w", lease_duration=LEASE, wait_timeout=0))

    async def op() -> None:
        await asyncio.sleep(0)

    await within(
        asyncio.gather(*(scheduler.execute_fenced(lease, op) for lease in leases for _ in range(4)))
    )
    assert scheduler.pinned_runs() == frozenset()


async def test_it_lists_live_leases_and_pending_work_of_a_group():
    group = SchedulerQuotaGroup(8, 2, 100)
    chat = InMemoryScheduler(quota_group=group)
    managed = InMemoryScheduler(quota_group=group)
    await chat.submit(default_work("c1"))
    await chat.submit(default_work("c2"))
    await managed.submit(default_work("m1"))
    lease = await managed.claim("w", lease_duration=LEASE, wait_timeout=0)
    assert group.leases() == (lease,)
    assert group.pending() == 2


async def test_it_shares_one_fencing_sequence_across_a_group():
    group = SchedulerQuotaGroup(8, 2, 100)
    chat = InMemoryScheduler(quota_group=group)
    managed = InMemoryScheduler(quota_group=group)
    await chat.submit(default_work("c1"))
    await managed.submit(default_work("m1", tenant_id="bob"))
    first = await chat.claim("w", lease_duration=LEASE, wait_timeout=0)
    second = await managed.claim("w", lease_duration=LEASE, wait_timeout=0)
    assert second.fencing_token == first.fencing_token + 1


async def test_it_releases_group_capacity_even_if_close_is_cancelled():
    group = SchedulerQuotaGroup(1, 1, 10)
    chat = InMemoryScheduler(quota_group=group)
    await chat.submit(default_work("c1"))
    lease = await chat.claim("w", lease_duration=LEASE, wait_timeout=0)
    write, gate = await mid_write(chat, lease)
    close = asyncio.create_task(chat.close())
    await spin()
    close.cancel()
    with pytest.raises(asyncio.CancelledError):
        await close
    assert group.active_total == 1  # the write in flight still holds its slot
    gate.set()
    await within(write)
    assert group.active_total == 0 and group.leases() == ()


async def test_it_does_not_spin_a_waiting_claim_on_an_expired_pinned_lease():
    clock = ManualClock()
    scheduler = InMemoryScheduler(clock=clock)
    await scheduler.submit(default_work("w1"))
    lease = await scheduler.claim("w", lease_duration=LEASE, wait_timeout=0)
    write, gate = await mid_write(scheduler, lease)
    clock.advance(31)
    assert await scheduler.reap_expired() == 0
    # The expired-but-pinned lease is parked, so it is no reason to wake a claimer.
    assert scheduler._next_wake_delay(clock.now) is None
    waiter = asyncio.create_task(scheduler.claim("w2", lease_duration=LEASE, wait_timeout=BOUND))
    await spin()
    assert not waiter.done()
    gate.set()
    await within(write)
    taken = await within(waiter)
    assert taken.work.attempt == 2 and taken.fencing_token == lease.fencing_token + 1


def test_it_builds_work_items_with_defaults():
    work = WorkItem(work_id="w1", run_id="r1")
    assert (work.tenant_id, work.priority, work.attempt, dict(work.payload)) == (None, 0, 1, {})
    assert work.available_at.tzinfo is not None


def test_it_describes_a_worker_shutdown_as_resumable_resource_loss():
    error = worker_shutdown_error()
    assert error.code == "scheduler.worker_shutdown"
    assert error.category == ErrorCategory.RESOURCE_LOST
    assert error.resumable is True
