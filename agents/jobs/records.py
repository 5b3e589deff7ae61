"""Job snapshots mirrored into the database: ``JobRecord`` rows and ``job.*`` session events.

``JobEventRecorder`` is a runtime's ``on_event``: it appends ``job.*`` events to the job's
session and keeps the ``JobRecord`` row (admin and API) in step. Where a job's events go is
decided by its ``labels`` (``session_id``, ``owner_id``), which the agent tools set from the
run's ``ToolContext``; jobs without them are not recorded.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from django.db import IntegrityError, transaction
from django.db.models import QuerySet
from django.utils import timezone

from agents.jobs.base import TERMINAL_EVENTS, TERMINAL_STATES, JobSnapshot, JobState
from sageproject.db import db_call

if TYPE_CHECKING:
    from agents.models import JobRecord

logger = logging.getLogger("sage.jobs")

# Label keys the tools set and the recorder reads.
LABEL_SESSION = "session_id"
LABEL_OWNER = "owner_id"

_TERMINAL_VALUES = tuple(str(s) for s in TERMINAL_STATES)
_TERMINAL_EVENT_TYPES = frozenset(TERMINAL_EVENTS.values())
_EVENT_STATES = {"job.created": JobState.CREATED, "job.started": JobState.RUNNING}


def unfinished(records: QuerySet[JobRecord]) -> QuerySet[JobRecord]:
    """The rows of ``records`` whose job has not reached a terminal state."""
    return records.exclude(state__in=_TERMINAL_VALUES)


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


def upsert_record_sync(snapshot: JobSnapshot, owner_id: int) -> bool:
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
    row = unfinished(JobRecord.objects.filter(job_id=snapshot.job_id))
    if row.update(**values):
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
        return bool(row.update(**values)) and terminal
    return terminal


def reopen_record_sync(job_id: str, state: str) -> None:
    """Make the job's row unfinished (``running``) again if it still says ``state``: its
    end could not be announced (see `JobEventRecorder.record`)."""
    from agents.models import JobRecord

    JobRecord.objects.filter(job_id=job_id, state=state).update(
        state=str(JobState.RUNNING), updated_at=timezone.now()
    )


async def append_job_event(
    session_id: Any, run_id: Any, event_type: str, payload: Mapping[str, Any]
) -> bool:
    """Append a job's event to its run's session, fenced like every write of a run: with
    the run's lease while this worker executes it; without one only while the run is not
    running (a job that outlived its run). A worker that lost the run's lease writes
    nothing (logged); returns whether the event was appended."""
    from scheduling import runs
    from scheduling.protocol import FenceRejected
    from scheduling.store import append_events
    from scheduling.worker import current_fence

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
        ended_now = await db_call(upsert_record_sync, snapshot, int(owner))
        if event_type in _TERMINAL_EVENT_TYPES and not ended_now:
            return False
        appended = await append_job_event(
            session_id, snapshot.owner_run_id, event_type, job_event_payload(snapshot, data)
        )
        if ended_now and not appended:
            # The end's event was refused (the run is running under a lease this process
            # does not hold: a dead worker's, not yet reaped). Nobody else would announce
            # it — the row says it is recorded — so the row is unfinished again, and a
            # later reconciliation, under whoever holds the run then, records the end.
            await db_call(reopen_record_sync, snapshot.job_id, str(snapshot.state))
        return appended

    async def record_end(self, snapshot: JobSnapshot) -> bool:
        """Record a terminal ``snapshot`` observed outside the runtime's events (an operator
        cancel, reconciliation); returns True if this call announced the end."""
        event_type = TERMINAL_EVENTS.get(snapshot.state)
        if event_type is None:
            return False
        return await self.record(snapshot, event_type, {})
