"""A bounded pool of shared values by key, borrowed through leases (Django-free).

The rules the model client pool (`pooling.clients`) and the MCP session pool
(`agents.mcp`) share: one value per key, built once however many borrowers ask at the same
moment (coalesced initialisation); no timed expiry — an idle value stays until it is
evicted (least-recently-borrowed first, only when nobody holds a lease on it) or the pool
closes; a pool whose every slot is leased refuses at once with a retryable error (nobody
queues); a value whose close failed stops all admission.

Concurrency notes (why it is built this way):

* Every mutation of the pool's bookkeeping happens between two awaits, and the worker is
  one asyncio loop, so those sections are atomic without a lock. The only awaits in
  ``acquire_key`` are on the shared build (outside any bookkeeping) and on an evicted
  value's close, after which the whole algorithm starts over. That keeps the warm path to
  a few dict operations.
* The build of a value runs as its own task and every borrower awaits it through
  ``asyncio.shield``: a cancelled borrower releases its own lease but never cancels the
  build other borrowers are waiting for.
* Shutdown runs as one background task; callers await it shielded, so a cancelled caller
  does not stop the cleanup and a later ``close()`` joins the same task and its outcome.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

from sageproject.errors import ErrorCategory, RateLimitedError, UnavailableError

__all__ = ["KeyedPool", "Lease"]

logger = logging.getLogger(__name__)

Factory = Callable[[Any], Awaitable[Any]]
Closer = Callable[[Any], Awaitable[Any]]


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


class Lease:
    """A borrowed value. ``provider`` is the shared value; close the lease when done.

    ``close()`` is idempotent and synchronous underneath, so it always completes even when
    the caller is being cancelled. ``async with lease:`` closes it on exit. ``discard()``
    says the value is broken (a dropped connection, refused credentials): the next
    borrower of the key gets a new one, and this one closes when its last lease does.
    """

    __slots__ = ("_closed", "_entry", "_pool", "_provider")

    def __init__(self, pool: KeyedPool, entry: _Entry, provider: Any) -> None:
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

    def discard(self) -> None:
        """Take the value out of the pool (see the class text); the lease stays open."""
        self._pool._discard(self._entry)

    async def __aenter__(self) -> Lease:
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        await self.close()
        return False

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<{type(self).__name__} {self._entry.key[:12]} {state}>"


class KeyedPool:
    """At most ``max_entries`` values, shared by key, borrowed through leases.

    Subclasses name what they pool through the class attributes (error codes and
    messages, the leases' class, the task and log label).
    """

    lease_class: ClassVar[type[Lease]] = Lease
    label: ClassVar[str] = "pooled value"
    full_code: ClassVar[str] = "server.pool_full"
    full_message: ClassVar[str] = "all pool slots are in use"
    closed_code: ClassVar[str] = "server.pool_closed"
    closed_message: ClassVar[str] = "the pool is closed"
    cleanup_code: ClassVar[str] = "server.pool_cleanup_failed"
    cleanup_message: ClassVar[str] = "pool cleanup failed"
    size_name: ClassVar[str] = "max_entries"

    def __init__(self, factory: Factory, closer: Closer, *, max_entries: int = 64) -> None:
        """``factory(arg_copy)`` builds a value, ``closer(value)`` closes one.

        Raises ``ValueError`` when ``max_entries < 1``.
        """
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 1:
            raise ValueError(f"{self.size_name} must be positive")
        self._factory = factory
        self._closer = closer
        self._max_entries = max_entries
        # Insertion order is borrow order: the first entry is the least recently borrowed.
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        # Discarded entries still leased: closed when their last lease is.
        self._discarded: set[_Entry] = set()
        self._retiring: set[asyncio.Task[None]] = set()
        self._active_leases = 0
        self._constructions = 0
        self._closed = False
        self._close_errors: list[Exception] = []
        self._close_task: asyncio.Task[None] | None = None
        self._idle: asyncio.Event | None = None

    @property
    def max_entries(self) -> int:
        return self._max_entries

    @property
    def closed(self) -> bool:
        return self._closed

    async def acquire_key(self, key: str, arg: Any) -> Lease:
        """Borrow the value of ``key``, built from a deep copy of ``arg`` on first use.

        ``key`` must say everything the value depends on (and never be a secret: it is
        shown in logs, shortened). Returns a lease (`lease_class`). Raises
        ``UnavailableError`` `closed_code` after ``close()``, ``UnavailableError``
        `cleanup_code` once any value failed to close, ``RateLimitedError`` `full_code`
        (retryable, resumable) when every slot is leased, and whatever the factory raised
        when the build failed (the failure is not cached).
        """
        while True:
            # 1. Closed pools admit nobody.
            if self._closed:
                raise UnavailableError(
                    self.closed_code, self.closed_message, category=ErrorCategory.UNAVAILABLE
                )
            # 2. One cleanup failure stops all admission: a value we could not close may
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
                # 4. Values still closing (or discarded but leased) count toward capacity.
                if len(entries) + len(self._retiring) + len(self._discarded) >= self._max_entries:
                    victim = next((e for e in entries.values() if e.users == 0), None)
                    if victim is None:
                        raise RateLimitedError(
                            self.full_code,
                            self.full_message,
                            category=ErrorCategory.RATE_LIMITED,
                            retryable=True,
                            resumable=True,
                            details={self.size_name: self._max_entries},
                        )
                    del entries[victim.key]
                    retire = self._start_retire(victim)
                    # The new value is built only once the old one has fully closed.
                    # asyncio.wait never cancels what it waits for, so a cancelled caller
                    # leaves the close running; a failed close is seen at step 2.
                    await asyncio.wait((retire,))
                    continue
                build = asyncio.get_running_loop().create_task(
                    self._factory(copy.deepcopy(arg)), name=f"{self._task_label}-build-{key[:12]}"
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
        return self.lease_class(self, entry, provider)

    async def snapshot(self) -> dict[str, Any]:
        """Return ``{"entries", "closing", "active_leases", "max_entries",
        "constructions"}`` (counts only; no keys, no secrets)."""
        return {
            "entries": len(self._entries) + len(self._discarded),
            "closing": len(self._retiring),
            "active_leases": self._active_leases,
            "max_entries": self._max_entries,
            "constructions": self._constructions,
        }

    async def close(self) -> None:
        """Stop admission, wait for every lease, then close every value.

        Idempotent: the cleanup runs once in a background task that a cancelled caller
        does not interrupt, and every later call awaits the same outcome. Every value is
        attempted; raises ``UnavailableError`` `cleanup_code` (chained from an
        ``ExceptionGroup`` of every failure) if any closer failed.
        """
        if self._close_task is None:
            self._closed = True
            self._close_task = asyncio.get_running_loop().create_task(
                self._shutdown(), name=f"{self._task_label}-pool-close"
            )
            self._close_task.add_done_callback(_consume_exception)
        await asyncio.shield(self._close_task)

    # -- internals ------------------------------------------------------------------

    @property
    def _task_label(self) -> str:
        return self.label.replace(" ", "-")

    def _release(self, entry: _Entry) -> None:
        entry.users -= 1
        self._active_leases -= 1
        if entry.users == 0:
            if entry in self._discarded:
                self._discarded.discard(entry)
                self._start_retire(entry)
            elif entry.failed and self._entries.get(entry.key) is entry:
                # A failed build must not hold a slot until someone happens to look it up.
                del self._entries[entry.key]
        if self._active_leases == 0 and self._idle is not None:
            self._idle.set()

    def _discard(self, entry: _Entry) -> None:
        if self._entries.get(entry.key) is not entry:
            return  # already discarded, evicted or replaced
        del self._entries[entry.key]
        if entry.users == 0:
            self._start_retire(entry)
        else:
            self._discarded.add(entry)

    def _start_retire(self, entry: _Entry) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(
            self._retire(entry), name=f"{self._task_label}-close-{entry.key[:12]}"
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
                "%s close failed (key %s): %s", self.label, entry.key[:12], type(exc).__name__
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
        # Includes values an eviction was already closing: report their failures too.
        tasks = list(self._retiring)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._close_errors:
            raise self._cleanup_error() from ExceptionGroup(
                f"{self.label} cleanup failed", list(self._close_errors)
            )

    def _cleanup_error(self) -> UnavailableError:
        return UnavailableError(
            self.cleanup_code,
            self.cleanup_message,
            category=ErrorCategory.UNAVAILABLE,
            details={"failed_closes": len(self._close_errors)},
        )

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} entries={len(self._entries)} "
            f"closing={len(self._retiring)} leases={self._active_leases} max={self._max_entries}>"
        )
