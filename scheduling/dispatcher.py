"""`Dispatcher`: a worker's executions, claimed and supervised.

Path of a run: ``DatabaseScheduler.claim_many`` (fair order, per-user and global quotas, one
run per session) → an execution task running ``executor.execute(run_id, fence, stop)``,
whose event writes carry the lease's fence → the `Outcome` it returns is committed here as
one transaction (``runs.Outcome``: the terminal event, status, result and archive, or the
suspension and its interaction) through the session store.

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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.utils import timezone

from sageproject.db import db_call, retry_transient, transient_database_error
from sageproject.errors import ErrorCategory, SageError
from scheduling import runs
from scheduling.db_scheduler import DatabaseScheduler, lease_fence
from scheduling.figures import (
    EXECUTION,
    FENCE_REJECTIONS,
    RATE_LIMITED,
    SUSPENSIONS,
    Figures,
)
from scheduling.models import (
    Run,
    RunStatus,
    run_cancelled_error,
)
from scheduling.protocol import (
    FenceRejected,
    LeaseExpired,
    SchedulerClaimPolicy,
    WorkerLease,
    worker_shutdown_error,
)
from scheduling.runs import Fence, Outcome
from scheduling.store import append_events

logger = logging.getLogger("sage.worker")

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

    # ----------------------------------------------------------------- counts

    def local_counts(self) -> dict[str, Any]:
        """This process's executions per user and per queue."""
        per_user: dict[str, int] = {}
        per_queue: dict[str, int] = {}
        for execution in self.executions.values():
            user = str(execution.tenant)
            per_user[user] = per_user.get(user, 0) + 1
            per_queue[execution.queue] = per_queue.get(execution.queue, 0) + 1
        return {"per_user": per_user, "per_queue": per_queue}
