"""Job records and reconciliation over ``CeleryJobRuntime``: real Redis, a real Celery
worker, real database.

Skipped without Redis, except under ``CI=true`` where that is a failure.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from asgiref.sync import sync_to_async

from agents.jobs import CeleryJobRuntime, JobState
from agents.jobs.reconcile import apply_cancel_requests, reconcile_job_records
from agents.jobs.records import JobEventRecorder
from agents.models import JobRecord
from scheduling.store import close_default_coordinator
from tests.agents import conftest_jobs
from tests.agents.conftest_jobs import (
    celery_app,
    celery_runtime,
    delete_keys,
    event_types,
    labelled,
    record_of,
    request_cancel,
    session_events,
)

celery_worker = conftest_jobs.celery_worker
run_of = conftest_jobs.run_of

pytestmark = [
    pytest.mark.redis,
    pytest.mark.celery,
    pytest.mark.storage,
    pytest.mark.django_db(transaction=True),
]


@pytest.fixture
async def make_celery(celery_worker) -> AsyncIterator[Callable[..., CeleryJobRuntime]]:
    """Build runtimes on the test worker's queue and a private key prefix; all closed after."""
    prefix = f"sagetest:reconcile:{uuid.uuid4().hex[:10]}"
    app = celery_app()
    built: list[CeleryJobRuntime] = []

    def make(**kwargs: Any) -> CeleryJobRuntime:
        built.append(celery_runtime(prefix, celery_app=app, queue=celery_worker.queue, **kwargs))
        return built[-1]

    yield make
    for runtime in built:
        await runtime.close()
    delete_keys(f"{prefix}:*")
    await close_default_coordinator()


async def test_it_records_a_celery_jobs_lifecycle(alice, run_of, make_celery):
    run = await sync_to_async(run_of)(alice)
    runtime = make_celery(on_event=JobEventRecorder())

    handle = await runtime.submit(labelled(run, "echo", {"chunks": ["ab", "c"]}))
    await runtime.wait(handle.job_id)

    assert await event_types(run.session_id) == ["job.created", "job.started", "job.completed"]
    record = await record_of(handle.job_id)
    assert (record.state, record.output_bytes, record.output_chunks) == ("completed", 3, 2)


async def test_it_reconciles_a_job_nobody_watched_to_its_end(alice, run_of, make_celery):
    run = await sync_to_async(run_of)(alice)
    recorder = JobEventRecorder()
    # The submitting process records job.created, then "dies": no watcher sees the end.
    runtime = make_celery()
    handle = await runtime.submit(labelled(run, "echo", {"chunks": ["done"]}))
    await recorder(await runtime.inspect(handle.job_id), "job.created", {})
    await runtime.wait(handle.job_id)

    ended = await reconcile_job_records(runtime)

    assert ended == 1
    assert (await record_of(handle.job_id)).state == "completed"
    assert (await event_types(run.session_id))[-1] == "job.completed"
    # A second pass finds nothing left to do and announces nothing twice.
    assert await reconcile_job_records(runtime) == 0
    assert (await event_types(run.session_id)).count("job.completed") == 1


async def test_it_marks_a_record_the_shared_runtime_forgot_as_killed(alice, run_of, make_celery):
    run = await sync_to_async(run_of)(alice)
    await sync_to_async(JobRecord.objects.create)(
        job_id="gone-" + uuid.uuid4().hex, run=run, owner=alice, kind="echo", state="running"
    )

    assert await reconcile_job_records(make_celery()) == 1

    record = await sync_to_async(JobRecord.objects.get)(run=run)
    assert record.state == "killed"


async def test_it_applies_an_operator_cancel_on_a_celery_worker(alice, run_of, make_celery):
    run = await sync_to_async(run_of)(alice)
    runtime = make_celery(on_event=JobEventRecorder())
    handle = await runtime.submit(labelled(run, "sleep", {"seconds": 3600}))
    await request_cancel(handle.job_id)

    assert await apply_cancel_requests(runtime) == 1

    assert (await runtime.inspect(handle.job_id)).state is JobState.KILLED
    assert (await record_of(handle.job_id)).state == "killed"
    killed = [p for _, t, p, _ in await session_events(run.session_id) if t == "job.killed"]
    assert len(killed) == 1
    assert killed[0]["error"]["code"] == "job.killed"
