"""A session's events and turn, as the transitions write them.

Terminal events written outside the worker's store (reaper, web cancels) are appended with
`append_event` under the session row's lock; the store's own commits are conditional on the
session's durable prefix, so the two never interleave sequence numbers. When a run leaves
the unfinished states its session's next queued run becomes ``ready`` (`promote_next`), so
a session executes one run at a time, in submission order.
"""

from __future__ import annotations

from typing import Any

from django.db import DEFAULT_DB_ALIAS, transaction
from django.utils import timezone

from scheduling import wakeups
from scheduling.models import UNFINISHED_STATUSES, Event, Run, RunStatus, Session
from scheduling.protocol import FenceRejected
from scheduling.serialization import encode_payload

TERMINAL_EVENTS = {
    RunStatus.COMPLETED: "run.completed",
    RunStatus.FAILED: "run.failed",
    RunStatus.CANCELLED: "run.cancelled",
    RunStatus.INTERRUPTED: "run.interrupted",
}


def locked_prefix(session_id: Any, using: str) -> int:
    """The session's durable event count, its row locked until the caller's transaction
    ends."""
    return (
        Session.objects.using(using)
        .select_for_update()
        .values_list("persisted_events", flat=True)
        .get(pk=session_id)
    )


def append_event(
    session_id: Any, run_id: Any, event_type: str, payload: Any, *, using: str = DEFAULT_DB_ALIAS
) -> int:
    """Append one event after the session's durable prefix (inside the caller's
    transaction, under the session row's lock); returns its seq."""
    with transaction.atomic(using=using):
        seq = locked_prefix(session_id, using) + 1
        Event.objects.using(using).create(
            session_id=session_id,
            seq=seq,
            run_id=run_id,
            type=event_type,
            data=encode_payload(payload),
        )
        Session.objects.using(using).filter(pk=session_id).update(
            persisted_events=seq, updated_at=timezone.now()
        )
        return seq


def append_unleased_event(
    session_id: Any, run_id: Any, event_type: str, payload: Any, *, using: str = DEFAULT_DB_ALIAS
) -> int:
    """Append an event of ``run_id`` written by someone who holds no lease of it (a job
    that outlived its run's execution): accepted while the run is not running; while it is
    running, only its lease holder may write (``scheduler.fence_rejected``)."""
    with transaction.atomic(using=using):
        status = (
            Run.objects.using(using)
            .select_for_update()
            .filter(pk=run_id)
            .values_list("status", flat=True)
            .first()
        )
        if status == RunStatus.RUNNING:
            raise FenceRejected(run_id)
        return append_event(session_id, run_id, event_type, payload, using=using)


def terminal_payload(status: str, result: Any, error: Any) -> dict[str, Any]:
    """The payload of a terminal event: the result of a completed run, else its error."""
    return {"result": result} if status == RunStatus.COMPLETED else {"error": error}


def promote_next(session_id: Any, using: str) -> None:
    """Make the session's oldest queued run ready, unless another run is still unfinished
    and ready (running, suspended or queued ahead)."""
    runs = Run.objects.using(using).filter(session_id=session_id)
    if runs.filter(status__in=UNFINISHED_STATUSES, ready=True).exists():
        return
    head = (
        runs.filter(status=RunStatus.QUEUED, ready=False)
        .order_by("created_at", "id")
        .values_list("pk", flat=True)
        .first()
    )
    if head is not None:
        runs.filter(pk=head).update(ready=True)
        wakeups.notify("run", using=using)


def remove_run_events(session_id: Any, run_id: Any, *, using: str = DEFAULT_DB_ALIAS) -> int:
    """Remove a run's events from its session and renumber the later ones (multitask
    rollback), under the session row's lock; returns how many were removed."""
    with transaction.atomic(using=using):
        persisted = locked_prefix(session_id, using)
        events = Event.objects.using(using).filter(session_id=session_id)
        first = events.filter(run_id=run_id).order_by("seq").values_list("seq", flat=True).first()
        if first is None:
            return 0
        later = list(events.filter(seq__gte=first).order_by("seq"))
        removed = sum(1 for event in later if event.run_id == run_id)
        events.filter(seq__gte=first).delete()
        kept = [event for event in later if event.run_id != run_id]
        for seq, event in enumerate(kept, start=first):
            event.pk = None
            event.seq = seq
        Event.objects.using(using).bulk_create(kept)
        Session.objects.using(using).filter(pk=session_id).update(
            persisted_events=persisted - removed, updated_at=timezone.now()
        )
        return removed
