"""The worker: one asyncio loop that claims runs from the Run table, executes them and
commits what each ends with. A run meets three classes, in this order:
`DatabaseScheduler` (`scheduling.db_scheduler`, the async door to the Run state machine),
`Dispatcher` (`scheduling.dispatcher`, the executions) and `Worker` (here, the process).

`Worker`: the process. Composition: a `DatabaseScheduler` over both run queues with
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
import logging
import os
import signal
import socket
import uuid
from typing import Any

from django.conf import settings
from django.db.models import Count
from django.utils import timezone

from sageproject.db import db_call
from scheduling import live, samples
from scheduling.db_scheduler import (
    REAP_SECONDS,
    DatabaseScheduler,
    fair_share,
    lease_fence,
    live_worker_slots,
)
from scheduling.dispatcher import Dispatcher, Execution, StopSignal, current_fence, is_transient
from scheduling.figures import (
    Figures,
)
from scheduling.live import LivePublisher
from scheduling.models import (
    Run,
    RunStatus,
    WorkerSnapshot,
)
from scheduling.protocol import (
    SchedulerQuotaGroup,
)
from scheduling.runs import DbNow
from scheduling.store import close_default_coordinator, default_snapshot
from scheduling.wakeups import Listener

# What other modules import from here (the worker's parts live in their own modules).
__all__ = [
    "REAP_SECONDS",
    "DatabaseScheduler",
    "Dispatcher",
    "StopSignal",
    "Worker",
    "current_fence",
    "fair_share",
    "install_signal_handlers",
    "is_transient",
    "lease_fence",
    "live_worker_slots",
    "queue_counts",
]

logger = logging.getLogger("sage.worker")

SNAPSHOT_SECONDS = 3.0
# The claim loop's longest idle poll once push wake-ups are listening.
PUSH_IDLE_MAX = 1.0


def queue_counts() -> dict[str, Any]:
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
        self._queue_counts: dict[str, Any] = {"per_user": {}, "per_queue": {}}
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
        local = dispatcher.local_counts()
        per_user = {k: dict(v) for k, v in self._queue_counts["per_user"].items()}
        per_queue = {k: dict(v) for k, v in self._queue_counts["per_queue"].items()}
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
            self._queue_counts = await db_call(queue_counts)
        except Exception as exc:
            logger.warning("could not count the queues: %s", exc)
        else:
            try:  # the capacity page's charts: one sample per period across all workers
                await db_call(samples.record, self._queue_counts)
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
