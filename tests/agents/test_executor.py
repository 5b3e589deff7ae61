"""``RunExecutor.execute`` on its own: a claimed run in, an ``Outcome`` out.

The executor commits the run's events (fenced) but never its status: the dispatcher
commits the outcome. These tests claim a run through the state machine, hand it to the
executor directly (no worker, no dispatcher) and check what it returns and what it left
in the database.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest
from asgiref.sync import sync_to_async

from agents.applications import ModelRecordView
from agents.executor import RunExecutor
from pooling.budget import ModelConcurrencyBudget
from pooling.providers.base import ModelRequest, TextDelta
from sageproject.errors import SageError
from scheduling import runs
from scheduling.figures import FIRST_TOKEN, MODEL_TOKENS
from scheduling.models import Event, Run, RunStatus
from scheduling.runs import Fence
from scheduling.worker import StopSignal
from tests.conftest import demo_manifest, scripted_model
from tests.pooling.upstream import upstream_fixture
from tests.waiting import awaited_until

upstream = upstream_fixture  # the loopback model server fixture

pytestmark = [pytest.mark.storage, pytest.mark.django_db(transaction=True)]


@pytest.fixture
async def executor():
    executor = RunExecutor()
    await executor.start()
    yield executor
    await executor.close()


@pytest.fixture
def submit(alice, make_session):
    """Admit one run of the demo agent on ``model`` and return its id."""

    def submit(model: str, text: str = "hi") -> str:
        session = make_session(alice, manifest=demo_manifest(name=f"p-{model}", model=model))
        run, _ = runs.admit(owner=alice, session_id=session.pk, input=text)
        return str(run.pk)

    return sync_to_async(submit)


async def claim(token_offset: int = 0) -> tuple[Fence, dict]:
    """Claim the one queued run as worker ``direct``; its fence (its token moved by
    ``token_offset`` to play a stale worker) and the claimed row."""
    grants, _ = await sync_to_async(runs.claim)(
        worker_id="direct", duration=timedelta(seconds=60), limit=1
    )
    (grant,) = grants
    fence = Fence(run_id=grant.row["pk"], lease_owner="direct", lease_token=grant.token)
    if token_offset:
        fence = Fence(run_id=fence.run_id, lease_owner="direct", lease_token=grant.token - 1)
    return fence, grant.row


async def events_of(run_id: str) -> list[str]:
    return await sync_to_async(
        lambda: list(
            Event.objects.filter(run_id=run_id).order_by("seq").values_list("type", flat=True)
        )
    )()


async def status_of(run_id: str) -> str:
    return (await Run.objects.aget(pk=run_id)).status


async def test_a_completed_run_returns_its_outcome_and_leaves_the_status_to_the_dispatcher(
    executor, submit
):
    await sync_to_async(scripted_model)("exec-ok", {"text": "hello there"})
    run_id = await submit("exec-ok")
    fence, row = await claim()

    outcome = await executor.execute(run_id, fence, StopSignal(), row)

    assert outcome.status == RunStatus.COMPLETED
    assert outcome.result["text"] == "hello there"
    # The start is committed once: by itself, or (a run this short, usually) with the
    # outcome, which the dispatcher commits.
    committed = await events_of(run_id)
    pending = [kind for kind, _ in outcome.events()]
    assert (committed + pending).count("run.started") == 1
    assert "message.completed" in pending
    assert await status_of(run_id) == RunStatus.RUNNING


async def test_a_missing_model_record_fails_the_run(executor, submit):
    record = await sync_to_async(scripted_model)("exec-gone", {"text": "never"})
    run_id = await submit("exec-gone")
    await record.adelete()  # gone between admission and execution
    fence, row = await claim()

    outcome = await executor.execute(run_id, fence, StopSignal(), row)

    assert outcome.status == RunStatus.FAILED
    assert outcome.error["code"] == "server.model_not_configured"


async def test_a_provider_rate_limit_suspends_the_run_with_a_retry_interaction(executor, submit):
    await sync_to_async(scripted_model)(
        "exec-429", error={"status": 429, "body": "{}", "retry_after": 7}
    )
    run_id = await submit("exec-429")
    fence, row = await claim()

    outcome = await executor.execute(run_id, fence, StopSignal(), row)

    assert outcome.status == RunStatus.SUSPENDED
    assert outcome.interaction["code"] == "upstream.rate_limited"
    assert outcome.interaction["allowed_decisions"] == ["retry", "cancel"]
    assert outcome.interaction["retry_after"] == 7


async def test_a_stale_fence_stops_the_run_writing(executor, submit):
    # Slow tokens: the start is committed on its own (after 50 ms) with the stale token.
    await sync_to_async(scripted_model)("exec-slow", {"text": "a b c d e"}, token_delay_ms=60)
    run_id = await submit("exec-slow")
    fence, row = await claim(token_offset=-1)

    outcome = await executor.execute(run_id, fence, StopSignal(), row)

    assert outcome == "lease_lost"
    assert await events_of(run_id) == []


async def test_a_cancelled_run_ends_cancelled_with_the_events_it_made(executor, submit):
    await sync_to_async(scripted_model)(
        "exec-long", {"text": " ".join(["w"] * 50)}, token_delay_ms=40
    )
    run_id = await submit("exec-long")
    fence, row = await claim()
    stop = StopSignal()

    task = asyncio.create_task(executor.execute(run_id, fence, stop, row))

    async def streaming() -> bool:
        first_tokens = executor.metrics.snapshot()["histograms"].get(FIRST_TOKEN, {})
        return bool(first_tokens.get("series")) and "run.started" in await events_of(run_id)

    await awaited_until(streaming, message="the start committed and the model streaming")
    stop.reason = "cancelled"
    task.cancel()
    outcome = await task

    assert outcome.status == RunStatus.CANCELLED
    assert outcome.error["code"] == "run.cancelled"
    committed = await events_of(run_id)
    assert (committed + [kind for kind, _ in outcome.events()]).count("run.started") == 1
    assert await status_of(run_id) == RunStatus.RUNNING


# -- the model call: one budget slot for the whole stream -----------------------------------


def _record(model: str = "m", **options) -> ModelRecordView:
    return ModelRecordView(
        id=1, protocol="scripted", base_url="", model=model, api_key="", options=options
    )


def _request(record: ModelRecordView) -> ModelRequest:
    return ModelRequest(
        model=record.model,
        messages=({"role": "user", "content": "hi"},),
        options=record.options,
    )


@pytest.fixture
async def one_slot():
    """An executor whose model calls share one budget slot, with nobody allowed to queue."""
    executor = RunExecutor(budget=ModelConcurrencyBudget(1, max_waiting=0))
    await executor.start()
    yield executor
    await executor.close()


async def test_a_model_call_holds_one_slot_for_its_whole_stream(one_slot):
    record = _record(script=[{"text": "a b c"}])
    seen = []
    async for item in one_slot._stream_model(record, 1, _request(record)):
        seen.append((type(item).__name__, one_slot.budget.active))
    assert seen == [("TextDelta", 1)] * 3 + [("StreamEnd", 1)]
    assert one_slot.budget.snapshot()["active"] == 0


async def test_a_model_call_counts_its_time_to_first_token_and_its_tokens(one_slot):
    record = _record(model="counted", script=[{"text": "a b c"}])
    async for _item in one_slot._stream_model(record, 1, _request(record)):
        pass
    snapshot = one_slot.metrics.snapshot()
    tokens = {
        labels["type"]: value
        for labels, value in snapshot["counters"][MODEL_TOKENS]
        if labels["model"] == "counted"
    }
    assert tokens == {"input": 1, "output": 3}  # "hi" in, "a b c" out
    (first,) = [
        data
        for labels, data in snapshot["histograms"][FIRST_TOKEN]["series"]
        if labels == {"model": "counted"}
    ]
    assert first["count"] == 1


async def test_a_failing_model_stream_gives_its_slot_back(one_slot):
    record = _record(error={"status": 502, "body": "{}"}, error_after_tokens=1)
    stream = one_slot._stream_model(record, 1, _request(record))
    with pytest.raises(SageError) as caught:
        async for _item in stream:
            pass
    assert caught.value.code == "upstream.error"
    assert one_slot.budget.snapshot()["active"] == 0


async def test_a_model_stream_closed_early_gives_its_slot_back(one_slot):
    record = _record(script=[{"text": "a b c"}])
    stream = one_slot._stream_model(record, 1, _request(record))
    assert isinstance(await anext(stream), TextDelta)
    assert one_slot.budget.active == 1
    await stream.aclose()
    assert one_slot.budget.snapshot()["active"] == 0


async def test_a_cancelled_model_call_gives_its_slot_back(one_slot):
    record = _record(script=[{"text": "a b c"}], token_delay_ms=60_000)
    first = asyncio.Event()

    async def consume() -> None:
        async for _item in one_slot._stream_model(record, 1, _request(record)):
            first.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(first.wait(), 10)
    assert one_slot.budget.active == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert one_slot.budget.snapshot()["active"] == 0


async def test_a_model_call_refused_by_the_budget_sends_no_upstream_request(one_slot, upstream):
    record = ModelRecordView(
        id=2,
        protocol="openai",
        base_url=upstream.openai_base_url,
        model="gpt-test",
        api_key="sk-test",
        options={},
    )
    async with one_slot.budget.lease():  # the one slot is taken, and nobody may queue
        with pytest.raises(SageError) as caught:
            async for _item in one_slot._stream_model(record, 1, _request(record)):
                pass
    assert caught.value.code == "model.queue_full"
    assert upstream.requests == []
    assert one_slot.budget.snapshot()["active"] == 0
