"""Fences: what every write of a leased run must still hold.

A leased run's write is conditional on ``status = running``, the writer's owner and
token, and ``lease_expires_at > now`` by the database's clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from django.db import DEFAULT_DB_ALIAS
from django.utils import timezone

from sageproject.db import prepared
from scheduling.models import Run, RunStatus
from scheduling.protocol import FenceRejected
from scheduling.runs import statements
from scheduling.runs.clock import Clock, now_expr


@dataclass(frozen=True, slots=True, kw_only=True)
class Fence:
    """What a write must still hold: the run's current lease owner and token."""

    run_id: Any
    lease_owner: str
    lease_token: int


def held(fence: Fence, using: str = DEFAULT_DB_ALIAS, clock: Clock = None) -> Any:
    """The run row while ``fence`` still owns it: running, same owner and token, and its
    lease not yet expired by the database's clock."""
    return Run.objects.using(using).filter(
        pk=fence.run_id,
        lease_owner=fence.lease_owner,
        lease_token=fence.lease_token,
        status=RunStatus.RUNNING,
        lease_expires_at__gt=now_expr(clock),
    )


def check_fence(fence: Fence, *, using: str = DEFAULT_DB_ALIAS, clock: Clock = None) -> None:
    """Conditional UPDATE of the run row inside the caller's transaction.

    Raises ``scheduler.fence_rejected`` when no row matches: another owner, a newer token,
    the run no longer running, or its lease expired (even if nobody reclaimed it yet).
    """
    if held(fence, using, clock).update(updated_at=timezone.now()) != 1:
        raise FenceRejected(fence.run_id)


def lock_fences(fences: Sequence[Fence], connection: Any) -> None:
    """PostgreSQL, for a pipeline on the raw connection: lock (in id order) the run rows
    that ``fences`` still own — running, same owner and token, lease not expired by the
    database's clock — and fail the statement (division by zero: the transaction is
    aborted, its ``COMMIT`` skipped) unless every fence's run is held."""
    prepared(connection.connection, *statements.lock_fences(fences, connection))
