"""The agent job tools through a real ``InMemoryJobRuntime`` (no database: no recorder)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from agents.jobs import InMemoryJobRuntime, JobSpec, JobState
from agents.jobs.tools import (
    JOB_TOOLS,
    TOOLS,
    job_cancel,
    job_output,
    job_status,
    run_job,
)
from agents.tools import ToolContext, ToolError
from sageproject.errors import SageError


@pytest.fixture
async def runtime() -> AsyncIterator[InMemoryJobRuntime]:
    jobs = InMemoryJobRuntime()
    yield jobs
    await jobs.close()


def ctx_for(runtime: Any, *, owner: int = 1, session: str = "s-1", run: str = "r-1") -> ToolContext:
    return ToolContext(owner_id=owner, session_id=session, run_id=run, extras={"jobs": runtime})


async def start(runtime: Any, ctx: ToolContext, kind: str, payload: dict[str, Any]) -> str:
    answer = json.loads(await run_job({"kind": kind, "input": payload}, ctx))
    return answer["job_id"]


async def read_all(ctx: ToolContext, job_id: str, *, max_bytes: int) -> tuple[str, list[dict]]:
    pages: list[dict] = []
    cursor = 0
    for _ in range(1000):  # bounded: a broken cursor must fail the test, not hang it
        page = json.loads(
            await job_output({"job_id": job_id, "cursor": cursor, "max_bytes": max_bytes}, ctx)
        )
        pages.append(page)
        cursor = page["next_cursor"]
        if page["done"]:
            break
    return "".join(p["text"] for p in pages), pages


def test_it_exposes_the_four_tools_under_both_names():
    assert [t.name for t in JOB_TOOLS] == ["run_job", "job_status", "job_output", "job_cancel"]
    assert TOOLS is JOB_TOOLS


async def test_it_returns_right_after_admission(runtime):
    ctx = ctx_for(runtime)

    answer = json.loads(await run_job({"kind": "sleep", "input": {"seconds": 3600}}, ctx))

    # The job sleeps for an hour; the tool answered anyway, with the job still going.
    assert answer["kind"] == "sleep"
    assert answer["state"] in ("created", "running")
    snapshot = await runtime.inspect(answer["job_id"])
    assert snapshot.state in (JobState.CREATED, JobState.RUNNING)


async def test_it_labels_the_job_with_the_calls_session_and_owner(runtime):
    ctx = ctx_for(runtime, owner=7, session="sess-7", run="run-7")

    job_id = await start(runtime, ctx, "echo", {"chunks": ["x"]})

    snapshot = await runtime.wait(job_id)
    assert snapshot.owner_run_id == "run-7"
    assert snapshot.labels == {"session_id": "sess-7", "owner_id": "7"}


async def test_it_reports_status_of_a_finished_job(runtime):
    ctx = ctx_for(runtime)
    job_id = await start(runtime, ctx, "echo", {"chunks": ["abc", "de"], "exit_code": 3})
    await runtime.wait(job_id)

    status = json.loads(await job_status({"job_id": job_id}, ctx))

    assert status == {
        "job_id": job_id,
        "kind": "echo",
        "state": "completed",
        "output_bytes": 5,
        "output_truncated": False,
        "exit_code": 3,
    }


async def test_it_reports_the_error_of_a_failed_job(runtime):
    ctx = ctx_for(runtime)
    job_id = await start(runtime, ctx, "echo", {"fail": "boom"})
    await runtime.wait(job_id)

    status = json.loads(await job_status({"job_id": job_id}, ctx))

    assert status["state"] == "failed"
    assert status["error"]["code"] == "job.runner_failed"


async def test_it_reads_output_page_by_page_with_cursors(runtime):
    ctx = ctx_for(runtime)
    chunks = [f"line {i}\n" for i in range(50)]
    job_id = await start(runtime, ctx, "echo", {"chunks": chunks})
    await runtime.wait(job_id)

    text, pages = await read_all(ctx, job_id, max_bytes=64)

    assert text == "".join(chunks)
    assert len(pages) > 5
    assert all(len(p["text"].encode()) <= 64 for p in pages)
    assert pages[-1]["done"] is True
    assert pages[-1]["next_cursor"] == len("".join(chunks).encode())


async def test_it_is_not_done_while_the_job_runs(runtime):
    ctx = ctx_for(runtime)
    job_id = await start(runtime, ctx, "sleep", {"chunks": ["started\n"]})

    page = json.loads(await job_output({"job_id": job_id, "cursor": 0}, ctx))

    assert page["done"] is False
    assert page["state"] in ("created", "running")


async def test_it_never_splits_a_character_between_pages(runtime):
    ctx = ctx_for(runtime)
    body = "héllo wörld ✓ " * 20
    job_id = await start(runtime, ctx, "echo", {"chunks": [body]})
    await runtime.wait(job_id)

    text, pages = await read_all(ctx, job_id, max_bytes=7)

    assert text == body
    assert all("\ufffd" not in p["text"] for p in pages)


async def test_it_reports_truncation_past_a_lowered_cap(runtime):
    ctx = ctx_for(runtime)
    answer = json.loads(
        await run_job(
            {"kind": "echo", "input": {"chunks": ["0123456789"] * 3}, "max_output_bytes": 15}, ctx
        )
    )
    await runtime.wait(answer["job_id"])

    status = json.loads(await job_status({"job_id": answer["job_id"]}, ctx))

    assert status["output_bytes"] == 15
    assert status["output_truncated"] is True


async def test_it_cancels_a_running_job(runtime):
    ctx = ctx_for(runtime)
    job_id = await start(runtime, ctx, "sleep", {"seconds": 3600})

    status = json.loads(await job_cancel({"job_id": job_id}, ctx))

    assert status["state"] == "killed"
    assert status["error"]["code"] == "job.killed"


async def test_it_answers_a_repeated_cancel_with_the_final_status(runtime):
    ctx = ctx_for(runtime)
    job_id = await start(runtime, ctx, "sleep", {"seconds": 3600})
    await job_cancel({"job_id": job_id}, ctx)

    again = json.loads(await job_cancel({"job_id": job_id}, ctx))

    assert again["state"] == "killed"


async def test_it_returns_the_same_job_for_a_repeated_idempotency_key(runtime):
    ctx = ctx_for(runtime)
    args = {"kind": "sleep", "input": {"seconds": 3600}, "idempotency_key": "export-1"}

    first = json.loads(await run_job(dict(args), ctx))
    second = json.loads(await run_job(dict(args), ctx))

    assert first["job_id"] == second["job_id"]


async def test_it_sees_a_job_from_another_run_of_the_same_session(runtime):
    job_id = await start(runtime, ctx_for(runtime, run="r-1"), "echo", {"chunks": ["x"]})
    await runtime.wait(job_id)

    status = json.loads(await job_status({"job_id": job_id}, ctx_for(runtime, run="r-2")))

    assert status["state"] == "completed"


@pytest.mark.parametrize(
    "other",
    [
        {"owner": 2, "session": "s-2", "run": "r-2"},  # another user
        {"owner": 1, "session": "s-9", "run": "r-9"},  # the same user, another session
        {"owner": 2, "session": "s-1", "run": "r-1"},  # another user claiming those ids
    ],
)
@pytest.mark.parametrize("tool", [job_status, job_output, job_cancel])
async def test_it_answers_not_found_for_a_job_the_caller_does_not_own(runtime, other, tool):
    job_id = await start(runtime, ctx_for(runtime), "sleep", {"seconds": 3600})

    with pytest.raises(SageError) as caught:
        await tool({"job_id": job_id}, ctx_for(runtime, **other))

    assert caught.value.code == "job.not_found"
    assert (await runtime.inspect(job_id)).state in (JobState.CREATED, JobState.RUNNING)


async def test_it_answers_not_found_for_an_unlabelled_job(runtime):
    handle = await runtime.submit(JobSpec(owner_run_id="r-1", kind="echo"))

    with pytest.raises(SageError) as caught:
        await job_status({"job_id": handle.job_id}, ctx_for(runtime))

    assert caught.value.code == "job.not_found"


async def test_it_answers_not_found_for_an_unknown_job(runtime):
    with pytest.raises(SageError) as caught:
        await job_output({"job_id": "f" * 32}, ctx_for(runtime))

    assert caught.value.code == "job.not_found"


async def test_it_refuses_an_unknown_kind(runtime):
    with pytest.raises(SageError) as caught:
        await run_job({"kind": "no-such-kind"}, ctx_for(runtime))

    assert caught.value.code == "job.kind_unsupported"


@pytest.mark.parametrize(
    "args",
    [
        {},
        {"kind": ""},
        {"kind": "echo", "input": "not an object"},
        {"kind": "echo", "max_output_bytes": 0},
        {"kind": "echo", "pause_behavior": "suspend"},
        {"kind": "echo", "idempotency_key": "k" * 201},
    ],
)
async def test_it_rejects_bad_run_job_arguments(runtime, args):
    with pytest.raises(ToolError):
        await run_job(args, ctx_for(runtime))


async def test_it_rejects_a_negative_cursor(runtime):
    job_id = await start(runtime, ctx_for(runtime), "echo", {"chunks": ["x"]})

    with pytest.raises(ToolError):
        await job_output({"job_id": job_id, "cursor": -1}, ctx_for(runtime))


async def test_it_refuses_to_start_a_job_outside_a_run(runtime):
    ctx = ToolContext(owner_id=1, extras={"jobs": runtime})

    with pytest.raises(ToolError):
        await run_job({"kind": "echo"}, ctx)


async def test_it_explains_when_the_host_has_no_job_runtime():
    ctx = ToolContext(owner_id=1, session_id="s", run_id="r")

    with pytest.raises(ToolError, match="not available"):
        await job_status({"job_id": "abc"}, ctx)


async def test_it_fails_run_job_once_the_runtime_is_closed(runtime):
    await runtime.close()

    with pytest.raises(SageError) as caught:
        await run_job({"kind": "echo"}, ctx_for(runtime))

    assert caught.value.code == "job.runtime_closed"


async def test_it_runs_through_the_agent_engine_without_waiting_for_the_job(runtime):
    from agents.engine import TOOL_SUCCEEDED, AgentTurn, run_turn
    from pooling.providers.base import StreamEnd, TextDelta, ToolCall

    ctx = ctx_for(runtime)
    steps: list[list[Any]] = [
        [ToolCall(id="c1", name="run_job", arguments={"kind": "sleep", "input": {}})],
        [TextDelta(text="started")],
    ]
    seen: list[Any] = []

    async def call_model(request):
        seen.append(request)
        for item in steps[len(seen) - 1]:
            yield item
        yield StreamEnd(stop_reason="end_turn", usage={})

    events: list[tuple[str, Any]] = []

    async def emit(batch):
        events.extend(batch)

    outcome = await run_turn(
        AgentTurn(model="m", instructions="", tools=tuple(JOB_TOOLS)),
        [{"role": "user", "content": "export"}],
        call_model=call_model,
        emit=emit,
        ctx=ctx,
    )

    # The turn finished while the hour-long job is still running.
    assert outcome.text == "started"
    succeeded = [p for t, p in events if t == TOOL_SUCCEEDED]
    job_id = json.loads(succeeded[0]["output"])["job_id"]
    assert (await runtime.inspect(job_id)).state in (JobState.CREATED, JobState.RUNNING)
    assert {spec.name for spec in seen[0].tools} >= {"run_job", "job_status"}
