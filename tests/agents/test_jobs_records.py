"""Job snapshots mirrored into the database (``agents.jobs.records``): ``job.*`` session
events and ``JobRecord`` rows, over the in-memory runtime."""

from __future__ import annotations

import asyncio

import orjson
import pytest
from asgiref.sync import sync_to_async

from agents.jobs import JobSpec
from agents.jobs.records import JobEventRecorder
from agents.models import JobRecord
from tests.agents import conftest_jobs
from tests.agents.conftest_jobs import event_types, labelled, record_of, session_events

run_of = conftest_jobs.run_of
recorded = conftest_jobs.recorded


@pytest.mark.storage
@pytest.mark.django_db(transaction=True)
async def test_it_records_a_jobs_lifecycle_as_session_events(alice, run_of, recorded):
    run = await sync_to_async(run_of)(alice)

    handle = await recorded.submit(
        labelled(run, "echo", {"chunks": ["secret-input-stays-out", "b"]})
    )
    await recorded.wait(handle.job_id)

    events = await session_events(run.session_id)
    assert [t for _, t, _, _ in events] == ["job.created", "job.started", "job.completed"]
    assert all(run_id == run.pk for _, _, _, run_id in events)
    final = events[-1][2]
    assert final == {
        "job_id": handle.job_id,
        "kind": "echo",
        "state": "completed",
        "output_bytes": 23,
        "output_chunks": 2,
        "output_truncated": False,
        "exit_code": 0,
    }


@pytest.mark.storage
@pytest.mark.django_db(transaction=True)
async def test_it_never_puts_the_job_input_in_events(alice, run_of, recorded):
    run = await sync_to_async(run_of)(alice)

    handle = await recorded.submit(labelled(run, "echo", {"chunks": ["x"], "token": "hunter2"}))
    await recorded.wait(handle.job_id)

    for _, _, payload, _ in await session_events(run.session_id):
        assert "hunter2" not in orjson.dumps(payload).decode()


@pytest.mark.storage
@pytest.mark.django_db(transaction=True)
async def test_it_keeps_seqs_contiguous_across_concurrent_jobs(alice, run_of, recorded):
    run = await sync_to_async(run_of)(alice)

    handles = await asyncio.gather(
        *(recorded.submit(labelled(run, "echo", {"chunks": [str(i)]})) for i in range(6))
    )
    await asyncio.gather(*(recorded.wait(h.job_id) for h in handles))

    events = await session_events(run.session_id)
    seqs = [seq for seq, _, _, _ in events]
    assert seqs == list(range(1, 19))
    for handle in handles:
        mine = [t for _, t, p, _ in events if p["job_id"] == handle.job_id]
        assert mine == ["job.created", "job.started", "job.completed"]


@pytest.mark.storage
@pytest.mark.django_db(transaction=True)
async def test_it_mirrors_the_job_in_its_record(alice, run_of, recorded):
    run = await sync_to_async(run_of)(alice)

    handle = await recorded.submit(
        labelled(run, "echo", {"chunks": ["0123456789"] * 3}, max_output_bytes=12)
    )
    await recorded.wait(handle.job_id)

    record = await record_of(handle.job_id)
    assert (record.run_id, record.owner_id, record.kind) == (run.pk, alice.pk, "echo")
    assert record.state == "completed"
    assert (record.output_bytes, record.output_chunks, record.output_truncated) == (12, 2, True)
    assert record.error is None


@pytest.mark.storage
@pytest.mark.django_db(transaction=True)
async def test_it_records_a_failed_job_with_its_error(alice, run_of, recorded):
    run = await sync_to_async(run_of)(alice)

    handle = await recorded.submit(labelled(run, "echo", {"fail": "disk full"}))
    await recorded.wait(handle.job_id)

    events = await session_events(run.session_id)
    assert events[-1][1] == "job.failed"
    assert events[-1][2]["error"]["code"] == "job.runner_failed"
    assert (await record_of(handle.job_id)).error["code"] == "job.runner_failed"


@pytest.mark.django_db(transaction=True)
async def test_it_ignores_jobs_without_labels(alice, run_of, recorded):
    run = await sync_to_async(run_of)(alice)

    handle = await recorded.submit(JobSpec(owner_run_id=str(run.pk), kind="echo"))
    await recorded.wait(handle.job_id)

    assert await session_events(run.session_id) == []
    assert not await sync_to_async(JobRecord.objects.filter(job_id=handle.job_id).exists)()


@pytest.mark.storage
@pytest.mark.django_db(transaction=True)
async def test_it_announces_a_jobs_end_only_once(alice, run_of, recorded):
    run = await sync_to_async(run_of)(alice)
    handle = await recorded.submit(labelled(run, "echo", {"chunks": ["x"]}))
    snapshot = await recorded.wait(handle.job_id)

    # Another path (an operator cancel, reconciliation) reports the same end again.
    again = await JobEventRecorder().record_end(snapshot)

    assert again is False
    assert (await event_types(run.session_id)).count("job.completed") == 1


@pytest.mark.django_db(transaction=True)
async def test_it_records_a_late_started_event_as_running(alice, run_of, recorded):
    run = await sync_to_async(run_of)(alice)
    handle = await recorded.submit(labelled(run, "echo", {"chunks": ["x"]}))
    finished = await recorded.wait(handle.job_id)
    recorder = JobEventRecorder()
    await sync_to_async(JobRecord.objects.filter(job_id=handle.job_id).update)(state="created")

    # A polling runtime may see the job only after it ended, and still report job.started.
    await recorder(finished, "job.started", {})
    await recorder(finished, "job.completed", {})

    events = await session_events(run.session_id)
    assert events[-2][1:3] == ("job.started", {**events[-2][2], "state": "running"})
    assert "exit_code" not in events[-2][2]
    assert events[-1][1] == "job.completed"
    assert (await record_of(handle.job_id)).state == "completed"


@pytest.mark.storage
@pytest.mark.django_db(transaction=True)
async def test_a_jobs_end_refused_by_its_runs_lease_is_recorded_once_the_run_is_free(alice, run_of):
    from agents.jobs.memory import InMemoryJobRuntime
    from scheduling.models import Run, RunStatus

    run = await sync_to_async(run_of)(alice)
    runtime = InMemoryJobRuntime()  # the job's own events are written by hand below
    try:
        handle = await runtime.submit(labelled(run, "echo", {"chunks": ["x"]}))
        finished = await runtime.wait(handle.job_id)
    finally:
        await runtime.close()
    recorder = JobEventRecorder()
    assert await recorder(finished, "job.created", {}) is None
    # A dead worker's lease still holds the run: this process may not write its events.
    leased = Run.objects.filter(pk=run.pk)
    await sync_to_async(leased.update)(status=RunStatus.RUNNING, lease_owner="gone", lease_token=7)

    assert await recorder.record(finished, "job.completed", {}) is False
    # The end is not lost: the row is unfinished again, for reconciliation to take up.
    assert (await record_of(handle.job_id)).state == "running"
    assert "job.completed" not in await event_types(run.session_id)

    # The lease was reaped; the next reconciliation records the end, once.
    await sync_to_async(leased.update)(status=RunStatus.QUEUED, lease_owner="", lease_token=None)
    assert await recorder.record_end(finished) is True
    assert await recorder.record_end(finished) is False
    assert (await record_of(handle.job_id)).state == "completed"
    assert await event_types(run.session_id) == ["job.created", "job.completed"]
