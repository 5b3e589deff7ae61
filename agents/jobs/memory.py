"""``InMemoryJobRuntime``: bounded background jobs run as asyncio tasks in this process.

One instance per worker process, shared by every Application (the host owns it and closes
it last). Everything lives on one event loop; admission happens without an ``await`` between
the check and the reservation, which is what makes it atomic under concurrent submits.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from agents.jobs.base import (
    ACTIVE_STATES,
    TERMINAL_STATES,
    JobCompletion,
    JobCursor,
    JobEventCallback,
    JobHandle,
    JobOutputChunk,
    JobRuntimeBase,
    JobSnapshot,
    JobSpec,
    JobState,
    JobStream,
    Runner,
    capacity_exhausted,
    end_event,
    invalid_transition,
    job_not_found,
    killed_error,
    kind_unsupported,
    owner_conflict,
    queue_full,
    runner_failed_error,
    to_bytes,
)

logger = logging.getLogger(__name__)

# Final snapshots of evicted rows kept only so ``wait`` can still answer; bounded.
_MAX_TOMBSTONES = 1024


def _now() -> datetime:
    return datetime.now(UTC)


@dataclass(slots=True, eq=False, kw_only=True)
class _Job:
    job_id: str
    spec: JobSpec
    max_bytes: int
    max_chunks: int
    state: JobState = JobState.CREATED
    created_at: datetime = field(default_factory=_now)
    updated_at: datetime = field(default_factory=_now)
    chunks: list[JobOutputChunk] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    output_bytes: int = 0
    truncated: bool = False
    cancel_requested: bool = False
    kill_reason: str = "cancelled"
    exit_code: int | None = None
    usage: Mapping[str, Any] = field(default_factory=dict)
    artifacts: tuple[str, ...] = ()
    error: Mapping[str, Any] | None = None
    terminal_at: float | None = None
    task: asyncio.Task[None] | None = None
    started_executing: bool = False
    cancel_event: asyncio.Event = field(default_factory=asyncio.Event)
    announced: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def snapshot(self) -> JobSnapshot:
        return JobSnapshot(
            job_id=self.job_id,
            owner_run_id=self.spec.owner_run_id,
            kind=self.spec.kind,
            state=self.state,
            pause_behavior=self.spec.pause_behavior,
            execution_affinity=self.spec.execution_affinity,
            output_cursor=JobCursor(job_id=self.job_id, offset=self.output_bytes),
            external_handle_ref=None,
            created_at=self.created_at,
            updated_at=self.updated_at,
            exit_code=self.exit_code,
            output_artifacts=self.artifacts,
            usage=dict(self.usage),
            error=dict(self.error) if self.error is not None else None,
            output_truncated=self.truncated,
            output_bytes=self.output_bytes,
            output_chunks=len(self.chunks),
            idempotency_key=self.spec.idempotency_key,
            labels=dict(self.spec.labels),
        )


class InMemoryJobRuntime(JobRuntimeBase):
    """Runs jobs as tasks on the current event loop within the limits of ``JobLimits``.

    ``limits`` are ``JobLimits``' fields (``max_concurrent_jobs=32``, ``max_admitted_jobs=1024``
    ...); invalid values raise ``ValueError``. ``on_event(snapshot, event_type, data)``
    (optional, async) is awaited on every lifecycle change (``job.created``, ``job.started``,
    ``job.completed``, ``job.failed``, ``job.killed``) so the caller can persist session
    events; its failures are logged, never raised into the job. ``builtin_runners`` registers
    the ``echo``/``sleep`` diagnostics (``agents.jobs.runtime`` adds ``python_script`` when
    the code tools are enabled).
    """

    FLAGS = {"durable": False, "reconnect": False, "local_runners": True}

    def __init__(
        self,
        *,
        on_event: JobEventCallback | None = None,
        builtin_runners: bool = True,
        clock: Callable[[], float] = time.monotonic,
        **limits: Any,
    ) -> None:
        super().__init__(on_event=on_event, limits=limits)
        self._clock = clock
        self._semaphore = asyncio.Semaphore(self.limits.max_concurrent_jobs)
        self._rows: dict[str, _Job] = {}
        self._by_run: dict[str, dict[str, None]] = {}
        self._idempotency: dict[tuple[str, str], str] = {}
        # Terminal rows in the order they ended: eviction walks from the oldest.
        self._terminal: OrderedDict[str, _Job] = OrderedDict()
        self._tombstones: OrderedDict[str, JobSnapshot] = OrderedDict()
        self._global_runners: dict[str, Runner] = {}
        self._run_runners: dict[tuple[str, str], Runner] = {}
        self._admitted = 0
        self._running = 0
        self._buffered_bytes = 0
        self._buffered_chunks = 0
        if builtin_runners:
            from agents.jobs.builtins import builtin_runners as _builtins

            for kind, runner in _builtins().items():
                self.register_runner(kind, runner)

    # --- runners ----------------------------------------------------------------------

    def register_runner(
        self, kind: str, runner: Runner, *, owner_run_id: str | None = None
    ) -> None:
        """Register ``runner`` for ``kind``, globally or for one run (which takes precedence)."""
        if owner_run_id is None:
            self._global_runners[kind] = runner
        else:
            self._run_runners[(owner_run_id, kind)] = runner

    def unregister_runner(
        self, kind: str, *, owner_run_id: str | None = None, runner: Runner | None = None
    ) -> bool:
        """Remove the runner for ``kind``; with ``runner=`` only if it is that exact one.

        Returns True when something was removed. Running jobs keep their runner.
        """
        table: dict[Any, Runner]
        key: Any
        if owner_run_id is None:
            table, key = self._global_runners, kind
        else:
            table, key = self._run_runners, (owner_run_id, kind)
        current = table.get(key)
        if current is None or (runner is not None and current is not runner):
            return False
        del table[key]
        return True

    def _resolve(self, kind: str, owner_run_id: str) -> Runner | None:
        return self._run_runners.get((owner_run_id, kind)) or self._global_runners.get(kind)

    # --- submit -----------------------------------------------------------------------

    async def submit(self, spec: JobSpec) -> JobHandle:
        """Admit ``spec`` and start it; returns its handle.

        The same ``(owner_run_id, idempotency_key)`` returns the existing handle, even when
        the runtime is full. Raises ``job.runtime_closed`` (CANCELLED), ``job.kind_unsupported``
        and ``job.pause_behavior_unsupported`` (VALIDATION), ``job.queue_full`` and
        ``job.capacity_exhausted`` (RATE_LIMITED, retryable).
        """
        self._check_open()
        self._sweep()
        if spec.idempotency_key is not None:
            existing = self._idempotency.get((spec.owner_run_id, spec.idempotency_key))
            if existing is not None:
                return self._rows[existing].snapshot().handle()
        runner = self._resolve(spec.kind, spec.owner_run_id)
        if runner is None:
            raise kind_unsupported(spec.kind)
        self._check_pause_behavior(spec)
        if self._admitted >= self.limits.max_admitted_jobs:
            raise queue_full(self.limits.max_admitted_jobs)
        if (
            len(self._rows)
            >= self.limits.max_retained_terminal_jobs + self.limits.max_admitted_jobs
        ):
            raise capacity_exhausted(len(self._rows))
        # No await above this line: check and reservation are one atomic step on the loop.
        max_bytes, max_chunks = self.limits.job_caps(spec)
        job = _Job(job_id=uuid.uuid4().hex, spec=spec, max_bytes=max_bytes, max_chunks=max_chunks)
        self._admitted += 1
        self._rows[job.job_id] = job
        self._by_run.setdefault(spec.owner_run_id, {})[job.job_id] = None
        if spec.idempotency_key is not None:
            self._idempotency[(spec.owner_run_id, spec.idempotency_key)] = job.job_id
        job.task = asyncio.create_task(self._execute(job, runner), name=f"job-{job.job_id}")
        handle = job.snapshot().handle()
        try:
            await self._fire(job, "job.created", {"kind": spec.kind})
        finally:
            # The runner waits for this so job.started never precedes job.created.
            job.announced.set()
        return handle

    async def _execute(self, job: _Job, runner: Runner) -> None:
        job.started_executing = True
        try:
            if job.cancel_requested:
                raise asyncio.CancelledError
            await job.announced.wait()
            async with self._semaphore:
                if job.cancel_requested:
                    raise asyncio.CancelledError
                self._running += 1
                try:
                    self._transition(job, JobState.RUNNING)
                    await self._fire(job, "job.started", {})
                    result = await runner(job.spec, self._emitter(job), job.cancel_event)
                finally:
                    self._running -= 1
        except asyncio.CancelledError:
            await self._finish(job, JobState.KILLED, error=killed_error(job.kill_reason))
        except Exception as exc:
            logger.info("job %s (%s) failed: %r", job.job_id, job.spec.kind, exc)
            await self._finish(job, JobState.FAILED, error=runner_failed_error(exc))
        else:
            if job.cancel_requested:
                # The runner swallowed its cancellation and returned: still a kill.
                await self._finish(job, JobState.KILLED, error=killed_error(job.kill_reason))
            else:
                completion = result if result is not None else JobCompletion()
                await self._finish(job, JobState.COMPLETED, completion=completion)

    def _emitter(self, job: _Job) -> Any:
        async def emit(stream: str, data: bytes | str) -> None:
            chunk_stream = JobStream(stream)
            body = to_bytes(data)
            if not body or job.state in TERMINAL_STATES:
                return
            limits = self.limits
            room = min(
                job.max_bytes - job.output_bytes,
                limits.max_buffered_output_bytes - self._buffered_bytes,
            )
            if (
                room <= 0
                or len(job.chunks) >= job.max_chunks
                or self._buffered_chunks >= limits.max_buffered_output_chunks
            ):
                job.truncated = True
                return
            if len(body) > room:
                body = body[:room]
                job.truncated = True
            offset = job.output_bytes
            job.chunks.append(
                JobOutputChunk(
                    job_id=job.job_id,
                    stream=chunk_stream,
                    offset=offset,
                    next_offset=offset + len(body),
                    data=body,
                    occurred_at=_now(),
                )
            )
            job.offsets.append(offset)
            job.output_bytes += len(body)
            self._buffered_bytes += len(body)
            self._buffered_chunks += 1

        return emit

    def _transition(self, job: _Job, state: JobState) -> None:
        job.state = state
        job.updated_at = _now()

    async def _finish(
        self,
        job: _Job,
        state: JobState,
        *,
        completion: JobCompletion | None = None,
        error: Mapping[str, Any] | None = None,
    ) -> None:
        if job.state in TERMINAL_STATES:
            return
        if completion is not None:
            job.exit_code = completion.exit_code
            job.usage = dict(completion.usage)
            job.artifacts = tuple(completion.output_artifacts)
        job.error = error
        self._transition(job, state)
        job.terminal_at = self._clock()
        self._admitted -= 1
        if job.job_id in self._rows:
            self._terminal[job.job_id] = job
        try:
            await self._fire(job, *end_event(job.snapshot()))
        finally:
            # After the event: whoever waits for the end (wait, cancel) can then rely on
            # the terminal event having been recorded.
            job.done.set()
        self._sweep()

    async def _fire(self, job: _Job, event_type: str, data: Mapping[str, Any]) -> None:
        if self._on_event is None:
            return
        recording = asyncio.ensure_future(self._on_event(job.snapshot(), event_type, data))
        try:
            await asyncio.shield(recording)
        except asyncio.CancelledError:
            # A kill arriving while an event is being recorded (job.started) waits for it:
            # a recording cut short would still finish in its database thread, after the
            # job.killed recorded next, and the session would read "killed" then "started".
            with contextlib.suppress(Exception):
                await recording
            raise
        except Exception:
            # A broken event sink must not fail the job or the submit.
            logger.exception("job event callback failed for %s %s", job.job_id, event_type)

    # --- reading ----------------------------------------------------------------------

    def _get(self, job_id: str) -> _Job:
        job = self._rows.get(job_id)
        if job is None:
            raise job_not_found(job_id)
        return job

    async def inspect(self, job_id: str) -> JobSnapshot:
        """The job's current snapshot. Raises ``job.not_found`` (NOT_FOUND) if unknown/purged."""
        self._sweep()
        return self._get(job_id).snapshot()

    async def list_jobs(self, run_id: str) -> list[JobSnapshot]:
        """Snapshots of every retained job of ``run_id``, oldest first."""
        self._sweep()
        return [self._rows[j].snapshot() for j in self._by_run.get(run_id, {})]

    async def read_output(
        self, cursor: JobCursor, *, max_bytes: int = 65536
    ) -> tuple[JobOutputChunk, ...]:
        """Output from ``cursor.offset``, at most ``max_bytes`` bytes, as exact chunk slices.

        Each chunk's ``next_offset`` is the absolute offset after it; ``()`` at the end.
        Raises ``job.not_found`` and ``job.invalid_argument`` (``max_bytes < 1``, offset < 0).
        """
        self._check_read(cursor, max_bytes)
        job = self._get(cursor.job_id)
        return _slice_chunks(job.chunks, job.offsets, cursor.offset, max_bytes)

    # --- control ----------------------------------------------------------------------

    async def cancel(
        self, job_id: str, *, force: bool = False, reason: str = "cancelled"
    ) -> JobSnapshot:
        """Cancel the job and wait until it is KILLED; idempotent.

        A terminal job returns its snapshot unchanged. ``force`` is accepted for contract
        parity (in process the runner's task is always cancelled at once). Raises
        ``job.not_found``.
        """
        job = self._get(job_id)
        if job.state in TERMINAL_STATES:
            return job.snapshot()
        if not job.cancel_requested:
            job.cancel_requested = True
            job.kill_reason = reason
            self._transition(job, JobState.STOPPING)
            job.cancel_event.set()
            # A task cancelled before its first step never enters _execute's handlers (and
            # so would never finish); such a task sees cancel_requested when it starts.
            if job.task is not None and job.started_executing:
                job.task.cancel()
        # Shielded: a caller that gives up waiting must not interrupt the kill itself.
        await asyncio.shield(job.done.wait())
        return job.snapshot()

    async def wait(self, job_id: str) -> JobSnapshot:
        """Wait for the job to end; returns its terminal snapshot, even if evicted meanwhile.

        Raises ``job.not_found`` when the job was never known (or evicted long ago).
        """
        job = self._rows.get(job_id)
        if job is None:
            tomb = self._tombstones.get(job_id)
            if tomb is None:
                raise job_not_found(job_id)
            return tomb
        await job.done.wait()
        return job.snapshot()

    async def mark_orphaned(self, job_id: str) -> JobSnapshot:
        """RUNNING/STOPPING → ORPHANED (its run let go). Raises ``job.invalid_transition``."""
        job = self._get(job_id)
        if job.state not in (JobState.RUNNING, JobState.STOPPING):
            raise invalid_transition(job_id, job.state, "be orphaned")
        self._transition(job, JobState.ORPHANED)
        return job.snapshot()

    async def adopt(self, job_id: str, owner_run_id: str) -> JobHandle:
        """ORPHANED → RUNNING for its own run; returns the handle.

        Raises ``job.invalid_transition`` (CONFLICT) unless orphaned, ``job.owner_conflict``
        (AUTHORIZATION) for another run, ``job.not_found``.
        """
        job = self._get(job_id)
        if job.state is not JobState.ORPHANED:
            raise invalid_transition(job_id, job.state, "be adopted")
        if job.spec.owner_run_id != owner_run_id:
            raise owner_conflict(job_id)
        self._transition(job, JobState.STOPPING if job.cancel_requested else JobState.RUNNING)
        return job.snapshot().handle()

    async def purge_terminal(self, owner_run_id: str) -> int:
        """Drop the run's terminal rows now (output, idempotency keys); returns how many."""
        victims = [
            j for j in self._by_run.get(owner_run_id, {}) if self._rows[j].state in TERMINAL_STATES
        ]
        for job_id in victims:
            self._evict(self._rows[job_id])
        return len(victims)

    def _evict(self, job: _Job) -> None:
        self._rows.pop(job.job_id, None)
        self._terminal.pop(job.job_id, None)
        run_jobs = self._by_run.get(job.spec.owner_run_id)
        if run_jobs is not None:
            run_jobs.pop(job.job_id, None)
            if not run_jobs:
                del self._by_run[job.spec.owner_run_id]
        key = job.spec.idempotency_key
        if key is not None and self._idempotency.get((job.spec.owner_run_id, key)) == job.job_id:
            del self._idempotency[(job.spec.owner_run_id, key)]
        # Evicted output returns its share of the aggregate caps.
        self._buffered_bytes -= job.output_bytes
        self._buffered_chunks -= len(job.chunks)
        self._tombstones[job.job_id] = job.snapshot()
        while len(self._tombstones) > _MAX_TOMBSTONES:
            self._tombstones.popitem(last=False)

    def _sweep(self) -> None:
        now = self._clock()
        retention = self.limits.retention_seconds
        window = self.limits.output_reconnect_window_seconds
        for job in list(self._terminal.values()):
            assert job.terminal_at is not None
            if now - job.terminal_at < retention:
                break
            self._evict(job)
        while len(self._terminal) > self.limits.max_retained_terminal_jobs:
            oldest = next(iter(self._terminal.values()))
            assert oldest.terminal_at is not None
            if now - oldest.terminal_at < window:
                # Younger rows are protected too: a client may still reconnect to them.
                break
            self._evict(oldest)

    # --- lifecycle --------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """Counters for the capacity snapshot: admitted, running, retained, buffered."""
        return {
            "admitted": self._admitted,
            "running": self._running,
            "retained_terminal": len(self._terminal),
            "rows": len(self._rows),
            "buffered_output_bytes": self._buffered_bytes,
            "buffered_output_chunks": self._buffered_chunks,
        }

    async def close(self) -> None:
        """Refuse new submits (``job.runtime_closed``) and kill every active job; idempotent."""
        self._closed = True
        active = [j.job_id for j in self._rows.values() if j.state in ACTIVE_STATES]
        await self._cancel_all(active, reason="runtime closed")
        with contextlib.suppress(Exception):
            self._sweep()


def _slice_chunks(
    chunks: list[JobOutputChunk], offsets: list[int], offset: int, max_bytes: int
) -> tuple[JobOutputChunk, ...]:
    """Exact slices of ``chunks`` starting at byte ``offset``, ``max_bytes`` at most."""
    index = max(bisect.bisect_right(offsets, offset) - 1, 0)
    out: list[JobOutputChunk] = []
    remaining = max_bytes
    while index < len(chunks) and remaining > 0:
        chunk = chunks[index]
        index += 1
        start = max(offset - chunk.offset, 0)
        if start >= len(chunk.data):
            continue
        piece = chunk.data[start : start + remaining]
        out.append(
            JobOutputChunk(
                job_id=chunk.job_id,
                stream=chunk.stream,
                offset=chunk.offset + start,
                next_offset=chunk.offset + start + len(piece),
                data=piece,
                occurred_at=chunk.occurred_at,
            )
        )
        remaining -= len(piece)
        offset = chunk.offset + start + len(piece)
    return tuple(out)
