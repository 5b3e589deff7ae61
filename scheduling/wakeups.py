"""Push wake-ups: a worker learns at once that there is work, instead of polling for it.

One channel per deployment, chosen by the database and settings:

- **PostgreSQL**: ``LISTEN``/``NOTIFY`` on ``sage_wakeup``. The notifying transaction
  (admission, a resume, a cancel) sends ``pg_notify`` inside itself, so the message is
  delivered exactly when the change commits (never for a rolled-back one). Each worker
  holds one listening connection (psycopg, outside Django's pool).
- **Redis** (``REDIS_URL`` set, other databases): pub/sub on ``sage:wakeup``, published
  after the commit.
- **Local socket** (the embedded SQLite default, or no Redis): each worker binds a Unix
  datagram socket under ``.local/wakeup/``; the web process sends a datagram to every socket
  there after the commit (a stale socket is removed).

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

OnWake = Callable[[str, str], None]


def socket_dir() -> Path:
    return Path(settings.BASE_DIR) / ".local" / "wakeup"


def _redis_url() -> str | None:
    return (getattr(settings, "SAGE", {}) or {}).get("REDIS_URL") or None


def backend(using: str = DEFAULT_DB_ALIAS) -> str:
    """``postgresql``, ``redis`` or ``socket``: the channel this deployment uses."""
    if connections[using].vendor == "postgresql":
        return "postgresql"
    if _redis_url():
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

        _redis_client = redis.Redis.from_url(_redis_url(), socket_timeout=1)
    _redis_client.publish(REDIS_CHANNEL, message)


def _send_sockets(message: str) -> None:
    directory = socket_dir()
    if not directory.is_dir():
        return
    data = message.encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender:
        sender.setblocking(False)
        for path in directory.glob("*.sock"):
            try:
                sender.sendto(data, str(path))
            except (ConnectionRefusedError, FileNotFoundError):
                # Its worker is gone: nobody will read this socket again.
                with contextlib.suppress(OSError):
                    path.unlink()
            except BlockingIOError:
                pass  # its buffer is full of wake-ups already: it will look anyway


# ------------------------------------------------------------------------------ listening


class Listener:
    """A worker's end of the channel: calls ``on_wake(kind, payload)`` on its event loop
    for every message, reconnecting (with backoff) when the channel drops."""

    def __init__(self, on_wake: OnWake, *, worker_id: str, using: str = DEFAULT_DB_ALIAS) -> None:
        self.on_wake = on_wake
        self.worker_id = worker_id
        self.using = using
        self.kind = backend(using)
        self.received = 0
        self.reconnects = 0
        self._task: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()
        self._socket_path: Path | None = None

    async def start(self) -> None:
        """Start listening; returns once the channel is listening (or failed once)."""
        self._task = asyncio.create_task(self._run(), name=f"wakeups-{self.kind}")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._ready.wait(), 10)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._socket_path is not None:
            with contextlib.suppress(OSError):
                self._socket_path.unlink()

    def snapshot(self) -> dict[str, Any]:
        return {"channel": self.kind, "received": self.received, "reconnects": self.reconnects}

    def _deliver(self, message: str) -> None:
        self.received += 1
        kind, _, payload = message.partition(":")
        try:
            self.on_wake(kind, payload)
        except Exception:
            logger.exception("wake-up handler failed for %r", message)

    async def _run(self) -> None:
        delay = RECONNECT_START
        listen = {
            "postgresql": self._listen_postgresql,
            "redis": self._listen_redis,
            "socket": self._listen_socket,
        }[self.kind]
        while True:
            try:
                await listen()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._ready.set()
                self.reconnects += 1
                logger.warning("wake-up channel (%s) dropped: %s; reconnecting", self.kind, exc)
                # Whatever was sent meanwhile is found by polling; say so to the worker.
                self._deliver("run")
                await asyncio.sleep(delay)
                delay = min(delay * 2, RECONNECT_MAX)
            else:
                delay = RECONNECT_START

    async def _listen_postgresql(self) -> None:
        import psycopg

        params = connections[self.using].get_connection_params()
        params.pop("cursor_factory", None)
        params.pop("context", None)
        params.pop("server_side_binding", None)
        conn = await psycopg.AsyncConnection.connect(**params, autocommit=True)
        try:
            await conn.execute(f"LISTEN {CHANNEL}")
            self._ready.set()
            async for message in conn.notifies():
                self._deliver(message.payload)
        finally:
            await conn.close()

    async def _listen_redis(self) -> None:
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(_redis_url())
        pubsub = client.pubsub()
        try:
            await pubsub.subscribe(REDIS_CHANNEL)
            self._ready.set()
            async for message in pubsub.listen():
                if message.get("type") == "message":
                    data = message["data"]
                    self._deliver(data.decode() if isinstance(data, bytes) else str(data))
        finally:
            await pubsub.aclose()
            await client.aclose()

    async def _listen_socket(self) -> None:
        directory = socket_dir()
        directory.mkdir(parents=True, exist_ok=True)
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in self.worker_id)
        path = directory / f"{safe}-{os.getpid()}.sock"
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.setblocking(False)
        sock.bind(str(path))
        self._socket_path = path
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[bytes] = asyncio.Queue()

        def readable() -> None:
            while True:
                try:
                    queue.put_nowait(sock.recv(4096))
                except BlockingIOError:
                    return
                except OSError:
                    return

        loop.add_reader(sock.fileno(), readable)
        self._ready.set()
        try:
            while True:
                self._deliver((await queue.get()).decode(errors="replace"))
        finally:
            loop.remove_reader(sock.fileno())
            sock.close()
