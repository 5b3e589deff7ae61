"""Push wake-ups: a worker learns at once that there is work, instead of polling for it.

One channel per deployment, chosen by the database and settings:

- **PostgreSQL**: ``LISTEN``/``NOTIFY`` on ``sage_wakeup``. The notifying transaction
  (admission, a resume, a cancel) sends ``pg_notify`` inside itself, so the message is
  delivered exactly when the change commits (never for a rolled-back one). Each worker
  holds one listening connection (psycopg, outside Django's pool).
- **Redis** (``REDIS_URL`` set, other databases): pub/sub on ``sage:wakeup``, published
  after the commit.
- **Local socket** (the embedded SQLite default, or no Redis): each worker binds a Unix
  datagram socket under ``wakeup/`` of the local directory (``SAGE_LOCAL_DIR``); the web
  process sends a datagram to every socket there after the commit (a stale socket is
  removed).

Messages are ``kind`` or ``kind:payload``: ``run`` (a run became claimable), ``cancel:<run
id>`` (a running run was asked to stop), ``ops`` (an operator request is waiting). A lost
message costs latency, never correctness: the worker still polls (every second or so), which
also catches runs made claimable by lease expiry or by a worker that was down.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, connections, transaction

logger = logging.getLogger("sage.wakeups")

CHANNEL = "sage_wakeup"
REDIS_CHANNEL = "sage:wakeup"
RECONNECT_START, RECONNECT_MAX = 0.2, 5.0


def socket_dir() -> Path:
    return Path(settings.LOCAL_DIR) / "wakeup"


def redis_url() -> str | None:
    """The deployment's ``REDIS_URL`` (None when it has no Redis)."""
    return (getattr(settings, "SAGE", {}) or {}).get("REDIS_URL") or None


def backend(using: str = DEFAULT_DB_ALIAS) -> str:
    """``postgresql``, ``redis`` or ``socket``: the channel this deployment uses."""
    if connections[using].vendor == "postgresql":
        return "postgresql"
    if redis_url():
        return "redis"
    return "socket"


# ------------------------------------------------------------------------------ sending


def notify(kind: str, payload: str = "", *, using: str = DEFAULT_DB_ALIAS) -> None:
    """Wake the workers: ``kind`` happened (see the module text). Call it inside the
    transaction that made the change; it is delivered when that transaction commits."""
    message = f"{kind}:{payload}" if payload else kind
    which = backend(using)
    if which == "postgresql":
        with connections[using].cursor() as cursor:
            cursor.execute("SELECT pg_notify(%s, %s)", [CHANNEL, message])
        return
    send = _publish_redis if which == "redis" else _send_sockets
    if connections[using].in_atomic_block:
        transaction.on_commit(lambda: _safely(send, message), using=using)
    else:
        _safely(send, message)


def _safely(send: Callable[[str], None], message: str) -> None:
    try:
        send(message)
    except Exception as exc:  # a lost wake-up costs latency only: the worker polls
        logger.warning("wake-up %r not sent: %s", message, exc)


_redis_client: Any = None


def _publish_redis(message: str) -> None:
    global _redis_client
    if _redis_client is None:
        import redis

        _redis_client = redis.Redis.from_url(redis_url(), socket_timeout=1)
    _redis_client.publish(REDIS_CHANNEL, message)


def _send_sockets(message: str) -> None:
    directory = socket_dir()
    if not directory.is_dir():
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender:
        sender.setblocking(False)
        # A socket too full to take it is full of wake-ups already: its worker will look.
        data = message.encode()
        for path in directory.glob("*.sock"):
            send_datagram(sender, path, data)


def send_datagram(sender: socket.socket, path: Path, data: bytes) -> bool:
    """Send ``data`` from the non-blocking ``sender`` to the socket at ``path``; False when
    the socket is too full to take it. A socket that refuses it or is gone is removed (its
    process will never read it again): nothing left to send to, True."""
    try:
        sender.sendto(data, str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        _remove(path)
    except BlockingIOError:
        return False
    return True


# ------------------------------------------------------------------------------ listening


def pg_params(using: str = DEFAULT_DB_ALIAS) -> dict[str, Any]:
    """psycopg connection parameters of a Django PostgreSQL connection, for a connection of
    our own (outside Django's pool)."""
    params = dict(connections[using].get_connection_params())
    for key in ("cursor_factory", "context", "server_side_binding"):
        params.pop(key, None)
    return params


async def listen(
    kind: str,
    *,
    pg_channel: str,
    redis_channel: str,
    socket_path: Path,
    deliver: Callable[[bytes | str], None],
    ready: Callable[[], None],
    using: str = DEFAULT_DB_ALIAS,
) -> None:
    """Receive messages on one transport until cancelled (or the transport fails):
    ``LISTEN`` on PostgreSQL, a Redis subscription, or a datagram socket bound at
    ``socket_path`` (removed afterwards). Calls ``ready()`` once listening."""
    if kind == "postgresql":
        import psycopg

        conn = await psycopg.AsyncConnection.connect(**pg_params(using), autocommit=True)
        try:
            await conn.execute(f"LISTEN {pg_channel}")
            ready()
            async for message in conn.notifies():
                deliver(message.payload)
        finally:
            await conn.close()
        return
    if kind == "redis":
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(redis_url())
        pubsub = client.pubsub()
        try:
            await pubsub.subscribe(redis_channel)
            ready()
            async for message in pubsub.listen():
                if message.get("type") == "message":
                    deliver(message["data"])
        finally:
            await pubsub.aclose()
            await client.aclose()
        return
    await asyncio.to_thread(_fresh_socket_path, socket_path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.setblocking(False)
    sock.bind(str(socket_path))
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue[bytes] = asyncio.Queue()

    def readable() -> None:
        while True:
            try:
                inbox.put_nowait(sock.recv(65536))
            except OSError:  # nothing more to read now (BlockingIOError) or closed
                return

    loop.add_reader(sock.fileno(), readable)
    ready()
    try:
        while True:
            deliver(await inbox.get())
    finally:
        loop.remove_reader(sock.fileno())
        sock.close()
        _remove(socket_path)


async def keep_listening(
    kind: str,
    *,
    on_drop: Callable[[Exception], None],
    ready: Callable[[], None],
    **channel: Any,
) -> None:
    """`listen` until cancelled, listening again (backoff 0.2 s → 5 s) whenever the channel
    drops — a database or Redis restart, a lost connection; ``on_drop(exc)`` is told each
    time. ``ready`` is called once listening (or once the first attempt failed)."""
    delay = RECONNECT_START
    while True:
        try:
            await listen(kind, ready=ready, **channel)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            ready()
            on_drop(exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, RECONNECT_MAX)
        else:
            delay = RECONNECT_START


def _fresh_socket_path(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove(path)


def _remove(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


class ChannelListener:
    """A process's listening end of one channel (``pg_channel`` on PostgreSQL,
    ``redis_channel`` on Redis, a datagram socket at `_socket_path` otherwise): listens in
    a task named ``task_name``, hands every message to `_deliver`, and listens again with
    backoff when the channel drops (counted in ``reconnects``, logged on ``logger`` as the
    ``label`` channel)."""

    pg_channel: str
    redis_channel: str
    task_name: str
    label: str
    logger: logging.Logger

    def __init__(self, *, using: str = DEFAULT_DB_ALIAS) -> None:
        self.using = using
        self.kind = backend(using)
        self.reconnects = 0
        self._task: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()

    def _socket_path(self) -> Path:
        """Where this end binds its datagram socket (the socket transport)."""
        raise NotImplementedError

    def _deliver(self, data: bytes | str) -> None:
        """Handle one message (a socket datagram or a notification's payload)."""
        raise NotImplementedError

    @property
    def listening(self) -> bool:
        """Whether the listening task runs."""
        return self._task is not None and not self._task.done()

    def _begin(self) -> None:
        """Start the listening task (see `_until_ready`)."""
        self._ready = asyncio.Event()
        self._task = asyncio.create_task(self._run(), name=f"{self.task_name}-{self.kind}")

    async def _until_ready(self, seconds: float) -> None:
        """Wait until the task listens (or failed once), at most ``seconds``."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._ready.wait(), seconds)

    async def _stop(self) -> None:
        """Cancel the listening task and wait for it to end."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _run(self) -> None:
        await keep_listening(
            self.kind,
            pg_channel=self.pg_channel,
            redis_channel=self.redis_channel,
            socket_path=self._socket_path(),
            deliver=self._deliver,
            ready=self._ready.set,
            using=self.using,
            on_drop=self._dropped,
        )

    def _dropped(self, exc: Exception) -> None:
        self.reconnects += 1
        self.logger.warning("%s channel (%s) dropped: %s; reconnecting", self.label, self.kind, exc)


class Listener(ChannelListener):
    """A worker's end of the channel: every message, as ``(kind, payload)``, waits in its
    inbox for the worker to take it (`next`), in arrival order; the channel reconnects (with
    backoff) when it drops."""

    pg_channel = CHANNEL
    redis_channel = REDIS_CHANNEL
    task_name = "wakeups"
    label = "wake-up"
    logger = logger

    def __init__(self, *, worker_id: str, using: str = DEFAULT_DB_ALIAS) -> None:
        super().__init__(using=using)
        self.worker_id = worker_id
        self.received = 0
        self._inbox: asyncio.Queue[tuple[str, str]] = asyncio.Queue()

    async def start(self) -> None:
        """Start listening; returns once the channel is listening (or failed once)."""
        self._begin()
        await self._until_ready(10)

    async def close(self) -> None:
        await self._stop()

    def snapshot(self) -> dict[str, Any]:
        return {"channel": self.kind, "received": self.received, "reconnects": self.reconnects}

    def _socket_path(self) -> Path:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in self.worker_id)
        return socket_dir() / f"{safe}-{os.getpid()}.sock"

    async def next(self) -> tuple[str, str]:
        """The oldest message not yet taken, waiting for one: ``(kind, payload)``."""
        return await self._inbox.get()

    def _deliver(self, data: bytes | str) -> None:
        self.received += 1
        message = data.decode(errors="replace") if isinstance(data, bytes) else str(data)
        kind, _, payload = message.partition(":")
        self._inbox.put_nowait((kind, payload))

    def _dropped(self, exc: Exception) -> None:
        super()._dropped(exc)
        # Whatever was sent meanwhile is found by polling; say so to the worker.
        self._deliver("run")
