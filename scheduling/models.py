from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import orjson
from django.conf import settings
from django.db import models
from django.utils import timezone

from sageproject.errors import ErrorCategory, SageError


class SessionKind(models.TextChoices):
    # The user's main conversation; its live kernel is never closed for idleness.
    MASTER = "master", "Master"
    # A side conversation branched from a master.
    BRANCH = "branch", "Branch"
    # A delegated deep-work conversation.
    DEEP = "deep", "Deep"
    # A background job's conversation.
    JOB = "job", "Job"
    # A copy of another session's history up to fork_seq.
    FORK = "fork", "Fork"


class OwnedQuerySet(models.QuerySet):
    """Rows that belong to a user (``owner``)."""

    def visible_to(self, user) -> OwnedQuerySet:
        """What ``user`` may see through the API: their own rows, or every row for staff.
        Another user's rows are simply absent, so looking one up answers 404."""
        return self if user.is_staff else self.filter(owner=user)


class Session(models.Model):
    objects = OwnedQuerySet.as_manager()

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    # Foreign keys whose column leads a composite index below carry no index of their own
    # (here and in Event, Run): the composite serves every lookup by the column, and each
    # index is one more write per inserted or updated row.
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.CASCADE,
        related_name="agent_sessions",
        db_index=False,  # session_owner_recent
    )
    # The package is referenced by its immutable content hash (and its name for people);
    # scheduling does not import agents (DESIGN §2), so there is no foreign key.
    package_ref = models.CharField(max_length=64, db_index=True)
    package_name = models.CharField(max_length=100)
    agent_id = models.CharField(max_length=100)
    kind = models.CharField(max_length=10, choices=SessionKind.choices, default=SessionKind.MASTER)
    fork_of = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.SET_NULL, related_name="forks"
    )
    fork_seq = models.PositiveIntegerField(null=True, blank=True)
    title = models.CharField(max_length=200, blank=True)
    # Length of the durable event prefix: events 1..persisted_events exist in the database.
    persisted_events = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["owner", "-created_at"], name="session_owner_recent")]

    def __str__(self) -> str:
        return f"{self.package_name}/{self.agent_id} {str(self.id)[:8]}"


class Event(models.Model):
    """One durable event. ``data`` holds the payload serialized once (orjson) as text."""

    session = models.ForeignKey(
        Session, on_delete=models.CASCADE, related_name="events", db_index=False
    )  # event_session_seq
    seq = models.PositiveIntegerField()
    run = models.ForeignKey(
        "Run", null=True, blank=True, on_delete=models.SET_NULL, related_name="events"
    )
    type = models.CharField(max_length=64)
    data = models.TextField(default="{}")
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["session", "seq"]
        constraints = [
            models.UniqueConstraint(fields=["session", "seq"], name="event_session_seq"),
        ]

    def __str__(self) -> str:
        return f"#{self.seq} {self.type}"

    @property
    def payload(self) -> Any:
        return orjson.loads(self.data)


class RunQueue(models.TextChoices):
    # Interactive turns of a session.
    CHAT = "chat", "Chat"
    # Runs started by the management service (packages run as applications).
    MANAGED = "managed", "Managed"


class RunStatus(models.TextChoices):
    # Admitted, waiting for a worker.
    QUEUED = "queued", "Queued"
    # Claimed by a worker that holds its lease.
    RUNNING = "running", "Running"
    # Waiting for the user (an interaction); a reply queues it again.
    SUSPENDED = "suspended", "Suspended"
    COMPLETED = "completed", "Completed"
    FAILED = "failed", "Failed"
    CANCELLED = "cancelled", "Cancelled"
    # Stopped because a newer run of its session asked to take over (multitask
    # ``interrupt`` or ``rollback``).
    INTERRUPTED = "interrupted", "Interrupted"


class Multitask(models.TextChoices):
    """What a new run does when its session already has an unfinished run."""

    # Wait behind the session's earlier runs (the default).
    ENQUEUE = "enqueue", "Enqueue"
    # Refuse the new run with 409 ``session.busy``.
    REJECT = "reject", "Reject"
    # Stop the unfinished runs at their next step (``interrupted``); the new run follows.
    INTERRUPT = "interrupt", "Interrupt"
    # As interrupt, and the interrupted runs' events are removed from the session.
    ROLLBACK = "rollback", "Rollback"


class StopRequest(models.TextChoices):
    """Why ``cancel_requested`` was set: a cancel, or a newer run taking over."""

    NONE = "", "None"
    CANCEL = "cancel", "Cancel"
    INTERRUPT = "interrupt", "Interrupt"
    ROLLBACK = "rollback", "Rollback"


def run_cancelled_error() -> dict[str, Any]:
    """``Run.error`` of a cancelled run (the same wherever the cancellation lands)."""
    return SageError(
        "run.cancelled", "the run was cancelled", category=ErrorCategory.CANCELLED
    ).record()


def run_interrupted_error() -> dict[str, Any]:
    """``Run.error`` of a run a newer run of its session interrupted."""
    return SageError(
        "run.interrupted",
        "a newer run of the session interrupted this run",
        category=ErrorCategory.CANCELLED,
    ).record()


TERMINAL_STATUSES = frozenset(
    {RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED, RunStatus.INTERRUPTED}
)
UNFINISHED_STATUSES = frozenset({RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.SUSPENDED})


class Run(models.Model):
    objects = OwnedQuerySet.as_manager()

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    session = models.ForeignKey(
        Session, on_delete=models.CASCADE, related_name="runs", db_index=False
    )  # run_session_created
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.CASCADE,
        related_name="runs",
        db_index=False,  # run_owner_status
    )
    parent = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.CASCADE, related_name="children"
    )
    queue = models.CharField(max_length=10, choices=RunQueue.choices, default=RunQueue.CHAT)
    priority = models.IntegerField(default=0)
    status = models.CharField(max_length=12, choices=RunStatus.choices, default=RunStatus.QUEUED)
    input = models.JSONField(default=str, blank=True)
    result = models.JSONField(null=True, blank=True)
    # {"code", "category", "message", "retryable", "resumable"}; never a raw upstream body.
    error = models.JSONField(null=True, blank=True)
    # The pending interaction of a suspended run: {"id", "type", "code", "allowed_decisions", ...}.
    interaction = models.JSONField(null=True, blank=True)
    idempotency_key = models.CharField(max_length=200, null=True, blank=True)
    cancel_requested = models.BooleanField(default=False)
    # Why cancel_requested was set (a cancel, or a newer run interrupting this one).
    stop_request = models.CharField(
        max_length=10, choices=StopRequest.choices, default=StopRequest.NONE, blank=True
    )
    # True for the one run of its session that may execute: the oldest unfinished run.
    # Claims consider ready runs only, so a session runs one run at a time, in order.
    ready = models.BooleanField(default=True)
    available_at = models.DateTimeField(default=timezone.now)
    lease_owner = models.CharField(max_length=200, blank=True, default="")
    # Fencing token: strictly increasing across all claims; a write must present the current one.
    lease_token = models.BigIntegerField(null=True, blank=True)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    # Claims so far (every execution, including resumes after a suspension or a restart).
    attempts = models.PositiveIntegerField(default=0)
    # Executions that ended because their worker died (the lease expired): the crash
    # budget SAGE_MAX_RUN_ATTEMPTS counts these, not suspensions or graceful restarts.
    crashes = models.PositiveIntegerField(default=0)
    # The host pending-count stripe this run's place is counted in while it is queued
    # (scheduling.pending).
    admission_slot = models.PositiveSmallIntegerField(default=0)
    created_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["owner", "idempotency_key"], name="run_owner_idempotency_key"
            ),
        ]
        indexes = [
            # The worker's claim query: ready queued runs that are available, oldest first.
            models.Index(
                fields=["status", "ready", "available_at", "created_at"], name="run_claim_ready"
            ),
            # The fair claim's per-tenant window over ready queued runs (best row per owner).
            models.Index(
                fields=["status", "ready", "owner", "-priority", "created_at"],
                name="run_fair_claim_ready",
            ),
            # The same on PostgreSQL and SQLite, holding only the rows a claim can take: the
            # claim's scan over the users with such runs and its per-user heads never walk
            # a user's finished runs, however long their history (MySQL has no partial
            # indexes and uses the one above).
            models.Index(
                fields=["owner", "-priority", "created_at", "id"],
                condition=models.Q(status="queued", ready=True, cancel_requested=False),
                name="run_claimable_by_owner",
            ),
            # Per-user quota counts and the owner's run list.
            models.Index(fields=["owner", "status"], name="run_owner_status"),
            # Reaping expired leases.
            models.Index(fields=["status", "lease_expires_at"], name="run_lease_expiry"),
            models.Index(fields=["session", "created_at"], name="run_session_created"),
        ]

    def __str__(self) -> str:
        return f"run {str(self.id)[:8]} ({self.status})"

    @property
    def is_terminal(self) -> bool:
        return self.status in TERMINAL_STATUSES


class PendingCount(models.Model):
    """Queued root runs of one admission scope: a stripe of the host's count (``host.07``)
    or a user's (``user.<id>``). Kept in the transaction of every transition into or out
    of the queue; see ``scheduling.pending``."""

    scope = models.CharField(max_length=40, primary_key=True)
    pending = models.IntegerField(default=0)

    def __str__(self) -> str:
        return f"{self.scope}: {self.pending}"


class FenceSequence(models.Model):
    """The one global fencing-token counter (a single row, id=1)."""

    value = models.BigIntegerField(default=0)


# A worker publishes its snapshot every few seconds: one older than this means the worker
# stopped publishing (crashed, paused or cut off). The readiness check and the doctor do not
# count it as live, /metrics leaves it out of the live workers, the capacity page flags it.
SNAPSHOT_STALE_AFTER = timedelta(seconds=30)


class WorkerSnapshotQuerySet(models.QuerySet):
    def live(self, limit: int = 20) -> WorkerSnapshotQuerySet:
        """The snapshots of running workers (not stopped), newest heartbeat first, at most
        ``limit`` of them."""
        return self.filter(stopped_at__isnull=True).order_by("-heartbeat_at")[:limit]


class WorkerSnapshot(models.Model):
    """The latest capacity snapshot a worker published (its heartbeat)."""

    objects = WorkerSnapshotQuerySet.as_manager()

    worker_id = models.CharField(max_length=200, unique=True)
    host = models.CharField(max_length=255)
    pid = models.PositiveIntegerField()
    started_at = models.DateTimeField()
    heartbeat_at = models.DateTimeField()
    stopped_at = models.DateTimeField(null=True, blank=True)
    capacity = models.JSONField(default=dict)

    class Meta:
        ordering = ["-heartbeat_at"]

    def __str__(self) -> str:
        return self.worker_id

    def summary(self) -> dict[str, Any]:
        """The snapshot as the capacity command and API show it."""
        return {
            "worker_id": self.worker_id,
            "host": self.host,
            "pid": self.pid,
            "started_at": self.started_at,
            "heartbeat_at": self.heartbeat_at,
            "capacity": self.capacity,
        }


class CapacitySample(models.Model):
    """One point of the capacity page's charts: root runs queued and active (all workers,
    from the database) at ``time``, the database's clock. ``slot`` is ``time`` in whole
    periods of ``scheduling.samples.SAMPLE_SECONDS``: its uniqueness keeps at most one
    sample per period however many workers publish, and ``scheduling.samples`` prunes the
    history to its last day."""

    slot = models.BigIntegerField(primary_key=True)
    time = models.DateTimeField()
    queued = models.PositiveIntegerField(default=0)
    active = models.PositiveIntegerField(default=0)
    # {queue: {"active": n, "pending": n}}
    per_queue = models.JSONField(default=dict)

    class Meta:
        ordering = ["slot"]

    def __str__(self) -> str:
        return f"{self.time:%Y-%m-%d %H:%M:%S}: {self.queued} queued, {self.active} active"
