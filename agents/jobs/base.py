"""Job contracts shared by every job runtime.

A *job* is long-running work an agent starts and keeps talking past: a data export, a long
Python computation. A runtime admits it (bounded), runs it through a *runner* chosen by its
``kind``, buffers its output within caps, and keeps its terminal state for a while so a
client that reconnects can still read it.

Runner contract::

    async def runner(spec: JobSpec, emit: Emit, cancel_event: asyncio.Event) -> JobCompletion | None

``await emit(stream, data)`` appends output (``stream`` is ``"stdout"``, ``"stderr"`` or
``"progress"``; ``data`` is ``bytes`` or ``str``, the latter encoded as UTF-8). Output past a
cap is dropped silently and the job is marked ``output_truncated``; the runner goes on.
``cancel_event`` is set when the job is being cancelled; the runtime also cancels the
runner's task, so cleanup belongs in ``finally``. Returning ``None`` means exit code 0. An
exception makes the job FAILED with ``job.runner_failed``.

This module imports neither Django nor Celery.
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, fields
from datetime import datetime
from enum import StrEnum
from typing import Any, ClassVar, Protocol

from sageproject.errors import (
    ConflictError,
    ErrorCategory,
    NotFoundError,
    RateLimitedError,
    SageError,
    ValidationError,
)

logger = logging.getLogger(__name__)

MiB = 1024 * 1024


class JobState(StrEnum):
    # Admitted, waiting for a runner slot.
    CREATED = "created"
    # The runner is executing.
    RUNNING = "running"
    # Cancellation requested; the runner is being stopped.
    STOPPING = "stopping"
    # The runner returned (any exit code).
    COMPLETED = "completed"
    # The runner raised (or its kind vanished before it started).
    FAILED = "failed"
    # Cancelled, by a client, a run pause or runtime close.
    KILLED = "killed"
    # Still executing, but its owning run let go of it (worker restart); ``adopt`` reattaches.
    ORPHANED = "orphaned"


TERMINAL_STATES: frozenset[JobState] = frozenset(
    {JobState.COMPLETED, JobState.FAILED, JobState.KILLED}
)
ACTIVE_STATES: frozenset[JobState] = frozenset(
    {JobState.CREATED, JobState.RUNNING, JobState.STOPPING, JobState.ORPHANED}
)


class JobPauseBehavior(StrEnum):
    # Keep running while the owning run is paused.
    CONTINUE = "continue"
    # Suspend with the run (no runtime here supports it; submit rejects it).
    SUSPEND = "suspend"
    # Keep running, detached from the run; the default.
    DETACH = "detach"
    # Cancel when the owning run pauses.
    CANCEL = "cancel"


class JobExecutionAffinity(StrEnum):
    # Run wherever jobs run (worker or Celery host), away from the agent's own process state.
    SANDBOX = "sandbox"
    # Must run in the host process that submitted it.
    HOST = "host"


class JobStream(StrEnum):
    STDOUT = "stdout"
    STDERR = "stderr"
    PROGRESS = "progress"


JOB_EVENT_TYPES = ("job.created", "job.started", "job.completed", "job.failed", "job.killed")
# The event that announces each terminal state.
TERMINAL_EVENTS: Mapping[JobState, str] = {
    JobState.COMPLETED: "job.completed",
    JobState.FAILED: "job.failed",
    JobState.KILLED: "job.killed",
}


MAX_LABELS = 16
MAX_LABEL_CHARS = 200


def _check_labels(labels: Mapping[str, str]) -> None:
    if len(labels) > MAX_LABELS:
        raise ValidationError("job.invalid_spec", f"at most {MAX_LABELS} labels")
    for key, value in labels.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise ValidationError("job.invalid_spec", "labels must map strings to strings")
        if not key or len(key) > MAX_LABEL_CHARS or len(value) > MAX_LABEL_CHARS:
            raise ValidationError(
                "job.invalid_spec", f"label keys and values are 1..{MAX_LABEL_CHARS} characters"
            )


def _plain(value: Any) -> Any:
    if isinstance(value, StrEnum):
        return str(value)
    if isinstance(value, Mapping):
        return dict(value)
    return value


@dataclass(frozen=True, slots=True, kw_only=True)
class JobSpec:
    """What to run: ``kind`` picks the runner, ``payload`` is its JSON-able input."""

    owner_run_id: str
    kind: str
    payload: Mapping[str, Any] = field(default_factory=dict)
    pause_behavior: JobPauseBehavior = JobPauseBehavior.DETACH
    execution_affinity: JobExecutionAffinity = JobExecutionAffinity.SANDBOX
    idempotency_key: str | None = None
    # Can only lower the runtime's per-job caps, never raise them.
    max_output_bytes: int | None = None
    max_output_chunks: int | None = None
    # Host bookkeeping (session id, owner id) for whoever records job events; never
    # secrets, never read by runners. Bounded: it is copied into every snapshot.
    labels: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.owner_run_id:
            raise ValidationError("job.invalid_spec", "owner_run_id is required")
        if not self.kind:
            raise ValidationError("job.invalid_spec", "kind is required")
        if self.max_output_bytes is not None and self.max_output_bytes <= 0:
            raise ValidationError("job.invalid_spec", "max_output_bytes must be > 0")
        if self.max_output_chunks is not None and self.max_output_chunks <= 0:
            raise ValidationError("job.invalid_spec", "max_output_chunks must be > 0")
        _check_labels(self.labels)
        object.__setattr__(self, "labels", dict(self.labels))
        # Coerce plain strings so specs decoded from JSON compare equal to typed ones.
        object.__setattr__(self, "pause_behavior", JobPauseBehavior(self.pause_behavior))
        object.__setattr__(
            self, "execution_affinity", JobExecutionAffinity(self.execution_affinity)
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-able: enums as their strings, mappings as dicts; ``from_dict`` reverses it."""
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> JobSpec:
        return cls(**data)


@dataclass(frozen=True, slots=True, kw_only=True)
class JobCursor:
    """A position in a job's output: ``offset`` counts accepted bytes from the start."""

    job_id: str
    offset: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class JobHandle:
    """What ``submit`` and ``adopt`` answer: the job's identity and its state then."""

    job_id: str
    owner_run_id: str
    kind: str
    state: JobState
    pause_behavior: JobPauseBehavior
    execution_affinity: JobExecutionAffinity
    output_cursor: JobCursor
    # Where the job really runs: a Celery task id, or None in process.
    external_handle_ref: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class JobSnapshot(JobHandle):
    """A job's full observable state: its handle's fields and more;
    ``output_cursor.offset`` is the accepted byte total."""

    created_at: datetime
    updated_at: datetime
    exit_code: int | None = None
    output_artifacts: tuple[str, ...] = ()
    usage: Mapping[str, Any] = field(default_factory=dict)
    # ``{"code", "category", "message", "retryable", "resumable"}`` when FAILED/KILLED.
    error: Mapping[str, Any] | None = None
    output_truncated: bool = False
    output_bytes: int = 0
    output_chunks: int = 0
    idempotency_key: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    def handle(self) -> JobHandle:
        """The handle alone (a plain ``JobHandle``, as ``submit`` answers)."""
        return JobHandle(**{f.name: getattr(self, f.name) for f in fields(JobHandle)})


@dataclass(frozen=True, slots=True, kw_only=True)
class JobOutputChunk:
    job_id: str
    stream: JobStream
    offset: int
    next_offset: int
    data: bytes
    occurred_at: datetime


@dataclass(frozen=True, slots=True, kw_only=True)
class JobCompletion:
    exit_code: int = 0
    usage: Mapping[str, Any] = field(default_factory=dict)
    output_artifacts: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class JobRuntimeCapabilities:
    durable: bool
    reconnect: bool
    adoption: bool
    suspend: bool
    output_cursor: bool
    terminal_purge: bool
    automatic_retention: bool
    # False when runners live in another process (Celery): register them there.
    local_runners: bool
    max_concurrent_jobs: int
    max_admitted_jobs: int
    max_job_output_bytes: int
    max_job_output_chunks: int
    max_buffered_output_bytes: int
    max_buffered_output_chunks: int
    terminal_ttl_seconds: float
    max_retained_terminal_jobs: int
    output_reconnect_window_seconds: float

    @classmethod
    def with_limits(cls, limits: JobLimits, **flags: bool) -> JobRuntimeCapabilities:
        """The runtime's ``flags`` plus every limit copied from ``limits``."""
        return cls(**flags, **{f.name: getattr(limits, f.name) for f in fields(JobLimits)})


class Emit(Protocol):
    def __call__(self, stream: str, data: bytes | str, /) -> Awaitable[None]: ...


Runner = Callable[[JobSpec, Emit, asyncio.Event], Awaitable[JobCompletion | None]]
# on_event(snapshot, event_type, data): lets the caller persist job.* session events.
JobEventCallback = Callable[[JobSnapshot, str, Mapping[str, Any]], Awaitable[None]]


@dataclass(frozen=True, slots=True, kw_only=True)
class JobLimits:
    """The job limits (concurrent, admitted, output size, time), validated once and
    shared by both runtimes."""

    max_concurrent_jobs: int = 32
    max_admitted_jobs: int = 1024
    max_job_output_bytes: int = 8 * MiB
    max_job_output_chunks: int = 8192
    max_buffered_output_bytes: int = 256 * MiB
    max_buffered_output_chunks: int = 65536
    terminal_ttl_seconds: float = 86400
    max_retained_terminal_jobs: int = 4096
    output_reconnect_window_seconds: float = 300

    def __post_init__(self) -> None:
        if self.max_concurrent_jobs < 1:
            raise ValueError("max_concurrent_jobs must be >= 1")
        if self.max_admitted_jobs < 1:
            raise ValueError("max_admitted_jobs must be >= 1")
        if self.terminal_ttl_seconds < 1:
            raise ValueError("terminal_ttl_seconds must be >= 1")
        for name in (
            "max_job_output_bytes",
            "max_job_output_chunks",
            "max_buffered_output_bytes",
            "max_buffered_output_chunks",
            "max_retained_terminal_jobs",
            "output_reconnect_window_seconds",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")

    @property
    def retention_seconds(self) -> float:
        # A terminal row lives at least as long as a client may take to reconnect.
        return max(self.terminal_ttl_seconds, self.output_reconnect_window_seconds)

    def job_caps(self, spec: JobSpec) -> tuple[int, int]:
        """The effective per-job (bytes, chunks) caps: a spec can only lower them."""
        max_bytes = self.max_job_output_bytes
        if spec.max_output_bytes is not None:
            max_bytes = min(max_bytes, spec.max_output_bytes)
        max_chunks = self.max_job_output_chunks
        if spec.max_output_chunks is not None:
            max_chunks = min(max_chunks, spec.max_output_chunks)
        return max_bytes, max_chunks


def to_bytes(data: bytes | str) -> bytes:
    if isinstance(data, str):
        return data.encode("utf-8")
    return bytes(data)


# --- errors (stable codes, listed in docs/OPERATIONS.md "Errors") --------------------


def runtime_closed() -> SageError:
    return SageError(
        "job.runtime_closed", "the job runtime is closed", category=ErrorCategory.CANCELLED
    )


def queue_full(limit: int) -> SageError:
    return RateLimitedError(
        "job.queue_full",
        f"too many admitted jobs (limit {limit}); try again later",
        details={"max_admitted_jobs": limit},
    )


def capacity_exhausted(rows: int) -> SageError:
    # Back-pressure against reconnect-protected terminal rows: purging frees it.
    return RateLimitedError(
        "job.capacity_exhausted",
        f"job capacity exhausted ({rows} rows retained); purge terminal jobs",
        details={"rows": rows},
    )


def kind_unsupported(kind: str) -> SageError:
    return ValidationError("job.kind_unsupported", f"no runner for job kind {kind!r}")


def pause_behavior_unsupported(behavior: str) -> SageError:
    return ValidationError(
        "job.pause_behavior_unsupported", f"pause behaviour {behavior!r} is not supported"
    )


def job_not_found(job_id: str) -> SageError:
    return NotFoundError("job.not_found", f"job {job_id} not found")


def invalid_transition(job_id: str, state: str, action: str) -> SageError:
    return ConflictError(
        "job.invalid_transition", f"job {job_id} cannot {action} from state {state}"
    )


def owner_conflict(job_id: str) -> SageError:
    return SageError(
        "job.owner_conflict",
        f"job {job_id} belongs to another run",
        category=ErrorCategory.AUTHORIZATION,
    )


def invalid_argument(message: str) -> SageError:
    return ValidationError("job.invalid_argument", message)


def _job_error(
    code: str, message: str, category: ErrorCategory, *, retryable: bool = False
) -> dict[str, Any]:
    # A job's ``error`` is always resumable: the job failed, the run that started it is safe.
    return SageError(code, message, category=category, retryable=retryable, resumable=True).record()


def runner_failed_error(exc: BaseException) -> dict[str, Any]:
    """The ``error`` of a job whose runner raised."""
    # Truncated: a runner message is not a place for megabytes of payload echo.
    message = f"job runner failed: {type(exc).__name__}: {str(exc)[:500]}"
    return _job_error("job.runner_failed", message, ErrorCategory.UPSTREAM)


def killed_error(reason: str) -> dict[str, Any]:
    return _job_error("job.killed", f"job killed: {reason}", ErrorCategory.CANCELLED)


def worker_lost_error() -> dict[str, Any]:
    """The ``error`` of a job whose Celery worker stopped answering (its host died or was
    cut off for ``SAGE_JOB_LOST_SECONDS``): it is failed, not run again (a job may have
    side effects); the agent may start it again."""
    return _job_error(
        "job.worker_lost",
        "the job's worker stopped answering; the job was failed",
        ErrorCategory.RESOURCE_LOST,
        retryable=True,
    )


def kind_unsupported_error(kind: str) -> dict[str, Any]:
    message = f"no runner for job kind {kind!r} on this worker"
    return _job_error("job.kind_unsupported", message, ErrorCategory.VALIDATION)


# --- what both runtimes share ---------------------------------------------------------


def end_event(snapshot: JobSnapshot) -> tuple[str, dict[str, Any]]:
    """The terminal event of an ended job's ``snapshot`` and its data for ``on_event``."""
    return TERMINAL_EVENTS[snapshot.state], {
        "exit_code": snapshot.exit_code,
        "error": snapshot.error,
        "output_bytes": snapshot.output_bytes,
        "output_truncated": snapshot.output_truncated,
    }


class JobRuntimeBase(ABC):
    """The part of a job runtime both runtimes share: limits, capabilities, closing, checks.

    ``limits`` are the keyword fields of ``JobLimits`` (invalid values raise ``ValueError``);
    ``FLAGS`` are a runtime's capability flags that differ between the runtimes.
    """

    FLAGS: ClassVar[Mapping[str, bool]]

    def __init__(self, *, on_event: JobEventCallback | None, limits: Mapping[str, Any]) -> None:
        self.limits = JobLimits(**limits)
        self._on_event = on_event
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def capabilities(self) -> JobRuntimeCapabilities:
        return JobRuntimeCapabilities.with_limits(
            self.limits,
            adoption=True,
            suspend=False,
            output_cursor=True,
            terminal_purge=True,
            automatic_retention=True,
            **self.FLAGS,
        )

    def _check_open(self) -> None:
        """``job.runtime_closed`` once the runtime is closed."""
        if self._closed:
            raise runtime_closed()

    @staticmethod
    def _check_pause_behavior(spec: JobSpec) -> None:
        """``job.pause_behavior_unsupported`` for SUSPEND: no runtime here suspends a job."""
        if spec.pause_behavior is JobPauseBehavior.SUSPEND:
            raise pause_behavior_unsupported(str(spec.pause_behavior))

    @staticmethod
    def _check_read(cursor: JobCursor, max_bytes: int) -> None:
        """``job.invalid_argument`` for ``max_bytes < 1`` or a negative cursor offset."""
        if max_bytes < 1:
            raise invalid_argument("max_bytes must be >= 1")
        if cursor.offset < 0:
            raise invalid_argument("cursor offset must be >= 0")

    @abstractmethod
    async def cancel(
        self, job_id: str, *, force: bool = False, reason: str = "cancelled"
    ) -> JobSnapshot: ...

    @abstractmethod
    async def list_jobs(self, run_id: str) -> list[JobSnapshot]: ...

    async def handle_run_pause(self, run_id: str) -> tuple[JobSnapshot, ...]:
        """Apply each job's pause behaviour: ``cancel`` jobs still active are killed
        (reason "run paused"), ``continue`` and ``detach`` jobs go on. Returns the
        snapshots of all the run's jobs afterwards."""
        jobs = await self.list_jobs(run_id)
        await asyncio.gather(
            *(
                self.cancel(job.job_id, reason="run paused")
                for job in jobs
                if job.pause_behavior is JobPauseBehavior.CANCEL and job.state in ACTIVE_STATES
            )
        )
        return tuple(await self.list_jobs(run_id))

    async def _cancel_all(self, job_ids: list[str], *, reason: str) -> None:
        """Cancel every job of ``job_ids`` at once; a failure is logged, never raised."""
        results = await asyncio.gather(
            *(self.cancel(job_id, reason=reason) for job_id in job_ids), return_exceptions=True
        )
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, SageError):
                logger.error("job runtime close: cancel failed: %r", result)
