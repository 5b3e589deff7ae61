"""``CeleryJobRuntime``: the job contract of ``InMemoryJobRuntime``, run on Celery workers.

Admission, output caps and state transitions are Lua scripts over Redis
(``agents.jobs.redis_store``), so the limits hold across every process and host that shares
the key prefix. A job's row and output live in Redis until retention evicts them: they stay
readable after the worker that ran the job is gone, and from any other process.

Differences from the in-process runtime, all deliberate:

- Runners live in the worker process (``agents.jobs.tasks``), registered by kind; run-scoped
  runners are not supported (``capabilities.local_runners`` is False).
- Cancellation is ``revoke`` (the message is dropped if not yet started) plus a cooperative
  Redis flag the running task polls; ``cancel`` waits at most ``cancel_timeout_seconds`` for
  the worker to confirm (a dead worker leaves the job STOPPING; ``mark_orphaned`` it).
- Lifecycle events after ``job.created`` are observed by polling, so ``on_event`` sees them a
  poll interval late; a job that is created and ends between two polls still yields
  ``job.started`` (when it ran) before its terminal event.
- ``close()`` kills the active jobs *this instance* submitted; other submitters' jobs go on.
- A job whose Celery worker dies mid-job (or whose host is cut off) is failed with
  ``job.worker_lost`` once its worker has not reported for ``SAGE_JOB_LOST_SECONDS``
  (``agents.jobs.redis_store``): every submit, inspect and list sweeps for such jobs, and
  the watcher sweeps every `SWEEP_SECONDS` while anyone waits, so waiters are answered and
  the job's slot is given back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from celery import Celery
from redis.asyncio import BlockingConnectionPool, Redis

from agents.jobs.base import (
    ACTIVE_STATES,
    TERMINAL_STATES,
    JobCursor,
    JobEventCallback,
    JobHandle,
    JobOutputChunk,
    JobRuntimeBase,
    JobSnapshot,
    JobSpec,
    JobState,
    Runner,
    capacity_exhausted,
    end_event,
    invalid_transition,
    job_not_found,
    killed_error,
    kind_unsupported,
    owner_conflict,
    queue_full,
    runtime_closed,
)
from agents.jobs.redis_store import RedisJobStore, row_to_snapshot
from sageproject.errors import UnavailableError, ValidationError

logger = logging.getLogger(__name__)

# While jobs are watched, lost jobs are looked for this often.
SWEEP_SECONDS = 1.0


class CeleryJobRuntime(JobRuntimeBase):
    """Submits jobs to Celery workers and reads their state and output from Redis.

    ``redis_url`` holds job state (default: the Celery app's ``REDIS_URL``); ``key_prefix``
    namespaces every key (hosts sharing limits must share it); ``queue`` is the Celery queue
    job workers consume; ``kinds`` the kinds accepted (default: those registered in
    ``agents.jobs.tasks`` in this process, which match the workers' when they share code and
    environment). ``limits`` as ``InMemoryJobRuntime``; invalid values raise ``ValueError``.
    """

    FLAGS = {"durable": True, "reconnect": True, "local_runners": False}

    def __init__(
        self,
        *,
        redis_url: str | None = None,
        key_prefix: str = "sage:jobs",
        celery_app: Celery | None = None,
        queue: str | None = None,
        kinds: frozenset[str] | set[str] | None = None,
        on_event: JobEventCallback | None = None,
        poll_interval_seconds: float = 0.05,
        cancel_timeout_seconds: float = 30.0,
        max_redis_connections: int = 32,
        **limits: Any,
    ) -> None:
        from agents.jobs import tasks
        from sageproject import celery as celery_module

        super().__init__(on_event=on_event, limits=limits)
        if poll_interval_seconds <= 0:
            raise ValueError("poll_interval_seconds must be > 0")
        self._tasks = tasks
        self._app = celery_app or celery_module.app
        self._queue = queue or celery_module.DEFAULT_QUEUE
        # Blocking pool: a burst of submits queues for a connection instead of failing with
        # "Too many connections" (the default pool raises at its cap).
        self._client = Redis(
            connection_pool=BlockingConnectionPool.from_url(
                redis_url or celery_module.redis_url(),
                max_connections=max_redis_connections,
                timeout=None,
            )
        )
        self.store = RedisJobStore(self._client, key_prefix)
        self._kinds = set(kinds) if kinds is not None else set(tasks.registered_kinds())
        self._poll = poll_interval_seconds
        self._cancel_timeout = cancel_timeout_seconds
        # Kombu producers are not safe to share between threads: one thread publishes.
        self._publisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sage-jobs-pub")
        self._owned: dict[str, None] = {}
        self._watched: dict[str, str] = {}
        self._waiters: dict[str, list[asyncio.Future[JobSnapshot]]] = {}
        self._observing: dict[str, asyncio.Lock] = {}
        # Jobs whose terminal event is being reported right now (set when it is done).
        self._ending: dict[str, asyncio.Event] = {}
        self._watch_task: asyncio.Task[None] | None = None

    # --- runners ----------------------------------------------------------------------

    def register_runner(
        self, kind: str, runner: Runner, *, owner_run_id: str | None = None
    ) -> None:
        """Accept ``kind`` and register ``runner`` in this process's Celery registry.

        Workers in other processes must register it too (``SAGE_JOB_RUNNER_MODULES``).
        Raises ``job.runner_not_local`` (VALIDATION) for run-scoped runners, which cannot
        reach a remote worker.
        """
        if owner_run_id is not None:
            raise ValidationError(
                "job.runner_not_local", "run-scoped runners are not supported on Celery workers"
            )
        self._tasks.register_runner(kind, runner)
        self._kinds.add(kind)

    def unregister_runner(
        self, kind: str, *, owner_run_id: str | None = None, runner: Runner | None = None
    ) -> bool:
        """Stop accepting ``kind``; with ``runner=`` only if that exact runner is registered."""
        if owner_run_id is not None or kind not in self._kinds:
            return False
        current = self._tasks.RUNNERS.get(kind)
        if runner is not None and current is not runner:
            return False
        self._kinds.discard(kind)
        if runner is not None:
            self._tasks.unregister_runner(kind)
        return True

    # --- submit -----------------------------------------------------------------------

    async def submit(self, spec: JobSpec) -> JobHandle:
        """Admit ``spec`` centrally in Redis and send it to a Celery worker; returns its handle.

        Same errors as ``InMemoryJobRuntime.submit``, plus ``job.dispatch_failed``
        (UNAVAILABLE) when the broker refuses the message (the admission is released).
        """
        self._check_open()
        await self.store.sweep(self.limits)
        if spec.kind not in self._kinds:
            raise kind_unsupported(spec.kind)
        self._check_pause_behavior(spec)
        job_id = uuid.uuid4().hex
        outcome, value = await self.store.submit(job_id, spec, self.limits, task_id=job_id)
        if outcome == "existing":
            return (await self._snapshot(value)).handle()
        if outcome == "full":
            raise queue_full(self.limits.max_admitted_jobs)
        if outcome == "capacity":
            raise capacity_exhausted(int(value))
        try:
            await self._publish(
                self._app.send_task,
                self._tasks.TASK_NAME,
                args=[job_id, self.store.prefix],
                queue=self._queue,
                task_id=job_id,
            )
        except Exception as exc:
            logger.error("job %s: broker refused the task: %r", job_id, exc)
            error = UnavailableError(
                "job.dispatch_failed",
                "the job broker is unavailable",
                retryable=True,
                resumable=True,
            )
            await self.store.finish(job_id, JobState.FAILED, error=error.record())
            raise error from exc
        self._owned[job_id] = None
        if len(self._owned) > 2 * self.limits.max_admitted_jobs:
            await self._prune_owned()
        snapshot = await self._snapshot(job_id)
        if self._on_event is not None:
            await self._fire(snapshot, "job.created", {"kind": spec.kind})
            # Watch from CREATED, not from the snapshot's state: a fast job may already be
            # running or done, and its job.started / terminal events must still fire.
            self._watched[job_id] = str(JobState.CREATED)
            self._ensure_watcher()
        return snapshot.handle()

    async def _publish(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._publisher, lambda: fn(*args, **kwargs))

    async def _prune_owned(self) -> None:
        ids = list(self._owned)
        for job_id, state in zip(ids, await self.store.states(ids), strict=True):
            if state is None or JobState(state) in TERMINAL_STATES:
                self._owned.pop(job_id, None)

    # --- reading ----------------------------------------------------------------------

    async def _snapshot(self, job_id: str) -> JobSnapshot:
        row = await self.store.row(job_id)
        if row is None:
            raise job_not_found(job_id)
        return row_to_snapshot(job_id, row)

    async def inspect(self, job_id: str) -> JobSnapshot:
        """The job's current snapshot from Redis. Raises ``job.not_found``."""
        await self.store.sweep(self.limits)
        return await self._snapshot(job_id)

    async def list_jobs(self, run_id: str) -> list[JobSnapshot]:
        """Snapshots of every retained job of ``run_id``, oldest first."""
        await self.store.sweep(self.limits)
        ids = await self.store.run_job_ids(run_id)
        async with self._client.pipeline(transaction=False) as pipe:
            for job_id in ids:
                pipe.hgetall(self.store.key("job", job_id))
            rows = await pipe.execute()
        return [row_to_snapshot(j, r) for j, r in zip(ids, rows, strict=True) if r]

    async def read_output(
        self, cursor: JobCursor, *, max_bytes: int = 65536
    ) -> tuple[JobOutputChunk, ...]:
        """Output from ``cursor.offset`` as exact slices, ``()`` at the end.

        Raises ``job.not_found`` and ``job.invalid_argument``.
        """
        self._check_read(cursor, max_bytes)
        if not await self._client.exists(self.store.key("job", cursor.job_id)):
            raise job_not_found(cursor.job_id)
        return await self.store.read_output(cursor, max_bytes)

    # --- control ----------------------------------------------------------------------

    async def cancel(
        self, job_id: str, *, force: bool = False, reason: str = "cancelled"
    ) -> JobSnapshot:
        """Cancel the job: revoke its message and raise its cooperative cancel flag.

        Idempotent; a terminal job returns its snapshot unchanged. Waits up to
        ``cancel_timeout_seconds`` for the worker to confirm KILLED and returns the snapshot
        then (STOPPING if no worker answered). ``force`` also asks a prefork worker to
        terminate the task's process. Raises ``job.not_found``.
        """
        outcome = await self.store.cancel(job_id, killed_error(reason))
        if outcome == "missing":
            raise job_not_found(job_id)
        if outcome in ("completed", "failed"):
            return await self._snapshot(job_id)
        try:
            await self._publish(self._app.control.revoke, job_id, terminate=force)
        except Exception as exc:
            # The cooperative flag still stops it; revoke only saves a worker the start.
            logger.warning("job %s: revoke failed: %r", job_id, exc)
        if outcome == "stopping":
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._cancel_timeout):
                    return await self.wait(job_id)
        return await self._snapshot(job_id)

    async def wait(self, job_id: str) -> JobSnapshot:
        """Wait for the job to end; returns its terminal snapshot, even if evicted meanwhile.

        Raises ``job.not_found`` for an unknown job.
        """
        row = await self.store.row(job_id)
        if row is None:
            tomb = await self.store.tombstone(job_id)
            if tomb is None:
                raise job_not_found(job_id)
            return row_to_snapshot(job_id, tomb)
        snapshot = row_to_snapshot(job_id, row)
        if snapshot.terminal:
            # Report its events before answering, so a caller that waited can rely on them
            # (as with the in-process runtime): it may have ended between two polls, or
            # the poller may be reporting its end right now.
            if job_id in self._watched:
                await self._observe(job_id, str(snapshot.state))
            ending = self._ending.get(job_id)
            if ending is not None:
                await ending.wait()
            return snapshot
        future: asyncio.Future[JobSnapshot] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(job_id, []).append(future)
        self._ensure_watcher()
        try:
            return await future
        finally:
            waiters = self._waiters.get(job_id)
            if waiters is not None and future in waiters:
                waiters.remove(future)
                if not waiters:
                    del self._waiters[job_id]

    async def mark_orphaned(self, job_id: str) -> JobSnapshot:
        """RUNNING/STOPPING → ORPHANED. Raises ``job.invalid_transition``, ``job.not_found``."""
        outcome = await self.store.orphan(job_id)
        if outcome == "missing":
            raise job_not_found(job_id)
        if outcome != "ok":
            raise invalid_transition(job_id, outcome, "be orphaned")
        return await self._snapshot(job_id)

    async def adopt(self, job_id: str, owner_run_id: str) -> JobHandle:
        """ORPHANED → RUNNING for its own run; returns the handle.

        Raises ``job.invalid_transition``, ``job.owner_conflict`` (AUTHORIZATION),
        ``job.not_found``.
        """
        outcome = await self.store.adopt(job_id, owner_run_id)
        if outcome == "missing":
            raise job_not_found(job_id)
        if outcome == "owner":
            raise owner_conflict(job_id)
        if outcome != "ok":
            raise invalid_transition(job_id, outcome, "be adopted")
        return (await self._snapshot(job_id)).handle()

    async def purge_terminal(self, owner_run_id: str) -> int:
        """Drop the run's terminal rows and output now; returns how many."""
        return await self.store.purge(owner_run_id)

    # --- watching (events and waiters) ------------------------------------------------

    def _ensure_watcher(self) -> None:
        if self._watch_task is None or self._watch_task.done():
            self._watch_task = asyncio.create_task(self._watch_loop(), name="sage-jobs-watch")

    async def _watch_loop(self) -> None:
        # One poller for every watched job: a pipelined HGET per job per interval, instead
        # of a poll loop per waiter.
        loop = asyncio.get_running_loop()
        next_sweep = loop.time() + SWEEP_SECONDS
        while self._watched or self._waiters:
            ids = list(dict.fromkeys([*self._watched, *self._waiters]))
            try:
                if loop.time() >= next_sweep:
                    # A job whose worker died ends here (job.worker_lost), not never.
                    next_sweep = loop.time() + SWEEP_SECONDS
                    await self.store.sweep(self.limits)
                states = await self.store.states(ids)
                for job_id, state in zip(ids, states, strict=True):
                    if state is None or state != self._watched.get(job_id, state):
                        await self._observe(job_id, state)
                    elif job_id in self._waiters and JobState(state) in TERMINAL_STATES:
                        await self._observe(job_id, state)
            except Exception:
                # Redis hiccup: keep the waiters, try again next interval.
                logger.exception("job watcher poll failed")
            await asyncio.sleep(self._poll)

    async def _observe(self, job_id: str, state: str | None) -> None:
        # One observer per job at a time (the poller and a waiter may both look): its
        # events then fire once each and in order (job.started before job.completed).
        lock = self._observing.setdefault(job_id, asyncio.Lock())
        async with lock:
            ended = await self._observe_locked(job_id, state)
        if ended and self._observing.get(job_id) is lock and not lock.locked():
            del self._observing[job_id]

    async def _observe_locked(self, job_id: str, state: str | None) -> bool:
        row = await self.store.row(job_id) if state is not None else None
        if row is None:
            row = await self.store.tombstone(job_id)
        snapshot = row_to_snapshot(job_id, row) if row is not None else None
        previous = self._watched.get(job_id)
        # Claim the transition before the first await below: a concurrent observer of the
        # same job (the poller and a waiter) then sees it done and fires nothing twice.
        ending: asyncio.Event | None = None
        if snapshot is None or snapshot.terminal:
            if self._watched.pop(job_id, None) is not None:
                ending = self._ending[job_id] = asyncio.Event()
        elif job_id in self._watched:
            self._watched[job_id] = str(snapshot.state)
        try:
            if snapshot is not None and previous is not None and previous != str(snapshot.state):
                await self._fire_transition(snapshot, row or {}, JobState(previous))
        finally:
            if ending is not None:
                self._ending.pop(job_id, None)
                ending.set()
        if snapshot is None or snapshot.terminal:
            for future in self._waiters.pop(job_id, []):
                if future.done():
                    continue
                if snapshot is None:
                    future.set_exception(job_not_found(job_id))
                else:
                    future.set_result(snapshot)
        return snapshot is None or snapshot.terminal

    async def _fire_transition(
        self, snapshot: JobSnapshot, row: Mapping[bytes, bytes], previous: JobState
    ) -> None:
        started = row.get(b"started") == b"1"
        if previous is JobState.CREATED and snapshot.state is not JobState.CREATED and started:
            await self._fire(snapshot, "job.started", {})
        if snapshot.terminal:
            await self._fire(snapshot, *end_event(snapshot))

    async def _fire(self, snapshot: JobSnapshot, event_type: str, data: Mapping[str, Any]) -> None:
        if self._on_event is None:
            return
        try:
            await self._on_event(snapshot, event_type, data)
        except Exception:
            logger.exception("job event callback failed for %s %s", snapshot.job_id, event_type)

    # --- lifecycle --------------------------------------------------------------------

    async def stats(self) -> dict[str, int]:
        """Cluster-wide counters for this key prefix: admitted, running, rows, buffered."""
        counters = await self.store.counters()
        return {
            "admitted": counters["admitted"],
            "running": counters["running"],
            "retained_terminal": await self.store.terminal_count(),
            "rows": counters["rows"],
            "buffered_output_bytes": counters["agg_bytes"],
            "buffered_output_chunks": counters["agg_chunks"],
        }

    async def close(self) -> None:
        """Refuse new submits and kill the active jobs this instance submitted; idempotent."""
        if self._closed and self._watch_task is None:
            return
        self._closed = True
        ids = list(self._owned)
        states = await self.store.states(ids) if ids else []
        active = [
            j
            for j, s in zip(ids, states, strict=True)
            if s is not None and JobState(s) in ACTIVE_STATES
        ]
        await self._cancel_all(active, reason="runtime closed")
        # One last look so jobs killed above (at once, from CREATED) still report job.killed.
        for job_id in list(self._watched):
            with contextlib.suppress(Exception):
                await self._observe(job_id, (await self.store.states([job_id]))[0])
        if self._watch_task is not None:
            self._watch_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch_task
            self._watch_task = None
        for futures in self._waiters.values():
            for future in futures:
                if not future.done():
                    future.set_exception(runtime_closed())
        self._waiters.clear()
        self._publisher.shutdown(wait=False)
        await self._client.aclose()
