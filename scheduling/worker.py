"""The worker process: one asyncio loop that claims runs and executes them.

Composition: the claim loop (``scheduling.claims``), a heartbeat per run that renews its
lease and notices cancellation, a snapshot publisher, and the executor named by
``settings.SAGE_RUN_EXECUTOR`` (``agents.execution.RunExecutor``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.conf import settings
from django.utils import timezone
from django.utils.module_loading import import_string

from sageproject.db import db_call
from scheduling import claims
from scheduling.models import WorkerSnapshot
from scheduling.store import Fence, close_default_coordinator

logger = logging.getLogger("sage.worker")

SNAPSHOT_SECONDS = 3.0
IDLE_POLL_SECONDS = 0.5
BACKOFF_START, BACKOFF_MAX = 0.1, 5.0


def _db(fn):
    return lambda *args, **kwargs: db_call(fn, *args, **kwargs)


@dataclass(slots=True)
class Execution:
    fence: Fence
    task: asyncio.Task[Any]
    stop: Any
    started: datetime = field(default_factory=timezone.now)


class Worker:
    """Claims queued runs and executes up to ``max_concurrent`` of them at once."""

    def __init__(
        self,
        *,
        max_concurrent: int | None = None,
        lease_seconds: int | None = None,
        heartbeat_seconds: float | None = None,
        grace_seconds: float | None = None,
        executor: Any = None,
        worker_id: str | None = None,
    ) -> None:
        sage = settings.SAGE
        self.max_concurrent = max_concurrent or sage["SAGE_SERVER_MAX_CONCURRENT_RUNS"]
        self.lease_seconds = lease_seconds or sage["SAGE_LEASE_SECONDS"]
        self.heartbeat_seconds = heartbeat_seconds or sage["SAGE_HEARTBEAT_SECONDS"]
        self.grace_seconds = (
            sage["SAGE_SHUTDOWN_GRACE_SECONDS"] if grace_seconds is None else grace_seconds
        )
        self.max_attempts = sage["SAGE_MAX_RUN_ATTEMPTS"]
        self.worker_id = worker_id or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.executor = executor or import_string(settings.SAGE_RUN_EXECUTOR)()
        self.started_at = timezone.now()
        self.executions: dict[Any, Execution] = {}
        self.completed = 0
        self._stopping = asyncio.Event()
        self._slot_freed = asyncio.Event()

    # --- lifecycle -------------------------------------------------------------

    def request_stop(self) -> None:
        """Stop claiming; running runs get the grace period (signal-handler safe)."""
        self._stopping.set()
        self._slot_freed.set()

    async def run(self) -> None:
        """Run until ``request_stop``; then drain, requeue what is left and return."""
        await self.executor.start()
        recovered = await _db(claims.recover_expired)(max_attempts=self.max_attempts)
        if recovered:
            logger.info("recovered %d run(s) left behind by a stopped worker", recovered)
        publisher = asyncio.create_task(self._publish_loop(), name="snapshot-publisher")
        try:
            await self._claim_loop()
        finally:
            await self._drain()
            publisher.cancel()
            await asyncio.gather(publisher, return_exceptions=True)
            await self.executor.close()
            await self._publish(stopped=True)
            await close_default_coordinator()

    async def _claim_loop(self) -> None:
        backoff = BACKOFF_START
        last_recovery = 0.0
        loop = asyncio.get_running_loop()
        while not self._stopping.is_set():
            if len(self.executions) >= self.max_concurrent:
                self._slot_freed.clear()
                await self._slot_freed.wait()
                continue
            try:
                if loop.time() - last_recovery > self.lease_seconds / 2:
                    last_recovery = loop.time()
                    await _db(claims.recover_expired)(max_attempts=self.max_attempts)
                claimed = await _db(claims.claim_next)(
                    worker_id=self.worker_id, lease_seconds=self.lease_seconds
                )
            except Exception as exc:  # a restarted database must not kill the worker
                logger.warning("claim failed (%s); retrying in %.1fs", exc, backoff)
                await self._sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX)
                continue
            backoff = BACKOFF_START
            if claimed is None:
                await self._sleep(IDLE_POLL_SECONDS)
                continue
            fence, run_id = claimed
            self._start(run_id, fence)

    async def _sleep(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self._stopping.wait(), timeout=seconds)
        except TimeoutError:
            pass

    def _start(self, run_id: Any, fence: Fence) -> None:
        from agents.execution import StopSignal  # the executor's own signal type

        stop = StopSignal()
        task = asyncio.create_task(self._execute(run_id, fence, stop), name=f"run-{run_id}")
        self.executions[run_id] = Execution(fence=fence, task=task, stop=stop)

    async def _execute(self, run_id: Any, fence: Fence, stop: Any) -> None:
        heartbeat = asyncio.create_task(self._heartbeat(run_id, fence, stop))
        try:
            status = await self.executor.execute(run_id, fence, stop)
            logger.info("run %s %s", run_id, status)
            self.completed += 1
        except asyncio.CancelledError:
            logger.info("run %s interrupted (%s)", run_id, stop.reason or "cancelled")
        except Exception:
            logger.exception("run %s crashed the executor", run_id)
        finally:
            heartbeat.cancel()
            await asyncio.gather(heartbeat, return_exceptions=True)
            self.executions.pop(run_id, None)
            self._slot_freed.set()

    async def _heartbeat(self, run_id: Any, fence: Fence, stop: Any) -> None:
        """Renew the lease; cancel the execution when it is lost or cancellation is asked."""
        interval = min(self.heartbeat_seconds, 1.0)
        since_renewal = 0.0
        while True:
            await asyncio.sleep(interval)
            since_renewal += interval
            try:
                if since_renewal >= self.heartbeat_seconds:
                    since_renewal = 0.0
                    held, cancel = await _db(claims.renew)(fence, lease_seconds=self.lease_seconds)
                else:
                    held, cancel = True, await _db(_cancel_requested)(run_id)
            except Exception as exc:
                logger.warning("lease renewal for run %s failed: %s", run_id, exc)
                continue
            execution = self.executions.get(run_id)
            if execution is None:
                return
            if not held:
                stop.reason = "lease_lost"
                execution.task.cancel()
                return
            if cancel:
                stop.reason = "cancelled"
                execution.task.cancel()
                return

    async def _drain(self) -> None:
        """Let running runs finish within the grace period, then requeue the rest."""
        if not self.executions:
            return
        tasks = [e.task for e in self.executions.values()]
        logger.info("waiting up to %ss for %d running run(s)", self.grace_seconds, len(tasks))
        await asyncio.wait(tasks, timeout=self.grace_seconds)
        leftover = list(self.executions.items())
        for _run_id, execution in leftover:
            execution.stop.reason = "shutdown"
            execution.task.cancel()
        await asyncio.gather(*(e.task for _, e in leftover), return_exceptions=True)
        reason = {
            "code": "scheduler.worker_shutdown",
            "category": "UNAVAILABLE",
            "message": "the worker shut down; the run was requeued",
            "retryable": True,
            "resumable": True,
        }
        for run_id, execution in leftover:
            try:
                await _db(claims.requeue)(execution.fence, reason=reason)
                logger.info("requeued run %s on shutdown", run_id)
            except Exception as exc:
                logger.warning("could not requeue run %s (%s); its lease will expire", run_id, exc)

    # --- snapshots -------------------------------------------------------------

    def capacity(self) -> dict[str, Any]:
        return {
            "runs": {
                "active": len(self.executions),
                "max_concurrent": self.max_concurrent,
                "completed": self.completed,
                "running": [str(run_id) for run_id in self.executions],
            },
            "executor": self.executor.capacity(),
        }

    async def _publish(self, *, stopped: bool = False) -> None:
        now = timezone.now()
        defaults = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started_at": self.started_at,
            "heartbeat_at": now,
            "stopped_at": now if stopped else None,
            "capacity": self.capacity(),
        }
        try:
            await _db(WorkerSnapshot.objects.update_or_create)(
                worker_id=self.worker_id, defaults=defaults
            )
        except Exception as exc:
            logger.warning("could not publish the worker snapshot: %s", exc)

    async def _publish_loop(self) -> None:
        while True:
            await self._publish()
            await asyncio.sleep(SNAPSHOT_SECONDS)


def _cancel_requested(run_id: Any) -> bool:
    from scheduling.models import Run

    return Run.objects.filter(pk=run_id, cancel_requested=True).exists()


def install_signal_handlers(worker: Worker) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.request_stop)
