"""The one behaviour suite every `Scheduler` backend must pass.

Use it by subclassing `SchedulerContract` in a ``test_*.py`` module and providing:

- ``make_scheduler`` — a fixture returning a callable
  ``make_scheduler(*, clock=None, max_pending_items=1024, max_retained_terminal_items=4096,
  quota_group=None) -> Scheduler``; the fixture closes what it made at teardown.
- optionally ``make_work`` — a fixture returning ``make_work(work_id, **fields) -> WorkItem``
  (a database backend overrides it to create the Run row the item refers to).

Tests that need expiry use `ManualClock`; the one that proves a waiting claim wakes at
lease expiry with no notification uses the real clock and a short lease, and waits on the
claim itself (bounded), never on a bare sleep.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from sageproject.errors import ErrorCategory, SageError
from scheduling.scheduler import (
    LeaseReleaseReason,
    Scheduler,
    SchedulerClaimPolicy,
    SchedulerQuotaGroup,
    WorkerLease,
    WorkItem,
)

LEASE = timedelta(seconds=30)
BOUND = 10.0  # seconds; an upper bound so a broken scheduler fails instead of hanging


class ManualClock:
    """A clock the test moves by hand."""

    def __init__(self, start: datetime | None = None) -> None:
        self.now = start or datetime(2026, 1, 1, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


async def within[R](aw: Awaitable[R], limit: float = BOUND) -> R:
    return await asyncio.wait_for(aw, limit)


async def spin(times: int = 20) -> None:
    """Yield to the loop so every ready task runs (not a timed wait)."""
    for _ in range(times):
        await asyncio.sleep(0)


async def claim_now(scheduler: Any, worker: str, **options: Any) -> WorkerLease | None:
    """``worker``'s claim on ``scheduler`` of a `LEASE`-long lease, without waiting
    (``options``, e.g. ``policy``, as ``claim`` takes them): the lease, or ``None``."""
    return await scheduler.claim(worker, lease_duration=LEASE, wait_timeout=0, **options)


async def claim_storm(
    members: list[Any],
    make_work: Callable[..., WorkItem],
    *,
    total: int,
    workers: int,
    policy: SchedulerClaimPolicy | None = None,
    bound: float = BOUND,
) -> tuple[int, dict[str, int]]:
    """Submit ``total`` items of three tenants round-robin to ``members``, then let
    ``workers`` claim loops (spread over the members) each claim, hold for a few loop turns
    and release until all are done, within ``bound`` seconds. Returns the peak of live
    leases and each tenant's."""
    tenants = ["alice", "bob", "carol"]
    for i in range(total):
        await members[i % len(members)].submit(make_work(f"w{i}", tenant_id=tenants[i % 3]))
    active: dict[str, int] = {}
    peak_total = 0
    peaks: dict[str, int] = {}
    done = 0

    async def worker(member: Any, name: str) -> None:
        nonlocal done, peak_total
        while done < total:
            lease = await member.claim(name, lease_duration=LEASE, policy=policy, wait_timeout=0.05)
            if lease is None:
                continue
            tenant = lease.work.tenant_id
            active[tenant] = active.get(tenant, 0) + 1
            peaks[tenant] = max(peaks.get(tenant, 0), active[tenant])
            peak_total = max(peak_total, sum(active.values()))
            await spin(3)
            active[tenant] -= 1
            done += 1
            await member.release(lease, LeaseReleaseReason.COMPLETED)

    loops = (worker(members[i % len(members)], f"worker-{i}") for i in range(workers))
    await within(asyncio.gather(*loops), bound)
    assert done == total
    return peak_total, peaks


async def leased(
    scheduler: Any, make_work: Callable[..., WorkItem], name: str, **fields: Any
) -> WorkerLease:
    """Submit the work item ``name`` (with ``fields``) and claim it as ``worker-<name>``;
    the lease."""
    await scheduler.submit(make_work(name, **fields))
    lease = await claim_now(scheduler, f"worker-{name}")
    assert lease is not None and lease.work.work_id == name
    return lease


async def claim_woken_by_release(
    waiting: Awaitable[WorkerLease | None], holder: Any, held: WorkerLease
) -> WorkerLease | None:
    """Start the ``waiting`` claim, check that it waits, release ``held`` (a lease of
    ``holder``) and return what the claim then got."""
    waiter = asyncio.create_task(waiting)
    await spin()
    assert not waiter.done()
    await holder.release(held, LeaseReleaseReason.COMPLETED)
    return await within(waiter)


async def mid_write(scheduler: Any, lease: WorkerLease) -> tuple[asyncio.Task, asyncio.Event]:
    """A fenced write of ``lease`` that has started and waits for its gate: the write's
    task (returning ``"done"``) and the gate."""
    gate, entered = asyncio.Event(), asyncio.Event()

    async def op() -> str:
        entered.set()
        await gate.wait()
        return "done"

    task = asyncio.create_task(scheduler.execute_fenced(lease, op))
    await within(entered.wait())
    return task, gate


def make_scheduler_fixture(backend: Callable[..., Any]) -> Any:
    """A ``make_scheduler`` fixture of ``backend`` (a scheduler class): its callable passes
    its keyword arguments to ``backend``; everything it made is closed at teardown."""

    @pytest.fixture
    async def make_scheduler() -> AsyncIterator[Callable[..., Any]]:
        made: list[Any] = []

        def make(**kwargs: Any) -> Any:
            scheduler = backend(**kwargs)
            made.append(scheduler)
            return scheduler

        yield make
        for scheduler in made:
            await within(scheduler.close())

    return make_scheduler


def default_work(work_id: str, **fields: Any) -> WorkItem:
    fields.setdefault("run_id", f"run-{work_id}")
    fields.setdefault("tenant_id", "alice")
    fields.setdefault("idempotency_key", f"key-{work_id}")
    fields.setdefault("available_at", datetime(2000, 1, 1, tzinfo=UTC))
    return WorkItem(work_id=work_id, **fields)


class SchedulerContract:
    # The backend's capability flags (`SchedulerCapabilities`) that matter.
    capabilities: dict[str, bool]

    @pytest.fixture
    def make_work(self) -> Callable[..., WorkItem]:
        return default_work

    @pytest.fixture
    def clock(self) -> ManualClock:
        return ManualClock()

    @pytest.fixture
    def scheduler(self, make_scheduler: Callable[..., Any], clock: ManualClock) -> Any:
        return make_scheduler(clock=clock)

    @pytest.fixture
    def group_members(
        self, make_scheduler: Callable[..., Any], clock: ManualClock
    ) -> Callable[[int, int, int], tuple[Any, Any]]:
        """``group_members(max_active, max_per_tenant, max_pending)``: two schedulers (the
        ``chat`` and ``managed`` queues) sharing one new quota group."""

        def make(max_active: int, max_per_tenant: int, max_pending: int) -> tuple[Any, Any]:
            group = SchedulerQuotaGroup(max_active, max_per_tenant, max_pending)
            return (
                make_scheduler(clock=clock, quota_group=group),
                make_scheduler(clock=clock, quota_group=group),
            )

        return make

    # ------------------------------------------------------------------ submit

    async def test_it_implements_the_scheduler_protocol(self, scheduler):
        assert isinstance(scheduler, Scheduler)

    async def test_it_reports_its_capabilities(self, make_scheduler):
        caps = make_scheduler(max_pending_items=5).capabilities()
        assert caps.max_pending_items == 5
        assert {flag: getattr(caps, flag) for flag in self.capabilities} == self.capabilities

    async def test_it_accepts_new_work_as_pending(self, scheduler, make_work):
        assert await scheduler.submit(make_work("w1")) is True
        assert await scheduler.pending_count() == 1

    async def test_it_ignores_a_repeated_submission_of_the_same_work(self, scheduler, make_work):
        await scheduler.submit(make_work("w1"))
        assert await scheduler.submit(make_work("w1")) is False
        assert await scheduler.pending_count() == 1

    async def test_it_ignores_a_known_idempotency_key_under_another_work_id(
        self, scheduler, make_work
    ):
        await scheduler.submit(make_work("w1", idempotency_key="same"))
        assert await scheduler.submit(make_work("w2", idempotency_key="same")) is False
        assert await scheduler.pending_count() == 1

    async def test_it_rejects_the_same_work_id_with_a_different_key(self, scheduler, make_work):
        await scheduler.submit(make_work("w1", idempotency_key="a"))
        with pytest.raises(SageError) as info:
            await scheduler.submit(make_work("w1", idempotency_key="b"))
        assert info.value.code == "scheduler.work_id_conflict"
        assert info.value.category == ErrorCategory.CONFLICT

    async def test_it_rejects_the_same_work_id_with_a_different_payload(self, scheduler, make_work):
        await scheduler.submit(make_work("w1", payload={"resume": False}))
        with pytest.raises(SageError) as info:
            await scheduler.submit(make_work("w1", payload={"resume": True}))
        assert info.value.code == "scheduler.work_id_conflict"

    async def test_it_remembers_the_key_of_finished_work(self, scheduler, make_work):
        await scheduler.submit(make_work("w1"))
        lease = await claim_now(scheduler, "worker")
        await scheduler.release(lease, LeaseReleaseReason.COMPLETED)
        assert await scheduler.submit(make_work("w1")) is False
        assert await scheduler.pending_count() == 0

    async def test_it_rejects_work_beyond_the_pending_limit(self, make_scheduler, make_work):
        scheduler = make_scheduler(max_pending_items=2)
        await scheduler.submit(make_work("w1"))
        await scheduler.submit(make_work("w2"))
        with pytest.raises(SageError) as info:
            await scheduler.submit(make_work("w3"))
        assert info.value.code == "scheduler.queue_full"
        assert info.value.category == ErrorCategory.RATE_LIMITED
        assert info.value.retryable is True

    async def test_it_counts_leased_work_as_no_longer_pending(self, make_scheduler, make_work):
        scheduler = make_scheduler(max_pending_items=1)
        await scheduler.submit(make_work("w1"))
        await claim_now(scheduler, "worker")
        assert await scheduler.submit(make_work("w2")) is True

    async def test_it_refuses_submissions_after_close(self, scheduler, make_work):
        await scheduler.close()
        with pytest.raises(SageError) as info:
            await scheduler.submit(make_work("w1"))
        assert info.value.code == "scheduler.closed"

    # ------------------------------------------------------------------ claim

    async def test_it_returns_none_at_once_when_nothing_is_queued(self, scheduler):
        assert await claim_now(scheduler, "worker") is None

    async def test_it_returns_none_when_the_wait_times_out(self, scheduler):
        claim = scheduler.claim("worker", lease_duration=LEASE, wait_timeout=0.02)
        assert await within(claim) is None

    async def test_it_rejects_a_non_positive_lease_duration(self, scheduler):
        with pytest.raises(ValueError):
            await scheduler.claim("worker", lease_duration=timedelta(0), wait_timeout=0)

    async def test_it_rejects_a_negative_wait_timeout(self, scheduler):
        with pytest.raises(ValueError):
            await scheduler.claim("worker", lease_duration=LEASE, wait_timeout=-1)

    async def test_it_leases_work_to_the_claiming_worker(self, scheduler, make_work, clock):
        work = make_work("w1")
        await scheduler.submit(work)
        lease = await claim_now(scheduler, "worker-1")
        assert isinstance(lease, WorkerLease)
        assert lease.work == work
        assert lease.worker_id == "worker-1"
        assert lease.fencing_token >= 1
        assert lease.acquired_at == clock.now
        assert lease.expires_at == clock.now + LEASE
        assert await scheduler.pending_count() == 0

    async def test_it_holds_back_work_until_it_is_available(self, scheduler, make_work, clock):
        await scheduler.submit(make_work("w1", available_at=clock.now + timedelta(seconds=5)))
        assert await claim_now(scheduler, "worker") is None
        clock.advance(5)
        lease = await claim_now(scheduler, "worker")
        assert lease is not None and lease.work.work_id == "w1"

    async def test_it_claims_higher_priority_first(self, scheduler, make_work):
        await scheduler.submit(make_work("low", priority=-10))
        await scheduler.submit(make_work("high", priority=10))
        lease = await claim_now(scheduler, "worker")
        assert lease.work.work_id == "high"

    async def test_it_claims_in_submit_order_within_a_priority(self, scheduler, make_work):
        for name in ("w1", "w2", "w3"):
            await scheduler.submit(make_work(name))
        claimed = [(await claim_now(scheduler, "worker")).work.work_id for _ in range(3)]
        assert claimed == ["w1", "w2", "w3"]

    async def test_it_allows_one_live_lease_per_run(self, scheduler, make_work):
        await scheduler.submit(make_work("main", run_id="run-1"))
        await scheduler.submit(make_work("cleanup", run_id="run-1", priority=-10))
        first = await claim_now(scheduler, "worker")
        assert first.work.work_id == "main"
        assert await claim_now(scheduler, "worker") is None
        await scheduler.release(first, LeaseReleaseReason.COMPLETED)
        second = await claim_now(scheduler, "worker")
        assert second.work.work_id == "cleanup"

    async def test_it_skips_a_run_with_a_live_lease_without_blocking_the_tenant(
        self, scheduler, make_work
    ):
        await scheduler.submit(make_work("main", run_id="run-1"))
        await scheduler.submit(make_work("cleanup", run_id="run-1"))
        await scheduler.submit(make_work("other", run_id="run-2"))
        await claim_now(scheduler, "worker")
        lease = await claim_now(scheduler, "worker")
        assert lease.work.work_id == "other"

    async def test_it_keeps_a_tenant_under_its_active_limit(self, scheduler, make_work):
        policy = SchedulerClaimPolicy(max_active_per_tenant=1)
        await scheduler.submit(make_work("a1", tenant_id="alice"))
        await scheduler.submit(make_work("a2", tenant_id="alice"))
        await claim_now(scheduler, "worker", policy=policy)
        assert await claim_now(scheduler, "worker", policy=policy) is None

    async def test_it_claims_another_tenant_while_one_is_saturated(self, scheduler, make_work):
        policy = SchedulerClaimPolicy(max_active_per_tenant=1, order="oldest")
        await scheduler.submit(make_work("a1", tenant_id="alice"))
        await scheduler.submit(make_work("a2", tenant_id="alice", priority=50))
        await scheduler.submit(make_work("b1", tenant_id="bob"))
        first = await claim_now(scheduler, "w", policy=policy)
        second = await claim_now(scheduler, "w", policy=policy)
        assert (first.work.work_id, second.work.work_id) == ("a2", "b1")

    async def test_it_lets_a_tenant_with_one_item_claim_second_behind_a_thousand(
        self, make_scheduler, make_work, clock
    ):
        scheduler = make_scheduler(clock=clock, max_pending_items=2000)
        for i in range(1000):
            await scheduler.submit(make_work(f"a{i}", tenant_id="alice"))
        await scheduler.submit(make_work("b0", tenant_id="bob"))
        first = await claim_now(scheduler, "w")
        second = await claim_now(scheduler, "w")
        assert (first.work.tenant_id, second.work.tenant_id) == ("alice", "bob")

    async def test_it_serves_oldest_first_under_the_plain_order(self, scheduler, make_work):
        policy = SchedulerClaimPolicy(order="oldest")
        for i in range(3):
            await scheduler.submit(make_work(f"a{i}", tenant_id="alice"))
        await scheduler.submit(make_work("b0", tenant_id="bob"))
        tenants = [
            (await claim_now(scheduler, "w", policy=policy)).work.tenant_id for _ in range(4)
        ]
        assert tenants == ["alice", "alice", "alice", "bob"]

    async def test_it_rotates_between_tenants_by_running_count(self, scheduler, make_work):
        for i in range(3):
            await scheduler.submit(make_work(f"a{i}", tenant_id="alice"))
        for i in range(3):
            await scheduler.submit(make_work(f"b{i}", tenant_id="bob"))
        await scheduler.submit(make_work("c0", tenant_id="carol"))
        tenants = [(await claim_now(scheduler, "w")).work.tenant_id for _ in range(5)]
        assert tenants == ["alice", "bob", "carol", "alice", "bob"]

    async def test_it_draws_fencing_tokens_from_one_increasing_sequence(self, scheduler, make_work):
        for name in ("w1", "w2", "w3"):
            await scheduler.submit(make_work(name, tenant_id=name))
        tokens = [(await claim_now(scheduler, "w")).fencing_token for _ in range(3)]
        assert tokens == sorted(tokens) and len(set(tokens)) == 3

    # ------------------------------------------------------------------ renew / release

    async def test_it_renews_a_live_lease(self, scheduler, make_work, clock):
        lease = await leased(scheduler, make_work, "w1")
        clock.advance(10)
        renewed = await scheduler.renew(lease, lease_duration=LEASE)
        assert renewed.expires_at == clock.now + LEASE
        assert renewed.fencing_token == lease.fencing_token
        await scheduler.assert_fence(renewed)

    async def test_it_refuses_to_renew_an_expired_lease(self, scheduler, make_work, clock):
        lease = await leased(scheduler, make_work, "w1")
        clock.advance(31)
        with pytest.raises(SageError) as info:
            await scheduler.renew(lease, lease_duration=LEASE)
        assert info.value.code == "scheduler.lease_expired"
        assert await scheduler.pending_count() == 1

    async def test_it_refuses_to_renew_a_superseded_lease(self, scheduler, make_work, clock):
        old = await leased(scheduler, make_work, "w1")
        clock.advance(31)
        new = await claim_now(scheduler, "w2")
        assert new.fencing_token == old.fencing_token + 1
        with pytest.raises(SageError) as info:
            await scheduler.renew(old, lease_duration=LEASE)
        assert info.value.code == "scheduler.lease_expired"

    async def test_it_requeues_released_work_with_the_next_attempt(self, scheduler, make_work):
        lease = await leased(scheduler, make_work, "w1")
        await scheduler.release(lease, LeaseReleaseReason.WORKER_SHUTDOWN, requeue=True)
        again = await claim_now(scheduler, "w")
        assert again.work.attempt == 2
        assert again.fencing_token > lease.fencing_token

    async def test_it_drops_released_work_without_requeue(self, scheduler, make_work):
        lease = await leased(scheduler, make_work, "w1")
        await scheduler.release(lease, LeaseReleaseReason.COMPLETED)
        assert await scheduler.pending_count() == 0
        assert await claim_now(scheduler, "w") is None

    async def test_it_rejects_releasing_a_stale_lease(self, scheduler, make_work, clock):
        lease = await leased(scheduler, make_work, "w1")
        clock.advance(31)
        await scheduler.reap_expired()
        with pytest.raises(SageError) as info:
            await scheduler.release(lease, LeaseReleaseReason.COMPLETED)
        assert info.value.code == "scheduler.fence_rejected"

    # ------------------------------------------------------------------ fence / cancel / reap

    async def test_it_accepts_the_fence_of_a_current_lease(self, scheduler, make_work):
        lease = await leased(scheduler, make_work, "w1")
        await scheduler.assert_fence(lease)

    async def test_it_rejects_the_fence_of_an_expired_lease(self, scheduler, make_work, clock):
        lease = await leased(scheduler, make_work, "w1")
        clock.advance(30)
        with pytest.raises(SageError) as info:
            await scheduler.assert_fence(lease)
        assert info.value.code == "scheduler.fence_rejected"
        assert info.value.category == ErrorCategory.CONFLICT

    async def test_it_rejects_a_forged_token(self, scheduler, make_work):
        lease = await leased(scheduler, make_work, "w1")
        forged = WorkerLease(
            lease_id=lease.lease_id,
            work=lease.work,
            worker_id=lease.worker_id,
            fencing_token=lease.fencing_token + 1,
            acquired_at=lease.acquired_at,
            expires_at=lease.expires_at,
        )
        with pytest.raises(SageError) as info:
            await scheduler.assert_fence(forged)
        assert info.value.code == "scheduler.fence_rejected"

    async def test_it_cancels_pending_work_once(self, scheduler, make_work):
        await scheduler.submit(make_work("w1"))
        assert await scheduler.cancel("w1") is True
        assert await scheduler.cancel("w1") is False
        assert await scheduler.pending_count() == 0
        assert await claim_now(scheduler, "w") is None

    async def test_it_reports_cancelling_unknown_work(self, scheduler):
        assert await scheduler.cancel("nope") is False

    async def test_it_fences_out_the_lease_of_cancelled_work(self, scheduler, make_work):
        lease = await leased(scheduler, make_work, "w1")
        assert await scheduler.cancel("w1") is True
        with pytest.raises(SageError) as info:
            await scheduler.assert_fence(lease)
        assert info.value.code == "scheduler.fence_rejected"

    async def test_it_frees_the_tenant_slot_of_cancelled_work(self, scheduler, make_work):
        policy = SchedulerClaimPolicy(max_active_per_tenant=1)
        await scheduler.submit(make_work("a1"))
        await scheduler.submit(make_work("a2"))
        await claim_now(scheduler, "w", policy=policy)
        await scheduler.cancel("a1")
        lease = await claim_now(scheduler, "w", policy=policy)
        assert lease.work.work_id == "a2"

    async def test_it_cancels_delayed_work(self, scheduler, make_work, clock):
        await scheduler.submit(make_work("w1", available_at=clock.now + timedelta(hours=1)))
        assert await scheduler.cancel("w1") is True
        clock.advance(7200)
        assert await claim_now(scheduler, "w") is None

    async def test_it_reaps_expired_leases_with_the_next_attempt(self, scheduler, make_work, clock):
        await scheduler.submit(make_work("w1", tenant_id="alice"))
        await scheduler.submit(make_work("w2", tenant_id="bob"))
        first = await claim_now(scheduler, "w")
        await scheduler.claim("w", lease_duration=timedelta(seconds=60), wait_timeout=0)
        clock.advance(30)
        assert await scheduler.reap_expired() == 1
        again = await claim_now(scheduler, "w")
        assert again.work.work_id == first.work.work_id
        assert again.work.attempt == 2

    # ------------------------------------------------------------------ waiting claims

    async def test_it_wakes_a_waiting_claim_on_submit(self, scheduler, make_work):
        waiter = asyncio.create_task(scheduler.claim("w", lease_duration=LEASE, wait_timeout=BOUND))
        await spin()
        await scheduler.submit(make_work("w1"))
        lease = await within(waiter)
        assert lease.work.work_id == "w1"

    async def test_it_wakes_a_waiting_claim_on_release(self, scheduler, make_work):
        policy = SchedulerClaimPolicy(max_active_per_tenant=1)
        await scheduler.submit(make_work("a1"))
        await scheduler.submit(make_work("a2"))
        held = await claim_now(scheduler, "w", policy=policy)
        waiting = scheduler.claim("w", lease_duration=LEASE, policy=policy, wait_timeout=BOUND)
        lease = await claim_woken_by_release(waiting, scheduler, held)
        assert lease.work.work_id == "a2"

    async def test_it_wakes_a_waiting_claim_at_lease_expiry(self, make_scheduler, make_work):
        scheduler = make_scheduler()  # real clock: nothing else will notify the waiter
        await scheduler.submit(make_work("w1", available_at=datetime.now(UTC)))
        old = await scheduler.claim("w", lease_duration=timedelta(seconds=0.2), wait_timeout=0)
        new = await within(scheduler.claim("w2", lease_duration=LEASE, wait_timeout=BOUND))
        assert new is not None
        assert new.work.work_id == "w1"
        assert new.work.attempt == 2
        assert new.fencing_token == old.fencing_token + 1

    async def test_it_wakes_a_waiting_claim_when_delayed_work_becomes_available(
        self, make_scheduler, make_work
    ):
        scheduler = make_scheduler()
        soon = datetime.now(UTC) + timedelta(seconds=0.1)
        await scheduler.submit(make_work("w1", available_at=soon))
        lease = await within(scheduler.claim("w", lease_duration=LEASE, wait_timeout=BOUND))
        assert lease.work.work_id == "w1"

    async def test_it_wakes_waiting_claims_with_closed_on_close(self, scheduler):
        waiter = asyncio.create_task(scheduler.claim("w", lease_duration=LEASE, wait_timeout=None))
        await spin()
        await scheduler.close()
        with pytest.raises(SageError) as info:
            await within(waiter)
        assert info.value.code == "scheduler.closed"

    async def test_it_never_exceeds_the_tenant_limit_under_a_claim_storm(
        self, scheduler, make_work
    ):
        policy = SchedulerClaimPolicy(max_active_per_tenant=2)
        _, peaks = await claim_storm([scheduler], make_work, total=30, workers=12, policy=policy)
        assert peaks == {"alice": 2, "bob": 2, "carol": 2}

    # ------------------------------------------------------------------ quota groups

    async def test_it_shares_the_active_limit_across_group_members(self, group_members, make_work):
        chat, managed = group_members(2, 2, 100)
        await chat.submit(make_work("c1", tenant_id="alice"))
        await chat.submit(make_work("c2", tenant_id="bob"))
        await managed.submit(make_work("m1", tenant_id="carol"))
        assert await claim_now(chat, "w") is not None
        assert await claim_now(chat, "w") is not None
        assert await claim_now(managed, "w") is None

    async def test_it_shares_the_tenant_limit_across_group_members(self, group_members, make_work):
        chat, managed = group_members(8, 1, 100)
        await chat.submit(make_work("c1", tenant_id="alice"))
        await managed.submit(make_work("m1", tenant_id="alice"))
        await managed.submit(make_work("m2", tenant_id="bob"))
        await claim_now(chat, "w")
        lease = await claim_now(managed, "w")
        assert lease.work.work_id == "m2"
        assert await claim_now(managed, "w") is None

    async def test_it_shares_the_pending_limit_across_group_members(self, group_members, make_work):
        chat, managed = group_members(8, 2, 2)
        await chat.submit(make_work("c1"))
        await managed.submit(make_work("m1"))
        with pytest.raises(SageError) as info:
            await chat.submit(make_work("c2"))
        assert info.value.code == "scheduler.queue_full"
        assert "queue is full" in info.value.message

    async def test_it_wakes_a_waiting_member_when_another_member_releases(
        self, group_members, make_work
    ):
        chat, managed = group_members(1, 1, 100)
        await chat.submit(make_work("c1", tenant_id="alice"))
        await managed.submit(make_work("m1", tenant_id="bob"))
        held = await claim_now(chat, "w")
        waiting = managed.claim("w", lease_duration=LEASE, wait_timeout=BOUND)
        lease = await claim_woken_by_release(waiting, chat, held)
        assert lease.work.work_id == "m1"

    async def test_it_leaks_no_group_capacity_to_a_cancelled_waiter(self, group_members, make_work):
        chat, managed = group_members(1, 1, 100)
        waiter = asyncio.create_task(chat.claim("w", lease_duration=LEASE, wait_timeout=BOUND))
        await spin()
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        await managed.submit(make_work("m1"))
        assert await claim_now(managed, "w") is not None

    async def test_it_returns_the_capacity_of_a_closed_member(self, group_members, make_work):
        chat, managed = group_members(1, 1, 1)
        await chat.submit(make_work("c1"))
        await claim_now(chat, "w")
        await chat.close()
        await managed.submit(make_work("m1"))
        assert await claim_now(managed, "w") is not None

    async def test_it_never_exceeds_group_quotas_under_a_claim_storm(
        self, make_scheduler, make_work
    ):
        group = SchedulerQuotaGroup(4, 2, 1000)
        members = [make_scheduler(quota_group=group) for _ in range(2)]
        # Three tenants for four slots: fair order gives one tenant a second slot, so both
        # the total and the per-tenant limit are reached (and must hold).
        peak_total, peaks = await claim_storm(members, make_work, total=60, workers=16)
        assert (peak_total, max(peaks.values())) == (4, 2)


async def _noop() -> None:
    return None


def _returns[R](value: R) -> Callable[[], Awaitable[R]]:
    async def op() -> R:
        return value

    return op


class FencedExecutionContract:
    """``execute_fenced`` of the in-memory scheduler (the database path fences each write
    inside its own transaction instead: ``scheduling.runs.check_fence``)."""

    async def test_it_returns_the_result_of_a_fenced_operation(self, scheduler, make_work):
        lease = await leased(scheduler, make_work, "w1")

        async def op() -> str:
            return "written"

        assert await scheduler.execute_fenced(lease, op) == "written"

    async def test_it_does_not_run_an_operation_under_a_stale_lease(
        self, scheduler, make_work, clock
    ):
        lease = await leased(scheduler, make_work, "w1")
        clock.advance(31)
        called = False

        async def op() -> None:
            nonlocal called
            called = True

        with pytest.raises(SageError) as info:
            await scheduler.execute_fenced(lease, op)
        assert info.value.code == "scheduler.fence_rejected"
        assert called is False

    async def test_it_propagates_an_operation_error_and_unpins_the_run(self, scheduler, make_work):
        lease = await leased(scheduler, make_work, "w1")

        async def boom() -> None:
            raise RuntimeError("disk full")

        async def ok() -> str:
            return "ok"

        with pytest.raises(RuntimeError):
            await scheduler.execute_fenced(lease, boom)
        assert await within(scheduler.execute_fenced(lease, ok)) == "ok"

    async def test_it_commits_different_runs_concurrently(self, scheduler, make_work):
        first = await leased(scheduler, make_work, "w1", tenant_id="alice")
        second = await leased(scheduler, make_work, "w2", tenant_id="bob")
        in_first, in_second = asyncio.Event(), asyncio.Event()

        async def op(mine: asyncio.Event, other: asyncio.Event) -> None:
            # Each write can only finish while the other is in flight too.
            mine.set()
            await other.wait()

        await within(
            asyncio.gather(
                scheduler.execute_fenced(first, lambda: op(in_first, in_second)),
                scheduler.execute_fenced(second, lambda: op(in_second, in_first)),
            )
        )

    async def test_it_keeps_the_writes_of_one_run_in_order(self, scheduler, make_work):
        lease = await leased(scheduler, make_work, "w1")
        gate = asyncio.Event()
        log: list[str] = []

        async def op(name: str, wait: bool) -> None:
            log.append(f"{name}-start")
            if wait:
                await gate.wait()
            log.append(f"{name}-end")

        first = asyncio.create_task(scheduler.execute_fenced(lease, lambda: op("a", True)))
        await spin()
        second = asyncio.create_task(scheduler.execute_fenced(lease, lambda: op("b", False)))
        await spin()
        assert log == ["a-start"]
        gate.set()
        await within(asyncio.gather(first, second))
        assert log == ["a-start", "a-end", "b-start", "b-end"]

    @pytest.mark.parametrize(
        ("end", "answer"),
        [
            (lambda scheduler, lease: scheduler.release(lease, LeaseReleaseReason.COMPLETED), None),
            (lambda scheduler, lease: scheduler.cancel(lease.work.work_id), True),
            (lambda scheduler, lease: scheduler.close(), None),
        ],
        ids=["release", "cancel", "close"],
    )
    async def test_it_makes_the_end_of_a_lease_wait_for_a_write_in_flight(
        self, scheduler, make_work, end, answer
    ):
        lease = await leased(scheduler, make_work, "w1")
        write, gate = await mid_write(scheduler, lease)
        ending = asyncio.create_task(end(scheduler, lease))
        await spin()
        assert not ending.done()
        gate.set()
        assert await within(ending) is answer
        assert await write == "done"

    async def test_it_lets_other_runs_write_and_claim_while_one_is_mid_write(
        self, scheduler, make_work
    ):
        lease = await leased(scheduler, make_work, "w1", tenant_id="alice")
        write, gate = await mid_write(scheduler, lease)
        other = await leased(scheduler, make_work, "w2", tenant_id="bob")

        async def op() -> str:
            return "other"

        assert await within(scheduler.execute_fenced(other, op)) == "other"
        gate.set()
        await within(write)

    async def test_it_renews_a_lease_while_its_run_is_mid_write(self, scheduler, make_work, clock):
        lease = await leased(scheduler, make_work, "w1")
        write, gate = await mid_write(scheduler, lease)
        clock.advance(31)
        renewed = await within(scheduler.renew(lease, lease_duration=LEASE))
        assert renewed.expires_at == clock.now + LEASE
        gate.set()
        await within(write)
        await scheduler.assert_fence(renewed)

    async def test_it_does_not_reap_an_expired_lease_mid_write(self, scheduler, make_work, clock):
        lease = await leased(scheduler, make_work, "w1")
        write, gate = await mid_write(scheduler, lease)
        clock.advance(31)
        assert await scheduler.reap_expired() == 0
        gate.set()
        await within(write)
        assert await scheduler.reap_expired() == 1

        async def op() -> None:
            return None

        with pytest.raises(SageError) as info:
            await scheduler.execute_fenced(lease, op)
        assert info.value.code == "scheduler.fence_rejected"

    async def test_it_keeps_the_tenant_slot_of_an_expired_lease_mid_write(
        self, scheduler, make_work, clock
    ):
        policy = SchedulerClaimPolicy(max_active_per_tenant=1)
        lease = await leased(scheduler, make_work, "w1")
        await scheduler.submit(make_work("w2"))
        write, gate = await mid_write(scheduler, lease)
        clock.advance(31)
        assert await claim_now(scheduler, "w", policy=policy) is None
        gate.set()
        await within(write)

    async def test_it_refuses_fenced_writes_after_close(self, scheduler, make_work):
        lease = await leased(scheduler, make_work, "w1")
        await scheduler.close()

        async def op() -> None:
            return None

        with pytest.raises(SageError) as info:
            await scheduler.execute_fenced(lease, op)
        assert info.value.code == "scheduler.closed"

    async def test_it_unpins_a_run_whose_writer_is_cancelled_repeatedly(self, scheduler, make_work):
        lease = await leased(scheduler, make_work, "w1")
        write, _gate = await mid_write(scheduler, lease)
        queued = asyncio.create_task(scheduler.execute_fenced(lease, _noop))
        await spin()
        for task in (queued, write, queued, write):
            task.cancel()
            await spin(2)
        for task in (queued, write):
            with pytest.raises(asyncio.CancelledError):
                await task
        assert await within(scheduler.execute_fenced(lease, _returns("after"))) == "after"

    async def test_it_passes_the_pin_on_when_the_next_writer_is_cancelled_at_handoff(
        self, scheduler, make_work
    ):
        lease = await leased(scheduler, make_work, "w1")
        gate = asyncio.Event()
        queued: asyncio.Task | None = None

        async def first_op() -> None:
            await gate.wait()
            # Runs before the pin is handed over, so the queued writer is cancelled
            # after it was chosen but before it resumes.
            asyncio.get_running_loop().call_soon(queued.cancel)

        first = asyncio.create_task(scheduler.execute_fenced(lease, first_op))
        await spin()
        queued = asyncio.create_task(scheduler.execute_fenced(lease, _noop))
        await spin()
        gate.set()
        await within(first)
        with pytest.raises(asyncio.CancelledError):
            await queued
        assert await within(scheduler.execute_fenced(lease, _returns("after"))) == "after"
