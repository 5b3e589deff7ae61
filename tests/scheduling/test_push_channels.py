"""The push channels on every transport: wake-ups (`scheduling.wakeups`) and live fan-out
(`scheduling.live`) over PostgreSQL NOTIFY, Redis pub/sub and local sockets."""

from __future__ import annotations

import asyncio

import pytest
from asgiref.sync import sync_to_async
from django.db import connection, transaction

from scheduling import live, wakeups
from tests.conftest import require_service

pytestmark = [pytest.mark.storage, pytest.mark.django_db(transaction=True)]


@pytest.fixture(params=["database", "redis"])
def transport(request, settings) -> str:
    """``database``: the database's own channel (NOTIFY on PostgreSQL, sockets elsewhere);
    ``redis``: Redis pub/sub (on PostgreSQL NOTIFY is always used, so not applicable)."""
    if request.param == "redis":
        if connection.vendor == "postgresql":
            pytest.skip("PostgreSQL deployments use NOTIFY whatever REDIS_URL says")
        require_service("Redis", "127.0.0.1", 6379)
        settings.SAGE = {**settings.SAGE, "REDIS_URL": "redis://127.0.0.1:6379/14"}
    return wakeups.backend()


async def test_a_wake_up_is_delivered_when_its_transaction_commits(transport):
    received: list[tuple[str, str]] = []
    got = asyncio.Event()

    def on_wake(kind: str, payload: str) -> None:
        if kind == "cancel":  # other workers on this host may be waking everyone
            received.append((kind, payload))
            got.set()

    listener = wakeups.Listener(on_wake, worker_id="test-worker")
    await listener.start()
    try:

        def rolled_back() -> None:
            try:
                with transaction.atomic():
                    wakeups.notify("cancel", "never")
                    raise RuntimeError("roll back")
            except RuntimeError:
                pass

        def committed() -> None:
            with transaction.atomic():
                wakeups.notify("cancel", "run-1")

        await sync_to_async(rolled_back)()
        await sync_to_async(committed)()
        await asyncio.wait_for(got.wait(), 10)
        await asyncio.sleep(0.2)
    finally:
        await listener.close()
    # Only the committed change woke anyone.
    assert received == [("cancel", "run-1")]
    assert listener.snapshot()["channel"] == transport


async def test_live_messages_reach_the_sessions_subscribers_only(transport):
    publisher = live.LivePublisher()
    await publisher.start()
    hub = live.LiveHub()
    mine = await hub.subscribe("session-a")
    other = await hub.subscribe("session-b")
    try:
        publisher.publish(
            {"session": "session-a", "type": "message.delta", "payload": {"text": "x" * 9000}}
        )
        publisher.publish({"session": "session-a", "type": "committed", "seq": 3})
        messages = []
        while len(messages) < 3:
            message = await mine.get(10)
            assert message is not None, f"got only {messages}"
            messages.append(message)
    finally:
        await mine.close()
        await other.close()
        await publisher.close()
    # A delta too long for one notification arrives in parts, in order.
    deltas = [m["payload"]["text"] for m in messages if m["type"] == "message.delta"]
    assert "".join(deltas) == "x" * 9000 and len(deltas) == 2
    assert {k: v for k, v in messages[-1].items() if k != "n"} == {
        "session": "session-a",
        "type": "committed",
        "seq": 3,
    }
    assert other.queue.empty()
