"""The peers' trivial task body: record when the task started (``time.time()``) in Redis.

``key`` is a Redis hash owned by one benchmark path; field ``i`` (the submission's index)
gets the start time. The time is read first, before any I/O.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/13"

_lock = threading.Lock()
_client: Any = None
_async_clients: dict[int, Any] = {}


def redis_url() -> str:
    return os.environ.get("BENCH_E2E_REDIS_URL") or DEFAULT_REDIS_URL


def client() -> Any:
    """One thread-safe Redis client per process."""
    global _client
    if _client is None:
        with _lock:
            if _client is None:
                import redis

                _client = redis.Redis.from_url(redis_url())
    return _client


def record(key: str, i: int) -> None:
    started = time.time()
    client().hset(key, str(i), repr(started))


async def arecord(key: str, i: int) -> None:
    """`record` for async tasks: a redis.asyncio client per event loop."""
    import asyncio

    started = time.time()
    loop_id = id(asyncio.get_running_loop())
    aclient = _async_clients.get(loop_id)
    if aclient is None:
        import redis.asyncio as aioredis

        aclient = _async_clients[loop_id] = aioredis.Redis.from_url(redis_url())
    await aclient.hset(key, str(i), repr(started))
