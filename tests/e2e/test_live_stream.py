"""Live streams: token deltas reach SSE clients while the model streams, durable events stay
the truth, a slow client never slows a run, and a resumed stream loses nothing."""

from __future__ import annotations

import asyncio
import time

import orjson
import pytest

from agents.services import packages
from scheduling import live
from scheduling.models import Event, Run, RunStatus
from tests.conftest import client_for, demo_manifest, scripted_model
from tests.e2e.conftest import all_terminal, wait_for
from tests.waiting import awaited_until

pytestmark = [pytest.mark.storage, pytest.mark.django_db(transaction=True)]

BOUND = 60.0


def _package(user, *, words: int, delay_ms: int) -> None:
    text = " ".join(f"w{i}" for i in range(words))
    scripted_model("streamy", {"text": text}, token_delay_ms=delay_ms)
    packages.package_create(owner=user, manifest=demo_manifest(name="streamy", model="streamy"))


def _session_and_run(api) -> tuple[str, str]:
    session = api.post(
        "/api/v1/sessions/", {"package": "streamy", "agent": "assistant"}, format="json"
    ).json()["id"]
    response = api.post("/api/v1/runs/", {"session": session, "input": "go"}, format="json")
    assert response.status_code == 202
    return session, response.json()["id"]


def _parse(buffer: bytes) -> tuple[list[dict], bytes]:
    """Complete SSE messages in ``buffer`` (and what is left of it)."""
    messages = []
    while b"\n\n" in buffer:
        raw, buffer = buffer.split(b"\n\n", 1)
        fields: dict = {}
        for line in raw.split(b"\n"):
            if line.startswith(b":") or b": " not in line:
                continue
            key, value = line.split(b": ", 1)
            fields[key.decode()] = value.decode()
        if "event" in fields:
            messages.append(fields)
    return messages, buffer


async def _read(response, until, *, limit: float = BOUND) -> list[dict]:
    """SSE messages of ``response`` until ``until(messages)`` holds (or the stream ends)."""
    messages: list[dict] = []
    buffer = b""
    iterator = response.streaming_content.__aiter__()
    deadline = time.monotonic() + limit
    while not until(messages):
        remaining = deadline - time.monotonic()
        got = [m["event"] for m in messages]
        assert remaining > 0, f"stream did not deliver in time; got {got}"
        try:
            chunk = await asyncio.wait_for(iterator.__anext__(), remaining)
        except StopAsyncIteration:
            break
        new, buffer = _parse(buffer + chunk)
        messages += new
    await iterator.aclose()
    return messages


def _completed(messages: list[dict]) -> bool:
    return any(m["event"] == "run.completed" for m in messages)


def test_token_deltas_reach_the_stream_while_the_model_streams(alice, start_worker):
    _package(alice, words=30, delay_ms=30)
    api = client_for(alice)
    start_worker()
    session, run_id = _session_and_run(api)
    response = api.get(f"/api/v1/sessions/{session}/stream/", {"timeout": 60})
    messages = asyncio.run(_read(response, _completed))
    kinds = [m["event"] for m in messages]
    deltas = [m for m in messages if m["event"] == "message.delta"]
    assert deltas, kinds
    assert all("id" not in m for m in deltas)  # never persisted: no id to resume from
    # The deltas arrived before the durable assistant message, and add up to it.
    assistant = next(
        i
        for i, m in enumerate(messages)
        if m["event"] == "message.completed"
        and orjson.loads(m["data"])["payload"].get("role") == "assistant"
    )
    assert kinds.index("message.delta") < assistant
    text = "".join(orjson.loads(m["data"])["payload"]["text"] for m in deltas)
    final = orjson.loads(messages[assistant]["data"])["payload"]["content"]
    assert text == final
    assert not Event.objects.filter(session_id=session, type="message.delta").exists()
    assert Run.objects.get(pk=run_id).status == RunStatus.COMPLETED


def test_a_delta_published_once_the_stream_began_reaches_it(alice):
    """The stream's first line (``retry:``) comes once it listens: a client that starts a
    run after reading it misses none of the run's deltas."""
    _package(alice, words=1, delay_ms=0)
    api = client_for(alice)
    session = api.post(
        "/api/v1/sessions/", {"package": "streamy", "agent": "assistant"}, format="json"
    ).json()["id"]
    response = api.get(f"/api/v1/sessions/{session}/stream/", {"timeout": 30})

    async def scenario() -> bytes:
        iterator = response.streaming_content.__aiter__()
        publisher = live.LivePublisher()
        await publisher.start()
        try:
            assert (await asyncio.wait_for(iterator.__anext__(), BOUND)).startswith(b"retry:")
            delta = {"type": "message.delta", "payload": {"text": "first", "offset": 0}}
            publisher.publish({"session": session, "run": None, **delta})
            # Sent (notified, or written to the listening sockets) before reading on.
            await awaited_until(lambda: publisher.sent >= 1, within=BOUND, message="the send")
            buffer = b""
            while b"message.delta" not in buffer:
                buffer += await asyncio.wait_for(iterator.__anext__(), 10)
            return buffer
        finally:
            await publisher.close()
            await iterator.aclose()

    assert b'"text":"first"' in asyncio.run(scenario())


def test_tool_call_argument_deltas_reach_the_stream_before_the_call(alice, start_worker):
    arguments = {"expression": "(2+3)*4 + 100/5 - 7"}
    scripted_model(
        "tooly",
        {"text": "", "tool_calls": [{"name": "calculator", "arguments": arguments}]},
        {"text": "done"},
        token_delay_ms=20,
    )
    packages.package_create(owner=alice, manifest=demo_manifest(name="tooly", model="tooly"))
    api = client_for(alice)
    start_worker()
    session = api.post(
        "/api/v1/sessions/", {"package": "tooly", "agent": "assistant"}, format="json"
    ).json()["id"]
    run_id = api.post("/api/v1/runs/", {"session": session, "input": "go"}, format="json").json()[
        "id"
    ]
    response = api.get(f"/api/v1/sessions/{session}/stream/", {"timeout": 60})
    messages = asyncio.run(_read(response, _completed))
    kinds = [m["event"] for m in messages]
    deltas = [orjson.loads(m["data"]) for m in messages if m["event"] == "tool_call.delta"]
    assert len(deltas) > 1, kinds  # in pieces, as the model streamed them
    assert all(d["run"] == run_id and d["payload"]["name"] == "calculator" for d in deltas)
    assert orjson.loads("".join(d["payload"]["arguments"] for d in deltas)) == arguments
    assert kinds.index("tool_call.delta") < kinds.index("tool.call.started")
    assert not Event.objects.filter(session_id=session, type="tool_call.delta").exists()


def test_a_subscriber_that_never_reads_does_not_slow_the_run(alice, start_worker):
    _package(alice, words=600, delay_ms=0)
    api = client_for(alice)
    worker = start_worker()

    def dropped(subscription: live.Subscription) -> int:
        # A delta that does not fit is dropped where it does not fit: in the subscriber's
        # queue, or (the socket transport) at the worker when the web process's socket
        # already holds as many datagrams as the kernel queues (net.unix.max_dgram_qlen) —
        # what a busy machine does. Counted either way.
        publisher = worker.worker.live if worker.worker is not None else None
        return subscription.dropped + (publisher.dropped if publisher is not None else 0)

    async def scenario() -> tuple[int, int]:
        session = await asyncio.to_thread(
            lambda: api.post(
                "/api/v1/sessions/", {"package": "streamy", "agent": "assistant"}, format="json"
            ).json()["id"]
        )
        subscription = await live.hub().subscribe(session)  # never read
        try:
            run_id = await asyncio.to_thread(
                lambda: api.post(
                    "/api/v1/runs/", {"session": session, "input": "go"}, format="json"
                ).json()["id"]
            )
            await awaited_until(
                lambda: asyncio.to_thread(all_terminal, [run_id]),
                within=BOUND,
                interval=0.05,
                message="the run to finish",
            )
            assert (await Run.objects.aget(pk=run_id)).status == RunStatus.COMPLETED
            # Deltas still in flight when the run ended arrive later on a busy machine (a
            # fixed half second was not always enough): wait for the overflow, bounded.
            await awaited_until(
                lambda: dropped(subscription) > 0,
                within=BOUND,
                interval=0.05,
                message="the overflow",
            )
            return dropped(subscription), subscription.queue.qsize()
        finally:
            await subscription.close()

    lost, held = asyncio.run(scenario())
    # About 600 deltas for a queue of 256 that nobody reads: the run completed anyway, the
    # queue held no more than its bound, and what did not fit was dropped and counted.
    assert held <= live.SUBSCRIBER_QUEUE
    assert lost > 0


def test_a_resumed_stream_yields_every_durable_event_exactly_once(alice, start_worker):
    _package(alice, words=40, delay_ms=40)
    api = client_for(alice)
    start_worker()
    session, run_id = _session_and_run(api)

    def durable(messages: list[dict]) -> list[int]:
        return [int(m["id"]) for m in messages if "id" in m]

    first = asyncio.run(
        _read(
            api.get(f"/api/v1/sessions/{session}/stream/", {"timeout": 60}),
            lambda ms: len(durable(ms)) >= 1,
        )
    )
    seen = durable(first)
    assert seen and not _completed(first)  # cut while the run is still streaming
    second = asyncio.run(
        _read(
            api.get(
                f"/api/v1/sessions/{session}/stream/",
                {"timeout": 60},
                HTTP_LAST_EVENT_ID=str(seen[-1]),
            ),
            _completed,
        )
    )
    wait_for(lambda: all_terminal([run_id]), message="the run to finish")
    ids = seen + durable(second)
    stored = list(
        Event.objects.filter(session_id=session).order_by("seq").values_list("seq", flat=True)
    )
    assert ids == stored  # every durable event, once, in order
