"""Live fan-out from workers to stream clients: token deltas and "new durable events" notices.

Durable events are the source of truth and are read from the database. This channel only
makes streams live: ``message.delta`` events (a model's text as it streams) and
``tool_call.delta`` events (pieces of a tool call's arguments as they stream), both never
persisted, and ``committed`` notices (a session's durable prefix moved on, so a waiting
stream reads it at once instead of at its next poll).

Transport, as for wake-ups (`scheduling.wakeups`): PostgreSQL ``NOTIFY sage_live``,
Redis pub/sub ``sage:live`` when ``REDIS_URL`` is set on other databases, or Unix datagram
sockets under ``live/`` of the local directory (``SAGE_LOCAL_DIR``, ``.local/`` by default;
one per web process) for the embedded default.

Nothing here may slow a run: `LivePublisher.publish` only appends to a bounded queue that a
background task drains (a full queue drops and counts), and each stream client reads from a
bounded queue of its own (`Subscription`; a client that does not read loses deltas, counted,
and never holds anything up). On the socket transport the kernel queues only a few datagrams
per socket: what a web process's full socket cannot take waits in a backlog of that socket's
own, offered again for up to ``FULL_WAIT_SECONDS`` (a busy process catches up) while the
other web processes get theirs at once, then it is dropped and counted; a socket that stays
full gets no backlog until it takes a datagram again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import weakref
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import DEFAULT_DB_ALIAS

from scheduling.wakeups import ChannelListener, backend, pg_params, redis_url, send_datagram

logger = logging.getLogger("sage.live")

CHANNEL = "sage_live"
REDIS_CHANNEL = "sage:live"
# PostgreSQL refuses NOTIFY payloads of 8000 bytes or more; longer deltas are split.
MAX_PAYLOAD = 7000
PUBLISH_QUEUE = 10_000
SUBSCRIBER_QUEUE = 256
# How long the socket transport keeps offering a datagram to a full socket, and how often.
FULL_WAIT_SECONDS = 0.1
FULL_RETRY_SECONDS = 0.001
# The live delta types stream clients receive, each with the payload field that holds its
# text (split in halves when a message is too large for one notification).
DELTA_TEXT = {"message.delta": "text", "tool_call.delta": "arguments"}
# What a follower passes on live: the deltas, and a tool call's progress (an MCP server's
# progress notifications: ``{"id", "name", "progress", "total", "message"}``).
LIVE_TYPES = frozenset({*DELTA_TEXT, "tool.progress"})


def live_dir() -> Path:
    return Path(settings.LOCAL_DIR) / "live"


# ------------------------------------------------------------------------------ publishing


class LivePublisher:
    """A worker's sender: `publish` never blocks; a task sends in batches."""

    def __init__(self, *, using: str = DEFAULT_DB_ALIAS) -> None:
        self.using = using
        self.kind = backend(using)
        self.sent = 0
        self.dropped = 0
        self._count = 0
        self._queue: deque[bytes] = deque()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # Socket transport: what waits for a web process's full socket, per socket, as
        # [time first refused, messages, datagram] (see `_offer`); and the sockets that
        # stayed full for FULL_WAIT_SECONDS (until one takes a datagram again, what does
        # not fit is dropped at once).
        self._backlog: dict[Path, deque[list[Any]]] = {}
        self._congested: set[Path] = set()

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"live-publisher-{self.kind}")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def snapshot(self) -> dict[str, Any]:
        return {
            "channel": self.kind,
            "sent": self.sent,
            "dropped": self.dropped,
            "congested": len(self._congested),
        }

    def publish(self, message: dict[str, Any]) -> None:
        """Queue ``message`` (with a ``session`` key) for the stream clients."""
        # A number of its own per message: PostgreSQL delivers identical payloads notified in
        # one transaction once, and one batch is one transaction.
        self._count += 1
        data = orjson.dumps({**message, "n": self._count})
        piece = DELTA_TEXT.get(str(message.get("type")))
        if len(data) > MAX_PAYLOAD and piece is not None:
            # Too large for one notification: the delta's text in two halves.
            text = message["payload"].get(piece, "")
            half = len(text) // 2
            for part in (text[:half], text[half:]):
                self.publish({**message, "payload": {**message["payload"], piece: part}})
            return
        if len(self._queue) >= PUBLISH_QUEUE:
            self.dropped += 1
            return
        self._queue.append(data)
        self._wake.set()

    async def _run(self) -> None:
        delay = 0.2
        while True:
            try:
                await self._send_loop()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                logger.warning("live channel (%s) failed: %s; reconnecting", self.kind, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _batches(self) -> Any:
        """Batches of queued messages as they come; while datagrams wait for a full socket,
        also an empty batch every ``FULL_RETRY_SECONDS`` (time to offer them again)."""
        while True:
            if self._backlog:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), FULL_RETRY_SECONDS)
            else:
                await self._wake.wait()
            self._wake.clear()
            if not self._queue:
                yield []
            while self._queue:
                batch = [self._queue.popleft() for _ in range(min(len(self._queue), 64))]
                yield batch

    async def _send_loop(self) -> None:
        if self.kind == "postgresql":
            import psycopg

            conn = await psycopg.AsyncConnection.connect(**pg_params(self.using), autocommit=True)
            try:
                async for batch in self._batches():
                    if not batch:
                        continue
                    # One statement for the whole batch: one round trip.
                    marks = ", ".join(["pg_notify(%s, %s)"] * len(batch))
                    args: list[Any] = []
                    for data in batch:
                        args += [CHANNEL, data.decode()]
                    await conn.execute(f"SELECT {marks}", args)
                    self.sent += len(batch)
            finally:
                await conn.close()
        elif self.kind == "redis":
            import redis.asyncio as aioredis

            client = aioredis.Redis.from_url(redis_url())
            try:
                async for batch in self._batches():
                    if not batch:
                        continue
                    async with client.pipeline(transaction=False) as pipe:
                        for data in batch:
                            pipe.publish(REDIS_CHANNEL, data)
                        await pipe.execute()
                    self.sent += len(batch)
            finally:
                await client.aclose()
        else:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender:
                sender.setblocking(False)
                async for batch in self._batches():
                    now = asyncio.get_running_loop().time()
                    self._retry(sender, now)
                    if not batch:
                        continue
                    paths = list(live_dir().glob("*.sock")) if live_dir().is_dir() else []
                    # One datagram per batch (JSON lines): a receiver's queue holds few
                    # datagrams (net.unix.max_dgram_qlen, 10 by default), not few messages.
                    for count, data in _datagrams(batch):
                        for path in paths:
                            self._offer(sender, path, count, data, now)
                    self.sent += len(batch)

    def _offer(
        self, sender: socket.socket, path: Path, count: int, data: bytes, now: float
    ) -> None:
        """Send a datagram of ``count`` messages to one web process's socket. One that is
        full keeps it in its backlog, to be offered again (`_retry`) for up to
        ``FULL_WAIT_SECONDS``: a web process a few datagrams behind (a busy machine) catches
        up within milliseconds, and meanwhile the others get theirs at once. What follows
        joins the backlog's last datagram while it fits (fewer, larger datagrams once the
        process reads again). A congested socket (it stayed full: a stopped or stuck
        process) gets no backlog: what it cannot take is dropped, counted."""
        backlog = self._backlog.get(path)
        if backlog:
            last = backlog[-1]
            if len(last[2]) + 1 + len(data) <= MAX_DATAGRAM:
                last[1] += count
                last[2] += b"\n" + data
            else:
                backlog.append([now, count, data])
            return
        if send_datagram(sender, path, data):
            self._congested.discard(path)
        elif path in self._congested:
            self.dropped += count
        else:
            self._backlog[path] = deque([[now, count, data]])

    def _retry(self, sender: socket.socket, now: float) -> None:
        """Offer the backlogs' datagrams again, in order; a socket whose oldest datagram has
        waited ``FULL_WAIT_SECONDS`` loses its backlog (dropped, counted) and is congested."""
        for path, backlog in list(self._backlog.items()):
            while backlog and send_datagram(sender, path, backlog[0][2]):
                backlog.popleft()
                if not path.exists():  # its process is gone (the socket was removed)
                    backlog.clear()
            if not backlog:
                del self._backlog[path]
            elif now - backlog[0][0] >= FULL_WAIT_SECONDS:
                self.dropped += sum(entry[1] for entry in backlog)
                del self._backlog[path]
                self._congested.add(path)


# The largest datagram the socket transport sends (well under the kernel's limits).
MAX_DATAGRAM = 60_000


def _datagrams(batch: list[bytes]) -> list[tuple[int, bytes]]:
    """``batch`` as JSON-lines datagrams of at most ``MAX_DATAGRAM`` bytes: (count, data)."""
    out: list[tuple[int, bytes]] = []
    lines: list[bytes] = []
    size = 0
    for data in batch:
        if lines and size + len(data) + 1 > MAX_DATAGRAM:
            out.append((len(lines), b"\n".join(lines)))
            lines, size = [], 0
        lines.append(data)
        size += len(data) + 1
    if lines:
        out.append((len(lines), b"\n".join(lines)))
    return out


_publisher: LivePublisher | None = None


def set_publisher(publisher: LivePublisher | None) -> None:
    """The worker's publisher (None: this process publishes nothing)."""
    global _publisher
    _publisher = publisher


def publish(message: dict[str, Any]) -> None:
    """Publish through this process's publisher, if it has one (the worker does)."""
    if _publisher is not None:
        _publisher.publish(message)


# ------------------------------------------------------------------------------ subscribing


class Subscription:
    """One stream client's live messages for one session (bounded; drops are counted)."""

    def __init__(self, hub: LiveHub, session_id: str) -> None:
        self.hub = hub
        self.session_id = session_id
        self.queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(SUBSCRIBER_QUEUE)
        self.dropped = 0

    def offer(self, message: dict[str, Any]) -> None:
        try:
            self.queue.put_nowait(message)
        except asyncio.QueueFull:
            self.dropped += 1
            self.hub.dropped += 1

    async def get(self, seconds: float) -> dict[str, Any] | None:
        try:
            return await asyncio.wait_for(self.queue.get(), seconds)
        except TimeoutError:
            return None

    async def close(self) -> None:
        await self.hub.unsubscribe(self)


class LiveHub(ChannelListener):
    """A web process's end of the channel (one per event loop): started with its first
    subscriber, stopped with its last. While the channel is down streams read the durable
    events; deltas resume once it listens again."""

    pg_channel = CHANNEL
    redis_channel = REDIS_CHANNEL
    task_name = "live-hub"
    label = "live"
    logger = logger

    def __init__(self, *, using: str = DEFAULT_DB_ALIAS) -> None:
        super().__init__(using=using)
        self.subscribers: dict[str, set[Subscription]] = {}
        self.received = 0
        self.dropped = 0

    async def subscribe(self, session_id: Any) -> Subscription:
        subscription = Subscription(self, str(session_id))
        self.subscribers.setdefault(subscription.session_id, set()).add(subscription)
        if not self.listening:
            self._begin()
        await self._until_ready(5)
        return subscription

    async def unsubscribe(self, subscription: Subscription) -> None:
        group = self.subscribers.get(subscription.session_id)
        if group is not None:
            group.discard(subscription)
            if not group:
                del self.subscribers[subscription.session_id]
        if not self.subscribers:
            await self._stop()

    def _socket_path(self) -> Path:
        return live_dir() / f"web-{os.getpid()}-{id(self):x}.sock"

    def _deliver(self, data: bytes | str) -> None:
        raw = data.encode() if isinstance(data, str) else data
        for line in raw.split(b"\n"):  # a socket datagram carries a batch, one per line
            try:
                message = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            self.received += 1
            for subscription in tuple(self.subscribers.get(str(message.get("session")), ())):
                subscription.offer(message)


_hubs: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LiveHub] = weakref.WeakKeyDictionary()


def hub() -> LiveHub:
    """This event loop's hub (web processes; created on first use)."""
    loop = asyncio.get_running_loop()
    found = _hubs.get(loop)
    if found is None:
        found = _hubs[loop] = LiveHub()
    return found


# ------------------------------------------------------------------------------ following


# How often a follower reads the database without a ``committed`` notice, how many durable
# events one read takes, and after how long without anything a keep-alive is due (seconds).
FOLLOW_POLL_SECONDS = 0.25
FOLLOW_PAGE = 200
KEEPALIVE_SECONDS = 15


@dataclass(frozen=True, slots=True)
class Delta:
    """A live piece of a model's output (``message.delta`` / ``tool_call.delta``)."""

    type: str
    run: str | None
    payload: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Dropped:
    """This follower lost deltas (it read too slowly); ``count`` so far."""

    count: int


@dataclass(frozen=True, slots=True)
class KeepAlive:
    """Nothing happened for ``KEEPALIVE_SECONDS``."""


def _events_after(session_id: Any, after: int) -> list[Any]:
    from scheduling.models import Event

    return list(
        Event.objects.filter(session_id=session_id, seq__gt=after).order_by("seq")[:FOLLOW_PAGE]
    )


async def follow(
    session_id: Any, after: int, seconds: float, *, subscription: Subscription | None = None
) -> AsyncIterator[Any]:
    """A session as it happens, for ``seconds`` at most: its durable events after seq
    ``after`` (``Event`` rows, from the database: the source of truth for every process) in
    seq order, with the workers' live `Delta`\\s in between, `Dropped` when this follower
    lost deltas and `KeepAlive` after a quiet spell. Every stream of the host (the SSE
    endpoint, the protocol layers) reads a session through this.

    A ``committed`` notice from a worker makes the follower read new durable events at
    once, before the deltas published after it (so a delta follows the durable events
    its worker committed before it); without one it polls every ``FOLLOW_POLL_SECONDS``.
    Deltas wait in a bounded queue per follower: one that does not read loses deltas and
    never slows a run. Close the iterator (``contextlib.aclosing``) to stop early.

    ``subscription``: one the caller took already (`LiveHub.subscribe`) — to tell its
    client it is live before the first item — which the follower then owns and closes.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    quiet_since = loop.time()
    if subscription is None:
        subscription = await hub().subscribe(session_id)
    reported = 0
    read_events = sync_to_async(_events_after, thread_sensitive=False)
    try:
        read = True
        while loop.time() < deadline:
            if read:
                rows = await read_events(session_id, after)
                for row in rows:
                    yield row
                    after = row.seq
                if rows:
                    quiet_since = loop.time()
                    if len(rows) >= FOLLOW_PAGE:
                        continue  # more are waiting
            if subscription.dropped > reported:
                reported = subscription.dropped
                yield Dropped(reported)
            if loop.time() - quiet_since > KEEPALIVE_SECONDS:
                quiet_since = loop.time()
                yield KeepAlive()
            message = await subscription.get(
                min(FOLLOW_POLL_SECONDS, max(deadline - loop.time(), 0.001))
            )
            read = message is None  # the poll interval passed: look at the database
            while message is not None:
                kind = message.get("type")
                if kind in LIVE_TYPES:
                    quiet_since = loop.time()
                    yield Delta(kind, message.get("run"), message.get("payload") or {})
                elif kind == "committed" and int(message.get("seq", 0)) > after:
                    # The events it announces come before any later delta (a worker
                    # publishes in order): read them before draining further.
                    read = True
                    break
                try:
                    message = subscription.queue.get_nowait()
                except asyncio.QueueEmpty:
                    message = None
    finally:
        await subscription.close()
