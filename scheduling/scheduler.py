"""Run scheduling, the public names in one place (Django-free).

The values, errors, ordering rule, protocol and quota group live in `scheduling.protocol`;
`InMemoryScheduler` in `scheduling.memory`; `DatabaseScheduler` (``Run`` rows, safe across
processes, needs Django) in `scheduling.db_scheduler`, re-exported here lazily so
importing this module never imports Django.
"""

from __future__ import annotations

from typing import Any

from scheduling.memory import InMemoryScheduler, RunPins
from scheduling.protocol import (
    ClaimCandidate,
    ClaimOrder,
    FenceRejected,
    LeaseExpired,
    LeaseReleaseReason,
    Scheduler,
    SchedulerCapabilities,
    SchedulerClaimPolicy,
    SchedulerQuotaGroup,
    WorkerLease,
    WorkItem,
    closed_error,
    fair_order,
    fence_rejected_error,
    lease_expired_error,
    queue_full_error,
    utc_now,
    work_id_conflict_error,
    worker_shutdown_error,
)

__all__ = [  # noqa: F822 (DatabaseScheduler is provided lazily by __getattr__)
    "ClaimCandidate",
    "ClaimOrder",
    "DatabaseScheduler",
    "FenceRejected",
    "InMemoryScheduler",
    "LeaseExpired",
    "LeaseReleaseReason",
    "RunPins",
    "Scheduler",
    "SchedulerCapabilities",
    "SchedulerClaimPolicy",
    "SchedulerQuotaGroup",
    "WorkItem",
    "WorkerLease",
    "closed_error",
    "fair_order",
    "fence_rejected_error",
    "lease_expired_error",
    "queue_full_error",
    "utc_now",
    "work_id_conflict_error",
    "worker_shutdown_error",
]


def __getattr__(name: str) -> Any:
    # `DatabaseScheduler` needs Django; importing it lazily keeps this module Django-free.
    if name == "DatabaseScheduler":
        from scheduling.db_scheduler import DatabaseScheduler

        return DatabaseScheduler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
