"""A bounded pool of model SDK clients shared by Runs.

The worker owns the clients; Runs borrow them through leases. One client exists per
(user, model record, protocol, base URL, model name, credential): changing any of those
changes the key, so new Runs get a new client while Runs already streaming finish on the
old one. There is no timed expiry; an idle client stays until it is evicted
(least-recently-borrowed first, only when nobody holds a lease on it) or the pool closes.

Concurrency notes (why it is built this way):

* Every mutation of the pool's bookkeeping happens between two awaits, and the worker is
  one asyncio loop, so those sections are atomic without a lock. The only awaits in
  ``acquire`` are on the shared build (outside any bookkeeping) and on an evicted client's
  close, after which the whole algorithm starts over. That keeps the warm path to a few
  dict operations.
* The build of a client runs as its own task and every borrower awaits it through
  ``asyncio.shield``: a cancelled borrower releases its own lease but never cancels the
  build other borrowers are waiting for.
* Shutdown runs as one background task; callers await it shielded, so a cancelled caller
  does not stop the cleanup and a later ``close()`` joins the same task and its outcome.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from sageproject.errors import ErrorCategory, RateLimitedError, UnavailableError

__all__ = ["ModelClientPool", "ModelLease", "pool_key"]

logger = logging.getLogger(__name__)

Factory = Callable[[Any], Awaitable[Any]]
Closer = Callable[[Any], Awaitable[Any]]


def _secret_plaintext(value: Any) -> Any:
    # Accept a plain string or a SecretStr-like object; the plaintext only ever enters
    # the digest below, never a log line or a snapshot.
    getter = getattr(value, "get_secret_value", None)
    return getter() if callable(getter) else value


def pool_key(user_id: Any, record: Any) -> str:
    """Return the pool key of ``user_id`` borrowing ``record``: a SHA-256 hex digest.

    The digest covers the user, the record id, protocol, base URL, model name and the
    credential in plaintext (compact JSON, ``ensure_ascii=False``), so a changed credential
    yields a new key while the key itself reveals nothing about the secret.
    """
    payload = json.dumps(
        [
            user_id,
            record.id,
            record.protocol,
            record.base_url,
            record.model,
            _secret_plaintext(getattr(record, "api_key", None)),
        ],
        ensure_ascii=False,
        separators=(",", ":"),
        default=str,
    )
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def _consume_exception(task: asyncio.Future[Any]) -> None:
    # A build or retire task may fail with nobody left awaiting it; retrieving the
    # exception here keeps asyncio from logging "exception was never retrieved" (the
    # failure is already handled: a failed build is dropped, a failed close recorded).
    if not task.cancelled():
        task.exception()


class _Entry:
    __slots__ = ("build", "key", "users")

    def __init__(self, key: str, build: asyncio.Task[Any]) -> None:
        self.key = key
        self.build = build
        self.users = 0

    @property
    def failed(self) -> bool:
        build = self.build
        return build.done() and (build.cancelled() or build.exception() is not None)


class ModelLease:
    """A borrowed client. ``provider`` is the shared client; close the lease when done.

    ``close()`` is idempotent and synchronous underneath, so it always completes even when
    the caller is being cancelled. ``async with lease:`` closes it on exit.
    """

    __slots__ = ("_closed", "_entry", "_pool", "_provider")

    def __init__(self, pool: ModelClientPool, entry: _Entry, provider: Any) -> None:
        self._pool = pool
        self._entry = entry
        self._provider = provider
        self._closed = False

    @property
    def provider(self) -> Any:
        return self._provider

    @property
    def key(self) -> str:
        """The pool key (a digest; safe to log)."""
        return self._entry.key

    @property
    def closed(self) -> bool:
        return self._closed

    async def close(self) -> None:
        """Return the client to the pool; a second call does nothing. Never raises."""
        if self._closed:
            return
        self._closed = True
        self._pool._release(self._entry)

    async def __aenter__(self) -> ModelLease:
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        await self.close()
        return False

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<ModelLease {self._entry.key[:12]} {state}>"


class ModelClientPool:
    """At most ``max_clients`` model clients, shared by key, borrowed through leases."""

    def __init__(self, factory: Factory, closer: Closer, *, max_clients: int = 64) -> None:
        """``factory(record_copy)`` builds a client, ``closer(client)`` closes one.

        Raises ``ValueError`` when ``max_clients < 1``.
        """
        if isinstance(max_clients, bool) or not isinstance(max_clients, int) or max_clients < 1:
            raise ValueError("max_model_clients must be positive")
        self._factory = factory
        self._closer = closer
        self._max_clients = max_clients
        # Insertion order is borrow order: the first entry is the least recently borrowed.
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._retiring: set[asyncio.Task[None]] = set()
        self._active_leases = 0
        self._constructions = 0
        self._closed = False
        self._close_errors: list[Exception] = []
        self._close_task: asyncio.Task[None] | None = None
        self._idle: asyncio.Event | None = None

    @property
    def max_clients(self) -> int:
        return self._max_clients

    @property
    def closed(self) -> bool:
        return self._closed

    async def acquire(self, user_id: Any, record: Any) -> ModelLease:
        """Borrow the client for ``user_id`` and ``record``, building it on first use.

        Returns a ``ModelLease``. Raises ``UnavailableError`` ``server.model_pool_closed``
        after ``close()``, ``UnavailableError`` ``server.model_pool_cleanup_failed`` once
        any client failed to close, ``RateLimitedError`` ``server.model_pool_full`` when
        every slot is leased (immediately; nobody queues), and whatever the factory raised
        when the build failed (the failure is not cached).
        """
        key = pool_key(user_id, record)
        while True:
            # 1. Closed pools admit nobody.
            if self._closed:
                raise UnavailableError(
                    "server.model_pool_closed",
                    "the model client pool is closed",
                    category=ErrorCategory.UNAVAILABLE,
                )
            # 2. One cleanup failure stops all admission: a client we could not close may
            #    still hold connections, so we must not add more on top of it.
            if self._close_errors:
                raise self._cleanup_error() from self._close_errors[0]
            entries = self._entries
            entry = entries.get(key)
            # 3. A failed build nobody is waiting on is dropped, so it is retried.
            if entry is not None and entry.users == 0 and entry.failed:
                del entries[key]
                entry = None
            if entry is None:
                # 4. Clients still closing count toward capacity.
                if len(entries) + len(self._retiring) >= self._max_clients:
                    victim = next((e for e in entries.values() if e.users == 0), None)
                    if victim is None:
                        raise RateLimitedError(
                            "server.model_pool_full",
                            "all model client slots are in use",
                            category=ErrorCategory.RATE_LIMITED,
                            retryable=True,
                            resumable=True,
                            details={"max_clients": self._max_clients},
                        )
                    del entries[victim.key]
                    retire = self._start_retire(victim)
                    # The new client is built only once the old one has fully closed.
                    # asyncio.wait never cancels what it waits for, so a cancelled caller
                    # leaves the close running; a failed close is seen at step 2.
                    await asyncio.wait((retire,))
                    continue
                build = asyncio.get_running_loop().create_task(
                    self._factory(copy.deepcopy(record)), name=f"model-client-build-{key[:12]}"
                )
                build.add_done_callback(_consume_exception)
                entry = _Entry(key, build)
                entries[key] = entry
                self._constructions += 1
            # 5. Count the borrower and mark the entry most recently borrowed.
            entry.users += 1
            self._active_leases += 1
            entries.move_to_end(key)
            break
        # 6. Wait for the (possibly shared) build; never cancel it for the others.
        build = entry.build
        try:
            provider = build.result() if build.done() else await asyncio.shield(build)
        except BaseException:
            self._release(entry)
            raise
        return ModelLease(self, entry, provider)

    async def snapshot(self) -> dict[str, Any]:
        """Return ``{"clients", "closing_clients", "active_leases", "max_clients",
        "constructions"}`` (counts only; no keys, no secrets)."""
        return {
            "clients": len(self._entries),
            "closing_clients": len(self._retiring),
            "active_leases": self._active_leases,
            "max_clients": self._max_clients,
            "constructions": self._constructions,
        }

    async def close(self) -> None:
        """Stop admission, wait for every lease, then close every client.

        Idempotent: the cleanup runs once in a background task that a cancelled caller
        does not interrupt, and every later call awaits the same outcome. Every client is
        attempted; raises ``UnavailableError`` ``server.model_pool_cleanup_failed``
        (chained from an ``ExceptionGroup`` of every failure) if any closer failed.
        """
        if self._close_task is None:
            self._closed = True
            self._close_task = asyncio.get_running_loop().create_task(
                self._shutdown(), name="model-client-pool-close"
            )
            self._close_task.add_done_callback(_consume_exception)
        await asyncio.shield(self._close_task)

    # -- internals ------------------------------------------------------------------

    def _release(self, entry: _Entry) -> None:
        entry.users -= 1
        self._active_leases -= 1
        if entry.users == 0 and entry.failed and self._entries.get(entry.key) is entry:
            # A failed build must not hold a slot until someone happens to look it up.
            del self._entries[entry.key]
        if self._active_leases == 0 and self._idle is not None:
            self._idle.set()

    def _start_retire(self, entry: _Entry) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(
            self._retire(entry), name=f"model-client-close-{entry.key[:12]}"
        )
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)
        task.add_done_callback(_consume_exception)
        return task

    async def _retire(self, entry: _Entry) -> None:
        # Wait for the build without being able to cancel it (asyncio.wait never cancels).
        await asyncio.wait((entry.build,))
        if entry.failed:
            return  # nothing was built, so there is nothing to close
        try:
            await self._closer(entry.build.result())
        except Exception as exc:
            self._close_errors.append(exc)
            logger.error(
                "model client close failed (key %s): %s", entry.key[:12], type(exc).__name__
            )
            raise

    async def _shutdown(self) -> None:
        while self._active_leases > 0:
            self._idle = asyncio.Event()
            await self._idle.wait()
        self._idle = None
        entries = list(self._entries.values())
        self._entries.clear()
        for entry in entries:
            self._start_retire(entry)
        # Includes clients an eviction was already closing: report their failures too.
        tasks = list(self._retiring)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._close_errors:
            raise self._cleanup_error() from ExceptionGroup(
                "model client cleanup failed", list(self._close_errors)
            )

    def _cleanup_error(self) -> UnavailableError:
        return UnavailableError(
            "server.model_pool_cleanup_failed",
            "model client pool cleanup failed",
            category=ErrorCategory.UNAVAILABLE,
            details={"failed_closes": len(self._close_errors)},
        )

    def __repr__(self) -> str:
        return (
            f"<ModelClientPool clients={len(self._entries)} closing={len(self._retiring)} "
            f"leases={self._active_leases} max={self._max_clients}>"
        )
