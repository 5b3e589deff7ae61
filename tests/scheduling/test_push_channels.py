"""The push channels on every transport: wake-ups (`scheduling.wakeups`) and live fan-out
(`scheduling.live`) over PostgreSQL NOTIFY, Redis pub/sub and local sockets."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from asgiref.sync import sync_to_async
from django.db import connection, transaction

from agents import services
from scheduling import live, wakeups
from scheduling.models import Event, Run, RunStatus
from tests.conftest import require_service
from tests.scheduling.processes import worker_processes_fixture
from tests.waiting import awaited_until

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

    async def first_cancel() -> None:
        while not received:
            kind, payload = await listener.next()
            if kind == "cancel":  # other workers on this host may be waking everyone
                received.append((kind, payload))

    listener = wakeups.Listener(worker_id="test-worker")
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
        await asyncio.wait_for(first_cancel(), 10)
        while True:  # what arrives next (for 0.2 s) holds no cancel of the rolled-back change
            try:
                kind, payload = await asyncio.wait_for(listener.next(), 0.2)
            except TimeoutError:
                break
            if kind == "cancel":
                received.append((kind, payload))
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


async def test_a_live_hub_listens_again_after_its_channel_drops(transport, monkeypatch):
    """A web process's live channel that drops (a database or Redis restart) is listened to
    again: its stream clients get deltas again without reconnecting."""
    real_listen = wakeups.listen
    attempts = 0
    listening = asyncio.Event()

    async def drops_once(kind: str, *, ready: Any, **channel: Any) -> None:
        nonlocal attempts
        attempts += 1
        if attempts == 1:
            raise OSError("connection lost")

        def now_listening() -> None:
            ready()
            listening.set()

        await real_listen(kind, ready=now_listening, **channel)

    monkeypatch.setattr(wakeups, "listen", drops_once)
    publisher = live.LivePublisher()
    await publisher.start()
    hub = live.LiveHub()
    subscription = await hub.subscribe("session-a")
    try:
        await asyncio.wait_for(listening.wait(), 10)
        publisher.publish({"session": "session-a", "type": "committed", "seq": 1})
        message = await subscription.get(10)
    finally:
        await subscription.close()
        await publisher.close()
    assert message is not None and message["seq"] == 1
    assert (attempts, hub.reconnects) == (2, 1)


# --------------------------------------------------- the socket transport's full sockets


@contextlib.asynccontextmanager
async def _publisher_and_receivers(
    n: int = 1,
) -> AsyncIterator[tuple[live.LivePublisher, list[socket.socket]]]:
    """A worker's publisher, and ``n`` web processes' sockets in the live directory that the
    test reads when it likes."""
    live.live_dir().mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as sockets:
        receivers = []
        for _ in range(n):
            receiver = sockets.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM))
            receiver.bind(str(live.live_dir() / f"test-{uuid.uuid4().hex[:8]}.sock"))
            receiver.setblocking(False)
            receivers.append(receiver)
        publisher = live.LivePublisher()
        await publisher.start()
        try:
            yield publisher, receivers
        finally:
            await publisher.close()


def _read(receiver: socket.socket, into: list[dict[str, Any]]) -> int:
    """Read what ``receiver`` holds into ``into``; returns how many messages it has."""
    while True:
        try:
            data = receiver.recv(1 << 20)
        except BlockingIOError:
            return len(into)
        into += [orjson.loads(line) for line in data.split(b"\n")]


async def _publish_one_by_one(publisher: live.LivePublisher, n: int, start: int = 0) -> None:
    """``n`` deltas, each sent on its own (a datagram each) before the next is published."""
    for i in range(start, start + n):
        publisher.publish({"session": "s", "type": "message.delta", "payload": {"text": str(i)}})
        for _ in range(3):
            await asyncio.sleep(0)


@pytest.fixture
def socket_transport(transport) -> None:
    if transport != "socket":
        pytest.skip("the socket transport is the embedded default's (no Redis, no PostgreSQL)")


async def test_a_socket_that_falls_behind_gets_every_delta_once_it_reads(
    socket_transport, monkeypatch
):
    # The kernel queues ten datagrams per socket by default; a process that reads late
    # (a busy machine) is offered them again instead of losing them.
    monkeypatch.setattr(live, "FULL_WAIT_SECONDS", 30.0)
    received: list[dict[str, Any]] = []
    async with _publisher_and_receivers() as (publisher, [receiver]):
        await _publish_one_by_one(publisher, 60)
        await awaited_until(lambda: _read(receiver, received) >= 60, within=30)
    assert [m["payload"]["text"] for m in received] == [str(i) for i in range(60)]
    assert publisher.snapshot()["dropped"] == 0
    assert publisher.snapshot()["congested"] == 0


async def test_a_socket_that_stays_full_loses_deltas_counted_until_it_reads_again(
    socket_transport, monkeypatch
):
    monkeypatch.setattr(live, "FULL_WAIT_SECONDS", 0.05)
    queued: list[dict[str, Any]] = []
    received: list[dict[str, Any]] = []
    async with _publisher_and_receivers() as (publisher, [receiver]):
        await _publish_one_by_one(publisher, 60)
        # A stuck process: what did not fit waited its time, then was dropped and
        # counted, and its socket is congested (no further wait for it).
        await awaited_until(
            lambda: publisher.sent >= 60 and publisher.snapshot()["congested"] == 1, within=30
        )
        assert publisher.snapshot()["dropped"] > 0
        assert 0 < _read(receiver, queued) < 60
        assert len(queued) + publisher.dropped == 60
        # It reads again: the next delta is delivered and the socket is no longer congested.
        await _publish_one_by_one(publisher, 1, start=60)
        await awaited_until(lambda: _read(receiver, received) >= 1, within=30)
    assert [m["payload"]["text"] for m in received] == ["60"]
    assert publisher.snapshot()["congested"] == 0


async def test_a_web_process_that_reads_late_holds_up_no_other(socket_transport, monkeypatch):
    # One web process does not read (yet); another does: it gets every delta while the
    # first one's wait for its full socket has long to run.
    monkeypatch.setattr(live, "FULL_WAIT_SECONDS", 300.0)
    late: list[dict[str, Any]] = []
    prompt: list[dict[str, Any]] = []
    async with _publisher_and_receivers(2) as (publisher, [stuck, reading]):
        await _publish_one_by_one(publisher, 60)
        await awaited_until(lambda: _read(reading, prompt) >= 60, within=20)
        assert _read(stuck, late) < 60  # its socket filled up: the rest waits for it
        await awaited_until(lambda: _read(stuck, late) >= 60, within=30)
    assert [m["payload"]["text"] for m in prompt] == [str(i) for i in range(60)]
    assert [m["payload"]["text"] for m in late] == [str(i) for i in range(60)]
    assert publisher.snapshot()["dropped"] == 0


# ------------------------------------------------------------------ lost wake-ups (processes)

worker_processes = worker_processes_fixture  # real runworker subprocesses

STARTUP_AND_RUN = 120  # generous: a Django start-up per worker on a loaded machine


def _completed_once(run_ids: list[Any]) -> bool:
    done = Run.objects.filter(pk__in=run_ids, status=RunStatus.COMPLETED).count()
    return done == len(run_ids)


def _working_worker(worker_processes, name: str, owner, make_session) -> tuple[Any, Any]:
    """A started worker that has completed one run (so it is up and listening), and that
    run's id."""
    worker = worker_processes.start(name)
    warm = services.run_submit(owner=owner, session_id=make_session(owner).pk, input="hi")[0]
    worker_processes.wait_for(
        lambda: _completed_once([warm.pk]),
        timeout=STARTUP_AND_RUN,
        message=f"worker {name} to complete a run",
        running=(worker,),
    )
    return worker, warm.pk


def _assert_completed_once(run_ids: list[Any]) -> None:
    for run_id in run_ids:
        ended = Event.objects.filter(run_id=run_id, type__in=["run.completed", "run.failed"])
        assert list(ended.values_list("type", flat=True)) == ["run.completed"], run_id


def test_runs_whose_wake_ups_reached_no_worker_are_found_after_a_restart(
    alice, make_session, worker_processes
):
    """Wake-ups sent while the only worker is dead reach nobody: the fresh worker finds
    those runs anyway (its first claim, then the fallback poll)."""
    first, warm = _working_worker(worker_processes, "first", alice, make_session)
    first.kill()  # its LISTEN connection (or socket) goes with it

    lost = [
        services.run_submit(owner=alice, session_id=make_session(alice).pk, input="hi")[0].pk
        for _ in range(3)
    ]
    assert Run.objects.filter(pk__in=lost, status=RunStatus.QUEUED).count() == 3
    fresh = worker_processes.start("fresh")
    worker_processes.wait_for(
        lambda: _completed_once(lost),
        timeout=STARTUP_AND_RUN,
        message="the fresh worker to complete the runs submitted while no worker listened",
        running=(fresh,),
    )
    _assert_completed_once([warm, *lost])


def test_a_ready_run_nobody_announced_is_found_by_the_idle_workers_poll(
    alice, make_session, worker_processes
):
    """A queued, ready run written without a wake-up (as a lost message leaves it) is
    claimed by an idle worker's fallback poll."""
    worker, warm = _working_worker(worker_processes, "idle", alice, make_session)
    session = make_session(alice)
    silent = Run.objects.create(session=session, owner=alice, input="hi", ready=True)
    worker_processes.wait_for(
        lambda: _completed_once([silent.pk]),
        timeout=STARTUP_AND_RUN,
        message="the idle worker's poll to find the unannounced run",
        running=(worker,),
    )
    _assert_completed_once([warm, silent.pk])
