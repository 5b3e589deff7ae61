"""The worker's dispatcher: claims runs from a scheduler and supervises their executions.

Path of a run (BEHAVIOUR §3.6-3.8): ``DatabaseScheduler.claim`` (fair order, per-user and
global quotas) → an execution task running ``executor.execute(run_id, fence, stop)`` → its
writes go through the session store coordinator fenced by the lease (``self.store`` is the
`LeaseFencedSessionStore` over the process coordinator; the stock executor passes the fence
to ``append_events`` itself) → ``release`` when it ends.

Per execution: a renewer extends the lease every third of its length; if it cannot (the
lease was lost, or renewal kept failing until the lease ran out) the execution is cancelled
with ``stop.reason = "lease_lost"``. One watcher polls ``Run.cancel_requested`` for all
executions about once a second and cancels with ``stop.reason = "cancelled"``. On drain,
executions left after the grace period are cancelled with ``stop.reason = "shutdown"`` and
requeued with ``scheduler.worker_shutdown`` (resumable).

Claim errors: transient ones (OS/database connection errors, retryable `SageError`) back
off 0.1 s → 5 s and claiming goes on; any other error stops claiming and is reported in
`capacity()` (runs already executing still finish).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db import InterfaceError, OperationalError
from django.utils import timezone
from django.utils.module_loading import import_string

from sageproject.db import db_call
from sageproject.errors import ErrorCategory, SageError
from scheduling.db_scheduler import DatabaseScheduler, lease_fence
from scheduling.models import Run, run_cancelled_error
from scheduling.scheduler import (
    LeaseReleaseReason,
    SchedulerClaimPolicy,
    WorkerLease,
    worker_shutdown_error,
)
from scheduling.store import Fence, LeaseFencedSessionStore, get_default_coordinator

logger = logging.getLogger("sage.dispatcher")

BACKOFF_START, BACKOFF_MAX = 0.1, 5.0
IDLE_START, IDLE_MAX = 0.05, 0.5

_RELEASE_FOR_STATUS = {
    "completed": LeaseReleaseReason.COMPLETED,
    "failed": LeaseReleaseReason.FAILED,
    "cancelled": LeaseReleaseReason.CANCELLED,
    "suspended": LeaseReleaseReason.SUSPENDED,
}


INTERNAL_ERROR = SageError(
    "execution.internal", "the executor failed unexpectedly", category=ErrorCategory.INTERNAL
).record()


def is_transient(exc: BaseException) -> bool:
    """True for claim errors worth retrying (the database restarting, a busy lock)."""
    if isinstance(exc, SageError):
        return exc.retryable
    return isinstance(exc, OSError | TimeoutError | OperationalError | InterfaceError)


def archive_run(run_pk: Any) -> None:
    """Archive a terminal run through ``agents.services.archive_terminal`` (by name).

    Scheduling never imports agents statically; call inside a transaction or thread.
    """
    archive = import_string("agents.services.archive_terminal")
    archive(Run.objects.select_related("session").get(pk=run_pk))


def _cancel_requested(run_ids: list[Any]) -> list[str]:
    return [
        str(pk)
        for pk in Run.objects.filter(pk__in=run_ids, cancel_requested=True).values_list(
            "pk", flat=True
        )
    ]


def _default_stop() -> Any:
    return import_string("agents.execution.StopSignal")()


class _LeaseLost(Exception):
    """The renewer could not keep the lease."""


@dataclass(slots=True)
class Execution:
    """One run this dispatcher is executing."""

    lease: WorkerLease
    fence: Fence
    stop: Any
    task: asyncio.Task[Any]
    started: datetime = field(default_factory=timezone.now)
    supervisor: asyncio.Task[Any] | None = None

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
        stop_factory: Callable[[], Any] = _default_stop,
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
        self._stop_factory = stop_factory
        self.executions: dict[str, Execution] = {}
        self.completed = 0
        self.peak_active = 0
        self.claim_errors = 0
        self.last_claim_error: str | None = None
        self.permanent_error: str | None = None
        self._slot_freed = asyncio.Event()
        self._store: LeaseFencedSessionStore | None = None

    # ----------------------------------------------------------------- store

    @property
    def store(self) -> LeaseFencedSessionStore:
        """The process coordinator, every write fenced by this dispatcher's live lease."""
        if self._store is None:
            self._store = LeaseFencedSessionStore(get_default_coordinator(), self.fence_for)
        return self._store

    def fence_for(self, run_id: Any) -> Fence | None:
        """The current fence of a run this dispatcher executes, else None."""
        execution = self.executions.get(str(run_id))
        return None if execution is None else execution.fence

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
            if len(self.executions) >= self.max_concurrent_runs:
                self._slot_freed.clear()
                await self._first(stopping.wait(), self._slot_freed.wait())
                continue
            try:
                lease = await self.scheduler.claim(
                    self.worker_id, lease_duration=self.lease, policy=self.policy, wait_timeout=0
                )
            except Exception as exc:
                self.claim_errors += 1
                self.last_claim_error = f"{type(exc).__name__}: {exc}"
                if not is_transient(exc):
                    self.permanent_error = self.last_claim_error
                    logger.error("claiming failed permanently; no new runs start: %s", exc)
                    return
                logger.warning("claim failed (%s); retrying in %.1fs", exc, backoff)
                await self._first(stopping.wait(), asyncio.sleep(backoff))
                backoff = min(backoff * 2, BACKOFF_MAX)
                continue
            backoff = BACKOFF_START
            if lease is None:
                # Woken early by a release/submit in this process; other processes'
                # submissions are found by the next poll.
                await self._first(stopping.wait(), self.scheduler.wait_for_change(idle))
                idle = min(idle * 2, IDLE_MAX)
                continue
            idle = IDLE_START
            self._start(lease)

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

    def _start(self, lease: WorkerLease) -> None:
        fence = lease_fence(lease)
        stop = self._stop_factory()
        task = asyncio.create_task(
            self.executor.execute(fence.run_id, fence, stop), name=f"run-{lease.run_id}"
        )
        execution = Execution(lease=lease, fence=fence, stop=stop, task=task)
        self.executions[lease.run_id] = execution
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
            self.executions.pop(execution.lease.run_id, None)
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
        """Renew every third of the lease; raise `_LeaseLost` when it cannot be kept."""
        while True:
            await asyncio.sleep(self.renew_interval)
            if execution.task.done():
                return
            lease = execution.lease
            try:
                execution.lease = await self.scheduler.renew(lease, lease_duration=self.lease)
            except SageError as exc:
                if exc.code == "scheduler.lease_expired":
                    logger.warning("run %s lost its lease", lease.run_id)
                    raise _LeaseLost() from exc
                raise
            except Exception as exc:
                if timezone.now() >= lease.expires_at:
                    raise _LeaseLost() from exc
                logger.warning("renewing run %s failed (%s); retrying", lease.run_id, exc)

    async def _settle(self, execution: Execution) -> None:
        """Wait for the execution and give its lease back according to how it ended."""
        lease, stop = execution.lease, execution.stop
        run_id = lease.run_id
        try:
            status = await execution.task
        except asyncio.CancelledError:
            reason = stop.reason
            lease = execution.lease
            if reason == "shutdown":
                await self._release(
                    lease,
                    LeaseReleaseReason.WORKER_SHUTDOWN,
                    requeue=True,
                    error=worker_shutdown_error().record(),
                )
                logger.info("run %s requeued on shutdown", run_id)
            elif reason == "cancelled":
                # Cancelled before the executor could record it (e.g. while preparing).
                if await self._release(
                    lease, LeaseReleaseReason.CANCELLED, error=run_cancelled_error()
                ):
                    await self._archive(run_id)
            else:
                logger.info("run %s stopped: %s", run_id, reason or "lease lost")
                self.scheduler.forget(lease)
            return
        except Exception:
            logger.exception("run %s crashed the executor", run_id)
            if await self._release(
                execution.lease, LeaseReleaseReason.FAILED, error=INTERNAL_ERROR
            ):
                await self._archive(run_id)
            return
        if status == "lease_lost":
            # The executor's fenced write was refused by the database: another worker
            # holds the run now, and nothing this execution wrote afterwards was kept.
            logger.warning("run %s: write rejected (scheduler.fence_rejected)", run_id)
            self.scheduler.forget(execution.lease)
            return
        self.completed += 1
        logger.info("run %s %s", run_id, status)
        reason = _RELEASE_FOR_STATUS.get(str(status), LeaseReleaseReason.FAILED)
        await self._release(execution.lease, reason)

    async def _release(self, lease: WorkerLease, reason: LeaseReleaseReason, **kw: Any) -> bool:
        try:
            await self.scheduler.release(lease, reason, **kw)
            return True
        except SageError as exc:
            logger.warning("releasing run %s: %s", lease.run_id, exc.code)
        except Exception as exc:  # its lease expires and the run is reaped
            logger.warning("releasing run %s failed: %s", lease.run_id, exc)
        return False

    async def _archive(self, run_id: str) -> None:
        try:
            await db_call(archive_run, run_id)
        except Exception as exc:
            logger.warning("archiving run %s failed: %s", run_id, exc)

    async def _watch_cancellations(self) -> None:
        """Cancel executions whose run got ``cancel_requested`` (one query per tick)."""
        while True:
            await asyncio.sleep(self.cancel_poll_seconds)
            ids = [uuid.UUID(rid) for rid, e in self.executions.items() if e.stop.reason is None]
            if not ids:
                continue
            try:
                requested = await db_call(_cancel_requested, ids)
            except Exception as exc:
                logger.warning("checking cancellations failed: %s", exc)
                continue
            for run_id in requested:
                execution = self.executions.get(run_id)
                if execution is not None and not execution.task.done():
                    execution.stop.reason = "cancelled"
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
