"""Operator cancels and their upkeep loop (``agents.jobs.reconcile``), over the in-memory
runtime; a shared (Celery) runtime's reconciliation is in ``test_jobs_reconcile_celery``."""

from __future__ import annotations

import asyncio

import pytest
from asgiref.sync import sync_to_async

from agents.jobs import InMemoryJobRuntime, JobState
from agents.jobs.reconcile import apply_cancel_requests, poll_cancel_requests
from agents.jobs.records import JobEventRecorder
from scheduling.models import Run
from scheduling.store import close_default_coordinator
from tests.agents import conftest_jobs
from tests.agents.conftest_jobs import event_types, labelled, record_of, request_cancel

run_of = conftest_jobs.run_of
recorded = conftest_jobs.recorded

pytestmark = pytest.mark.django_db(transaction=True)


async def sleeping(run_of, user, runtime: InMemoryJobRuntime) -> tuple[Run, str]:
    """A new run of ``user`` and the id of its job that sleeps until cancelled."""
    run = await sync_to_async(run_of)(user)
    handle = await runtime.submit(labelled(run, "sleep", {"seconds": 3600}))
    return run, handle.job_id


@pytest.mark.storage
async def test_it_applies_an_operator_cancel(alice, run_of, recorded):
    run, job_id = await sleeping(run_of, alice, recorded)
    await request_cancel(job_id)

    assert await apply_cancel_requests(recorded) == 1

    assert (await recorded.inspect(job_id)).state is JobState.KILLED
    assert (await record_of(job_id)).state == "killed"
    assert (await event_types(run.session_id))[-1] == "job.killed"


async def test_it_applies_each_cancel_once(alice, run_of, recorded):
    _, job_id = await sleeping(run_of, alice, recorded)
    await request_cancel(job_id)
    await apply_cancel_requests(recorded)

    assert await apply_cancel_requests(recorded) == 0


async def test_it_leaves_jobs_without_a_cancel_request_running(alice, run_of, recorded):
    _, job_id = await sleeping(run_of, alice, recorded)

    assert await apply_cancel_requests(recorded) == 0
    assert (await recorded.inspect(job_id)).state in (JobState.CREATED, JobState.RUNNING)


async def test_it_leaves_a_job_of_another_in_memory_runtime_alone(alice, run_of, recorded):
    _, job_id = await sleeping(run_of, alice, recorded)
    await request_cancel(job_id)
    other = InMemoryJobRuntime()
    try:
        # Another worker process's runtime does not know the job: not its job to kill.
        assert await apply_cancel_requests(other) == 0
    finally:
        await other.close()

    assert (await record_of(job_id)).state in ("created", "running")


async def test_it_polls_cancel_requests_until_stopped(alice, run_of, recorded):
    _, job_id = await sleeping(run_of, alice, recorded)
    await request_cancel(job_id)
    stop = asyncio.Event()
    poller = asyncio.create_task(poll_cancel_requests(recorded, stop, interval_seconds=0.05))

    snapshot = await asyncio.wait_for(recorded.wait(job_id), timeout=20)
    stop.set()
    await asyncio.wait_for(poller, timeout=20)

    assert snapshot.state is JobState.KILLED


@pytest.mark.storage
async def test_it_records_an_operator_cancel_without_an_attached_recorder(alice, run_of):
    runtime = InMemoryJobRuntime()
    try:
        run, job_id = await sleeping(run_of, alice, runtime)
        await JobEventRecorder()(await runtime.inspect(job_id), "job.created", {})
        await request_cancel(job_id)

        assert await apply_cancel_requests(runtime) == 1
    finally:
        await runtime.close()
        await close_default_coordinator()

    assert await event_types(run.session_id) == ["job.created", "job.killed"]
    assert (await record_of(job_id)).state == "killed"
