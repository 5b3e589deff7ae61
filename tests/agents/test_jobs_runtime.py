"""Building the worker's job runtime (``agents.jobs.runtime``): which one, which kinds.

Which runtime the settings ask for (``SAGE_JOB_RUNTIME``, its default and its checks) is
``sageproject.config``'s: ``tests/test_config.py``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from agents.jobs import InMemoryJobRuntime, JobCursor, JobSpec, JobState
from agents.jobs.runtime import build_job_runtime
from sageproject.errors import SageError
from tests.agents.conftest_jobs import script

REDIS = "redis://127.0.0.1:6379/13"


def configure(settings: Any, **values: Any) -> None:
    settings.SAGE = {**settings.SAGE, "SAGE_CODE_TOOLS": False, **values}


@pytest.fixture
def without_redis(settings: Any) -> Any:
    configure(settings, REDIS_URL=None, SAGE_JOB_RUNTIME="memory")
    return settings


@pytest.fixture
def with_redis(settings: Any) -> Any:
    configure(settings, REDIS_URL=REDIS, SAGE_JOB_RUNTIME="celery", SAGE_JOBS_REDIS_URL=None)
    return settings


@pytest.fixture
async def build() -> AsyncIterator[Callable[..., Any]]:
    """``build(**limits)``: ``build_job_runtime``; every runtime built is closed after."""
    built: list[Any] = []

    def make(**limits: Any) -> Any:
        built.append(build_job_runtime(**limits))
        return built[-1]

    yield make
    for runtime in built:
        await runtime.close()


async def test_it_builds_an_in_memory_runtime_with_the_given_limits(without_redis, build):
    runtime = build(max_admitted_jobs=5)

    assert isinstance(runtime, InMemoryJobRuntime)
    assert runtime.capabilities.max_admitted_jobs == 5


async def test_it_builds_the_in_memory_runtime_the_settings_ask_for_even_with_redis(
    with_redis, build
):
    configure(with_redis, SAGE_JOB_RUNTIME="memory")

    assert isinstance(build(), InMemoryJobRuntime)


async def test_it_builds_a_celery_runtime_on_the_configured_redis(with_redis, build):
    from agents.jobs.celery_runtime import CeleryJobRuntime

    runtime = build()

    assert isinstance(runtime, CeleryJobRuntime)
    assert runtime.capabilities.durable is True
    assert "python_script" not in runtime._kinds
    assert runtime._client.connection_pool.connection_kwargs["db"] == 13


async def test_it_keeps_celery_job_state_in_the_jobs_redis_when_one_is_set(with_redis, build):
    configure(with_redis, SAGE_JOBS_REDIS_URL="redis://127.0.0.1:6379/12")

    runtime = build()

    assert runtime._client.connection_pool.connection_kwargs["db"] == 12


async def test_it_accepts_python_script_on_celery_only_with_code_tools(with_redis, build):
    configure(with_redis, SAGE_CODE_TOOLS=True)

    assert "python_script" in build()._kinds


async def test_it_refuses_python_script_without_code_tools(without_redis, monkeypatch, build):
    # Even when the raw environment variable says yes, the settings decide.
    monkeypatch.setenv("SAGE_CODE_TOOLS", "1")
    runtime = build()

    with pytest.raises(SageError) as caught:
        await runtime.submit(JobSpec(owner_run_id="r", kind="python_script"))

    assert caught.value.code == "job.kind_unsupported"


async def test_it_runs_python_script_with_code_tools(without_redis, build):
    configure(without_redis, SAGE_CODE_TOOLS=True)
    runtime = build()

    handle = await runtime.submit(script("print(6 * 7)"))
    snapshot = await runtime.wait(handle.job_id)
    chunks = await runtime.read_output(JobCursor(job_id=handle.job_id))

    assert snapshot.state is JobState.COMPLETED
    assert b"".join(c.data for c in chunks).strip() == b"42"
