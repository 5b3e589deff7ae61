"""The worker's small claim loop on ``Run`` rows (replaced by the DatabaseScheduler).

A claim takes the oldest available queued run under a fresh fencing token. PostgreSQL and
MySQL lock the candidate with ``SELECT … FOR UPDATE SKIP LOCKED`` so two workers never
take one row; SQLite serializes the whole claim in one IMMEDIATE transaction.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.db import connection, transaction
from django.db.models import F
from django.utils import timezone

from scheduling.models import FenceSequence, Run, RunStatus
from scheduling.store import Fence


def next_fencing_token() -> int:
    """One global strictly increasing token; call inside a transaction."""
    FenceSequence.objects.get_or_create(pk=1)
    FenceSequence.objects.filter(pk=1).update(value=F("value") + 1)
    return FenceSequence.objects.values_list("value", flat=True).get(pk=1)


def claim_next(*, worker_id: str, lease_seconds: int) -> tuple[Fence, Any] | None:
    """Lease the oldest available queued run, or return None."""
    now = timezone.now()
    with transaction.atomic():
        candidates = Run.objects.filter(
            status=RunStatus.QUEUED, available_at__lte=now, cancel_requested=False
        ).order_by("available_at", "created_at")
        if connection.features.has_select_for_update_skip_locked:
            candidates = candidates.select_for_update(skip_locked=True)
        run = candidates.only("pk", "attempts", "started_at").first()
        if run is None:
            return None
        token = next_fencing_token()
        Run.objects.filter(pk=run.pk).update(
            status=RunStatus.RUNNING,
            lease_owner=worker_id,
            lease_token=token,
            lease_expires_at=now + timedelta(seconds=lease_seconds),
            attempts=F("attempts") + 1,
            started_at=run.started_at or now,
        )
    return Fence(run_id=run.pk, lease_owner=worker_id, lease_token=token), run.pk


def renew(fence: Fence, *, lease_seconds: int) -> tuple[bool, bool]:
    """Extend the lease; returns (still held, cancel requested)."""
    now = timezone.now()
    held = (
        Run.objects.filter(
            pk=fence.run_id,
            lease_owner=fence.lease_owner,
            lease_token=fence.lease_token,
            status=RunStatus.RUNNING,
        ).update(lease_expires_at=now + timedelta(seconds=lease_seconds))
        == 1
    )
    cancel = Run.objects.filter(pk=fence.run_id, cancel_requested=True).exists()
    return held, cancel


def requeue(fence: Fence, *, reason: dict[str, Any] | None = None) -> bool:
    """Give a run back to the queue (shutdown); only while this lease still holds it."""
    return (
        Run.objects.filter(
            pk=fence.run_id,
            lease_owner=fence.lease_owner,
            lease_token=fence.lease_token,
            status=RunStatus.RUNNING,
        ).update(
            status=RunStatus.QUEUED,
            lease_owner="",
            lease_expires_at=None,
            error=reason,
            available_at=timezone.now(),
        )
        == 1
    )


def recover_expired(*, max_attempts: int) -> int:
    """Requeue runs whose lease expired (a killed worker); fail those out of attempts."""
    now = timezone.now()
    expired = Run.objects.filter(status=RunStatus.RUNNING, lease_expires_at__lt=now)
    failed = expired.filter(attempts__gte=max_attempts).update(
        status=RunStatus.FAILED,
        finished_at=now,
        lease_owner="",
        lease_expires_at=None,
        error={
            "code": "execution.worker_restarted",
            "category": "RESOURCE_LOST",
            "message": f"the run's worker stopped {max_attempts} times; the run was failed",
            "retryable": False,
            "resumable": False,
        },
    )
    requeued = expired.update(
        status=RunStatus.QUEUED, lease_owner="", lease_expires_at=None, available_at=now
    )
    return failed + requeued
