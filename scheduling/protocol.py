"""The scheduler protocol: values, errors and rules shared by every backend (Django-free).

The values (`WorkItem`, `WorkerLease`, the claim policy and capabilities), the error types
(one per code: `LeaseExpired`, `FenceRejected`, ...), the one claim-ordering rule
(`fair_order`) that the in-memory and the database schedulers share, the `Scheduler`
protocol, the quota group that members of one process share, and `SchedulerBase`: the
bookkeeping both backends keep alike (limits, idempotency and terminal keys, leases) and
their claim loop. Backends: `scheduling.memory.InMemoryScheduler` (one event loop) and
`scheduling.db_scheduler.DatabaseScheduler` (``Run`` rows, across processes).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any, Protocol, TypeVar, runtime_checkable

from sageproject.errors import (
    ConflictError,
    ErrorCategory,
    RateLimitedError,
    SageError,
)

T = TypeVar("T")


def utc_now() -> datetime:
    """The default clock: an aware UTC ``datetime``."""
    return datetime.now(UTC)


# --------------------------------------------------------------------------- values


class LeaseReleaseReason(StrEnum):
    # The run reached a terminal success state.
    COMPLETED = "completed"
    # The run failed; it will not be retried unless requeued.
    FAILED = "failed"
    # The run is waiting on a human; a reply submits it again.
    SUSPENDED = "suspended"
    # The run was cancelled by its owner or an operator.
    CANCELLED = "cancelled"
    # The worker is stopping; the work is normally requeued.
    WORKER_SHUTDOWN = "worker_shutdown"


class ClaimOrder(StrEnum):
    # Fewest running items per tenant first, then priority, then oldest submit.
    FAIR = "fair"
    # Plain priority then oldest submit (the original order; kept for comparison).
    OLDEST = "oldest"


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkItem:
    """One unit of schedulable work (normally one Run attempt)."""

    work_id: str
    run_id: str
    tenant_id: str | None = None
    priority: int = 0
    available_at: datetime = field(default_factory=utc_now)
    attempt: int = 1
    idempotency_key: str | None = None
    payload: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.work_id:
            raise ValueError("work_id must be non-empty")
        if not self.run_id:
            raise ValueError("run_id must be non-empty")
        if not -100 <= self.priority <= 100:
            raise ValueError("priority must be between -100 and 100")
        if self.attempt < 1:
            raise ValueError("attempt must be at least 1")
        if self.available_at.tzinfo is None:
            raise ValueError("available_at must be an aware datetime")


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerLease:
    """A worker's time-limited authority over one work item.

    ``fencing_token`` comes from one global, strictly increasing sequence, so a
    replacement lease always carries a larger token than the one it replaced; storage
    compares it to reject writes from a worker that lost its lease.
    """

    lease_id: str
    work: WorkItem
    worker_id: str
    fencing_token: int
    acquired_at: datetime
    expires_at: datetime

    @property
    def run_id(self) -> str:
        return self.work.run_id


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerClaimPolicy:
    """Per-claim limits: at most ``max_active_per_tenant`` live leases per tenant."""

    max_active_per_tenant: int | None = None
    order: ClaimOrder = ClaimOrder.FAIR

    def __post_init__(self) -> None:
        if self.max_active_per_tenant is not None and self.max_active_per_tenant < 1:
            raise ValueError("max_active_per_tenant must be positive")
        # Accept the plain strings "fair"/"oldest" and normalise them.
        object.__setattr__(self, "order", ClaimOrder(self.order))


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerCapabilities:
    api_version: str = "2"
    durable_across_process_restart: bool = False
    supports_priority: bool = True
    supports_delayed_work: bool = True
    supports_leases: bool = True
    supports_fencing: bool = True
    supports_distributed_claims: bool = False
    supports_atomic_tenant_quota: bool = False
    supports_atomic_fenced_mutations: bool = False
    max_pending_items: int = 1024
    max_retained_terminal_items: int = 4096


# --------------------------------------------------------------------------- errors


def queue_full_error(limit: int, *, per_user: bool = False) -> RateLimitedError:
    """``scheduler.queue_full`` (RATE_LIMITED, retryable, resumable): ``limit`` runs are
    pending, the host's (or, ``per_user``, the user's) limit."""
    whose = "you have" if per_user else "the host has"
    return RateLimitedError(
        "scheduler.queue_full",
        f"the queue is full: {whose} {limit} queued runs, the limit; try again shortly",
        retryable=True,
        resumable=True,
        details={"max_pending_per_user" if per_user else "max_pending": limit, "retry_after": 2},
    )


def work_id_conflict_error(work_id: str) -> ConflictError:
    return ConflictError(
        "scheduler.work_id_conflict",
        "A different work item with this work_id is already known.",
        details={"work_id": work_id},
    )


class LeaseExpired(ConflictError):
    """``scheduler.lease_expired``: the lease ran out or was superseded (renewal refused)."""

    def __init__(self, message: str = "The lease has expired or was superseded.") -> None:
        super().__init__("scheduler.lease_expired", message)


class FenceRejected(ConflictError):
    """``scheduler.fence_rejected`` (resumable): a write under a lease that no longer owns
    its run — another owner, a newer token, an expired lease or a finished run. Nothing of
    the write was stored; the run continues (or already ended) under its current owner."""

    def __init__(self, run_id: Any = None) -> None:
        what = f"run {run_id}" if run_id is not None else "the run"
        super().__init__(
            "scheduler.fence_rejected",
            f"{what} is no longer leased by this worker; the write was rejected",
            resumable=True,
            details={"run": str(run_id)} if run_id is not None else {},
        )


def lease_expired_error() -> LeaseExpired:
    return LeaseExpired()


def fence_rejected_error(run_id: Any = None) -> FenceRejected:
    return FenceRejected(run_id)


def closed_error() -> SageError:
    return SageError(
        "scheduler.closed", "The scheduler is closed.", category=ErrorCategory.CANCELLED
    )


def worker_shutdown_error() -> SageError:
    """``scheduler.worker_shutdown`` (RESOURCE_LOST, resumable): a run cut off by shutdown."""
    return SageError(
        "scheduler.worker_shutdown",
        "The worker shut down before the run finished; it will be resumed.",
        category=ErrorCategory.RESOURCE_LOST,
        resumable=True,
    )


# --------------------------------------------------------------------------- ordering


@dataclass(frozen=True, slots=True, kw_only=True)
class ClaimCandidate:
    """One claimable item as the ordering rule sees it.

    ``submit_order`` is any comparable value that grows with submission time (a sequence
    number in memory, ``(created_at, pk)`` in the database); ``ref`` is opaque to the rule.
    """

    tenant_id: str | None
    priority: int
    submit_order: Any
    ref: Any = None


def fair_order(
    candidates: Iterable[ClaimCandidate],
    running_per_tenant: Mapping[str | None, int],
    *,
    order: ClaimOrder | str = ClaimOrder.FAIR,
    max_active_per_tenant: int | None = None,
) -> list[ClaimCandidate]:
    """Return the claimable candidates, best first, under one shared ordering rule.

    Candidates of a tenant already holding ``max_active_per_tenant`` leases are dropped
    (a saturated tenant is skipped, never blocking others; tenant ``None`` is exempt).
    ``FAIR`` sorts by the tenant's running count, then priority (higher first), then
    submit order, so a tenant with a thousand queued items cannot starve a tenant with
    one; ``OLDEST`` sorts by priority then submit order only.

    Pass at least every tenant's own best item (highest priority, then oldest): the
    in-memory scheduler passes exactly one head per tenant; a database query should pick
    per-tenant heads too (a window ``ROW_NUMBER() OVER (PARTITION BY tenant ...)``), since
    the global top-N rows may all belong to the one tenant with a thousand queued.
    """
    order = ClaimOrder(order)
    eligible = [
        c
        for c in candidates
        if c.tenant_id is None
        or max_active_per_tenant is None
        or running_per_tenant.get(c.tenant_id, 0) < max_active_per_tenant
    ]
    if order is ClaimOrder.FAIR:
        eligible.sort(
            key=lambda c: (running_per_tenant.get(c.tenant_id, 0), -c.priority, c.submit_order)
        )
    else:
        eligible.sort(key=lambda c: (-c.priority, c.submit_order))
    return eligible


# --------------------------------------------------------------------------- protocol


@runtime_checkable
class Scheduler(Protocol):
    """What the dispatcher needs from any scheduler backend (all methods async)."""

    def capabilities(self) -> SchedulerCapabilities: ...

    async def submit(self, work: WorkItem) -> bool: ...

    async def claim(
        self,
        worker_id: str,
        *,
        lease_duration: timedelta,
        policy: SchedulerClaimPolicy | None = None,
        wait_timeout: float | None = None,
    ) -> WorkerLease | None: ...

    async def renew(self, lease: WorkerLease, *, lease_duration: timedelta) -> WorkerLease: ...

    async def release(
        self, lease: WorkerLease, reason: LeaseReleaseReason | str, *, requeue: bool = False
    ) -> None: ...

    async def assert_fence(self, lease: WorkerLease) -> None: ...

    async def cancel(self, work_id: str) -> bool: ...

    async def reap_expired(self) -> int: ...

    async def pending_count(self) -> int: ...

    async def close(self) -> None: ...


# --------------------------------------------------------------------------- shared ledger


class _Ledger:
    """Counters and waiters shared by every scheduler that draws on the same capacity.

    A scheduler without a quota group gets a private ledger; members of a
    `SchedulerQuotaGroup` share the group's, which is what keeps totals from multiplying
    with the number of queues.
    """

    def __init__(self) -> None:
        self.members: list[Any] = []  # the InMemoryScheduler members
        self.active_total = 0
        self.by_tenant: dict[str | None, int] = {}
        # One live lease per run, across every member.
        self.run_leases: dict[str, str] = {}
        self.fence_sequence = 0
        self.waiters: set[asyncio.Future[None]] = set()

    def notify(self) -> None:
        """Wake every waiting claim; each retries and goes back to sleep if it lost."""
        for fut in self.waiters:
            if not fut.done():
                fut.set_result(None)
        self.waiters.clear()

    def lease_added(self, lease: WorkerLease) -> None:
        self.active_total += 1
        tenant = lease.work.tenant_id
        self.by_tenant[tenant] = self.by_tenant.get(tenant, 0) + 1
        self.run_leases[lease.work.run_id] = lease.lease_id

    def lease_removed(self, lease: WorkerLease) -> None:
        self.active_total -= 1
        tenant = lease.work.tenant_id
        left = self.by_tenant[tenant] - 1
        if left:
            self.by_tenant[tenant] = left
        else:
            del self.by_tenant[tenant]
        if self.run_leases.get(lease.work.run_id) == lease.lease_id:
            del self.run_leases[lease.work.run_id]

    def pending_total(self) -> int:
        return sum(member._pending() for member in self.members)


class SchedulerQuotaGroup(_Ledger):
    """Capacity shared by several schedulers (the ``chat`` and ``managed`` queues).

    Members keep separate queues, so a dispatcher never claims another queue's work, but
    ``max_active`` live leases, ``max_per_tenant`` live leases per tenant and
    ``max_pending`` queued items are totals over all members.
    """

    def __init__(self, max_active: int, max_per_tenant: int, max_pending: int) -> None:
        if max_active < 1:
            raise ValueError("max_active must be positive")
        if max_per_tenant < 1:
            raise ValueError("max_per_tenant must be positive")
        if max_pending < 1:
            raise ValueError("max_pending must be positive")
        super().__init__()
        self.max_active = max_active
        self.max_per_tenant = max_per_tenant
        self.max_pending = max_pending

    def leases(self) -> tuple[WorkerLease, ...]:
        """Live leases across all open members."""
        return tuple(lease for member in self.members for lease in member._leases.values())

    def pending(self) -> int:
        """Queued (not leased, not cancelled) items across all open members."""
        return self.pending_total()

    def snapshot(self) -> dict[str, Any]:
        """Plain-dict figures for the capacity page."""
        return {
            "active": self.active_total,
            "pending": self.pending_total(),
            "max_active": self.max_active,
            "max_per_tenant": self.max_per_tenant,
            "max_pending": self.max_pending,
            "active_per_tenant": dict(self.by_tenant),
        }


def _as_timedelta(value: timedelta | float) -> timedelta:
    duration = value if isinstance(value, timedelta) else timedelta(seconds=float(value))
    if duration <= timedelta(0):
        raise ValueError("lease_duration must be positive")
    return duration


def _content(work: WorkItem) -> tuple[Any, ...]:
    # What makes two submissions "the same work": attempt and available_at may differ
    # between a retry and the original, the identity of the work may not.
    return (work.run_id, work.tenant_id, work.priority, work.idempotency_key, work.payload)


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


# --------------------------------------------------------------------------- shared bookkeeping


def _soonest(*delays: float | None) -> float | None:
    """The smallest of the known delays (None where none is known)."""
    known = [delay for delay in delays if delay is not None]
    return min(known) if known else None


class SchedulerBase:
    """What every scheduler backend keeps the same way, and its claim loop.

    The limits (``max_pending_items``, ``max_retained_terminal_items``, the quota group),
    the ledger whose waiters its claims sleep on (the group's, else a private one), the
    leases it handed out, the idempotency keys of the work it knows and, once that work
    finished, the newest ``max_retained_terminal_items`` of them. A backend says how to try
    one claim (`_claim_once`) and when work may next be due (`_due_in`); ``claim_poll`` —
    ``(start, max)`` seconds — makes an idle claim also poll, doubling the interval after
    each wait nothing woke.
    """

    capability_flags: Mapping[str, bool] = {}
    claim_poll: tuple[float, float] | None = None

    def __init__(
        self,
        *,
        max_pending_items: int,
        max_retained_terminal_items: int,
        clock: Callable[[], datetime] | None,
        quota_group: SchedulerQuotaGroup | None,
    ) -> None:
        if max_pending_items < 1:
            raise ValueError("max_pending_items must be positive")
        if max_retained_terminal_items < 0:
            raise ValueError("max_retained_terminal_items must be non-negative")
        self.max_pending_items = max_pending_items
        self.max_retained_terminal_items = max_retained_terminal_items
        self._clock = clock
        self._group = quota_group
        self._ledger: _Ledger = quota_group if quota_group is not None else _Ledger()
        self._leases: dict[str, WorkerLease] = {}
        self._idempotency: dict[str, str] = {}
        self._terminal: deque[str] = deque()
        self._closed = False

    def capabilities(self) -> SchedulerCapabilities:
        """Static capability flags of this backend."""
        return SchedulerCapabilities(
            max_pending_items=self.max_pending_items,
            max_retained_terminal_items=self.max_retained_terminal_items,
            **self.capability_flags,
        )

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        """Raise ``scheduler.closed`` once `close()` was called."""
        if self._closed:
            raise closed_error()

    def leases(self) -> tuple[WorkerLease, ...]:
        """Live leases this scheduler handed out (in this process)."""
        return tuple(self._leases.values())

    # ----------------------------------------------------------------- submit

    def _already_known(self, known: WorkItem | None, work: WorkItem) -> bool:
        """Whether submitting ``work`` changes nothing: ``known`` (the live item under its
        ``work_id``) is the same work, or its idempotency key is known (while retained,
        also after the item finished).

        Raises ``scheduler.closed`` after `close()` and ``scheduler.work_id_conflict`` when
        ``known`` is different work.
        """
        self._check_open()
        if known is not None:
            if _content(known) == _content(work):
                return True
            raise work_id_conflict_error(work.work_id)
        return work.idempotency_key is not None and work.idempotency_key in self._idempotency

    def _remember_key(self, work: WorkItem) -> None:
        """Record the idempotency key (if any) of newly accepted ``work``."""
        if work.idempotency_key is not None:
            self._idempotency[work.idempotency_key] = work.work_id

    def _retire_key(self, key: str | None) -> None:
        """Keep the key of finished work as terminal, forgetting the oldest beyond
        ``max_retained_terminal_items`` (keys are unique per item, so the oldest terminal
        key belongs to no live item)."""
        if key is None:
            return
        self._terminal.append(key)
        while len(self._terminal) > self.max_retained_terminal_items:
            self._idempotency.pop(self._terminal.popleft(), None)

    # ----------------------------------------------------------------- claim

    async def claim(
        self,
        worker_id: str,
        *,
        lease_duration: timedelta,
        policy: SchedulerClaimPolicy | None = None,
        wait_timeout: float | None = None,
    ) -> WorkerLease | None:
        """Lease the best eligible item, waiting up to ``wait_timeout`` seconds for one.

        ``wait_timeout=0`` tries once, ``None`` waits forever. Between attempts it sleeps
        until a submit, release or close here (or in the quota group) wakes it, the next
        due time the backend knows (availability or lease expiry), or its poll interval.
        Returns the lease, or None on timeout. Raises ValueError for a non-positive duration
        or a negative timeout, and ``scheduler.closed`` if the scheduler is (or becomes)
        closed.
        """
        duration = _as_timedelta(lease_duration)
        if wait_timeout is not None and wait_timeout < 0:
            raise ValueError("wait_timeout must be non-negative")
        policy = policy or SchedulerClaimPolicy()
        loop = asyncio.get_running_loop()
        deadline = None if wait_timeout is None else loop.time() + wait_timeout
        poll = self.claim_poll[0] if self.claim_poll is not None else None
        while True:
            lease = await self._claim_once(worker_id, duration, policy)
            if lease is not None:
                return lease
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                return None
            delay = _soonest(await self._due_in(), poll, remaining)
            woke = await self._wait(loop, delay)
            if poll is not None and self.claim_poll is not None:
                start, longest = self.claim_poll
                poll = start if woke else min(poll * 2, longest)

    async def _claim_once(
        self, worker_id: str, duration: timedelta, policy: SchedulerClaimPolicy
    ) -> WorkerLease | None:
        """One claim attempt without waiting: the lease, or None when nothing is eligible."""
        raise NotImplementedError

    async def _due_in(self) -> float | None:
        """Seconds until work may next become claimable here (None: nothing known)."""
        raise NotImplementedError

    async def _wait(self, loop: asyncio.AbstractEventLoop, delay: float | None) -> bool:
        """Sleep up to ``delay`` seconds (None: without limit) or until notified; True if
        notified. A cancelled waiter leaves nothing behind: it never held capacity, and its
        future is dropped from the ledger."""
        fut: asyncio.Future[None] = loop.create_future()
        self._ledger.waiters.add(fut)
        handle = None if delay is None else loop.call_later(max(delay, 0.001), _wake, fut)
        try:
            await fut
        finally:
            self._ledger.waiters.discard(fut)
            notified = handle is None or (not handle.cancelled() and handle.when() > loop.time())
            if handle is not None:
                handle.cancel()
        return notified
