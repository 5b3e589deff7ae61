"""`DatabaseScheduler`: the worker loop's async door to the Run state machine
(``scheduling.runs``). A run row *is* the queue entry: ``status``, ``ready`` (its session's
turn), ``priority``, ``available_at``, ``lease_owner``, ``lease_token``,
``lease_expires_at``, ``attempts`` and ``crashes``. Every state change is a function of
`scheduling.runs` run in a thread; the class adds what one process needs around them:
wake-ups of waiting claims within the process (and its quota group), polling with backoff
for other processes' changes, the leases it handed out, and the `Scheduler` protocol's shape
(``submit``, ``claim``, ``renew``, ``release``, ``cancel``, ``reap_expired``) so the shared
contract tests run against real rows. Writes of a leased run are fenced inside their own
transactions (``runs.check_fence`` in the session store's commits, conditional updates in
each transition), which is what stops a worker whose lease another process took over; there
is no second, in-process fencing path. Lease times come from the database's clock (``Now()``
at grant and renewal); an injected ``clock`` replaces it so tests can move time by hand.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

from django.db import transaction

from sageproject.db import db_call
from sageproject.errors import NotFoundError
from scheduling import pending, runs
from scheduling.figures import (
    LEASE_RECLAIMS,
    START_WAIT,
    Figures,
)
from scheduling.models import (
    RunStatus,
    WorkerSnapshot,
)
from scheduling.protocol import (
    FenceRejected,
    LeaseExpired,
    LeaseReleaseReason,
    SchedulerBase,
    SchedulerClaimPolicy,
    SchedulerQuotaGroup,
    WorkerLease,
    WorkItem,
    _as_timedelta,
    closed_error,
)
from scheduling.runs import Fence, Grant
from scheduling.runs.selectors import queued_roots

logger = logging.getLogger("sage.worker")

POLL_START, POLL_MAX = 0.05, 1.0
# Dead leases are looked for at most this often by the claims of one scheduler (a lease is
# tens of seconds long, so this adds nothing to a reclaim's delay); every claim would
# otherwise pay for two more statements.
REAP_SECONDS = 1.0
# A worker counts as live while its snapshot (published every few seconds) is younger than
# this by the database's clock; the live workers are looked up at most every SHARE_SECONDS.
LIVE_WORKER_SECONDS = 10.0
SHARE_SECONDS = 1.0
# A claim answering a `run` wake-up leaves the periodic look for dead leases and the read
# of the live workers to the next claim (the one right after it looks for more work anyway)
# unless they are overdue by this many periods: the run the wake-up announced should not
# wait for them.
PUSHED_DEFERS = 1

_RELEASE_STATUS = {
    LeaseReleaseReason.COMPLETED: RunStatus.COMPLETED,
    LeaseReleaseReason.FAILED: RunStatus.FAILED,
    LeaseReleaseReason.CANCELLED: RunStatus.CANCELLED,
}


def run_not_found(run_id: Any) -> NotFoundError:
    return NotFoundError("scheduler.run_not_found", f"no run {run_id}")


def work_from_row(row: Mapping[str, Any]) -> WorkItem:
    """The `WorkItem` of a run row that was admitted outside this scheduler (the API).

    ``payload["claimed"]`` carries what the claim read of the run and its session, so the
    executor prepares the run without reading it again.
    """
    run_id = str(row["pk"])
    return WorkItem(
        work_id=run_id,
        run_id=run_id,
        tenant_id=str(row["owner_id"]),
        priority=max(-100, min(100, int(row["priority"]))),
        available_at=row["available_at"],
        attempt=max(1, int(row["attempts"])),
        payload={
            "queue": row["queue"],
            "parent": str(row["parent_id"] or "") or None,
            "claimed": dict(row),
        },
    )


def live_worker_slots(using: str = "default") -> dict[str, int]:
    """The live workers (a snapshot younger than `LIVE_WORKER_SECONDS` by the database's
    clock, not stopped) and the slots each published (``runs.max_concurrent``)."""
    rows = (
        WorkerSnapshot.objects.using(using)
        .filter(
            stopped_at__isnull=True,
            heartbeat_at__gt=runs.later_expr(-timedelta(seconds=LIVE_WORKER_SECONDS)),
        )
        .values_list("worker_id", "capacity__runs__max_concurrent")
    )
    slots = {}
    for worker_id, published in rows:
        try:
            slots[worker_id] = max(1, int(published))
        except (TypeError, ValueError):
            slots[worker_id] = 1
    return slots


def fair_share(limit: int, slots: Mapping[str, int], worker_id: str) -> int:
    """``worker_id``'s share of ``limit`` runs among workers with ``slots`` each: the limit
    is dealt out evenly (rounded up), a worker with fewer slots than its part leaving the
    rest to the others (water-filling). At least 1, at most the worker's own slots."""
    remaining = limit
    ordered = sorted(slots.items(), key=lambda item: (item[1], item[0]))
    for index, (worker, own) in enumerate(ordered):
        part = min(own, -(-max(remaining, 0) // (len(ordered) - index)))
        if worker == worker_id:
            return max(1, part)
        remaining -= part
    return max(1, min(limit, slots.get(worker_id, limit)))


def lease_fence(lease: WorkerLease) -> Fence:
    """The `Fence` every write of a database lease carries."""
    return Fence(
        run_id=uuid.UUID(lease.run_id), lease_owner=lease.worker_id, lease_token=lease.fencing_token
    )


class DatabaseScheduler(SchedulerBase):
    """The scheduler protocol on ``Run`` rows, safe across worker processes.

    ``queue`` limits claims (and pending counts) to one `RunQueue` (None: all). Limits:
    ``max_pending_items`` and, with a ``quota_group``, its ``max_active``,
    ``max_per_tenant`` and ``max_pending`` — all counted over every queue in the
    database. ``max_attempts`` (optional) is the crash budget: reaping fails a run whose
    worker died that many times, with ``execution.worker_restarted`` (suspensions and
    graceful restarts do not count).
    """

    capability_flags = {
        "durable_across_process_restart": True,
        "supports_distributed_claims": True,
        "supports_atomic_tenant_quota": True,
        "supports_atomic_fenced_mutations": True,
    }
    claim_poll = (POLL_START, POLL_MAX)

    def __init__(
        self,
        *,
        queue: str | None = None,
        max_pending_items: int = 1024,
        max_retained_terminal_items: int = 4096,
        clock: Callable[[], datetime] | None = None,
        quota_group: SchedulerQuotaGroup | None = None,
        max_attempts: int | None = None,
        using: str = "default",
        metrics: Figures | None = None,
    ) -> None:
        # Of a group's ledger only the waiters are used: members of one group wake each other.
        super().__init__(
            max_pending_items=max_pending_items,
            max_retained_terminal_items=max_retained_terminal_items,
            clock=clock,
            quota_group=quota_group,
        )
        self.queue = queue
        self.max_attempts = max_attempts
        self.using = using
        self._pushed = False  # see `notify`
        self._works: dict[str, WorkItem] = {}
        self._by_run: dict[str, str] = {}
        self.claims = 0
        self.polls = 0
        self.reaped = 0
        # Lease reclaims and the wait from admission to claim, for /metrics.
        self.metrics = metrics if metrics is not None else Figures()
        self._next_reap = 0.0
        self._next_recount = time.monotonic() + pending.RECONCILE_SECONDS
        self._next_share = 0.0
        self._live: dict[str, int] = {}

    # ----------------------------------------------------------------- introspection

    def snapshot(self) -> dict[str, Any]:
        """Plain-dict figures of this process's side (the database has the rest)."""
        return {
            "backend": "database",
            "queue": self.queue,
            "leases": len(self._leases),
            "claims": self.claims,
            "polls": self.polls,
            "reaped": self.reaped,
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

    # ----------------------------------------------------------------- pending

    def _pending_sync(self) -> int:
        return queued_roots(self.queue, using=self.using).count()

    async def pending_count(self) -> int:
        """Queued root runs (of this scheduler's queue, if it has one) in the database."""
        return await db_call(self._pending_sync)

    # ----------------------------------------------------------------- submit

    def _resolve(self, work_id: str) -> str | None:
        work = self._works.get(work_id)
        if work is not None:
            return work.run_id
        try:
            return str(uuid.UUID(work_id.removeprefix("work-")))
        except ValueError:
            return None

    def _submit_sync(self, work: WorkItem) -> bool:
        submitted = runs.submit(
            work.run_id,
            priority=work.priority,
            available_at=work.available_at,
            queue=self.queue,
            max_pending=self._pending_limit(),
            using=self.using,
        )
        if submitted is None:
            raise run_not_found(work.run_id)
        return submitted

    async def submit(self, work: WorkItem) -> bool:
        """Queue the run ``work`` refers to; return False if already known or finished.

        The run row must exist (the API admits it through ``runs.admit``): a suspended row
        is queued, a queued row is adopted, a running or finished one is left alone
        (False). Raises ``scheduler.closed`` after `close()`, ``scheduler.work_id_conflict``
        for a different item under a known ``work_id``, ``scheduler.queue_full`` at the
        pending limit (all queues), ``scheduler.run_not_found`` for a missing row.
        """
        if self._already_known(self._works.get(work.work_id), work):
            return False
        accepted = await db_call(self._submit_sync, work)
        if not accepted:
            return False
        self._works[work.work_id] = work
        self._by_run[work.run_id] = work.work_id
        self._remember_key(work)
        self._ledger.notify()
        return True

    def _finish(self, run_id: str) -> None:
        """Forget a finished or cancelled item, keeping its key as terminal."""
        work_id = self._by_run.pop(run_id, None)
        work = self._works.pop(work_id, None) if work_id is not None else None
        if work is not None:
            self._retire_key(work.idempotency_key)

    def _requeued(self, run_id: str) -> None:
        work_id = self._by_run.get(run_id)
        if work_id is not None:
            work = self._works[work_id]
            self._works[work_id] = replace(work, attempt=work.attempt + 1)

    # ----------------------------------------------------------------- reaping

    async def reap_expired(self) -> int:
        """End every dead lease (requeued as a crash; cancelled if a cancel was requested;
        failed once the crash budget is used up); return how many runs were touched."""
        reaped = await db_call(
            runs.reap, max_crashes=self.max_attempts, using=self.using, clock=self._clock
        )
        self._after_reap(reaped)
        return len(reaped)

    async def recount_pending(self) -> int:
        """Correct the pending counters from the queued runs themselves (queued rows that
        went without a transition: a deleted session, an import); returns how many counters
        were wrong (logged)."""
        wrong = await db_call(pending.reconcile, using=self.using)
        if wrong:
            logger.warning("pending counts corrected: %d counter(s) were off", wrong)
        return wrong

    def _after_reap(self, reaped: list[str]) -> None:
        self.reaped += len(reaped)
        self.metrics.count(LEASE_RECLAIMS, len(reaped))
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

    async def claim_many(
        self,
        worker_id: str,
        *,
        lease_duration: timedelta,
        limit: int,
        policy: SchedulerClaimPolicy | None = None,
    ) -> list[WorkerLease]:
        """Claim up to ``limit`` runs in one transaction (no waiting); [] when none. A
        claim that could take every claimable run leaves the other live workers (as
        `fair_share` last read them) their part (``runs.claim``'s ``share_with``)."""
        self._check_open()
        duration = _as_timedelta(lease_duration)
        policy = policy or SchedulerClaimPolicy()
        max_active, per_tenant = self._limits(policy)
        now = time.monotonic()
        # With an injected clock (tests move time by hand) every claim reaps.
        reap = self._clock is not None or now >= self._due(self._next_reap, REAP_SECONDS)
        if reap:
            self._next_reap = now + REAP_SECONDS
        look_first, self._pushed = not self._pushed, False
        grants, reaped = await db_call(
            runs.claim,
            worker_id=worker_id,
            duration=duration,
            order=policy.order,
            max_active=max_active,
            per_tenant=per_tenant,
            queue=self.queue,
            limit=limit,
            max_crashes=self.max_attempts,
            reap=reap,
            look_first=look_first,
            share_with=self.live_workers,
            using=self.using,
            clock=self._clock,
        )
        self._after_reap(reaped)
        if now >= self._next_recount:
            self._next_recount = now + pending.RECONCILE_SECONDS
            await self.recount_pending()
        leases = [self._lease_from_grant(grant, worker_id) for grant in grants]
        if self._closed and leases:
            # Closed while the claim ran: hand the rows straight back.
            for lease in leases:
                await self._requeue(lease)
            raise closed_error()
        return leases

    async def fair_share(self, worker_id: str, slots: int) -> int:
        """How many runs ``worker_id`` (with ``slots`` of its own) may hold: all its slots,
        unless the global limit of its quota group (``max_active``) is smaller than what
        the live workers can hold together — then its share of that limit (`fair_share`),
        so one worker's claims cannot take every freed slot while another starves. The
        live workers are read at most every `SHARE_SECONDS`; a failed read keeps the last.
        """
        now = time.monotonic()
        if now >= self._due(self._next_share, SHARE_SECONDS):
            self._next_share = now + SHARE_SECONDS
            try:
                self._live = await db_call(live_worker_slots, self.using)
            except Exception as exc:  # the claim itself reports database trouble
                logger.debug("reading the live workers failed: %s", exc)
        max_active = self._group.max_active if self._group is not None else None
        if max_active is None:
            return slots
        return fair_share(max_active, {**self._live, worker_id: slots}, worker_id)

    def _due(self, next_at: float, period: float) -> float:
        """When a periodic read planned for ``next_at`` is done: then, or a claim answering
        a wake-up lets it wait up to `PUSHED_DEFERS` more periods (the first one is never
        put off: ``next_at`` 0)."""
        if self._pushed and next_at:
            return next_at + PUSHED_DEFERS * period
        return next_at

    @property
    def live_workers(self) -> int:
        """The live workers `fair_share` last read (at least 1: this one)."""
        return max(1, len(self._live))

    async def _claim_once(
        self, worker_id: str, duration: timedelta, policy: SchedulerClaimPolicy
    ) -> WorkerLease | None:
        leases = await self.claim_many(worker_id, lease_duration=duration, limit=1, policy=policy)
        return leases[0] if leases else None

    async def _due_in(self) -> float | None:
        """Seconds until the queue's next run becomes available or lease expires, on the
        database's clock (an idle claim's look between polls, counted in ``polls``)."""
        self.polls += 1
        due = await db_call(runs.next_due, self.queue, using=self.using)
        if due is None:
            return None
        now = await db_call(runs.db_now, self.using, self._clock)
        return max((due - now).total_seconds(), 0.001)

    def _lease_from_grant(self, grant: Grant, worker_id: str) -> WorkerLease:
        row = grant.row
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
            fencing_token=grant.token,
            acquired_at=grant.granted_at,
            expires_at=grant.expires_at,
        )
        self._leases[lease.lease_id] = lease
        self.claims += 1
        waited = (grant.granted_at - row["available_at"]).total_seconds()
        self.metrics.observe(START_WAIT, waited, queue=row["queue"])
        return lease

    async def wait_for_change(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for a submit/release/close notification here.

        Returns True if notified. For a dispatcher that claims without waiting and does its
        own (interruptible) waiting.
        """
        return await self._wait(asyncio.get_running_loop(), seconds)

    def forget(self, lease: WorkerLease) -> None:
        """Drop ``lease`` from this process's books without touching the database (a lease
        already lost to another worker: there is nothing left to release)."""
        self._leases.pop(lease.lease_id, None)

    def notify(self, *, pushed: bool = False) -> None:
        """Wake waiting claims of this scheduler (and of its quota group). ``pushed``: a
        wake-up said a run was queued, so the next claim goes straight to its transaction
        instead of first looking for work without a lock (as idle polls do)."""
        if pushed:
            self._pushed = True
        self._ledger.notify()

    # ----------------------------------------------------------------- leases

    async def renew(self, lease: WorkerLease, *, lease_duration: timedelta) -> WorkerLease:
        """Extend ``lease`` to the database's now + ``lease_duration``.

        Raises ``scheduler.lease_expired`` if the lease expired or was superseded, released
        or cancelled (an expired run is reaped by the next claim); ValueError for a
        non-positive duration.
        """
        duration = _as_timedelta(lease_duration)
        expires = await db_call(
            runs.renew,
            lease_fence(lease),
            duration,
            max_crashes=self.max_attempts,
            using=self.using,
            clock=self._clock,
        )
        if expires is None:
            self._leases.pop(lease.lease_id, None)
            raise LeaseExpired()
        renewed = replace(lease, expires_at=expires)
        if lease.lease_id in self._leases:
            self._leases[lease.lease_id] = renewed
        return renewed

    def _held_sync(self, fence: Fence) -> bool:
        return runs.held(fence, self.using, self._clock).exists()

    async def assert_fence(self, lease: WorkerLease) -> None:
        """Return if ``lease`` still owns its run (unexpired); raise
        ``scheduler.fence_rejected``."""
        if not await db_call(self._held_sync, lease_fence(lease)):
            self._leases.pop(lease.lease_id, None)
            raise FenceRejected(lease.run_id)

    async def _requeue(self, lease: WorkerLease, error: Mapping[str, Any] | None = None) -> bool:
        return await db_call(
            runs.requeue,
            lease_fence(lease),
            error=dict(error) if error is not None else None,
            using=self.using,
            clock=self._clock,
        )

    async def release(
        self,
        lease: WorkerLease,
        reason: LeaseReleaseReason | str,
        *,
        requeue: bool = False,
        error: Mapping[str, Any] | None = None,
    ) -> None:
        """End ``lease``; with ``requeue`` (or ``worker_shutdown``) the run is queued again
        (no crash counted).

        Otherwise the run ends with the status of ``reason`` (completed, failed,
        cancelled) through ``runs.finish`` — its terminal event and archive included — or
        is suspended. Raises ``scheduler.fence_rejected`` if the lease no longer owns the
        run.
        """
        reason = LeaseReleaseReason(reason)
        run_id = lease.run_id
        fence = lease_fence(lease)
        if requeue or reason is LeaseReleaseReason.WORKER_SHUTDOWN:
            ok = await self._requeue(lease, error)
        elif reason is LeaseReleaseReason.SUSPENDED:
            ok = await db_call(self._suspend_sync, fence, dict(error or {}))
        else:
            ok = await db_call(
                self._finish_sync, fence, _RELEASE_STATUS[reason], dict(error) if error else None
            )
        self._leases.pop(lease.lease_id, None)
        if not ok:
            raise FenceRejected(run_id)
        if requeue or reason is LeaseReleaseReason.WORKER_SHUTDOWN:
            self._requeued(run_id)
        else:
            self._finish(run_id)
        self._ledger.notify()

    def _suspend_sync(self, fence: Fence, error: dict[str, Any]) -> bool:
        try:
            with transaction.atomic(using=self.using):
                runs.check_fence(fence, using=self.using, clock=self._clock)
                runs.Suspend(fence, {"type": "retry", **error})(self.using, clock=self._clock)
        except FenceRejected:
            return False
        return True

    def _finish_sync(self, fence: Fence, status: str, error: dict[str, Any] | None) -> bool:
        try:
            runs.finish(fence, status, error=error, using=self.using, clock=self._clock)
        except FenceRejected:
            return False
        return True

    # ----------------------------------------------------------------- cancel

    async def cancel(self, work_id: str) -> bool:
        """Cancel a queued, suspended or leased run; False if unknown or already finished.

        ``work_id`` is a work id submitted here, or the run's id (optionally
        ``work-<run id>``). A queued or suspended run ends now; a leased one is asked to
        stop and its lease no longer admits writes once its worker ends it.
        """
        run_id = self._resolve(work_id)
        if run_id is None:
            return False
        cancelled = await db_call(self._cancel_sync, run_id)
        lease = self._lease_of_run(run_id)
        if lease is not None:
            del self._leases[lease.lease_id]
        if cancelled:
            self._finish(run_id)
            self._ledger.notify()
        return cancelled

    def _cancel_sync(self, run_id: str) -> bool:
        with transaction.atomic(using=self.using):
            if runs.cancel_queued(run_id, using=self.using):
                return True
            # A leased run: end it now as cancelled (its worker's next write is refused).
            return runs.cancel_leased(run_id, using=self.using)

    # ----------------------------------------------------------------- close

    async def close(self) -> None:
        """Close: wake waiting claims with ``scheduler.closed``. Leases still held here go
        back to the queue (conditional on owner and token), so they need not wait for
        expiry. Idempotent."""
        self._closed = True
        self._ledger.notify()
        leases, self._leases = list(self._leases.values()), {}
        for lease in leases:
            try:
                await self._requeue(lease)
            except Exception as exc:  # its lease expires on its own
                logger.warning("could not requeue run %s at close: %s", lease.run_id, exc)
        if leases:
            self._ledger.notify()
