"""Django side of the job runtimes: choosing one, recording job events, operator cancels.

- ``build_job_runtime(on_event=...)`` picks ``CeleryJobRuntime`` when Redis is configured
  (``REDIS_URL``) and ``InMemoryJobRuntime`` otherwise; ``SAGE_JOB_RUNTIME=memory|celery``
  overrides. The worker builds one per process and closes it after its runs.
- ``JobEventRecorder`` is the runtime's ``on_event``: it appends ``job.*`` events to the
  job's session and keeps the ``JobRecord`` row (admin and API) in step.
- ``apply_cancel_requests(runtime)`` applies the admin's "Cancel selected jobs" action; the
  worker calls it every few seconds.

Where a job's events go is decided by its ``labels`` (``session_id``, ``owner_id``), which the
agent tools set from the run's ``ToolContext``; jobs without them are not recorded.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import IntegrityError, transaction
from django.utils import timezone

from agents.jobs.base import (
    TERMINAL_STATES,
    JobEventCallback,
    JobSnapshot,
    JobState,
    killed_error,
)
from agents.jobs.memory import InMemoryJobRuntime
from sageproject.db import db_call
from sageproject.errors import SageError

logger = logging.getLogger("sage.jobs")

RUNTIME_ENV = "SAGE_JOB_RUNTIME"
RUNTIME_CHOICES = ("memory", "celery")
CODE_KINDS = ("python_script",)
# Label keys the tools set and the recorder reads.
LABEL_SESSION = "session_id"
LABEL_OWNER = "owner_id"

_TERMINAL_VALUES = tuple(str(s) for s in TERMINAL_STATES)
# Operator cancels are applied a few at a time: a Celery cancel may wait for its worker.
_CANCEL_CONCURRENCY = 8


# --- runtime selection ---------------------------------------------------------------


def selected_runtime_kind(environ: Mapping[str, str] | None = None) -> str:
    """``"memory"`` or ``"celery"`` for this host's settings and environment.

    Raises ``ImproperlyConfigured`` (one line) for an unknown ``SAGE_JOB_RUNTIME`` or for
    ``celery`` without ``REDIS_URL``.
    """
    env = os.environ if environ is None else environ
    redis_url = settings.SAGE.get("REDIS_URL")
    choice = env.get(RUNTIME_ENV, "").strip().lower()
    if not choice:
        return "celery" if redis_url else "memory"
    if choice not in RUNTIME_CHOICES:
        raise ImproperlyConfigured(
            f"{RUNTIME_ENV} must be one of {', '.join(RUNTIME_CHOICES)} (got {choice!r})"
        )
    if choice == "celery" and not redis_url:
        raise ImproperlyConfigured(f"{RUNTIME_ENV}=celery needs REDIS_URL (the Celery broker)")
    return choice


def build_job_runtime(
    *,
    on_event: JobEventCallback | None = None,
    environ: Mapping[str, str] | None = None,
    **limits: Any,
) -> Any:
    """The job runtime for this process: ``CeleryJobRuntime`` or ``InMemoryJobRuntime``.

    ``limits`` go to the runtime's constructor (``max_concurrent_jobs=``...). Code kinds
    (``python_script``) are accepted only when ``settings.SAGE["SAGE_CODE_TOOLS"]`` is true.
    Raises ``ImproperlyConfigured`` as ``selected_runtime_kind``; the caller owns the result
    and must ``await runtime.close()``.
    """
    code_tools = bool(settings.SAGE.get("SAGE_CODE_TOOLS"))
    if selected_runtime_kind(environ) == "celery":
        from agents.jobs import tasks
        from agents.jobs.celery_runtime import CeleryJobRuntime

        kinds = set(tasks.registered_kinds())
        if code_tools:
            # The workers decide what really runs (their own SAGE_CODE_TOOLS); this side
            # only decides what it accepts.
            kinds.update(CODE_KINDS)
        else:
            kinds.difference_update(CODE_KINDS)
        return CeleryJobRuntime(
            redis_url=settings.SAGE["REDIS_URL"], kinds=kinds, on_event=on_event, **limits
        )
    runtime = InMemoryJobRuntime(on_event=on_event, **limits)
    if code_tools:
        from agents.jobs.python_script import python_script_runner

        runtime.register_runner("python_script", python_script_runner)
    else:
        for kind in CODE_KINDS:
            runtime.unregister_runner(kind)
    return runtime


# --- recording job events ---------------------------------------------------------------


def job_event_payload(snapshot: JobSnapshot, data: Mapping[str, Any]) -> dict[str, Any]:
    """The session event payload for a job: ids, state, sizes and the error; never its input.

    The job's payload (a script, arguments) is left out on purpose: it may hold anything
    the model passed in, and session events are shown to every reader of the session.
    """
    payload: dict[str, Any] = {
        "job_id": snapshot.job_id,
        "kind": snapshot.kind,
        "state": str(snapshot.state),
        "output_bytes": snapshot.output_bytes,
        "output_chunks": snapshot.output_chunks,
        "output_truncated": snapshot.output_truncated,
    }
    exit_code = data.get("exit_code", snapshot.exit_code)
    if exit_code is not None:
        payload["exit_code"] = exit_code
    error = data.get("error", snapshot.error)
    if error:
        payload["error"] = {
            key: error[key]
            for key in ("code", "category", "message", "retryable", "resumable")
            if key in error
        }
    return payload


def _upsert_record_sync(snapshot: JobSnapshot, owner_id: int) -> bool:
    """Bring the job's ``JobRecord`` up to ``snapshot``; returns True when this call is the
    one that made the row terminal (so exactly one caller announces the end)."""
    from agents.models import JobRecord

    terminal = snapshot.state in TERMINAL_STATES
    values: dict[str, Any] = {
        "state": str(snapshot.state),
        "output_bytes": snapshot.output_bytes,
        "output_chunks": snapshot.output_chunks,
        "output_truncated": snapshot.output_truncated,
        "error": dict(snapshot.error) if snapshot.error else None,
        # .update() skips auto_now fields.
        "updated_at": timezone.now(),
    }
    # Never touch a finished row: events of one job can land out of order (a kill racing
    # its job.created), and several writers may report the same end (the runtime's events,
    # an operator cancel, reconciliation). The database decides which UPDATE wins.
    unfinished = JobRecord.objects.filter(job_id=snapshot.job_id).exclude(
        state__in=_TERMINAL_VALUES
    )
    if unfinished.update(**values):
        return terminal
    if JobRecord.objects.filter(job_id=snapshot.job_id).exists():
        return False  # already terminal; nothing newer to say
    try:
        # A savepoint: a failed insert must not poison a surrounding transaction.
        with transaction.atomic():
            JobRecord.objects.create(
                job_id=snapshot.job_id,
                run_id=snapshot.owner_run_id,
                owner_id=owner_id,
                kind=snapshot.kind,
                **values,
            )
    except IntegrityError:
        # Another writer created the row first: apply ours on top, if still unfinished.
        return bool(unfinished.update(**values)) and terminal
    return terminal


_TERMINAL_EVENTS = {
    JobState.COMPLETED: "job.completed",
    JobState.FAILED: "job.failed",
    JobState.KILLED: "job.killed",
}
_TERMINAL_EVENT_TYPES = frozenset(_TERMINAL_EVENTS.values())
_EVENT_STATES = {"job.created": JobState.CREATED, "job.started": JobState.RUNNING}


async def append_job_event(
    session_id: Any, run_id: Any, event_type: str, payload: Mapping[str, Any]
) -> bool:
    """Append a job's event to its run's session, fenced like every write of a run: with
    the run's lease while this worker executes it; without one only while the run is not
    running (a job that outlived its run). A worker that lost the run's lease writes
    nothing (logged); returns whether the event was appended."""
    from scheduling import runs
    from scheduling.dispatcher import current_fence
    from scheduling.leases import FenceRejected
    from scheduling.store import append_events

    fence = current_fence(run_id) if run_id else None
    try:
        if fence is not None:
            try:
                await append_events(
                    session_id=session_id,
                    run_id=run_id,
                    events=[(event_type, payload)],
                    fence=fence,
                )
                return True
            except FenceRejected:
                # The run may have just ended under this very lease (its outcome committed
                # while the job finished): then it is no longer running, and the event
                # goes in unleased; if another worker runs it now, this is refused too.
                pass
        await db_call(runs.append_unleased_event, session_id, run_id, event_type, payload)
    except FenceRejected:
        logger.warning(
            "job event %s of run %s rejected: this worker no longer holds the run",
            event_type,
            run_id,
        )
        return False
    return True


class JobEventRecorder:
    """``on_event`` for a job runtime: session events plus the ``JobRecord`` row.

    Awaiting it upserts the job's ``JobRecord`` and appends one event (``job.created`` ...
    ``job.killed``) to the session named by the job's ``session_id`` label, attributed to
    its run. A terminal event is appended only by whoever moved the row to its terminal
    state, so the end of a job is announced once even when several paths observe it.
    Jobs without ``session_id``/``owner_id`` labels are ignored. Errors propagate to the
    runtime, which logs them and never fails the job for them.
    """

    async def __call__(
        self, snapshot: JobSnapshot, event_type: str, data: Mapping[str, Any]
    ) -> None:
        await self.record(snapshot, event_type, data)

    async def record(self, snapshot: JobSnapshot, event_type: str, data: Mapping[str, Any]) -> bool:
        """Upsert the row and append the event; returns True if the event was appended."""
        session_id = snapshot.labels.get(LABEL_SESSION)
        owner = snapshot.labels.get(LABEL_OWNER)
        if not session_id or not owner:
            return False
        implied = _EVENT_STATES.get(event_type)
        if implied is not None and snapshot.terminal:
            # A runtime that observes by polling (Celery) may report job.started with a
            # snapshot taken after the job already ended; the end has its own event, so
            # this one must describe (and record) the job as it was then.
            snapshot = replace(snapshot, state=implied, exit_code=None, error=None)
        # The row first: a reader that sees the event can then find the job in the API.
        ended_now = await db_call(_upsert_record_sync, snapshot, int(owner))
        if event_type in _TERMINAL_EVENT_TYPES and not ended_now:
            return False
        return await append_job_event(
            session_id, snapshot.owner_run_id, event_type, job_event_payload(snapshot, data)
        )

    async def record_end(self, snapshot: JobSnapshot) -> bool:
        """Record a terminal ``snapshot`` observed outside the runtime's events (an operator
        cancel, reconciliation); returns True if this call announced the end."""
        event_type = _TERMINAL_EVENTS.get(snapshot.state)
        if event_type is None:
            return False
        return await self.record(snapshot, event_type, {})


# --- operator cancels and reconciliation -------------------------------------------------

# Stateless: one instance serves every caller below.
_RECORDER = JobEventRecorder()


def _unfinished_records_sync(*, cancel_requested: bool | None, limit: int) -> list[str]:
    from agents.models import JobRecord

    query = JobRecord.objects.exclude(state__in=_TERMINAL_VALUES)
    if cancel_requested is not None:
        query = query.filter(cancel_requested=cancel_requested)
    # Least recently updated first: every row gets its turn under the limit.
    return list(query.order_by("updated_at").values_list("job_id", flat=True)[:limit])


def _mark_lost_sync(job_id: str) -> bool:
    from agents.models import JobRecord

    return bool(
        JobRecord.objects.filter(job_id=job_id)
        .exclude(state__in=_TERMINAL_VALUES)
        .update(
            state=str(JobState.KILLED),
            error=killed_error("the job runtime no longer knows this job"),
            updated_at=timezone.now(),
        )
    )


def _is_shared(runtime: Any) -> bool:
    # A durable runtime (Celery over Redis) sees every host's jobs: a job it does not know
    # is gone for good. An in-memory one sees only this process's jobs.
    return bool(getattr(runtime.capabilities, "durable", False))


async def _gathered(jobs: list[str], one: Any) -> int:
    gate = asyncio.Semaphore(_CANCEL_CONCURRENCY)

    async def guarded(job_id: str) -> bool:
        async with gate:
            return await one(job_id)

    results = await asyncio.gather(*(guarded(j) for j in jobs), return_exceptions=True)
    count = 0
    for job_id, result in zip(jobs, results, strict=True):
        if isinstance(result, BaseException):
            logger.error("job upkeep failed for %s: %r", job_id, result)
        elif result:
            count += 1
    return count


async def apply_cancel_requests(runtime: Any, *, limit: int = 100) -> int:
    """Cancel jobs whose ``JobRecord.cancel_requested`` is set and that are not terminal.

    Returns how many of them ended (their row and ``job.killed`` event are recorded, once,
    whichever path saw the end first). A job the runtime does not know is left alone by an
    in-memory runtime (another worker process may own it) and marked KILLED by a shared
    one. One job's failure is logged, never raised; it is retried on the next call.
    """
    pending = await db_call(_unfinished_records_sync, cancel_requested=True, limit=limit)
    if not pending:
        return 0
    shared = _is_shared(runtime)

    async def cancel_one(job_id: str) -> bool:
        try:
            snapshot = await runtime.cancel(job_id, reason="cancelled by an operator")
        except SageError as exc:
            if exc.code != "job.not_found":
                logger.warning("operator cancel of job %s failed: %s", job_id, exc.code)
                return False
            return shared and await db_call(_mark_lost_sync, job_id)
        if not snapshot.terminal:
            return False  # still stopping (a slow Celery worker): the next round looks again
        # The runtime's recorder has usually written this already; record_end is a no-op then.
        await _RECORDER.record_end(snapshot)
        return True

    return await _gathered(pending, cancel_one)


async def reconcile_job_records(runtime: Any, *, limit: int = 200) -> int:
    """Bring unfinished ``JobRecord`` rows up to the runtime's state; returns how many ended.

    For a shared (Celery) runtime: jobs whose submitting process went away while they ran
    are watched by nobody, so their end is recorded here (row and terminal event), and
    rows of jobs the runtime has forgotten are marked KILLED. An in-memory runtime reports
    its own jobs' ends synchronously, so there is nothing to do and it returns 0.
    """
    if not _is_shared(runtime):
        return 0
    rows = await db_call(_unfinished_records_sync, cancel_requested=None, limit=limit)

    async def sync_one(job_id: str) -> bool:
        try:
            snapshot = await runtime.inspect(job_id)
        except SageError as exc:
            if exc.code != "job.not_found":
                raise
            return await db_call(_mark_lost_sync, job_id)
        if snapshot.terminal:
            return await _RECORDER.record_end(snapshot)
        owner = snapshot.labels.get(LABEL_OWNER)
        if owner:
            await db_call(_upsert_record_sync, snapshot, int(owner))
        return False

    return await _gathered(rows, sync_one)


async def poll_cancel_requests(
    runtime: Any,
    stop: asyncio.Event,
    *,
    interval_seconds: float = 3.0,
    reconcile_every: int = 10,
) -> None:
    """Until ``stop`` is set: ``apply_cancel_requests`` every ``interval_seconds`` and
    ``reconcile_job_records`` every ``reconcile_every`` rounds (and on the first).

    For the worker: ``asyncio.create_task(poll_cancel_requests(runtime, stop))``. A failed
    round is logged and the loop goes on; returns once ``stop`` is set.
    """
    rounds = 0
    while not stop.is_set():
        try:
            if rounds % max(reconcile_every, 1) == 0:
                await reconcile_job_records(runtime)
            await apply_cancel_requests(runtime)
        except Exception:
            logger.exception("job upkeep round failed")
        rounds += 1
        try:
            await asyncio.wait_for(stop.wait(), timeout=interval_seconds)
        except TimeoutError:
            pass
