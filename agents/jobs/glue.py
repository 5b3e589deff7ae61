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


def _upsert_record_sync(snapshot: JobSnapshot, owner_id: int) -> None:
    from agents.models import JobRecord

    state = str(snapshot.state)
    values: dict[str, Any] = {
        "state": state,
        "output_bytes": snapshot.output_bytes,
        "output_chunks": snapshot.output_chunks,
        "output_truncated": snapshot.output_truncated,
        "error": dict(snapshot.error) if snapshot.error else None,
        # .update() skips auto_now fields.
        "updated_at": timezone.now(),
    }

    def matching() -> Any:
        query = JobRecord.objects.filter(job_id=snapshot.job_id)
        if snapshot.state not in TERMINAL_STATES:
            # Events of one job can land out of order (a kill racing its job.created): a
            # late non-terminal update must never move a finished row back.
            query = query.exclude(state__in=_TERMINAL_VALUES)
        return query

    if matching().update(**values):
        return
    if JobRecord.objects.filter(job_id=snapshot.job_id).exists():
        return  # already terminal; nothing newer to say
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
        # Another event of the same job created the row first: apply ours on top.
        matching().update(**values)


class JobEventRecorder:
    """``on_event`` for a job runtime: session events plus the ``JobRecord`` row.

    Awaiting it appends one event (``job.created`` ... ``job.killed``) to the session named
    by the job's ``session_id`` label, attributed to its run, and upserts the job's
    ``JobRecord``. Jobs without ``session_id``/``owner_id`` labels are ignored. Errors
    propagate to the runtime, which logs them and never fails the job for them.
    """

    async def __call__(
        self, snapshot: JobSnapshot, event_type: str, data: Mapping[str, Any]
    ) -> None:
        session_id = snapshot.labels.get(LABEL_SESSION)
        owner = snapshot.labels.get(LABEL_OWNER)
        if not session_id or not owner:
            return
        owner_id = int(owner)
        # The row first: a reader that sees the event can then find the job in the API.
        await db_call(_upsert_record_sync, snapshot, owner_id)
        from scheduling.store import append_events

        await append_events(
            session_id=session_id,
            run_id=snapshot.owner_run_id,
            events=[(event_type, job_event_payload(snapshot, data))],
        )


# --- operator cancels -------------------------------------------------------------------


def _pending_cancels_sync(limit: int) -> list[tuple[str, int]]:
    from agents.models import JobRecord

    rows = (
        JobRecord.objects.filter(cancel_requested=True)
        .exclude(state__in=_TERMINAL_VALUES)
        .order_by("created_at")
        .values_list("job_id", "owner_id")[:limit]
    )
    return list(rows)


def _mark_lost_sync(job_id: str) -> None:
    from agents.models import JobRecord

    JobRecord.objects.filter(job_id=job_id).exclude(state__in=_TERMINAL_VALUES).update(
        state=str(JobState.KILLED),
        error=killed_error("the job runtime no longer knows this job"),
        updated_at=timezone.now(),
    )


async def apply_cancel_requests(runtime: Any, *, limit: int = 100) -> int:
    """Cancel jobs whose ``JobRecord.cancel_requested`` is set and that are not terminal.

    Returns how many jobs this call cancelled (or found already ended and recorded).
    A job the runtime does not know is left alone by an in-memory runtime (another worker
    process may own it) and marked KILLED by a shared one (Celery: its row is gone for
    good). Never raises for one job's failure; those are logged and retried next call.
    """
    pending = await db_call(_pending_cancels_sync, limit)
    if not pending:
        return 0
    gate = asyncio.Semaphore(_CANCEL_CONCURRENCY)
    shared = bool(getattr(runtime.capabilities, "durable", False))

    async def cancel_one(job_id: str, owner_id: int) -> bool:
        async with gate:
            try:
                snapshot = await runtime.cancel(job_id, reason="cancelled by an operator")
            except SageError as exc:
                if exc.code != "job.not_found":
                    logger.warning("operator cancel of job %s failed: %s", job_id, exc.code)
                    return False
                if not shared:
                    return False
                await db_call(_mark_lost_sync, job_id)
                return True
            # The recorder may not be attached (or may lag a poll behind): write the row.
            await db_call(_upsert_record_sync, snapshot, owner_id)
            return True

    results = await asyncio.gather(
        *(cancel_one(job_id, owner_id) for job_id, owner_id in pending), return_exceptions=True
    )
    done = 0
    for (job_id, _), result in zip(pending, results, strict=True):
        if isinstance(result, BaseException):
            logger.error("operator cancel of job %s failed: %r", job_id, result)
        elif result:
            done += 1
    return done


async def poll_cancel_requests(
    runtime: Any, stop: asyncio.Event, *, interval_seconds: float = 3.0
) -> None:
    """Call ``apply_cancel_requests`` every ``interval_seconds`` until ``stop`` is set.

    For the worker: ``asyncio.create_task(poll_cancel_requests(runtime, stop))``. A failed
    round is logged and the loop goes on.
    """
    while not stop.is_set():
        try:
            await apply_cancel_requests(runtime)
        except Exception:
            logger.exception("applying job cancel requests failed")
        try:
            await asyncio.wait_for(stop.wait(), timeout=interval_seconds)
        except TimeoutError:
            pass
