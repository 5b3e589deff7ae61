"""Django glue of the job runtimes: runtime selection, the event recorder, operator cancels."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from asgiref.sync import sync_to_async
from django.core.exceptions import ImproperlyConfigured

from agents.jobs import InMemoryJobRuntime, JobCursor, JobSpec, JobState
from agents.jobs.glue import (
    JobEventRecorder,
    apply_cancel_requests,
    build_job_runtime,
    poll_cancel_requests,
    selected_runtime_kind,
)
from agents.models import JobRecord
from sageproject.errors import SageError
from scheduling.models import Event, Run
from scheduling.store import close_default_coordinator

# --- runtime selection -------------------------------------------------------------------


@pytest.fixture
def without_redis(settings):
    settings.SAGE = {**settings.SAGE, "REDIS_URL": None, "SAGE_CODE_TOOLS": False}
    return settings


@pytest.fixture
def with_redis(settings):
    settings.SAGE = {
        **settings.SAGE,
        "REDIS_URL": "redis://127.0.0.1:6379/13",
        "SAGE_CODE_TOOLS": False,
    }
    return settings


def test_it_picks_the_in_memory_runtime_without_redis(without_redis):
    assert selected_runtime_kind({}) == "memory"


def test_it_picks_celery_when_redis_is_configured(with_redis):
    assert selected_runtime_kind({}) == "celery"


def test_it_lets_the_environment_force_the_in_memory_runtime(with_redis):
    assert selected_runtime_kind({"SAGE_JOB_RUNTIME": "memory"}) == "memory"


def test_it_refuses_celery_without_redis(without_redis):
    with pytest.raises(ImproperlyConfigured, match="REDIS_URL"):
        selected_runtime_kind({"SAGE_JOB_RUNTIME": "celery"})


def test_it_refuses_an_unknown_runtime_name(with_redis):
    with pytest.raises(ImproperlyConfigured, match="memory, celery"):
        selected_runtime_kind({"SAGE_JOB_RUNTIME": "kubernetes"})


async def test_it_builds_an_in_memory_runtime_with_the_given_limits(without_redis):
    runtime = build_job_runtime(environ={}, max_admitted_jobs=5)
    try:
        assert isinstance(runtime, InMemoryJobRuntime)
        assert runtime.capabilities.max_admitted_jobs == 5
    finally:
        await runtime.close()


async def test_it_builds_a_celery_runtime_on_the_configured_redis(with_redis):
    from agents.jobs.celery_runtime import CeleryJobRuntime

    runtime = build_job_runtime(environ={})
    try:
        assert isinstance(runtime, CeleryJobRuntime)
        assert runtime.capabilities.durable is True
        assert "python_script" not in runtime._kinds
    finally:
        await runtime.close()


async def test_it_accepts_python_script_on_celery_only_with_code_tools(with_redis):
    with_redis.SAGE = {**with_redis.SAGE, "SAGE_CODE_TOOLS": True}
    runtime = build_job_runtime(environ={})
    try:
        assert "python_script" in runtime._kinds
    finally:
        await runtime.close()


async def test_it_refuses_python_script_without_code_tools(without_redis, monkeypatch):
    # Even when the raw environment variable says yes, the settings decide.
    monkeypatch.setenv("SAGE_CODE_TOOLS", "1")
    runtime = build_job_runtime(environ={})
    try:
        with pytest.raises(SageError) as caught:
            await runtime.submit(JobSpec(owner_run_id="r", kind="python_script"))
        assert caught.value.code == "job.kind_unsupported"
    finally:
        await runtime.close()


async def test_it_runs_python_script_with_code_tools(without_redis):
    without_redis.SAGE = {**without_redis.SAGE, "SAGE_CODE_TOOLS": True}
    runtime = build_job_runtime(environ={})
    try:
        handle = await runtime.submit(
            JobSpec(owner_run_id="r", kind="python_script", payload={"script": "print(6 * 7)"})
        )
        snapshot = await runtime.wait(handle.job_id)
        chunks = await runtime.read_output(JobCursor(job_id=handle.job_id))
        assert snapshot.state is JobState.COMPLETED
        assert b"".join(c.data for c in chunks).strip() == b"42"
    finally:
        await runtime.close()


# --- the recorder ------------------------------------------------------------------------


@pytest.fixture
def run_of(make_session):
    def make(user) -> Run:
        session = make_session(user)
        return Run.objects.create(session=session, owner=user, input="go")

    return make


@pytest.fixture
async def recorded() -> AsyncIterator[InMemoryJobRuntime]:
    runtime = InMemoryJobRuntime(on_event=JobEventRecorder())
    yield runtime
    await runtime.close()
    await close_default_coordinator()


def labelled(run: Run, kind: str, payload: dict[str, Any] | None = None, **kw: Any) -> JobSpec:
    return JobSpec(
        owner_run_id=str(run.pk),
        kind=kind,
        payload=payload or {},
        labels={"session_id": str(run.session_id), "owner_id": str(run.owner_id)},
        **kw,
    )


@sync_to_async
def session_events(session_id: Any) -> list[tuple[int, str, dict[str, Any], Any]]:
    rows = Event.objects.filter(session_id=session_id).order_by("seq")
    return [(e.seq, e.type, orjson.loads(e.data), e.run_id) for e in rows]


@sync_to_async
def record_of(job_id: str) -> JobRecord:
    return JobRecord.objects.get(job_id=job_id)


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


# --- operator cancels --------------------------------------------------------------------


@sync_to_async
def request_cancel(job_id: str) -> None:
    JobRecord.objects.filter(job_id=job_id).update(cancel_requested=True)


@pytest.mark.storage
@pytest.mark.django_db(transaction=True)
async def test_it_applies_an_operator_cancel(alice, run_of, recorded):
    run = await sync_to_async(run_of)(alice)
    handle = await recorded.submit(labelled(run, "sleep", {"seconds": 3600}))
    await request_cancel(handle.job_id)

    assert await apply_cancel_requests(recorded) == 1

    assert (await recorded.inspect(handle.job_id)).state is JobState.KILLED
    assert (await record_of(handle.job_id)).state == "killed"
    assert (await session_events(run.session_id))[-1][1] == "job.killed"


@pytest.mark.django_db(transaction=True)
async def test_it_applies_each_cancel_once(alice, run_of, recorded):
    run = await sync_to_async(run_of)(alice)
    handle = await recorded.submit(labelled(run, "sleep", {"seconds": 3600}))
    await request_cancel(handle.job_id)
    await apply_cancel_requests(recorded)

    assert await apply_cancel_requests(recorded) == 0


@pytest.mark.django_db(transaction=True)
async def test_it_leaves_jobs_without_a_cancel_request_running(alice, run_of, recorded):
    run = await sync_to_async(run_of)(alice)
    handle = await recorded.submit(labelled(run, "sleep", {"seconds": 3600}))

    assert await apply_cancel_requests(recorded) == 0
    assert (await recorded.inspect(handle.job_id)).state in (JobState.CREATED, JobState.RUNNING)


@pytest.mark.django_db(transaction=True)
async def test_it_leaves_a_job_of_another_in_memory_runtime_alone(alice, run_of, recorded):
    run = await sync_to_async(run_of)(alice)
    handle = await recorded.submit(labelled(run, "sleep", {"seconds": 3600}))
    await request_cancel(handle.job_id)
    other = InMemoryJobRuntime()
    try:
        # Another worker process's runtime does not know the job: not its job to kill.
        assert await apply_cancel_requests(other) == 0
    finally:
        await other.close()

    assert (await record_of(handle.job_id)).state in ("created", "running")


@pytest.mark.django_db(transaction=True)
async def test_it_polls_cancel_requests_until_stopped(alice, run_of, recorded):
    run = await sync_to_async(run_of)(alice)
    handle = await recorded.submit(labelled(run, "sleep", {"seconds": 3600}))
    await request_cancel(handle.job_id)
    stop = asyncio.Event()
    poller = asyncio.create_task(poll_cancel_requests(recorded, stop, interval_seconds=0.05))

    snapshot = await asyncio.wait_for(recorded.wait(handle.job_id), timeout=20)
    stop.set()
    await asyncio.wait_for(poller, timeout=20)

    assert snapshot.state is JobState.KILLED


@pytest.mark.storage
@pytest.mark.django_db(transaction=True)
async def test_it_announces_a_jobs_end_only_once(alice, run_of, recorded):
    run = await sync_to_async(run_of)(alice)
    handle = await recorded.submit(labelled(run, "echo", {"chunks": ["x"]}))
    snapshot = await recorded.wait(handle.job_id)

    # Another path (an operator cancel, reconciliation) reports the same end again.
    again = await JobEventRecorder().record_end(snapshot)

    assert again is False
    types = [t for _, t, _, _ in await session_events(run.session_id)]
    assert types.count("job.completed") == 1


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
async def test_it_records_an_operator_cancel_without_an_attached_recorder(alice, run_of):
    run = await sync_to_async(run_of)(alice)
    runtime = InMemoryJobRuntime()
    try:
        handle = await runtime.submit(labelled(run, "sleep", {"seconds": 3600}))
        await JobEventRecorder()(await runtime.inspect(handle.job_id), "job.created", {})
        await request_cancel(handle.job_id)

        assert await apply_cancel_requests(runtime) == 1
    finally:
        await runtime.close()
        await close_default_coordinator()

    assert [t for _, t, _, _ in await session_events(run.session_id)] == [
        "job.created",
        "job.killed",
    ]
    assert (await record_of(handle.job_id)).state == "killed"
