"""Reads of runs by status, for code outside the state machine.

Only the state machine writes ``Run.status``; what other modules ask of it (the pending
counters' recount, the health checks, the scheduler's pending count) is written here
once.
"""

from __future__ import annotations

from datetime import datetime

from django.db import DEFAULT_DB_ALIAS
from django.db.models import QuerySet

from scheduling.models import Run, RunStatus


def queued_roots(queue: str | None = None, *, using: str = DEFAULT_DB_ALIAS) -> QuerySet[Run]:
    """Queued root runs (of ``queue``, if given): what the pending limits count."""
    rows = Run.objects.using(using).filter(status=RunStatus.QUEUED, parent__isnull=True)
    if queue is not None:
        rows = rows.filter(queue=queue)
    return rows


def queued_in_turn(*, using: str = DEFAULT_DB_ALIAS) -> QuerySet[Run]:
    """Queued runs whose session's turn it is (``ready``): what workers may claim."""
    return Run.objects.using(using).filter(status=RunStatus.QUEUED, ready=True)


def running_past_lease(before: datetime, *, using: str = DEFAULT_DB_ALIAS) -> QuerySet[Run]:
    """Running runs whose lease expired before ``before``."""
    return Run.objects.using(using).filter(status=RunStatus.RUNNING, lease_expires_at__lt=before)
