"""The worker: one asyncio loop that claims runs from the Run table, executes them and
commits what each ends with. A run meets three classes here, in this order.

**`DatabaseScheduler`** — the loop's async door to the Run state machine
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

**`Dispatcher`** — claims and supervises. Path of a run: ``DatabaseScheduler.claim_many``
(fair order, per-user and global quotas, one run per session) → an execution task running
``executor.execute(run_id, fence, stop)``, whose event writes carry the lease's fence → the
`Outcome` it returns is committed here as one transaction (``runs.Outcome``: the terminal
event, status, result and archive, or the suspension and its interaction) through the
session store.

Per execution: a renewer extends the lease every third of its length; if it cannot (the
lease was lost, or renewal kept failing until the lease ran out) the execution is cancelled
with ``stop.reason = "lease_lost"``. The worker never compares its own clock with the
database's: it counts a lease as gone once a lease length has passed on its monotonic clock
since it last asked for it (claim or renewal) — never later than the database lets it
expire — and a renewal that hangs (the network is gone) is abandoned at that moment. One
watcher polls ``Run.cancel_requested`` for all executions about once a second and stops
them with ``stop.reason`` ``cancelled``, ``interrupt`` or ``rollback`` (a newer run of the
session took over). On drain, executions left after the grace period are cancelled with
``stop.reason = "shutdown"`` and requeued with ``scheduler.worker_shutdown`` (resumable;
the crash budget is not used).

Several workers share the global limit (``max_active`` of the scheduler's quota group):
each holds at most its share of it (`fair_share`, from the live workers' snapshots), so the
worker whose slots free first cannot take every freed run while another one starves; after
a claim that left runs to the others it waits `CLAIM_TURN_SECONDS`.

Claim errors: transient ones (any database or connection error, retryable `SageError`)
back off 0.1 s → 5 s and claiming goes on; any other error stops claiming, is logged and
reported in `capacity()`, and ``on_permanent_error`` is called (the worker then exits so
its supervisor restarts it).

**`Worker`** — the process. Composition: a `DatabaseScheduler` over both run queues with
one `SchedulerQuotaGroup` (``SAGE_SERVER_MAX_CONCURRENT_RUNS`` / ``…_PER_USER`` /
``SAGE_SERVER_MAX_PENDING_RUNS``, counted in the database, so they never multiply with
queues or workers; each worker holds its share of them, `SAGE_WORKER_CONCURRENT_RUNS` at
most), a `Dispatcher`, the push listener (``scheduling.wakeups``), a snapshot publisher
(`WorkerSnapshot`), and the executor it is given (the ``runworker`` command composes the
worker with ``agents.executor.RunExecutor``; scheduling never imports agents).

Start-up recovery: a run found ``running`` with no live lease (its worker died) is requeued
with one more crash counted or, once its worker died ``SAGE_MAX_RUN_ATTEMPTS`` times, failed
with ``execution.worker_restarted`` (its ``run.failed`` event and archive in the same
transaction); a dead run whose cancel was requested ends ``cancelled``. A worker whose claim
loop stopped on a permanent error says so in its snapshot and its log, then stops (exit
status 1), so a supervisor restarts it rather than leaving a silent worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Count
from django.utils import timezone

from sageproject.db import db_call, retry_transient, transient_database_error
from sageproject.errors import ErrorCategory, NotFoundError, SageError
from scheduling import live, pending, runs, samples
from scheduling.figures import (
    EXECUTION,
    FENCE_REJECTIONS,
    LEASE_RECLAIMS,
    RATE_LIMITED,
    START_WAIT,
    SUSPENSIONS,
    Figures,
)
from scheduling.leases import (
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
    queue_full_error,
    worker_shutdown_error,
)
from scheduling.live import LivePublisher
from scheduling.models import (
    TERMINAL_STATUSES,
    Run,
    RunStatus,
    WorkerSnapshot,
    run_cancelled_error,
)
from scheduling.runs import DbNow, Fence, Grant, Outcome
from scheduling.store import append_events, close_default_coordinator, default_snapshot
from scheduling.wakeups import Listener

logger = logging.getLogger("sage.worker")

# ----------------------------------------------------------------- the door to the Run table

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
        rows = Run.objects.using(self.using).filter(status=RunStatus.QUEUED, parent__isnull=True)
        if self.queue is not None:
            rows = rows.filter(queue=self.queue)
        return rows.count()

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
        with transaction.atomic(using=self.using):
            row = (
                Run.objects.using(self.using)
                .select_for_update()
                .filter(pk=work.run_id)
                .values("status", "parent_id", "owner_id", "admission_slot")
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
                limit = self._pending_limit()
                if self._pending_sync() >= limit:
                    raise queue_full_error(limit)
            values: dict[str, Any] = {
                "status": RunStatus.QUEUED,
                "priority": work.priority,
                "available_at": work.available_at,
            }
            if self.queue is not None:
                values["queue"] = self.queue
            if Run.objects.using(self.using).filter(pk=work.run_id, status=status).update(**values):
                pending.put_back(pending.root_runs([row]), using=self.using)
            return True

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


# ---------------------------------------------------------------------------- the dispatcher

BACKOFF_START, BACKOFF_MAX = 0.1, 5.0
IDLE_START, IDLE_MAX = 0.05, 0.5
CLAIM_COALESCE_TURNS = 4
# A worker held to its share looks again this often (the share grows when a worker stops).
SHARE_RECHECK_SECONDS = 1.0
# After a claim that left runs to other live workers, this one waits this long before it
# looks again: theirs come first (SQLite's lock, unlike PostgreSQL's, is not first come).
CLAIM_TURN_SECONDS = 0.05

INTERNAL_ERROR = SageError(
    "execution.internal", "the executor failed unexpectedly", category=ErrorCategory.INTERNAL
).record()

# ``Run.stop_request`` → the stop reason an execution is cancelled with.
_STOP_REASONS = {
    "cancel": "cancelled",
    "interrupt": "interrupt",
    "rollback": "rollback",
    "": "cancelled",
}


def is_transient(exc: BaseException) -> bool:
    """True for claim errors worth retrying: a database restarting, a dropped connection, a
    busy lock, PostgreSQL ending a session left idle in its transaction (class 25, raised
    as ``InternalError``). A schema or programming error is permanent."""
    if isinstance(exc, SageError):
        return exc.retryable
    return isinstance(exc, OSError | TimeoutError) or transient_database_error(exc)


def _stop_requests(run_ids: list[Any]) -> list[tuple[str, str]]:
    return [
        (str(pk), reason)
        for pk, reason in Run.objects.filter(pk__in=run_ids, cancel_requested=True).values_list(
            "pk", "stop_request"
        )
    ]


# The fences of every execution of this process's dispatchers, by run id: what a write made
# for a run outside its execution (a job's event) must carry.
_live_fences: dict[str, Fence] = {}


def current_fence(run_id: Any) -> Fence | None:
    """The fence of ``run_id`` if a dispatcher of this process is executing it, else None."""
    return _live_fences.get(str(run_id))


@dataclass(slots=True)
class StopSignal:
    """Why the worker stopped an execution: ``cancelled``, ``interrupt``, ``rollback``
    (the run ends so), ``shutdown`` or ``lease_lost`` (the run is requeued)."""

    reason: str | None = None


class _LeaseLost(Exception):
    """The renewer could not keep the lease."""


@dataclass(slots=True)
class Execution:
    """One run this dispatcher is executing."""

    lease: WorkerLease
    fence: Fence
    stop: StopSignal
    task: asyncio.Task[Any]
    started: datetime = field(default_factory=timezone.now)
    supervisor: asyncio.Task[Any] | None = None
    # When the lease runs out at the latest, on this process's monotonic clock: a lease
    # length after the claim or renewal that set it was asked for.
    deadline: float = 0.0

    @property
    def tenant(self) -> str | None:
        return self.lease.work.tenant_id

    @property
    def queue(self) -> str:
        return str(self.lease.work.payload.get("queue", "chat"))


class Dispatcher:
    """Holds up to ``max_concurrent_runs`` executions, ``max_concurrent_runs_per_user`` each.

    The per-user and global limits are enforced by the scheduler (counted in the database
    across workers and queues); ``max_concurrent_runs`` also bounds this process's slots.
    Raises ValueError for limits below 1 or a non-positive ``lease_seconds``.
    """

    def __init__(
        self,
        scheduler: DatabaseScheduler,
        executor: Any,
        *,
        worker_id: str,
        max_concurrent_runs: int = 8,
        max_concurrent_runs_per_user: int = 2,
        lease_seconds: float = 30.0,
        cancel_poll_seconds: float = 1.0,
        on_permanent_error: Callable[[str], None] | None = None,
        metrics: Figures | None = None,
    ) -> None:
        if max_concurrent_runs < 1 or max_concurrent_runs_per_user < 1:
            raise ValueError("concurrency limits must be positive")
        if lease_seconds <= 0:
            raise ValueError("lease_seconds must be positive")
        self.scheduler = scheduler
        self.executor = executor
        self.worker_id = worker_id
        self.max_concurrent_runs = max_concurrent_runs
        self.max_concurrent_runs_per_user = max_concurrent_runs_per_user
        self.lease = timedelta(seconds=lease_seconds)
        self.renew_interval = max(lease_seconds / 3, 0.05)
        self.cancel_poll_seconds = cancel_poll_seconds
        self.policy = SchedulerClaimPolicy(max_active_per_tenant=max_concurrent_runs_per_user)
        self.on_permanent_error = on_permanent_error
        # Longest idle poll: short without a push channel, about a second with one.
        self.idle_max = IDLE_MAX
        self._check_stops = asyncio.Event()
        self.executions: dict[str, Execution] = {}
        self.completed = 0
        self.peak_active = 0
        self.claim_errors = 0
        self.last_claim_error: str | None = None
        self.permanent_error: str | None = None
        # What executions ended with, and fence rejections, for /metrics.
        self.metrics = metrics if metrics is not None else Figures()
        self._slot_freed = asyncio.Event()
        # Runs this worker may hold now (its share of the global limit), and executions
        # dropped because their lease was lost (expired, reclaimed, or unreachable).
        self.share = max_concurrent_runs
        self.leases_lost = 0

    # ----------------------------------------------------------------- claim loop

    async def run(self, stopping: asyncio.Event) -> None:
        """Claim and start runs until ``stopping`` is set (then return; see `drain`)."""
        watcher = asyncio.create_task(self._watch_cancellations(), name="cancel-watcher")
        try:
            await self._claim_loop(stopping)
            if not stopping.is_set():
                await stopping.wait()  # a permanent error stopped claiming; keep reporting
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)

    async def _claim_loop(self, stopping: asyncio.Event) -> None:
        backoff = BACKOFF_START
        idle = IDLE_START
        while not stopping.is_set():
            self.share = await self._share()
            room = min(self.max_concurrent_runs, self.share) - len(self.executions)
            if room <= 0:
                self._slot_freed.clear()
                waits = [stopping.wait(), self._slot_freed.wait()]
                if self.share < self.max_concurrent_runs:
                    waits.append(asyncio.sleep(SHARE_RECHECK_SECONDS))
                await self._first(*waits)
                # Runs finished by one group commit free their slots in the same few loop
                # turns: let them all, so one claim transaction fills them together.
                for _ in range(CLAIM_COALESCE_TURNS):
                    await asyncio.sleep(0)
                continue
            asked = time.monotonic()
            try:
                # One transaction takes as many runs as there are free slots.
                leases = await self.scheduler.claim_many(
                    self.worker_id,
                    lease_duration=self.lease,
                    limit=room,
                    policy=self.policy,
                )
            except Exception as exc:
                self.claim_errors += 1
                self.last_claim_error = f"{type(exc).__name__}: {exc}"
                if not is_transient(exc):
                    self.permanent_error = self.last_claim_error
                    logger.error("claiming failed permanently; no new runs start: %s", exc)
                    if self.on_permanent_error is not None:
                        self.on_permanent_error(self.last_claim_error)
                    return
                logger.warning("claim failed (%s); retrying in %.1fs", exc, backoff)
                await self._first(stopping.wait(), asyncio.sleep(backoff))
                backoff = min(backoff * 2, BACKOFF_MAX)
                continue
            backoff = BACKOFF_START
            if not leases:
                # Woken by a push wake-up (a submission anywhere) or a release here; the
                # poll is only the fallback for a lost one.
                await self._first(stopping.wait(), self.scheduler.wait_for_change(idle))
                idle = min(idle * 2, self.idle_max)
                continue
            idle = IDLE_START
            for lease in leases:
                self._start(lease, asked + self.lease.total_seconds())
            if len(leases) < room and getattr(self.scheduler, "live_workers", 1) > 1:
                await self._first(stopping.wait(), asyncio.sleep(CLAIM_TURN_SECONDS))

    async def _share(self) -> int:
        fair_share = getattr(self.scheduler, "fair_share", None)
        if fair_share is None:
            return self.max_concurrent_runs
        return await fair_share(self.worker_id, self.max_concurrent_runs)

    @staticmethod
    async def _first(*aws: Any) -> None:
        tasks = [asyncio.ensure_future(aw) for aw in aws]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # ----------------------------------------------------------------- executions

    def _start(self, lease: WorkerLease, deadline: float | None = None) -> None:
        fence = lease_fence(lease)
        if deadline is None:
            deadline = time.monotonic() + self.lease.total_seconds()
        stop = StopSignal()
        claimed = lease.work.payload.get("claimed")
        task = asyncio.create_task(
            self.executor.execute(fence.run_id, fence, stop, claimed=claimed),
            name=f"run-{lease.run_id}",
        )
        execution = Execution(lease=lease, fence=fence, stop=stop, task=task, deadline=deadline)
        self.executions[lease.run_id] = execution
        _live_fences[lease.run_id] = fence
        self.peak_active = max(self.peak_active, len(self.executions))
        execution.supervisor = asyncio.create_task(
            self._supervise(execution), name=f"supervise-{lease.run_id}"
        )

    async def _supervise(self, execution: Execution) -> None:
        renewer = asyncio.create_task(self._renew(execution), name="renewer")
        renewer.add_done_callback(lambda t: self._renewer_done(t, execution))
        try:
            await self._settle(execution)
        finally:
            renewer.cancel()
            await asyncio.gather(renewer, return_exceptions=True)
            # Only this execution's entry: after its lease was reaped this worker may have
            # claimed the run again, and the newer execution's entry must stay.
            if self.executions.get(execution.lease.run_id) is execution:
                del self.executions[execution.lease.run_id]
            if _live_fences.get(execution.lease.run_id) is execution.fence:
                del _live_fences[execution.lease.run_id]
            self._slot_freed.set()
            self.scheduler.notify()

    def _renewer_done(self, renewer: asyncio.Task[Any], execution: Execution) -> None:
        if renewer.cancelled() or execution.task.done():
            return
        exc = renewer.exception()
        if exc is None:
            return
        if not isinstance(exc, _LeaseLost):
            logger.error("lease renewer of run %s crashed: %r", execution.lease.run_id, exc)
        if execution.stop.reason is None:
            execution.stop.reason = "lease_lost"
        execution.task.cancel()

    async def _renew(self, execution: Execution) -> None:
        """Renew every third of the lease; raise `_LeaseLost` when it cannot be kept.

        A renewal that has not answered by the execution's `deadline` (monotonic) is given
        up: the lease may be gone already, and the worker must not write as if it held it."""
        while True:
            await asyncio.sleep(self.renew_interval)
            if execution.task.done():
                return
            lease = execution.lease
            asked = time.monotonic()
            try:
                async with asyncio.timeout(max(execution.deadline - asked, 0.0)):
                    execution.lease = await self.scheduler.renew(lease, lease_duration=self.lease)
                execution.deadline = asked + self.lease.total_seconds()
            except LeaseExpired as exc:
                logger.warning("run %s lost its lease", lease.run_id)
                self.metrics.count(FENCE_REJECTIONS, write="renew")
                raise _LeaseLost() from exc
            except Exception as exc:
                if time.monotonic() >= execution.deadline:
                    logger.warning(
                        "run %s: its lease ran out unrenewed (%s)", lease.run_id, exc or "timeout"
                    )
                    raise _LeaseLost() from exc
                logger.warning("renewing run %s failed (%s); retrying", lease.run_id, exc)

    async def _settle(self, execution: Execution) -> None:
        """Wait for the execution and commit how it ended (one transaction), or give the
        run back to the queue."""
        lease, stop = execution.lease, execution.stop
        run_id = lease.run_id
        try:
            outcome = await execution.task
        except asyncio.CancelledError:
            reason = stop.reason
            if reason == "shutdown":
                if await self._requeue(execution, worker_shutdown_error().record()):
                    logger.info("run %s requeued on shutdown", run_id)
            elif reason in ("cancelled", "interrupt", "rollback"):
                # Stopped before the executor could record it (e.g. while preparing).
                status = RunStatus.CANCELLED if reason == "cancelled" else RunStatus.INTERRUPTED
                error = run_cancelled_error() if reason == "cancelled" else None
                await self._finish_direct(execution, status, error)
            else:
                logger.info("run %s stopped: %s", run_id, reason or "lease lost")
                self._lease_lost(execution)
            return
        except Exception as exc:
            if transient_database_error(exc):
                # The database went away under the executor: the run goes back to the
                # queue (no crash counted), it is not failed by the outage.
                logger.warning("run %s: database error (%s); requeueing it", run_id, exc)
                await self._requeue(execution, worker_shutdown_error().record())
                return
            logger.exception("run %s crashed the executor", run_id)
            await self._finish_direct(execution, RunStatus.FAILED, INTERNAL_ERROR)
            return
        if outcome == "lease_lost":
            # The executor's fenced write was refused by the database: another worker
            # holds the run now, and nothing this execution wrote afterwards was kept.
            logger.warning("run %s: write rejected (scheduler.fence_rejected)", run_id)
            self._lease_lost(execution, write="events")
            return
        await self._commit(execution, outcome)

    async def _commit(self, execution: Execution, outcome: Outcome) -> None:
        """The outcome's events and transition in one transaction (retried through a
        database restart; refused once the lease is lost — the run is then reclaimed)."""
        run_id = execution.lease.run_id
        fence = execution.fence
        try:
            if outcome.session_id is None:
                await retry_transient(
                    db_call,
                    runs.finish,
                    fence,
                    outcome.status,
                    result=outcome.result,
                    error=outcome.error,
                    what=f"finishing run {run_id}",
                )
            else:
                await asyncio.shield(
                    append_events(
                        session_id=outcome.session_id,
                        run_id=fence.run_id,
                        events=outcome.events(),
                        fence=fence,
                        transition=outcome.transition(fence),
                    )
                )
        except FenceRejected:
            logger.warning("run %s lost its lease before it could finish", run_id)
            self._lease_lost(execution, write="outcome")
            return
        except Exception as exc:  # its lease expires and the run is reaped (a crash)
            logger.error("run %s: committing its outcome failed: %s", run_id, exc)
            self.scheduler.forget(execution.lease)
            return
        self.scheduler.forget(execution.lease)
        self.completed += 1
        self._ended(execution, outcome.status, outcome.interaction or outcome.error)
        logger.info("run %s %s", run_id, outcome.status)

    async def _finish_direct(
        self, execution: Execution, status: str, error: dict[str, Any] | None
    ) -> None:
        try:
            await retry_transient(
                db_call,
                runs.finish,
                execution.fence,
                status,
                error=error,
                what=f"finishing run {execution.lease.run_id}",
            )
            self._ended(execution, status, error)
            logger.info("run %s %s", execution.lease.run_id, status)
        except FenceRejected:
            logger.warning("run %s: finish rejected (lease lost)", execution.lease.run_id)
            self._lease_lost(execution, write="outcome")
            return
        except Exception as exc:  # its lease expires and the run is reaped
            logger.warning("finishing run %s failed: %s", execution.lease.run_id, exc)
        self.scheduler.forget(execution.lease)

    def _lease_lost(self, execution: Execution, *, write: str | None = None) -> None:
        """Count an execution dropped because its lease is gone (``write``: the fenced
        write the database refused, if that is how it showed) and forget the lease."""
        if write is not None:
            self.metrics.count(FENCE_REJECTIONS, write=write)
        self.leases_lost += 1
        self.scheduler.forget(execution.lease)

    def _ended(self, execution: Execution, status: str, error: dict[str, Any] | None) -> None:
        """Count a committed outcome: its execution's length by outcome, a suspension by
        its code, an error of the RATE_LIMITED category (a 429 of ours or the provider's)."""
        elapsed = (timezone.now() - execution.started).total_seconds()
        self.metrics.observe(EXECUTION, elapsed, outcome=status)
        code = (error or {}).get("code")
        if status == RunStatus.SUSPENDED:
            self.metrics.count(SUSPENSIONS, code=code)
        if (error or {}).get("category") == ErrorCategory.RATE_LIMITED:
            self.metrics.count(RATE_LIMITED, code=code)

    async def _requeue(self, execution: Execution, error: dict[str, Any]) -> bool:
        try:
            await retry_transient(
                self.scheduler.release,
                execution.lease,
                "worker_shutdown",
                requeue=True,
                error=error,
                what=f"requeueing run {execution.lease.run_id}",
            )
            return True
        except Exception as exc:  # its lease expires and the run is reaped
            logger.warning("requeueing run %s failed: %s", execution.lease.run_id, exc)
            self.scheduler.forget(execution.lease)
            return False

    def on_wake(self, kind: str, payload: str) -> None:
        """A push wake-up (`scheduling.wakeups`): claim now, or look at stop requests now."""
        if kind == "run":
            self.scheduler.notify(pushed=True)
        elif kind == "cancel" and payload in self.executions:
            self._check_stops.set()
        else:
            # Anything else is the executor's (e.g. ``records``: model records changed).
            on_wake = getattr(self.executor, "on_wake", None)
            if on_wake is not None:
                on_wake(kind, payload)

    async def _watch_cancellations(self) -> None:
        """Stop executions whose run got ``cancel_requested`` (one query per tick, or at
        once on a ``cancel`` wake-up)."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._check_stops.wait(), self.cancel_poll_seconds)
            self._check_stops.clear()
            ids = [uuid.UUID(rid) for rid, e in self.executions.items() if e.stop.reason is None]
            if not ids:
                continue
            try:
                requested = await db_call(_stop_requests, ids)
            except Exception as exc:
                logger.warning("checking cancellations failed: %s", exc)
                continue
            for run_id, reason in requested:
                execution = self.executions.get(run_id)
                if execution is not None and not execution.task.done():
                    execution.stop.reason = _STOP_REASONS.get(reason, "cancelled")
                    execution.task.cancel()

    # ----------------------------------------------------------------- shutdown

    async def drain(self, grace_seconds: float) -> None:
        """Let executions finish within ``grace_seconds``; requeue the rest (resumable)."""
        supervisors = [e.supervisor for e in self.executions.values() if e.supervisor]
        if not supervisors:
            return
        logger.info("waiting up to %ss for %d running run(s)", grace_seconds, len(supervisors))
        await asyncio.wait(supervisors, timeout=grace_seconds)
        for execution in list(self.executions.values()):
            if not execution.task.done():
                execution.stop.reason = "shutdown"
                execution.task.cancel()
        await asyncio.gather(*supervisors, return_exceptions=True)

    # ----------------------------------------------------------------- figures

    def local_figures(self) -> dict[str, Any]:
        """This process's executions per user and per queue."""
        per_user: dict[str, int] = {}
        per_queue: dict[str, int] = {}
        for execution in self.executions.values():
            user = str(execution.tenant)
            per_user[user] = per_user.get(user, 0) + 1
            per_queue[execution.queue] = per_queue.get(execution.queue, 0) + 1
        return {"per_user": per_user, "per_queue": per_queue}


# ------------------------------------------------------------------------ the worker process

SNAPSHOT_SECONDS = 3.0
# The claim loop's longest idle poll once push wake-ups are listening.
PUSH_IDLE_MAX = 1.0


def queue_figures() -> dict[str, Any]:
    """Running and queued root runs per user and per queue, from the database."""
    rows = (
        Run.objects.filter(status__in=[RunStatus.RUNNING, RunStatus.QUEUED], parent__isnull=True)
        .values_list("owner_id", "queue", "status")
        .annotate(n=Count("pk"))
        .order_by()
    )
    per_user: dict[str, dict[str, int]] = {}
    per_queue: dict[str, dict[str, int]] = {}
    for owner, queue, status, n in rows:
        key = "active" if status == RunStatus.RUNNING else "pending"
        for bucket, name in ((per_user, str(owner)), (per_queue, queue)):
            figures = bucket.setdefault(name, {"active": 0, "pending": 0})
            figures[key] += n
    return {"per_user": per_user, "per_queue": per_queue}


class Worker:
    """Claims queued runs and executes up to ``max_concurrent`` of them at once."""

    def __init__(
        self,
        *,
        max_concurrent: int | None = None,
        lease_seconds: float | None = None,
        heartbeat_seconds: float | None = None,
        grace_seconds: float | None = None,
        executor: Any,
        worker_id: str | None = None,
        max_per_user: int | None = None,
        cancel_poll_seconds: float = 1.0,
        max_active: int | None = None,
    ) -> None:
        sage = settings.SAGE
        # Runs executing at once across every worker (counted in the database), and this
        # worker's own slots: on several hosts each takes its share of the first.
        self.max_active = max_active or sage["SAGE_SERVER_MAX_CONCURRENT_RUNS"]
        self.max_concurrent = (
            max_concurrent
            or sage.get("SAGE_WORKER_CONCURRENT_RUNS")
            or sage["SAGE_SERVER_MAX_CONCURRENT_RUNS"]
        )
        self.max_per_user = min(
            max_per_user or sage["SAGE_SERVER_MAX_CONCURRENT_RUNS_PER_USER"], self.max_active
        )
        self.max_pending = sage["SAGE_SERVER_MAX_PENDING_RUNS"]
        self.lease_seconds = lease_seconds or sage["SAGE_LEASE_SECONDS"]
        # Renewal runs every third of the lease; the heartbeat setting
        # is kept for compatibility and as an upper bound on that period.
        self.heartbeat_seconds = heartbeat_seconds or sage["SAGE_HEARTBEAT_SECONDS"]
        self.grace_seconds = (
            sage["SAGE_SHUTDOWN_GRACE_SECONDS"] if grace_seconds is None else grace_seconds
        )
        self.max_attempts = sage["SAGE_MAX_RUN_ATTEMPTS"]
        self.worker_id = worker_id or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.executor = executor
        self.started_at = timezone.now()
        self.quota = SchedulerQuotaGroup(self.max_active, self.max_per_user, self.max_pending)
        # One set of counters and histograms for /metrics, shared with the executor's own
        # (published in every snapshot: `capacity()["metrics"]`).
        self.metrics: Figures = getattr(executor, "metrics", None) or Figures()
        self.scheduler = DatabaseScheduler(
            quota_group=self.quota,
            max_pending_items=self.max_pending,
            max_attempts=self.max_attempts,
            metrics=self.metrics,
        )
        self.dispatcher = Dispatcher(
            self.scheduler,
            self.executor,
            worker_id=self.worker_id,
            max_concurrent_runs=self.max_concurrent,
            max_concurrent_runs_per_user=self.max_per_user,
            lease_seconds=float(self.lease_seconds),
            cancel_poll_seconds=cancel_poll_seconds,
            on_permanent_error=self._claiming_stopped,
            metrics=self.metrics,
        )
        # Renewal runs every third of the lease, never less often than the heartbeat.
        self.dispatcher.renew_interval = max(
            min(float(self.lease_seconds) / 3, float(self.heartbeat_seconds)), 0.05
        )
        self.recovered = 0
        self.wakeups: Listener | None = None
        self.live: LivePublisher | None = None
        # Set when claiming stopped for good: the process should exit non-zero.
        self.failed: str | None = None
        self._figures: dict[str, Any] = {"per_user": {}, "per_queue": {}}
        self._stopping = asyncio.Event()

    # --- compatibility views --------------------------------------------------

    @property
    def executions(self) -> dict[str, Execution]:
        return self.dispatcher.executions

    @property
    def completed(self) -> int:
        return self.dispatcher.completed

    # --- lifecycle -------------------------------------------------------------

    def _claiming_stopped(self, error: str) -> None:
        logger.error("worker %s stops: claiming failed permanently (%s)", self.worker_id, error)
        self.failed = error
        self._stopping.set()

    def request_stop(self) -> None:
        """Stop claiming; running runs get the grace period (signal-handler safe)."""
        self._stopping.set()

    async def _follow_wakeups(self, wakeups: Listener) -> None:
        """Hand every push wake-up to the dispatcher, in arrival order."""
        while True:
            kind, payload = await wakeups.next()
            try:
                self.dispatcher.on_wake(kind, payload)
            except Exception:
                logger.exception("handling the wake-up %r failed", f"{kind}:{payload}")

    async def run(self) -> None:
        """Run until ``request_stop``; then drain, requeue what is left and return."""
        await self.executor.start()
        self.wakeups = Listener(worker_id=self.worker_id)
        await self.wakeups.start()
        woken = asyncio.create_task(self._follow_wakeups(self.wakeups), name="wakeup-follower")
        self.live = LivePublisher()
        await self.live.start()
        live.set_publisher(self.live)
        # With a push channel the poll is only the fallback for a lost wake-up.
        self.dispatcher.idle_max = PUSH_IDLE_MAX
        try:
            self.recovered = await self.scheduler.reap_expired()
        except Exception as exc:  # the claim loop's reaping retries it
            logger.warning("start-up recovery failed: %s", exc)
        if self.recovered:
            logger.info("recovered %d run(s) left behind by a stopped worker", self.recovered)
        publisher = asyncio.create_task(self._publish_loop(), name="snapshot-publisher")
        try:
            await self.dispatcher.run(self._stopping)
        finally:
            await self.dispatcher.drain(self.grace_seconds)
            woken.cancel()
            await asyncio.gather(woken, return_exceptions=True)
            await self.wakeups.close()
            live.set_publisher(None)
            await self.live.close()
            await self.scheduler.close()
            publisher.cancel()
            await asyncio.gather(publisher, return_exceptions=True)
            await self.executor.close()
            await self._publish(stopped=True)
            await close_default_coordinator()

    # --- snapshots -------------------------------------------------------------

    def capacity(self) -> dict[str, Any]:
        """Figures for the capacity page: runs (local and per user/queue) and scheduler.

        ``per_user``/``per_queue`` hold ``{"active", "pending", "local"}``: active and
        pending are root runs in the database (all workers, refreshed with every
        snapshot); ``local`` counts this worker's executions.
        """
        dispatcher = self.dispatcher
        local = dispatcher.local_figures()
        per_user = {k: dict(v) for k, v in self._figures["per_user"].items()}
        per_queue = {k: dict(v) for k, v in self._figures["per_queue"].items()}
        for bucket, counts in ((per_user, local["per_user"]), (per_queue, local["per_queue"])):
            for name, n in counts.items():
                bucket.setdefault(name, {"active": 0, "pending": 0})["local"] = n
        return {
            "runs": {
                "active": len(dispatcher.executions),
                "max_concurrent": self.max_concurrent,
                "max_active": self.max_active,
                "share": dispatcher.share,
                "max_per_user": self.max_per_user,
                "max_pending": self.max_pending,
                "completed": dispatcher.completed,
                "running": list(dispatcher.executions),
                "per_user": per_user,
                "per_queue": per_queue,
            },
            "scheduler": {
                **self.scheduler.snapshot(),
                "lease_seconds": float(self.lease_seconds),
                "renew_seconds": dispatcher.renew_interval,
                "recovered_at_start": self.recovered,
                "claim_errors": dispatcher.claim_errors,
                "last_claim_error": dispatcher.last_claim_error,
                "permanent_error": dispatcher.permanent_error,
                "leases_lost": dispatcher.leases_lost,
                "wakeups": self.wakeups.snapshot() if self.wakeups is not None else None,
                "live": self.live.snapshot() if self.live is not None else None,
            },
            "executor": self.executor.capacity(),
            "store": default_snapshot(),
            "metrics": self.metrics.snapshot(),
        }

    async def _publish(self, *, stopped: bool = False) -> None:
        try:
            self._figures = await db_call(queue_figures)
        except Exception as exc:
            logger.warning("could not count the queues: %s", exc)
        else:
            try:  # the capacity page's charts: one sample per period across all workers
                await db_call(samples.record, self._figures)
            except Exception as exc:
                logger.warning("could not record the capacity sample: %s", exc)
        # The heartbeat is the database's time: workers on several hosts are compared by
        # one clock (their own may be skewed).
        now = DbNow()
        defaults = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started_at": self.started_at,
            "heartbeat_at": now,
            "stopped_at": now if stopped else None,
            "capacity": self.capacity(),
        }
        try:
            await db_call(
                WorkerSnapshot.objects.update_or_create, worker_id=self.worker_id, defaults=defaults
            )
        except Exception as exc:
            logger.warning("could not publish the worker snapshot: %s", exc)

    async def _publish_loop(self) -> None:
        while True:
            await self._publish()
            await asyncio.sleep(SNAPSHOT_SECONDS)


def install_signal_handlers(worker: Worker) -> None:
    """SIGTERM/SIGINT ask ``worker`` to stop (drain, requeue, exit)."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.request_stop)
