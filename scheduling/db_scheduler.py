"""DatabaseScheduler: the `Scheduler` protocol with its queue state kept in ``Run`` rows.

A run row *is* the queue entry: ``status`` (queued/running), ``priority``, ``available_at``,
``lease_owner``, ``lease_token``, ``lease_expires_at`` and ``attempts`` (claims so far).
Several processes may share one database; what makes that safe:

- **Claims are serialized** by locking the single ``FenceSequence`` row first (``SELECT …
  FOR UPDATE`` on PostgreSQL/MySQL, an IMMEDIATE transaction on SQLite). Inside that
  transaction the per-tenant and global quotas are counted from running *root* runs, so
  the check and the claim are atomic across processes and across the ``chat`` and
  ``managed`` queues; the candidate row is then taken with ``FOR UPDATE SKIP LOCKED`` so a
  row another transaction is touching is skipped, never waited for.
- **Fair candidates**: one head row per tenant (a ``ROW_NUMBER() OVER (PARTITION BY
  owner)`` window), ranked with the shared `fair_order`, so one tenant's thousand queued
  rows cannot hide another tenant's one.
- **Fencing**: tokens come from the one global ``FenceSequence``; every state change of a
  leased run is a conditional ``UPDATE … WHERE lease_owner = ? AND lease_token = ? AND
  status = 'running'``; writes go through ``scheduling.store.check_fence`` in the same
  transaction as the rows they write, so a worker that lost its lease — even one resumed
  after a long pause in another process — cannot write.

Within one process the scheduler adds what the in-memory one has: per-run pins (a run's
fenced writes are ordered; release/cancel/close wait for them; this process does not reap a
pinned run), in-process wake-ups of waiting claims on submit/release, and polling with
backoff for changes made by other processes.

Times come from the injected ``clock`` (default `django.utils.timezone.now`) and are written
as values, never taken from the database server, so tests can move time by hand.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any, TypeVar

from django.db import IntegrityError, connections, transaction
from django.db.models import Count, F, Q, Window
from django.db.models.functions import Coalesce, RowNumber
from django.utils import timezone

from sageproject.db import db_call
from sageproject.errors import ErrorCategory, NotFoundError, SageError
from scheduling.models import TERMINAL_STATUSES, FenceSequence, Run, RunStatus
from scheduling.scheduler import (
    ClaimCandidate,
    ClaimOrder,
    LeaseReleaseReason,
    RunPins,
    SchedulerCapabilities,
    SchedulerClaimPolicy,
    SchedulerQuotaGroup,
    WorkerLease,
    WorkItem,
    _as_timedelta,
    _content,
    _Ledger,
    _wake,
    closed_error,
    fair_order,
    fence_rejected_error,
    lease_expired_error,
    queue_full_error,
    work_id_conflict_error,
)
from scheduling.store import Fence, check_fence

logger = logging.getLogger("sage.scheduler")

T = TypeVar("T")

POLL_START, POLL_MAX = 0.05, 1.0

WORKER_RESTARTED = SageError(
    "execution.worker_restarted",
    "the run's worker stopped too many times; the run was failed",
    category=ErrorCategory.RESOURCE_LOST,
).record()

_RELEASE_STATUS = {
    LeaseReleaseReason.COMPLETED: RunStatus.COMPLETED,
    LeaseReleaseReason.FAILED: RunStatus.FAILED,
    LeaseReleaseReason.CANCELLED: RunStatus.CANCELLED,
    LeaseReleaseReason.SUSPENDED: RunStatus.SUSPENDED,
}

_ROW_FIELDS = ("pk", "owner_id", "priority", "available_at", "attempts", "queue", "parent_id")


def run_not_found(run_id: Any) -> NotFoundError:
    return NotFoundError("scheduler.run_not_found", f"no run {run_id}")


def work_from_row(row: Mapping[str, Any]) -> WorkItem:
    """The `WorkItem` of a run row that was admitted outside this scheduler (the API)."""
    run_id = str(row["pk"])
    return WorkItem(
        work_id=run_id,
        run_id=run_id,
        tenant_id=str(row["owner_id"]),
        priority=max(-100, min(100, int(row["priority"]))),
        available_at=row["available_at"],
        attempt=max(1, int(row["attempts"])),
        payload={"queue": row["queue"], "parent": str(row["parent_id"] or "") or None},
    )


def lease_fence(lease: WorkerLease) -> Fence:
    """The store's `Fence` for a database lease."""
    return Fence(
        run_id=uuid.UUID(lease.run_id), lease_owner=lease.worker_id, lease_token=lease.fencing_token
    )


def _held(lease: WorkerLease) -> Any:
    """Rows still held by ``lease`` (owner + token + running)."""
    return Run.objects.filter(
        pk=lease.run_id,
        lease_owner=lease.worker_id,
        lease_token=lease.fencing_token,
        status=RunStatus.RUNNING,
    )


def _requeue_values() -> dict[str, Any]:
    # The token is cleared too, so a stale lease can never match a requeued row; the row
    # keeps created_at, so a run that lost its worker is not sent to the back.
    return {
        "status": RunStatus.QUEUED,
        "lease_owner": "",
        "lease_token": None,
        "lease_expires_at": None,
    }


class DatabaseScheduler:
    """The scheduler protocol on ``Run`` rows, safe across worker processes.

    ``queue`` limits claims (and pending counts) to one `RunQueue` (None: all). Limits:
    ``max_pending_items`` and, with a ``quota_group``, its ``max_active``,
    ``max_per_tenant`` and ``max_pending`` — all counted over every queue in the
    database. ``max_attempts`` (optional) makes reaping fail a run whose lease expired
    after that many claims, with ``execution.worker_restarted``; ``on_failed(run_pk)`` is
    then called in the same transaction (the worker archives the run there).
    """

    def __init__(
        self,
        *,
        queue: str | None = None,
        max_pending_items: int = 1024,
        max_retained_terminal_items: int = 4096,
        clock: Callable[[], datetime] | None = None,
        quota_group: SchedulerQuotaGroup | None = None,
        max_attempts: int | None = None,
        on_failed: Callable[[Any], None] | None = None,
        using: str = "default",
    ) -> None:
        if max_pending_items < 1:
            raise ValueError("max_pending_items must be positive")
        if max_retained_terminal_items < 0:
            raise ValueError("max_retained_terminal_items must be non-negative")
        self.queue = queue
        self.max_pending_items = max_pending_items
        self.max_retained_terminal_items = max_retained_terminal_items
        self.max_attempts = max_attempts
        self.on_failed = on_failed
        self.using = using
        self._clock = clock or timezone.now
        self._group = quota_group
        # Only the waiters of a group are used: members of one group wake each other.
        self._ledger: _Ledger = quota_group if quota_group is not None else _Ledger()
        self._works: dict[str, WorkItem] = {}
        self._by_run: dict[str, str] = {}
        self._idempotency: dict[str, str] = {}
        self._terminal: deque[str] = deque()
        self._leases: dict[str, WorkerLease] = {}
        self._pins = RunPins(self._unpinned)
        self._closed = False
        self._drained: asyncio.Event | None = None
        self._fence_row_ready = False
        self.claims = 0
        self.polls = 0

    # ----------------------------------------------------------------- introspection

    def capabilities(self) -> SchedulerCapabilities:
        """Static capability flags of this backend."""
        return SchedulerCapabilities(
            durable_across_process_restart=True,
            supports_distributed_claims=True,
            supports_atomic_tenant_quota=True,
            supports_atomic_fenced_mutations=True,
            max_pending_items=self.max_pending_items,
            max_retained_terminal_items=self.max_retained_terminal_items,
        )

    @property
    def closed(self) -> bool:
        return self._closed

    def leases(self) -> tuple[WorkerLease, ...]:
        """Live leases handed out by this scheduler (this process)."""
        return tuple(self._leases.values())

    def pinned_runs(self) -> frozenset[str]:
        """Runs with a fenced write in flight (or queued behind one) in this process."""
        return frozenset(self._pins)

    def snapshot(self) -> dict[str, Any]:
        """Plain-dict figures of this process's side (the database has the rest)."""
        return {
            "backend": "database",
            "queue": self.queue,
            "leases": len(self._leases),
            "pinned_runs": len(self._pins),
            "claims": self.claims,
            "polls": self.polls,
            "closed": self._closed,
        }

    def _limits(self, policy: SchedulerClaimPolicy) -> tuple[int | None, int | None]:
        per_tenant = policy.max_active_per_tenant
        max_active = None
        if self._group is not None:
            max_active = self._group.max_active
            group_limit = self._group.max_per_tenant
            per_tenant = group_limit if per_tenant is None else min(per_tenant, group_limit)
        return max_active, per_tenant

    def _pending_limit(self) -> int:
        limit = self.max_pending_items
        if self._group is not None:
            limit = min(limit, self._group.max_pending)
        return limit

    async def _db(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return await db_call(fn, *args, **kwargs)

    # ----------------------------------------------------------------- pending

    def _pending_sync(self) -> int:
        rows = Run.objects.using(self.using).filter(status=RunStatus.QUEUED, parent__isnull=True)
        if self.queue is not None:
            rows = rows.filter(queue=self.queue)
        return rows.count()

    async def pending_count(self) -> int:
        """Queued root runs (of this scheduler's queue, if it has one) in the database."""
        return await self._db(self._pending_sync)

    # ----------------------------------------------------------------- submit

    def _resolve(self, work_id: str) -> str | None:
        run_id = self._by_run_for(work_id)
        if run_id is not None:
            return run_id
        try:
            return str(uuid.UUID(work_id.removeprefix("work-")))
        except ValueError:
            return None

    def _by_run_for(self, work_id: str) -> str | None:
        work = self._works.get(work_id)
        return None if work is None else work.run_id

    def _ensure_fence_row(self) -> None:
        if self._fence_row_ready:
            return
        try:
            FenceSequence.objects.using(self.using).get_or_create(pk=1)
        except IntegrityError:  # another process created it first
            pass
        self._fence_row_ready = True

    def _submit_sync(self, work: WorkItem) -> bool:
        self._ensure_fence_row()
        with transaction.atomic(using=self.using):
            # The fence row serializes admissions with claims, so the pending limit holds.
            FenceSequence.objects.using(self.using).select_for_update().get(pk=1)
            row = (
                Run.objects.using(self.using)
                .filter(pk=work.run_id)
                .values("status", "parent_id")
                .first()
            )
            if row is None:
                raise run_not_found(work.run_id)
            status = row["status"]
            if status in TERMINAL_STATUSES or status == RunStatus.RUNNING:
                return False
            if status == RunStatus.QUEUED:
                # Admitted already (by the API): this scheduler now knows its work item.
                return True
            if row["parent_id"] is None:
                pending = (
                    Run.objects.using(self.using)
                    .filter(status=RunStatus.QUEUED, parent__isnull=True)
                    .count()
                )
                limit = self._pending_limit()
                if pending >= limit:
                    raise queue_full_error(limit)
            values: dict[str, Any] = {
                "status": RunStatus.QUEUED,
                "priority": work.priority,
                "available_at": work.available_at,
            }
            if self.queue is not None:
                values["queue"] = self.queue
            Run.objects.using(self.using).filter(pk=work.run_id, status=status).update(**values)
            return True

    async def submit(self, work: WorkItem) -> bool:
        """Queue the run ``work`` refers to; return False if already known or finished.

        The run row must exist (the API creates it): a suspended row is queued, a queued
        row is adopted, a running or finished one is left alone (False). Raises
        ``scheduler.closed`` after `close()`, ``scheduler.work_id_conflict`` for a
        different item under a known ``work_id``, ``scheduler.queue_full`` at the pending
        limit (all queues), ``scheduler.run_not_found`` for a missing row.
        """
        if self._closed:
            raise closed_error()
        existing = self._works.get(work.work_id)
        if existing is not None:
            if _content(existing) == _content(work):
                return False
            raise work_id_conflict_error(work.work_id)
        if work.idempotency_key is not None and work.idempotency_key in self._idempotency:
            return False
        accepted = await self._db(self._submit_sync, work)
        if not accepted:
            return False
        self._works[work.work_id] = work
        self._by_run[work.run_id] = work.work_id
        if work.idempotency_key is not None:
            self._idempotency[work.idempotency_key] = work.work_id
        self._ledger.notify()
        return True

    def _finish(self, run_id: str) -> None:
        """Forget a finished or cancelled item, keeping its key as terminal."""
        work_id = self._by_run.pop(run_id, None)
        work = self._works.pop(work_id, None) if work_id is not None else None
        if work is None or work.idempotency_key is None:
            return
        self._terminal.append(work.idempotency_key)
        while len(self._terminal) > self.max_retained_terminal_items:
            self._idempotency.pop(self._terminal.popleft(), None)

    def _requeued(self, run_id: str) -> None:
        work_id = self._by_run.get(run_id)
        if work_id is not None:
            work = self._works[work_id]
            self._works[work_id] = replace(work, attempt=work.attempt + 1)

    # ----------------------------------------------------------------- reaping

    def _reap_sync(self, now: datetime, pinned: frozenset[str]) -> list[str]:
        """Requeue (or fail, past ``max_attempts``) expired unpinned leases; inside a txn."""
        # A running row without an expiry has no live lease either (a crashed claim).
        dead = Q(lease_expires_at__lte=now) | Q(lease_expires_at__isnull=True)
        expired = Run.objects.using(self.using).filter(dead, status=RunStatus.RUNNING)
        if pinned:
            # This process's writes in flight keep their lease (BEHAVIOUR §3.3).
            expired = expired.exclude(pk__in=list(pinned))
        ids = [str(pk) for pk in expired.values_list("pk", flat=True)]
        if not ids:
            return []
        rows = Run.objects.using(self.using).filter(dead, pk__in=ids, status=RunStatus.RUNNING)
        if self.max_attempts is not None:
            exhausted = list(
                rows.filter(attempts__gte=self.max_attempts).values_list("pk", flat=True)
            )
            if exhausted:
                Run.objects.using(self.using).filter(pk__in=exhausted).update(
                    status=RunStatus.FAILED,
                    error=WORKER_RESTARTED,
                    finished_at=now,
                    lease_owner="",
                    lease_expires_at=None,
                )
                if self.on_failed is not None:
                    for pk in exhausted:
                        self.on_failed(pk)
        rows.update(**_requeue_values())
        return ids

    def _reap_txn(self, now: datetime, pinned: frozenset[str]) -> list[str]:
        with transaction.atomic(using=self.using):
            return self._reap_sync(now, pinned)

    async def reap_expired(self) -> int:
        """Requeue every expired lease not mid-write here (``attempt + 1``); return how many."""
        reaped = await self._db(self._reap_txn, self._clock(), frozenset(self._pins))
        self._after_reap(reaped)
        return len(reaped)

    def _after_reap(self, reaped: list[str]) -> None:
        for run_id in reaped:
            lease = self._lease_of_run(run_id)
            if lease is not None:
                del self._leases[lease.lease_id]
            self._requeued(run_id)
        if reaped:
            self._ledger.notify()

    def _lease_of_run(self, run_id: str) -> WorkerLease | None:
        for lease in self._leases.values():
            if lease.run_id == run_id:
                return lease
        return None

    # ----------------------------------------------------------------- claim

    def _claim_sync(
        self,
        worker_id: str,
        duration: timedelta,
        order: ClaimOrder,
        max_active: int | None,
        per_tenant: int | None,
        now: datetime,
        pinned: frozenset[str],
    ) -> tuple[dict[str, Any] | None, int, list[str], datetime | None]:
        """One claim attempt: (row, token, reaped run ids, next due time when none)."""
        self._ensure_fence_row()
        db = self.using
        # Idle polling must not take the claim lock: a worker frozen (SIGSTOP, a long GC,
        # a swapped-out VM) inside that transaction would stall every other worker's claims.
        available = Q(status=RunStatus.QUEUED, available_at__lte=now, cancel_requested=False)
        if self.queue is not None:
            available &= Q(queue=self.queue)
        dead_lease = Q(status=RunStatus.RUNNING) & (
            Q(lease_expires_at__lte=now) | Q(lease_expires_at__isnull=True)
        )
        if not Run.objects.using(db).filter(available | dead_lease).exists():
            return None, 0, [], self._next_due_sync(now)
        with transaction.atomic(using=db):
            fence = FenceSequence.objects.using(db).select_for_update().get(pk=1)
            reaped = self._reap_sync(now, pinned)
            running = {
                owner: n
                for owner, n in Run.objects.using(db)
                .filter(status=RunStatus.RUNNING, parent__isnull=True)
                .values_list("owner_id")
                .annotate(n=Count("pk"))
                .order_by()
            }
            queued = Run.objects.using(db).filter(
                status=RunStatus.QUEUED, available_at__lte=now, cancel_requested=False
            )
            if self.queue is not None:
                queued = queued.filter(queue=self.queue)
            if max_active is not None and sum(running.values()) >= max_active:
                # Only child runs (which count against no quota) may still start.
                queued = queued.filter(parent__isnull=False)
            if per_tenant is not None:
                saturated = [owner for owner, n in running.items() if n >= per_tenant]
                if saturated:
                    queued = queued.exclude(Q(owner_id__in=saturated) & Q(parent__isnull=True))
            heads = (
                queued.annotate(
                    head=Window(
                        RowNumber(),
                        partition_by=[F("owner_id")],
                        order_by=[F("priority").desc(), F("created_at").asc(), F("id").asc()],
                    )
                )
                .filter(head=1)
                .values_list("pk", "owner_id", "priority", "created_at", "parent_id")
            )
            candidates = [
                ClaimCandidate(
                    tenant_id=owner if parent is None else None,
                    priority=priority,
                    submit_order=(created, str(pk)),
                    ref=pk,
                )
                for pk, owner, priority, created, parent in heads
            ]
            skip_locked = connections[db].features.has_select_for_update_skip_locked
            for candidate in fair_order(candidates, running, order=order):
                rows = Run.objects.using(db).filter(pk=candidate.ref, status=RunStatus.QUEUED)
                if skip_locked:
                    rows = rows.select_for_update(skip_locked=True)
                row = rows.values(*_ROW_FIELDS).first()
                if row is None:
                    continue  # taken or being changed by another transaction
                token = fence.value + 1
                FenceSequence.objects.using(db).filter(pk=1).update(value=token)
                Run.objects.using(db).filter(pk=candidate.ref).update(
                    status=RunStatus.RUNNING,
                    lease_owner=worker_id,
                    lease_token=token,
                    lease_expires_at=now + duration,
                    attempts=F("attempts") + 1,
                    started_at=Coalesce(F("started_at"), now),
                )
                row["attempts"] += 1
                return row, token, reaped, None
            return None, 0, reaped, self._next_due_sync(now)

    def _next_due_sync(self, now: datetime) -> datetime | None:
        """The next time a queued row becomes available or a lease expires."""
        db = self.using
        later = Run.objects.using(db).filter(status=RunStatus.QUEUED, available_at__gt=now)
        if self.queue is not None:
            later = later.filter(queue=self.queue)
        times = [
            later.order_by("available_at").values_list("available_at", flat=True).first(),
            Run.objects.using(db)
            .filter(status=RunStatus.RUNNING, lease_expires_at__isnull=False)
            .order_by("lease_expires_at")
            .values_list("lease_expires_at", flat=True)
            .first(),
        ]
        due = [t for t in times if t is not None]
        return min(due) if due else None

    async def claim(
        self,
        worker_id: str,
        *,
        lease_duration: timedelta,
        policy: SchedulerClaimPolicy | None = None,
        wait_timeout: float | None = None,
    ) -> WorkerLease | None:
        """Lease the best eligible run, waiting up to ``wait_timeout`` seconds for one.

        ``0`` tries once, ``None`` waits forever. Between attempts it sleeps until a
        submit/release in this process (or quota group) wakes it, the next known due time
        (availability or lease expiry), or a poll interval growing 0.05 s → 1 s — other
        processes' changes are only seen by polling. Returns None on timeout. Raises
        ValueError for a non-positive duration or a negative timeout, ``scheduler.closed``
        when closed.
        """
        duration = _as_timedelta(lease_duration)
        if wait_timeout is not None and wait_timeout < 0:
            raise ValueError("wait_timeout must be non-negative")
        policy = policy or SchedulerClaimPolicy()
        max_active, per_tenant = self._limits(policy)
        loop = asyncio.get_running_loop()
        deadline = None if wait_timeout is None else loop.time() + wait_timeout
        poll = POLL_START
        while True:
            if self._closed:
                raise closed_error()
            now = self._clock()
            row, token, reaped, due = await self._db(
                self._claim_sync,
                worker_id,
                duration,
                policy.order,
                max_active,
                per_tenant,
                now,
                frozenset(self._pins),
            )
            self._after_reap(reaped)
            if self._closed and row is not None:
                # Closed while the claim ran: hand the row straight back.
                await self._db(self._requeue_token_sync, str(row["pk"]), worker_id, token)
                raise closed_error()
            if row is not None:
                return self._lease_from_row(row, worker_id, token, now, duration)
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                return None
            delay = poll
            if due is not None:
                delay = min(delay, max((due - now).total_seconds(), 0.001))
            if remaining is not None:
                delay = min(delay, remaining)
            self.polls += 1
            woke = await self._wait(loop, delay)
            poll = POLL_START if woke else min(poll * 2, POLL_MAX)

    def _lease_from_row(
        self, row: dict[str, Any], worker_id: str, token: int, now: datetime, duration: timedelta
    ) -> WorkerLease:
        run_id = str(row["pk"])
        work_id = self._by_run.get(run_id)
        if work_id is not None:
            work = self._works[work_id]
            if work.attempt != row["attempts"]:
                work = replace(work, attempt=max(1, row["attempts"]))
                self._works[work_id] = work
        else:
            work = work_from_row(row)
        lease = WorkerLease(
            lease_id=uuid.uuid4().hex,
            work=work,
            worker_id=worker_id,
            fencing_token=token,
            acquired_at=now,
            expires_at=now + duration,
        )
        self._leases[lease.lease_id] = lease
        self.claims += 1
        return lease

    async def _wait(self, loop: asyncio.AbstractEventLoop, delay: float) -> bool:
        """Sleep up to ``delay`` s or until notified; True if notified."""
        fut: asyncio.Future[None] = loop.create_future()
        self._ledger.waiters.add(fut)
        handle = loop.call_later(max(delay, 0.001), _wake, fut)
        try:
            await fut
        finally:
            self._ledger.waiters.discard(fut)
            notified = not handle.cancelled() and handle.when() > loop.time()
            handle.cancel()
        return notified

    async def wait_for_change(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for a submit/release/close notification here.

        Returns True if notified. For a dispatcher that claims with ``wait_timeout=0``
        and does its own (interruptible) waiting.
        """
        return await self._wait(asyncio.get_running_loop(), seconds)

    def forget(self, lease: WorkerLease) -> None:
        """Drop ``lease`` from this process's books without touching the database.

        For a lease already lost to another worker (its writes were rejected): there is
        nothing left to release.
        """
        self._leases.pop(lease.lease_id, None)

    def notify(self) -> None:
        """Wake waiting claims of this scheduler (and of its quota group)."""
        self._ledger.notify()

    # ----------------------------------------------------------------- leases

    def _renew_sync(
        self, lease: WorkerLease, now: datetime, duration: timedelta, pinned: bool
    ) -> str:
        with transaction.atomic(using=self.using):
            held = _held(lease).using(self.using)
            if not pinned:
                expired = held.filter(lease_expires_at__lte=now).update(**_requeue_values())
                if expired:
                    return "expired"
            touched = held.update(lease_expires_at=now + duration)
            return "renewed" if touched else "lost"

    async def renew(self, lease: WorkerLease, *, lease_duration: timedelta) -> WorkerLease:
        """Extend ``lease`` to now + ``lease_duration``; return the updated lease.

        Works mid-write even past expiry. Raises ``scheduler.lease_expired`` if the
        lease expired (the run is then requeued) or was superseded, released or
        cancelled; ValueError for a non-positive duration.
        """
        duration = _as_timedelta(lease_duration)
        now = self._clock()
        outcome = await self._db(self._renew_sync, lease, now, duration, lease.run_id in self._pins)
        if outcome != "renewed":
            self._leases.pop(lease.lease_id, None)
            if outcome == "expired":
                self._requeued(lease.run_id)
                self._ledger.notify()
            raise lease_expired_error()
        renewed = replace(lease, expires_at=now + duration)
        if lease.lease_id in self._leases:
            self._leases[lease.lease_id] = renewed
        return renewed

    def _admit_sync(self, lease: WorkerLease, now: datetime, allow_expired: bool) -> str:
        with transaction.atomic(using=self.using):
            held = _held(lease).using(self.using)
            expires = held.values_list("lease_expires_at", flat=True).first()
            if expires is None:
                return "lost"
            if not allow_expired and expires <= now:
                held.update(**_requeue_values())
                return "expired"
            return "held"

    async def _admit(self, lease: WorkerLease, *, allow_expired: bool = False) -> None:
        outcome = await self._db(self._admit_sync, lease, self._clock(), allow_expired)
        if outcome == "held":
            return
        self._leases.pop(lease.lease_id, None)
        if outcome == "expired":
            self._requeued(lease.run_id)
            self._ledger.notify()
        raise fence_rejected_error()

    async def assert_fence(self, lease: WorkerLease) -> None:
        """Return if ``lease`` still owns its run; raise ``scheduler.fence_rejected``.

        An expired lease is reaped first, except while its run is mid-write here.
        """
        await self._admit(lease, allow_expired=lease.run_id in self._pins)

    def _release_sync(
        self,
        lease: WorkerLease,
        reason: LeaseReleaseReason,
        requeue: bool,
        error: Mapping[str, Any] | None,
        now: datetime,
        allow_expired: bool,
    ) -> bool:
        with transaction.atomic(using=self.using):
            held = _held(lease).using(self.using)
            if not allow_expired:
                held = held.filter(lease_expires_at__gt=now)
            values: dict[str, Any]
            if requeue or reason is LeaseReleaseReason.WORKER_SHUTDOWN:
                values = {**_requeue_values(), "available_at": now}
            else:
                values = {
                    "status": _RELEASE_STATUS[reason],
                    "lease_owner": "",
                    "lease_expires_at": None,
                }
                if reason is not LeaseReleaseReason.SUSPENDED:
                    values["finished_at"] = now
            if error is not None:
                values["error"] = dict(error)
            if held.update(**values):
                return True
            # The executor may already have finished the run under this very lease (it
            # writes the terminal state itself): releasing that is not a stale release.
            return (
                Run.objects.using(self.using)
                .filter(
                    pk=lease.run_id,
                    lease_token=lease.fencing_token,
                    status__in=[*TERMINAL_STATUSES, RunStatus.SUSPENDED],
                )
                .exists()
            )

    async def release(
        self,
        lease: WorkerLease,
        reason: LeaseReleaseReason | str,
        *,
        requeue: bool = False,
        error: Mapping[str, Any] | None = None,
    ) -> None:
        """End ``lease``; with ``requeue`` (or ``worker_shutdown``) the run is queued again.

        Otherwise the run takes the status of ``reason`` (completed, failed, cancelled,
        suspended); ``error`` (optional) is stored on the run. Waits for a fenced write of
        the run in flight here. A run the executor already finished under this lease is
        accepted. Raises ``scheduler.fence_rejected`` if the lease no longer owns the run.
        """
        reason = LeaseReleaseReason(reason)
        run_id = lease.run_id
        await self._pins.acquire(run_id)
        try:
            ok = await self._db(
                self._release_sync, lease, reason, requeue, error, self._clock(), False
            )
            self._leases.pop(lease.lease_id, None)
            if not ok:
                raise fence_rejected_error()
            if requeue or reason is LeaseReleaseReason.WORKER_SHUTDOWN:
                self._requeued(run_id)
            else:
                self._finish(run_id)
            self._ledger.notify()
        finally:
            self._pins.release(run_id)

    def _requeue_token_sync(self, run_id: str, worker_id: str, token: int) -> None:
        Run.objects.using(self.using).filter(
            pk=run_id, lease_owner=worker_id, lease_token=token, status=RunStatus.RUNNING
        ).update(**_requeue_values())

    # ----------------------------------------------------------------- cancel

    def _cancel_sync(self, run_id: str, now: datetime) -> bool:
        with transaction.atomic(using=self.using):
            return (
                Run.objects.using(self.using)
                .filter(
                    pk=run_id,
                    status__in=[RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.SUSPENDED],
                )
                .update(
                    status=RunStatus.CANCELLED,
                    lease_owner="",
                    lease_expires_at=None,
                    finished_at=now,
                    cancel_requested=True,
                )
                == 1
            )

    async def cancel(self, work_id: str) -> bool:
        """Cancel a queued, suspended or leased run; False if unknown or already finished.

        ``work_id`` is a work id submitted here, or the run's id (optionally
        ``work-<run id>``). Waits for a fenced write of the run in flight here; afterwards
        the run's lease fails `assert_fence` (everywhere: the row is no longer running).
        """
        run_id = self._resolve(work_id)
        if run_id is None:
            return False
        await self._pins.acquire(run_id)
        try:
            cancelled = await self._db(self._cancel_sync, run_id, self._clock())
            lease = self._lease_of_run(run_id)
            if lease is not None:
                del self._leases[lease.lease_id]
            if cancelled:
                self._finish(run_id)
                self._ledger.notify()
            return cancelled
        finally:
            self._pins.release(run_id)

    # ----------------------------------------------------------------- fenced writes

    def _unpinned(self, run_id: str) -> None:
        # An expiry skipped while the run was pinned may be due now.
        self._ledger.notify()
        if not self._pins and self._drained is not None:
            self._drained.set()

    async def execute_fenced(self, lease: WorkerLease, operation: Callable[[], Awaitable[T]]) -> T:
        """Run ``operation()`` while ``lease`` provably owns its run; return its result.

        Writes of one run are ordered (FIFO); different runs write concurrently. While
        the write is in flight this process does not reap, release or cancel the run and
        `close()` waits. Across processes the guarantee comes from the database: the
        operation's own transaction must re-check the fence (`scheduling.store` does;
        see `run_fenced`). Raises ``scheduler.fence_rejected`` (operation not called)
        for a stale or expired lease, ``scheduler.closed`` after `close()`.
        """
        if self._closed:
            raise closed_error()
        run_id = lease.run_id
        await self._pins.acquire(run_id)
        try:
            if self._closed:
                raise closed_error()
            stored = self._leases.get(lease.lease_id)
            if (
                stored is None
                or stored.fencing_token != lease.fencing_token
                or stored.worker_id != lease.worker_id
                or stored.run_id != lease.run_id
                or stored.expires_at <= self._clock()
            ):
                # Not a live lease of this process (or expired): ask the database, which
                # requeues an expired run and rejects.
                await self._admit(lease)
            # A lease this process holds live is admitted without a round trip; the
            # operation's own transaction re-checks owner and token (check_fence), which
            # is what stops a worker whose lease another process took over.
            return await operation()
        finally:
            self._pins.release(run_id)

    def _run_fenced_sync(self, lease: WorkerLease, fn: Callable[[], T]) -> T:
        with transaction.atomic(using=self.using):
            check_fence(lease_fence(lease), using=self.using)
            return fn()

    async def run_fenced(self, lease: WorkerLease, fn: Callable[[], T]) -> T:
        """Run the ORM function ``fn`` in one transaction that first re-checks the fence.

        The conditional update of the run row and ``fn``'s writes commit or roll back
        together, so a worker that lost its lease (in any process) writes nothing.
        Raises ``scheduler.fence_rejected`` (nothing written).
        """
        return await self.execute_fenced(lease, lambda: self._db(self._run_fenced_sync, lease, fn))

    # ----------------------------------------------------------------- close

    async def close(self) -> None:
        """Close: wake waiting claims with ``scheduler.closed``, wait for writes in flight.

        Leases still held here go back to the queue (conditional on owner and token), so
        they need not wait for expiry. Idempotent.
        """
        self._closed = True
        self._ledger.notify()
        if self._pins:
            if self._drained is None or self._drained.is_set():
                self._drained = asyncio.Event()
            await self._drained.wait()
        leases, self._leases = list(self._leases.values()), {}
        for lease in leases:
            try:
                await self._db(
                    self._requeue_token_sync, lease.run_id, lease.worker_id, lease.fencing_token
                )
            except Exception as exc:  # its lease expires on its own
                logger.warning("could not requeue run %s at close: %s", lease.run_id, exc)
        if leases:
            self._ledger.notify()
