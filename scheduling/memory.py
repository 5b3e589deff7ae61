"""`InMemoryScheduler`: the scheduling protocol in one asyncio event loop (Django-free).

Concurrency model: it belongs to one asyncio event loop and is not thread-safe. Every
check-and-update runs as a synchronous section with no ``await`` inside, which makes it
atomic with respect to other coroutines on the loop; that is the "global lock held
briefly" of the reference design, without paying for an ``asyncio.Lock`` on every fenced
write. The only waits are for a claimable item, for the per-run write pin, and for
in-flight writes at ``close()``. Writes of a lease go through `execute_fenced`, which
holds the run's pin (`RunPins`) so writes of one run are ordered and a release or cancel
waits for them.
"""

from __future__ import annotations

import asyncio
import heapq
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any, TypeVar

from scheduling.protocol import (
    ClaimCandidate,
    LeaseReleaseReason,
    SchedulerBase,
    SchedulerClaimPolicy,
    SchedulerQuotaGroup,
    WorkerLease,
    WorkItem,
    _as_timedelta,
    fair_order,
    fence_rejected_error,
    lease_expired_error,
    queue_full_error,
    utc_now,
)

T = TypeVar("T")


class _Entry:
    """Mutable bookkeeping for one live (pending or leased) work item."""

    __slots__ = ("lease_id", "queued", "seq", "work")

    def __init__(self, work: WorkItem, seq: int) -> None:
        self.work = work
        self.seq = seq
        self.lease_id: str | None = None
        # True while the item sits in the ready or delayed heap.
        self.queued = False


class RunPins:
    """Per-run write pins: one holder per run, later takers queue FIFO behind it.

    The in-memory scheduler uses it for ``execute_fenced``, ``release`` and ``cancel``. ``release``
    is synchronous on purpose: a cancelled caller cannot be interrupted half-way, so
    repeated cancellation never leaves a run pinned, and the uncontended path
    (``try_acquire``) creates no future and no task. ``on_free(run_id)`` runs when a run's
    last pin is released.
    """

    __slots__ = ("_on_free", "_pins")

    def __init__(self, on_free: Callable[[str], None]) -> None:
        self._pins: dict[str, deque[asyncio.Future[None]]] = {}
        self._on_free = on_free

    def __contains__(self, run_id: object) -> bool:
        return run_id in self._pins

    def __iter__(self) -> Iterator[str]:
        return iter(self._pins)

    def __len__(self) -> int:
        return len(self._pins)

    def try_acquire(self, run_id: str) -> bool:
        """Take the pin if nobody holds it; never waits."""
        if run_id in self._pins:
            return False
        self._pins[run_id] = deque()
        return True

    async def acquire(self, run_id: str) -> None:
        """Take the run's pin, queueing FIFO behind a write (or release) in flight."""
        waiters = self._pins.get(run_id)
        if waiters is None:
            self._pins[run_id] = deque()
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiters.append(fut)
        try:
            await fut
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.release(run_id)  # handed to us just as we were cancelled: pass it on
            else:
                try:
                    waiters.remove(fut)
                except ValueError:
                    pass
            raise

    def release(self, run_id: str) -> None:
        """Hand the pin to the oldest live waiter, or free the run."""
        waiters = self._pins[run_id]
        while waiters:
            fut = waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        del self._pins[run_id]
        self._on_free(run_id)


class InMemoryScheduler(SchedulerBase):
    """A single-process scheduler with leases, fencing, fair claims and per-run pins.

    Not durable and not thread-safe: it belongs to the event loop that first uses it.
    """

    capability_flags = {
        "durable_across_process_restart": False,
        "supports_atomic_tenant_quota": True,
        "supports_atomic_fenced_mutations": True,
    }

    def __init__(
        self,
        *,
        max_pending_items: int = 1024,
        max_retained_terminal_items: int = 4096,
        clock: Callable[[], datetime] | None = None,
        quota_group: SchedulerQuotaGroup | None = None,
    ) -> None:
        super().__init__(
            max_pending_items=max_pending_items,
            max_retained_terminal_items=max_retained_terminal_items,
            clock=clock or utc_now,
            quota_group=quota_group,
        )
        self._ledger.members.append(self)

        self._items: dict[str, _Entry] = {}
        self._sequence = 0
        # Ready items per tenant: heaps of (-priority, seq, work_id).
        self._ready: dict[str | None, list[tuple[int, int, str]]] = {}
        # Items not yet available: heap of (available_at, seq, work_id).
        self._delayed: list[tuple[datetime, int, str]] = []
        # Lease expiries: heap of (expires_at, fencing_token, lease_id); stale entries
        # (renewed or released leases) are skipped lazily.
        self._expiries: list[tuple[datetime, int, str]] = []
        # Expired leases of pinned runs, put back on the heap when the pin clears.
        self._deferred: dict[str, tuple[datetime, int, str]] = {}
        self._pins = RunPins(self._unpinned)
        self._finalized = False
        self._drained: asyncio.Event | None = None

    # ----------------------------------------------------------------- introspection

    @property
    def fence_sequence(self) -> int:
        """The last fencing token handed out (shared with the quota group, if any)."""
        return self._ledger.fence_sequence

    def pinned_runs(self) -> frozenset[str]:
        """Runs with a fenced write in flight (or queued behind one)."""
        return frozenset(self._pins)

    def snapshot(self) -> dict[str, Any]:
        """Plain-dict figures for the capacity page."""
        by_tenant: dict[str | None, int] = {}
        for lease in self._leases.values():
            by_tenant[lease.work.tenant_id] = by_tenant.get(lease.work.tenant_id, 0) + 1
        return {
            "active": len(self._leases),
            "pending": self._pending(),
            "max_pending": self.max_pending_items,
            "active_per_tenant": by_tenant,
            "pinned_runs": len(self._pins),
            "fence_sequence": self._ledger.fence_sequence,
        }

    def _pending(self) -> int:
        return len(self._items) - len(self._leases)

    async def pending_count(self) -> int:
        """Items that are neither leased nor cancelled."""
        return self._pending()

    # ----------------------------------------------------------------- submit

    async def submit(self, work: WorkItem) -> bool:
        """Queue ``work``; return False if it (or its idempotency key) is already known.

        Raises ``scheduler.closed`` after `close()`, ``scheduler.work_id_conflict`` when a
        live item with this ``work_id`` differs, and ``scheduler.queue_full`` when this
        scheduler or its quota group already holds the maximum of pending items.
        """
        existing = self._items.get(work.work_id)
        if self._already_known(existing.work if existing is not None else None, work):
            return False
        if self._pending() >= self.max_pending_items:
            raise queue_full_error(self.max_pending_items)
        if self._group is not None and self._group.pending_total() >= self._group.max_pending:
            raise queue_full_error(self._group.max_pending)
        self._sequence += 1
        entry = _Entry(work, self._sequence)
        self._items[work.work_id] = entry
        self._remember_key(work)
        self._push(entry, self._clock())
        self._ledger.notify()
        return True

    def _push(self, entry: _Entry, now: datetime) -> None:
        work = entry.work
        entry.queued = True
        if work.available_at > now:
            heapq.heappush(self._delayed, (work.available_at, entry.seq, work.work_id))
        else:
            heap = self._ready.setdefault(work.tenant_id, [])
            heapq.heappush(heap, (-work.priority, entry.seq, work.work_id))

    def _promote_due(self, now: datetime) -> None:
        delayed = self._delayed
        while delayed and delayed[0][0] <= now:
            _, seq, work_id = heapq.heappop(delayed)
            entry = self._items.get(work_id)
            if entry is None or entry.seq != seq or not entry.queued:
                continue
            heap = self._ready.setdefault(entry.work.tenant_id, [])
            heapq.heappush(heap, (-entry.work.priority, seq, work_id))

    # ----------------------------------------------------------------- claim

    async def _claim_once(
        self, worker_id: str, duration: timedelta, policy: SchedulerClaimPolicy
    ) -> WorkerLease | None:
        """Reap the group's expired leases, then lease the best eligible item, if any.
        Raises ``scheduler.closed`` once closed."""
        self._check_open()
        now = self._clock()
        self._reap_group(now)
        return self._try_claim(worker_id, duration, policy, now)

    async def _due_in(self) -> float | None:
        return self._next_wake_delay(self._clock())

    def _next_wake_delay(self, now: datetime) -> float | None:
        """Seconds until the next delayed item becomes available or a lease may expire."""
        times: list[datetime] = []
        if self._delayed:
            times.append(self._delayed[0][0])
        # Any member's expiry can free a run, a tenant slot or a group slot.
        for member in self._ledger.members:
            if member._expiries:
                times.append(member._expiries[0][0])
        if not times:
            return None
        return (min(times) - now).total_seconds()

    def _try_claim(
        self,
        worker_id: str,
        duration: timedelta,
        policy: SchedulerClaimPolicy,
        now: datetime,
    ) -> WorkerLease | None:
        ledger = self._ledger
        group = self._group
        limit = policy.max_active_per_tenant
        if group is not None:
            if ledger.active_total >= group.max_active:
                return None
            limit = group.max_per_tenant if limit is None else min(limit, group.max_per_tenant)
        self._promote_due(now)
        candidates: list[ClaimCandidate] = []
        for tenant, heap in list(self._ready.items()):
            head = self._eligible_head(tenant, heap)
            if head is not None:
                candidates.append(
                    ClaimCandidate(
                        tenant_id=tenant, priority=-head[0], submit_order=head[1], ref=head
                    )
                )
        ranked = fair_order(
            candidates, ledger.by_tenant, order=policy.order, max_active_per_tenant=limit
        )
        if not ranked:
            return None
        best = ranked[0]
        heap = self._ready[best.tenant_id]
        if heap[0] == best.ref:
            heapq.heappop(heap)
        else:
            heap.remove(best.ref)
            heapq.heapify(heap)
        if not heap:
            del self._ready[best.tenant_id]
        entry = self._items[best.ref[2]]
        entry.queued = False
        ledger.fence_sequence += 1
        token = ledger.fence_sequence
        lease = WorkerLease(
            lease_id=uuid.uuid4().hex,
            work=entry.work,
            worker_id=worker_id,
            fencing_token=token,
            acquired_at=now,
            expires_at=now + duration,
        )
        entry.lease_id = lease.lease_id
        self._leases[lease.lease_id] = lease
        ledger.lease_added(lease)
        heapq.heappush(self._expiries, (lease.expires_at, token, lease.lease_id))
        return lease

    def _valid(self, item: tuple[int, int, str]) -> bool:
        entry = self._items.get(item[2])
        return entry is not None and entry.seq == item[1] and entry.queued

    def _eligible_head(
        self, tenant: str | None, heap: list[tuple[int, int, str]]
    ) -> tuple[int, int, str] | None:
        while heap and not self._valid(heap[0]):
            heapq.heappop(heap)
        if not heap:
            del self._ready[tenant]
            return None
        run_leases = self._ledger.run_leases
        if self._items[heap[0][2]].work.run_id not in run_leases:
            return heap[0]
        # Rare: the head's run already has a live lease (e.g. cleanup work of a running
        # run); the tenant's next item may still be eligible.
        for item in sorted(heap):
            if self._valid(item) and self._items[item[2]].work.run_id not in run_leases:
                return item
        return None

    # ----------------------------------------------------------------- leases

    def _current(self, lease: WorkerLease) -> WorkerLease | None:
        """The stored lease if ``lease`` still owns its work and run, else None."""
        stored = self._leases.get(lease.lease_id)
        if (
            stored is None
            or stored.fencing_token != lease.fencing_token
            or stored.worker_id != lease.worker_id
            or stored.work.work_id != lease.work.work_id
            or stored.work.run_id != lease.work.run_id
        ):
            return None
        entry = self._items.get(stored.work.work_id)
        if entry is None or entry.lease_id != stored.lease_id:
            return None
        if self._ledger.run_leases.get(stored.work.run_id) != stored.lease_id:
            return None
        return stored

    def _remove_lease(self, stored: WorkerLease) -> None:
        del self._leases[stored.lease_id]
        self._deferred.pop(stored.lease_id, None)
        self._ledger.lease_removed(stored)
        entry = self._items.get(stored.work.work_id)
        if entry is not None and entry.lease_id == stored.lease_id:
            entry.lease_id = None

    def _expire(self, stored: WorkerLease, now: datetime) -> None:
        """Drop an expired lease and requeue its item with ``attempt + 1``."""
        self._remove_lease(stored)
        entry = self._items.get(stored.work.work_id)
        if entry is not None:
            # The requeued item keeps its submit sequence, so a run that lost its worker
            # does not go to the back of the queue.
            entry.work = replace(entry.work, attempt=entry.work.attempt + 1)
            self._push(entry, now)

    def _reap_due(self, now: datetime) -> int:
        expiries = self._expiries
        reaped = 0
        while expiries and expiries[0][0] <= now:
            item = heapq.heappop(expiries)
            stored = self._leases.get(item[2])
            if stored is None or stored.expires_at != item[0]:
                continue
            if stored.work.run_id in self._pins:
                # Ownership holds for a write in flight; the pin's release puts this
                # expiry back, so waiting claims do not spin on it meanwhile.
                self._deferred[stored.lease_id] = item
                continue
            self._expire(stored, now)
            reaped += 1
        if reaped:
            self._ledger.notify()
        return reaped

    def _reap_group(self, now: datetime) -> None:
        for member in self._ledger.members:
            member._reap_due(now)

    async def reap_expired(self) -> int:
        """Requeue every expired, unpinned lease (``attempt + 1``); return how many."""
        return self._reap_due(self._clock())

    async def renew(self, lease: WorkerLease, *, lease_duration: timedelta) -> WorkerLease:
        """Extend ``lease`` to now + ``lease_duration`` and return the updated lease.

        Works while the run is mid-write, even past expiry, since ownership was held
        throughout. Raises ``scheduler.lease_expired`` if the lease expired (it is then
        requeued) or was superseded, released or cancelled; ValueError for a
        non-positive duration.
        """
        duration = _as_timedelta(lease_duration)
        stored = self._current(lease)
        if stored is None:
            raise lease_expired_error()
        now = self._clock()
        if stored.expires_at <= now and stored.work.run_id not in self._pins:
            self._expire(stored, now)
            self._ledger.notify()
            raise lease_expired_error()
        renewed = replace(stored, expires_at=now + duration)
        self._leases[stored.lease_id] = renewed
        self._deferred.pop(stored.lease_id, None)
        heapq.heappush(
            self._expiries, (renewed.expires_at, renewed.fencing_token, renewed.lease_id)
        )
        return renewed

    async def assert_fence(self, lease: WorkerLease) -> None:
        """Return if ``lease`` still owns its work; raise ``scheduler.fence_rejected``.

        Expired leases are reaped first, except for a run with a write in flight.
        """
        now = self._clock()
        self._reap_due(now)
        if self._current(lease) is None:
            raise fence_rejected_error()

    def _admit(self, lease: WorkerLease) -> WorkerLease:
        """Check ``lease`` for a caller that holds the run's pin (nothing admitted yet)."""
        stored = self._current(lease)
        if stored is None:
            raise fence_rejected_error()
        now = self._clock()
        if stored.expires_at <= now:
            self._expire(stored, now)
            self._ledger.notify()
            raise fence_rejected_error()
        return stored

    async def release(
        self, lease: WorkerLease, reason: LeaseReleaseReason | str, *, requeue: bool = False
    ) -> None:
        """End ``lease``; with ``requeue`` the item is queued again with ``attempt + 1``.

        Waits for a fenced write of the run in flight. Without ``requeue`` the item is
        dropped and its idempotency key is remembered as terminal. Raises
        ``scheduler.fence_rejected`` if the lease no longer owns the work (including when
        it expired before the release).
        """
        reason = LeaseReleaseReason(reason)
        run_id = lease.work.run_id
        await self._pins.acquire(run_id)
        try:
            stored = self._admit(lease)
            now = self._clock()
            self._remove_lease(stored)
            entry = self._items[stored.work.work_id]
            if requeue:
                entry.work = replace(entry.work, attempt=entry.work.attempt + 1)
                self._push(entry, now)
            else:
                self._finish(entry)
            self._ledger.notify()
        finally:
            self._pins.release(run_id)

    def _finish(self, entry: _Entry) -> None:
        """Forget a finished or cancelled item, keeping its key as terminal."""
        del self._items[entry.work.work_id]
        entry.queued = False
        self._retire_key(entry.work.idempotency_key)

    async def cancel(self, work_id: str) -> bool:
        """Cancel a pending or leased item; return False if unknown or already finished.

        Waits for a fenced write of the item's run in flight; afterwards the item's lease
        (if any) fails `assert_fence`.
        """
        entry = self._items.get(work_id)
        if entry is None:
            return False
        run_id = entry.work.run_id
        await self._pins.acquire(run_id)
        try:
            entry = self._items.get(work_id)
            if entry is None:
                return False
            if entry.lease_id is not None:
                self._remove_lease(self._leases[entry.lease_id])
            if entry.queued:
                self._unqueue(entry)
            self._finish(entry)
            self._ledger.notify()
            return True
        finally:
            self._pins.release(run_id)

    def _unqueue(self, entry: _Entry) -> None:
        # Eager removal keeps the heaps free of cancelled (possibly far-future) items.
        work = entry.work
        key = (work.available_at, entry.seq, work.work_id)
        if key in self._delayed:
            self._delayed.remove(key)
            heapq.heapify(self._delayed)
        heap = self._ready.get(work.tenant_id)
        ready_key = (-work.priority, entry.seq, work.work_id)
        if heap is not None and ready_key in heap:
            heap.remove(ready_key)
            heapq.heapify(heap)
            if not heap:
                del self._ready[work.tenant_id]
        entry.queued = False

    # ----------------------------------------------------------------- fenced writes

    def _unpinned(self, run_id: str) -> None:
        if self._deferred:
            self._restore_deferred(run_id)
        if not self._pins and self._closed:
            if self._drained is not None:
                self._drained.set()
            self._finalize()

    def _restore_deferred(self, run_id: str) -> None:
        restored = False
        for lease_id, item in list(self._deferred.items()):
            stored = self._leases.get(lease_id)
            if stored is None:
                del self._deferred[lease_id]
            elif stored.work.run_id == run_id:
                del self._deferred[lease_id]
                heapq.heappush(self._expiries, item)
                restored = True
        if restored:
            # The expiry a waiting claim skipped while the run was pinned is due now.
            self._ledger.notify()

    async def execute_fenced(self, lease: WorkerLease, operation: Callable[[], Awaitable[T]]) -> T:
        """Run ``operation()`` while ``lease`` provably owns its run; return its result.

        Writes of one run are serialised (FIFO); writes of different runs run
        concurrently. While the write is in flight the lease cannot be reaped, released
        or cancelled and `close()` waits for it. Raises ``scheduler.fence_rejected`` (the
        operation is not called) if the lease is stale or expired, ``scheduler.closed``
        after `close()`; exceptions of ``operation`` propagate unchanged.
        """
        self._check_open()
        run_id = lease.work.run_id
        pins = self._pins
        if not pins.try_acquire(run_id):
            await pins.acquire(run_id)
        try:
            self._check_open()
            self._admit(lease)
            return await operation()
        finally:
            self._pins.release(run_id)

    # ----------------------------------------------------------------- close

    async def close(self) -> None:
        """Close: wake waiting claims with ``scheduler.closed`` and wait for writes in flight.

        Idempotent. Once no write is in flight the scheduler leaves its quota group, so its
        leases and pending items stop counting against shared capacity, even if this call
        is cancelled while waiting.
        """
        self._closed = True
        self._ledger.notify()
        if self._pins:
            # A fresh event if an earlier close already drained (release/cancel may pin
            # again after close).
            if self._drained is None or self._drained.is_set():
                self._drained = asyncio.Event()
            await self._drained.wait()
        self._finalize()

    def _finalize(self) -> None:
        if self._finalized:
            return
        self._finalized = True
        ledger = self._ledger
        for lease in list(self._leases.values()):
            ledger.lease_removed(lease)
        # A closed scheduler holds nothing: later release/renew/cancel calls find no lease
        # (so they cannot return capacity twice) and pending_count() is 0.
        self._leases.clear()
        self._deferred.clear()
        self._expiries.clear()
        self._items.clear()
        self._ready.clear()
        self._delayed.clear()
        if self in ledger.members:
            ledger.members.remove(self)
        ledger.notify()
