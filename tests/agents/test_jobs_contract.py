"""The job runtime contract, run against every runtime.

Parametrized over ``InMemoryJobRuntime`` and ``CeleryJobRuntime`` (real Redis, a real Celery
worker subprocess). Only the built-in diagnostic kinds are used (``echo``, ``sleep``) so the
same jobs run in process and on the worker.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from agents.jobs import (
    JobCursor,
    JobPauseBehavior,
    JobSnapshot,
    JobSpec,
    JobState,
)
from sageproject.errors import ErrorCategory, SageError
from tests.agents import conftest_jobs
from tests.waiting import awaited_until

# Fixtures shared with test_jobs_celery.py, bound here so pytest finds them.
celery_worker = conftest_jobs.celery_worker
make_runtime = conftest_jobs.make_runtime

STATE_TIMEOUT = 20.0


async def wait_for_state(runtime: Any, job_id: str, state: JobState) -> JobSnapshot:
    """Poll until the job reaches ``state`` (the Celery runtime has no push channel)."""
    seen: list[JobSnapshot] = []

    async def reached() -> bool:
        seen.append(await runtime.inspect(job_id))
        return seen[-1].state is state

    await awaited_until(reached, within=STATE_TIMEOUT)
    return seen[-1]


async def read_all(runtime: Any, job_id: str, *, max_bytes: int = 65536) -> bytes:
    cursor = JobCursor(job_id=job_id, offset=0)
    body = b""
    while chunks := await runtime.read_output(cursor, max_bytes=max_bytes):
        body += b"".join(c.data for c in chunks)
        cursor = JobCursor(job_id=job_id, offset=chunks[-1].next_offset)
    return body


def echo(run: str = "run-alice", **payload: Any) -> JobSpec:
    return JobSpec(owner_run_id=run, kind="echo", payload=payload)


def sleeper(run: str = "run-alice", **kwargs: Any) -> JobSpec:
    return JobSpec(owner_run_id=run, kind="sleep", payload={"chunks": ["up"]}, **kwargs)


async def test_it_runs_a_job_to_completion_with_its_output(make_runtime):
    runtime = await make_runtime()
    handle = await runtime.submit(echo(chunks=["hello ", "world"], exit_code=3))

    done = await runtime.wait(handle.job_id)

    assert done.state is JobState.COMPLETED
    assert done.exit_code == 3
    assert done.output_cursor.offset == 11
    assert await read_all(runtime, handle.job_id) == b"hello world"


async def test_it_reads_output_by_cursor_in_exact_slices(make_runtime):
    runtime = await make_runtime()
    handle = await runtime.submit(echo(chunks=["abc", "defgh"]))
    await runtime.wait(handle.job_id)

    first = await runtime.read_output(JobCursor(job_id=handle.job_id, offset=1), max_bytes=4)
    rest = await runtime.read_output(
        JobCursor(job_id=handle.job_id, offset=first[-1].next_offset), max_bytes=100
    )
    end = await runtime.read_output(JobCursor(job_id=handle.job_id, offset=8))

    assert [(c.offset, c.next_offset, c.data) for c in first] == [(1, 3, b"bc"), (3, 5, b"de")]
    assert [(c.offset, c.next_offset, c.data) for c in rest] == [(5, 8, b"fgh")]
    assert end == ()


async def test_it_rejects_a_read_of_zero_bytes(make_runtime):
    runtime = await make_runtime()
    handle = await runtime.submit(echo(chunks=["x"]))

    with pytest.raises(SageError) as caught:
        await runtime.read_output(JobCursor(job_id=handle.job_id), max_bytes=0)

    assert caught.value.category is ErrorCategory.VALIDATION


async def test_it_returns_the_same_handle_for_the_same_idempotency_key(make_runtime):
    runtime = await make_runtime()
    spec = JobSpec(owner_run_id="run-alice", kind="echo", idempotency_key="export-1")

    first = await runtime.submit(spec)
    second = await runtime.submit(spec)
    other_run = await runtime.submit(
        JobSpec(owner_run_id="run-bob", kind="echo", idempotency_key="export-1")
    )

    assert second.job_id == first.job_id
    assert other_run.job_id != first.job_id


async def test_it_admits_exactly_the_limit_under_fifty_concurrent_submits(make_runtime):
    runtime = await make_runtime(max_admitted_jobs=3)

    results = await asyncio.gather(
        *(runtime.submit(sleeper(f"run-{i}")) for i in range(50)), return_exceptions=True
    )

    handles = [r for r in results if not isinstance(r, BaseException)]
    errors = [r for r in results if isinstance(r, BaseException)]
    assert len(handles) == 3
    assert len(errors) == 47
    assert {e.code for e in errors} == {"job.queue_full"}
    assert all(e.retryable and e.category is ErrorCategory.RATE_LIMITED for e in errors)


async def test_it_answers_an_idempotent_submit_even_when_full(make_runtime):
    runtime = await make_runtime(max_admitted_jobs=1)
    spec = sleeper(idempotency_key="k")
    first = await runtime.submit(spec)

    again = await runtime.submit(spec)

    assert again.job_id == first.job_id
    with pytest.raises(SageError, match="too many"):
        await runtime.submit(sleeper(idempotency_key="other"))


async def test_it_truncates_output_past_the_per_job_byte_cap(make_runtime):
    runtime = await make_runtime()
    spec = JobSpec(
        owner_run_id="run-alice",
        kind="echo",
        payload={"chunks": ["0123456", "789abcdef"], "exit_code": 0},
        max_output_bytes=10,
    )
    handle = await runtime.submit(spec)

    done = await runtime.wait(handle.job_id)

    assert done.state is JobState.COMPLETED
    assert done.output_truncated is True
    assert done.output_bytes == 10
    assert await read_all(runtime, handle.job_id) == b"0123456789"


async def test_it_truncates_output_past_the_per_job_chunk_cap(make_runtime):
    runtime = await make_runtime(max_job_output_chunks=2)
    handle = await runtime.submit(echo(chunks=["a", "b", "c", "d"]))

    done = await runtime.wait(handle.job_id)

    assert (done.state, done.output_truncated, done.output_chunks) == (
        JobState.COMPLETED,
        True,
        2,
    )
    assert await read_all(runtime, handle.job_id) == b"ab"


async def test_it_truncates_output_past_the_aggregate_cap(make_runtime):
    runtime = await make_runtime(max_buffered_output_bytes=16)
    first = await runtime.wait((await runtime.submit(echo(chunks=["x" * 10]))).job_id)

    second = await runtime.wait((await runtime.submit(echo(chunks=["y" * 10]))).job_id)

    assert first.output_truncated is False
    assert (second.state, second.output_truncated, second.output_bytes) == (
        JobState.COMPLETED,
        True,
        6,
    )


async def test_it_returns_aggregate_room_when_jobs_are_purged(make_runtime):
    runtime = await make_runtime(max_buffered_output_bytes=10)
    await runtime.wait((await runtime.submit(echo(chunks=["x" * 10]))).job_id)

    purged = await runtime.purge_terminal("run-alice")
    later = await runtime.wait((await runtime.submit(echo("run-bob", chunks=["y" * 10]))).job_id)

    assert purged == 1
    assert (later.output_bytes, later.output_truncated) == (10, False)


async def test_it_cancels_a_running_job(make_runtime):
    runtime = await make_runtime()
    handle = await runtime.submit(sleeper())
    await wait_for_state(runtime, handle.job_id, JobState.RUNNING)

    killed = await runtime.cancel(handle.job_id)

    assert killed.state is JobState.KILLED
    assert killed.error["code"] == "job.killed"


async def test_it_treats_a_repeated_cancel_as_a_no_op(make_runtime):
    runtime = await make_runtime()
    handle = await runtime.submit(echo(chunks=["done"]))
    done = await runtime.wait(handle.job_id)

    again = await runtime.cancel(handle.job_id)

    assert again.state is JobState.COMPLETED
    assert again.updated_at == done.updated_at


async def test_it_kills_active_jobs_on_close_and_refuses_new_ones(make_runtime):
    runtime = await make_runtime()
    handle = await runtime.submit(sleeper())
    await wait_for_state(runtime, handle.job_id, JobState.RUNNING)

    await runtime.close()

    with pytest.raises(SageError) as caught:
        await runtime.submit(echo())
    assert caught.value.code == "job.runtime_closed"
    assert (await runtime.inspect(handle.job_id)).state is JobState.KILLED


async def test_it_marks_a_failing_runner_failed_and_keeps_its_output(make_runtime):
    runtime = await make_runtime()
    handle = await runtime.submit(echo(chunks=["partial"], fail="boom"))

    done = await runtime.wait(handle.job_id)

    assert done.state is JobState.FAILED
    assert done.error["code"] == "job.runner_failed"
    assert done.error["resumable"] is True
    assert await read_all(runtime, handle.job_id) == b"partial"


async def test_it_rejects_an_unknown_kind(make_runtime):
    runtime = await make_runtime()

    with pytest.raises(SageError) as caught:
        await runtime.submit(JobSpec(owner_run_id="run-alice", kind="no-such-kind"))

    assert (caught.value.code, caught.value.category) == (
        "job.kind_unsupported",
        ErrorCategory.VALIDATION,
    )


async def test_it_rejects_the_suspend_pause_behaviour(make_runtime):
    runtime = await make_runtime()

    with pytest.raises(SageError) as caught:
        await runtime.submit(sleeper(pause_behavior=JobPauseBehavior.SUSPEND))

    assert caught.value.code == "job.pause_behavior_unsupported"


async def test_it_answers_not_found_for_an_unknown_job(make_runtime):
    runtime = await make_runtime()

    with pytest.raises(SageError) as inspected:
        await runtime.inspect("no-such-job")
    with pytest.raises(SageError) as read:
        await runtime.read_output(JobCursor(job_id="no-such-job"))

    assert inspected.value.code == read.value.code == "job.not_found"
    assert inspected.value.http_status == 404


async def test_it_purges_terminal_jobs_and_frees_their_idempotency_keys(make_runtime):
    runtime = await make_runtime()
    spec = JobSpec(owner_run_id="run-alice", kind="echo", idempotency_key="k")
    first = await runtime.submit(spec)
    await runtime.wait(first.job_id)

    assert await runtime.purge_terminal("run-alice") == 1
    second = await runtime.submit(spec)

    assert second.job_id != first.job_id
    with pytest.raises(SageError, match="not found"):
        await runtime.inspect(first.job_id)


async def test_it_cancels_only_cancel_jobs_when_the_run_pauses(make_runtime):
    runtime = await make_runtime()
    doomed = await runtime.submit(sleeper(pause_behavior=JobPauseBehavior.CANCEL))
    kept = await runtime.submit(sleeper(pause_behavior=JobPauseBehavior.CONTINUE))
    detached = await runtime.submit(sleeper())
    for handle in (doomed, kept, detached):
        await wait_for_state(runtime, handle.job_id, JobState.RUNNING)

    snapshots = {s.job_id: s.state for s in await runtime.handle_run_pause("run-alice")}

    assert snapshots == {
        doomed.job_id: JobState.KILLED,
        kept.job_id: JobState.RUNNING,
        detached.job_id: JobState.RUNNING,
    }


async def test_it_lets_only_the_owning_run_adopt_an_orphaned_job(make_runtime):
    runtime = await make_runtime()
    handle = await runtime.submit(sleeper())
    await wait_for_state(runtime, handle.job_id, JobState.RUNNING)
    orphaned = await runtime.mark_orphaned(handle.job_id)

    with pytest.raises(SageError) as caught:
        await runtime.adopt(handle.job_id, "run-bob")
    adopted = await runtime.adopt(handle.job_id, "run-alice")

    assert orphaned.state is JobState.ORPHANED
    assert (caught.value.code, caught.value.category) == (
        "job.owner_conflict",
        ErrorCategory.AUTHORIZATION,
    )
    assert adopted.state is JobState.RUNNING


async def test_it_refuses_to_orphan_a_terminal_job(make_runtime):
    runtime = await make_runtime()
    handle = await runtime.submit(echo())
    await runtime.wait(handle.job_id)

    with pytest.raises(SageError) as caught:
        await runtime.mark_orphaned(handle.job_id)

    assert caught.value.code == "job.invalid_transition"


async def test_it_lists_a_runs_jobs_with_output_size_and_truncation(make_runtime):
    runtime = await make_runtime()
    small = await runtime.submit(echo(chunks=["abc"]))
    capped = await runtime.submit(
        JobSpec(
            owner_run_id="run-alice",
            kind="echo",
            payload={"chunks": ["abcdef"]},
            max_output_bytes=2,
        )
    )
    await runtime.submit(echo("run-bob", chunks=["other"]))
    await runtime.wait(small.job_id)
    await runtime.wait(capped.job_id)

    jobs = {
        j.job_id: (j.state, j.output_bytes, j.output_truncated)
        for j in await runtime.list_jobs("run-alice")
    }

    assert jobs == {
        small.job_id: (JobState.COMPLETED, 3, False),
        capped.job_id: (JobState.COMPLETED, 2, True),
    }


async def test_it_answers_wait_after_the_row_was_evicted(make_runtime):
    runtime = await make_runtime(max_retained_terminal_jobs=0, output_reconnect_window_seconds=0)
    handle = await runtime.submit(echo(chunks=["bye"]))
    await runtime.wait(handle.job_id)
    assert await runtime.list_jobs("run-alice") == []

    again = await runtime.wait(handle.job_id)

    assert (again.state, again.output_bytes) == (JobState.COMPLETED, 3)
    with pytest.raises(SageError, match="not found"):
        await runtime.inspect(handle.job_id)


async def test_it_reports_lifecycle_events_in_order(make_runtime):
    events: list[tuple[str, str]] = []

    async def on_event(snapshot: JobSnapshot, event_type: str, data: Any) -> None:
        events.append((snapshot.job_id, event_type))

    runtime = await make_runtime(on_event=on_event)
    ok = await runtime.submit(echo(chunks=["x"]))
    await runtime.wait(ok.job_id)
    bad = await runtime.submit(echo(fail="boom"))
    await runtime.wait(bad.job_id)
    await runtime.close()

    assert [e for j, e in events if j == ok.job_id] == [
        "job.created",
        "job.started",
        "job.completed",
    ]
    assert [e for j, e in events if j == bad.job_id] == [
        "job.created",
        "job.started",
        "job.failed",
    ]
