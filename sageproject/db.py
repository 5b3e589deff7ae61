"""Running ORM work from the worker's event loop.

Every blocking database call of the worker goes through ``db_call``: it runs in a thread
(never on the loop) and gives the thread's connection back afterwards when the connection
settings say so. With PostgreSQL's connection pool (CONN_MAX_AGE 0) that returns the
connection to the pool after each call, so idle threads never pin pool slots; SQLite
(persistent) and MySQL (CONN_MAX_AGE 60) keep theirs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from asgiref.sync import sync_to_async
from django.db import close_old_connections

P = ParamSpec("P")
T = TypeVar("T")


def _call_and_release[T](fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    try:
        return fn(*args, **kwargs)
    finally:
        close_old_connections()


async def db_call[T](fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run ``fn(*args, **kwargs)`` in a worker thread and return its result."""
    return await sync_to_async(_call_and_release, thread_sensitive=False)(fn, *args, **kwargs)
