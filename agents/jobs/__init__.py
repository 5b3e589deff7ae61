"""Background jobs: bounded runtimes that run long work beside an agent.

``InMemoryJobRuntime`` runs jobs on the worker's event loop; ``CeleryJobRuntime`` runs the
same contract on Celery workers over Redis. One runtime per worker process, shared by every
Application; the host closes its users first, then the runtime.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agents.jobs.base import (
    ACTIVE_STATES,
    JOB_EVENT_TYPES,
    TERMINAL_STATES,
    Emit,
    JobCompletion,
    JobCursor,
    JobEventCallback,
    JobExecutionAffinity,
    JobHandle,
    JobLimits,
    JobOutputChunk,
    JobPauseBehavior,
    JobRuntimeCapabilities,
    JobSnapshot,
    JobSpec,
    JobState,
    JobStream,
    Runner,
)
from agents.jobs.memory import InMemoryJobRuntime

if TYPE_CHECKING:
    from agents.jobs.celery_runtime import CeleryJobRuntime

__all__ = [
    "ACTIVE_STATES",
    "JOB_EVENT_TYPES",
    "TERMINAL_STATES",
    "CeleryJobRuntime",
    "Emit",
    "InMemoryJobRuntime",
    "JobCompletion",
    "JobCursor",
    "JobEventCallback",
    "JobExecutionAffinity",
    "JobHandle",
    "JobLimits",
    "JobOutputChunk",
    "JobPauseBehavior",
    "JobRuntimeCapabilities",
    "JobSnapshot",
    "JobSpec",
    "JobState",
    "JobStream",
    "Runner",
]


def __getattr__(name: str) -> Any:
    # Lazy: importing agents.jobs must not import Celery (the embedded default has none).
    if name == "CeleryJobRuntime":
        from agents.jobs.celery_runtime import CeleryJobRuntime

        return CeleryJobRuntime
    raise AttributeError(name)
