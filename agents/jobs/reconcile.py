"""Keeping ``JobRecord`` rows and the job runtime in agreement: operator cancels, lost jobs.

- ``apply_cancel_requests(runtime)`` applies the admin's "Cancel selected jobs" action.
- ``reconcile_job_records(runtime)`` records the end of jobs nobody watched and marks rows
  of jobs the runtime forgot as KILLED.
- ``poll_cancel_requests(runtime, stop)`` runs both every few seconds, for the worker.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from django.utils import timezone

from agents.jobs.base import JobState, killed_error
from agents.jobs.records import LABEL_OWNER, JobEventRecorder, unfinished, upsert_record_sync
from sageproject.db import db_call
from sageproject.errors import SageError

logger = logging.getLogger("sage.jobs")

# Operator cancels are applied a few at a time: a Celery cancel may wait for its worker.
_CANCEL_CONCURRENCY = 8
# Stateless: one instance serves every caller below.
_RECORDER = JobEventRecorder()


def _unfinished_records_sync(*, cancel_requested: bool | None, limit: int) -> list[str]:
    from agents.models import JobRecord

    query = unfinished(JobRecord.objects.all())
    if cancel_requested is not None:
        query = query.filter(cancel_requested=cancel_requested)
    # Least recently updated first: every row gets its turn under the limit.
    return list(query.order_by("updated_at").values_list("job_id", flat=True)[:limit])


def _mark_lost_sync(job_id: str) -> bool:
    from agents.models import JobRecord

    return bool(
        unfinished(JobRecord.objects.filter(job_id=job_id)).update(
            state=str(JobState.KILLED),
            error=killed_error("the job runtime no longer knows this job"),
            updated_at=timezone.now(),
        )
    )


def _is_shared(runtime: Any) -> bool:
    # A durable runtime (Celery over Redis) sees every host's jobs: a job it does not know
    # is gone for good. An in-memory one sees only this process's jobs.
    return bool(getattr(runtime.capabilities, "durable", False))


async def _gathered(jobs: list[str], one: Callable[[str], Awaitable[bool]]) -> int:
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
            await db_call(upsert_record_sync, snapshot, int(owner))
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
