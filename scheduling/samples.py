"""The capacity history behind the capacity page's charts: `CapacitySample` rows.

Every worker offers a sample with each snapshot it publishes (``record``, every few
seconds), but a sample is written at most once per ``SAMPLE_SECONDS`` across all workers:
its primary key is the period of the database's clock it falls in, so a second worker
offering one for the same period writes nothing. The writer of a new sample prunes the
history to the last ``KEEP_SECONDS`` (and drops periods ahead of the clock, should the
database's clock have gone back), so the table holds at most ``KEEP_SECONDS /
SAMPLE_SECONDS + 1`` rows (5,761) whatever the number of workers or their uptime.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import Q

from scheduling.models import CapacitySample
from scheduling.runs import db_now

SAMPLE_SECONDS = 15
KEEP_SECONDS = 24 * 3600
KEEP_SLOTS = KEEP_SECONDS // SAMPLE_SECONDS


def slot_of(moment: datetime) -> int:
    """The sampling period ``moment`` falls in."""
    return int(moment.timestamp()) // SAMPLE_SECONDS


def record(figures: dict[str, Any], *, now: datetime | None = None) -> bool:
    """Write the sample of the current period from a worker's queue figures
    (``scheduling.worker.queue_counts``: ``{"per_queue": {queue: {"active", "pending"}}}``)
    unless a worker already did; True when this call wrote it (and pruned the history).
    ``now`` replaces the database's clock (tests)."""
    now = now or db_now()
    slot = slot_of(now)
    if CapacitySample.objects.filter(slot=slot).exists():
        return False
    per_queue = {
        str(name): {"active": int(row.get("active", 0)), "pending": int(row.get("pending", 0))}
        for name, row in (figures.get("per_queue") or {}).items()
        if isinstance(row, dict)
    }
    try:
        with transaction.atomic():
            CapacitySample.objects.create(
                slot=slot,
                time=now,
                queued=sum(row["pending"] for row in per_queue.values()),
                active=sum(row["active"] for row in per_queue.values()),
                per_queue=per_queue,
            )
    except IntegrityError:  # another worker wrote this period's sample meanwhile
        return False
    CapacitySample.objects.filter(Q(slot__lt=slot - KEEP_SLOTS) | Q(slot__gt=slot)).delete()
    return True


def history(seconds: int = 3600, *, now: datetime | None = None) -> list[CapacitySample]:
    """The samples of the last ``seconds`` (at most ``KEEP_SECONDS``), oldest first."""
    now = now or db_now()
    since = slot_of(now) - min(seconds, KEEP_SECONDS) // SAMPLE_SECONDS
    return list(CapacitySample.objects.filter(slot__gte=since).order_by("slot"))
