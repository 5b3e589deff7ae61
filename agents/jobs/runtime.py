"""The job runtime of a worker process: which one, and built how.

``build_job_runtime(on_event=...)`` builds ``CeleryJobRuntime`` when ``SAGE_JOB_RUNTIME`` is
``celery`` (its default when ``REDIS_URL`` is set; ``sageproject.config`` decides and
validates) and ``InMemoryJobRuntime`` otherwise. The code kinds (``python_script``) are
accepted only while ``SAGE_CODE_TOOLS`` is on. The worker builds one per process and closes
it after its runs.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings

from agents.code_tools import code_tools_enabled
from agents.jobs.base import JobEventCallback
from agents.jobs.builtins import CODE_KINDS, code_runners
from agents.jobs.memory import InMemoryJobRuntime


def build_job_runtime(*, on_event: JobEventCallback | None = None, **limits: Any) -> Any:
    """The job runtime for this process: ``CeleryJobRuntime`` or ``InMemoryJobRuntime``.

    ``limits`` go to the runtime's constructor (``max_concurrent_jobs=``...). The caller
    owns the result and must ``await runtime.close()``.
    """
    if settings.SAGE["SAGE_JOB_RUNTIME"] == "celery":
        return _celery_runtime(on_event, limits)
    runtime = InMemoryJobRuntime(on_event=on_event, **limits)
    if code_tools_enabled():
        for kind, runner in code_runners().items():
            runtime.register_runner(kind, runner)
    return runtime


def _celery_runtime(on_event: JobEventCallback | None, limits: dict[str, Any]) -> Any:
    from agents.jobs import tasks
    from agents.jobs.celery_runtime import CeleryJobRuntime

    kinds = set(tasks.registered_kinds())
    # The workers decide what really runs (their own SAGE_CODE_TOOLS); this side only
    # decides what it accepts.
    if code_tools_enabled():
        kinds.update(CODE_KINDS)
    else:
        kinds.difference_update(CODE_KINDS)
    sage = settings.SAGE
    return CeleryJobRuntime(
        # Job state lives where the workers keep it: their Redis, else the broker's.
        redis_url=sage["SAGE_JOBS_REDIS_URL"] or sage["REDIS_URL"],
        kinds=kinds,
        on_event=on_event,
        **limits,
    )
