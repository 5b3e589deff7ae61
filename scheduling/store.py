"""Incremental event persistence: the session store coordinator and its writers.

One :class:`SessionStoreCoordinator` per worker process keeps each open session's history
in memory together with the length of its durable prefix (``Session.persisted_events``).
A commit appends to the history and hands only the events after the persisted prefix to a
writer, so appending to a 100,000-event session costs what appending to an empty one does.

Writers are threads, each owning one Django database connection and fed by a queue. A
writer takes every commit waiting for it, from any number of sessions, into one database
transaction (group commit); each commit runs in its own savepoint with its own lease-fence
check, so a stale run's commit is rejected alone while the rest of the batch lands. Every
caller is answered only after the transaction has committed, so an answered event is a
durable event. ``SAGE_STORE_WRITERS`` writers may run; a session always uses the same one.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db import (
    DEFAULT_DB_ALIAS,
)
from django.utils import timezone

from sageproject.db import (
    db_call,
)
from sageproject.errors import (
    ConflictError,
    NotFoundError,
    SageError,
    ValidationError,
)
from scheduling import live
from scheduling.models import Event, Session
from scheduling.runs import Fence, check_fence
from scheduling.serialization import (
    SessionEvent,
    encode_payload,
    ensure_encoded,
    export_session_lines,
    import_session_lines,
)
from scheduling.store_writer import (
    Transition,
    _Call,
    _Commit,
    _Request,
    _Writer,
    fence_rejected,
    store_closed,
)

__all__ = [
    "CommitResult",
    "CommitSpec",
    "EventDraft",
    "Fence",
    "SessionStoreCoordinator",
    "append_events",
    "check_fence",
    "close_default_coordinator",
    "dump_events",
    "encode_payload",
    "export_session_lines",
    "fence_rejected",
    "get_default_coordinator",
    "import_session_lines",
]

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------
# Values


@dataclass(frozen=True, slots=True, kw_only=True)
class EventDraft:
    """An event to append: its type and its (not yet serialized) payload."""

    type: str
    payload: Any


@dataclass(frozen=True, slots=True, kw_only=True)
class CommitSpec:
    """One session's part of :meth:`SessionStoreCoordinator.commit_many`."""

    session_id: Any
    run_id: Any = None
    drafts: Sequence[EventDraft | tuple[str, Any]] = ()
    fence: Fence | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class CommitResult:
    """What a commit made durable.

    ``seqs`` are the seqs of the appended events; ``written`` the event rows inserted
    (the whole history after a truncation or a run deletion, when ``replaced`` is true);
    ``persisted_events`` the durable prefix length afterwards.
    """

    session_id: str
    seqs: tuple[int, ...]
    persisted_events: int
    written: int
    replaced: bool


def session_key(session_id: Any) -> str:
    """The canonical text of a session id (``UUID`` or any spelling of it)."""
    try:
        return str(session_id if isinstance(session_id, uuid.UUID) else uuid.UUID(str(session_id)))
    except ValueError:
        raise NotFoundError("store.session_not_found", f"no session {session_id!r}") from None


def dump_events(history: list[SessionEvent], offset: int | None = None) -> list[SessionEvent]:
    """Serialize (once) and return the events a commit must write.

    ``offset=None``: the full history. ``offset <= len(history)``: only
    ``history[offset:]`` — the persisted prefix is never visited, so it costs nothing.
    ``offset > len(history)`` (the history was truncated below the persisted prefix):
    the full current history. Raises ``ValidationError`` for an unserializable payload.
    """
    if offset is None or offset > len(history):
        events = list(history)
    elif offset == len(history):
        return []
    else:
        events = history[offset:]
    for event in events:
        if event.data is None:
            ensure_encoded(event)
    return events


# ---------------------------------------------------------------------------------------
# Coordinator


def _marker(last: tuple[Any, str, datetime] | None) -> tuple[Any, ...]:
    if last is None:
        return (None, None, None)
    run_id, etype, created_at = last
    return (str(run_id) if run_id is not None else None, etype, created_at)


def _prefix_marker(state: _SessionState) -> tuple[Any, ...]:
    """What the database's durable prefix looks like if this cached state is current."""
    if state.persisted == 0 or state.persisted > len(state.history):
        return (state.persisted, None, None, None)
    last = state.history[state.persisted - 1]
    return (state.persisted, *_marker((last.run_id, last.type, last.created_at)))


class _SessionState:
    """An open session: its history and what of it is durable."""

    __slots__ = ("clean", "history", "key", "persisted")

    def __init__(self, key: str, history: list[SessionEvent], persisted: int, clean: int) -> None:
        self.key = key
        self.history = history
        # Length of the durable prefix (what Session.persisted_events says).
        self.persisted = persisted
        # Length of the prefix of ``history`` known to equal the durable rows; below
        # ``persisted`` after a truncation or a run deletion rewrote the history.
        self.clean = clean


class _LockEntry:
    __slots__ = ("lock", "users")

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.users = 0


def _as_draft(item: EventDraft | tuple[str, Any]) -> EventDraft:
    if isinstance(item, EventDraft):
        return item
    etype, payload = item
    return EventDraft(type=etype, payload=payload)


class SessionStoreCoordinator:
    """Owns the open sessions of one worker process and persists them incrementally.

    ``writers`` defaults to ``settings.SAGE["SAGE_STORE_WRITERS"]``; ``group_commit=False``
    gives every commit its own transaction (the benchmark's baseline). All methods are
    coroutines for one event loop; the database work happens on the writer threads.
    """

    def __init__(
        self,
        *,
        using: str = DEFAULT_DB_ALIAS,
        writers: int | None = None,
        group_commit: bool = True,
        max_batch: int = 1024,
        clock: Callable[[], datetime] = timezone.now,
        max_open_sessions: int = 1024,
        idle_close_seconds: float = 2.0,
    ) -> None:
        if writers is None:
            writers = int(getattr(settings, "SAGE", {}).get("SAGE_STORE_WRITERS", 1) or 1)
        if writers < 1 or max_batch < 1 or max_open_sessions < 1:
            raise ValueError("writers, max_batch and max_open_sessions must be positive")
        self.using = using
        self.group_commit = group_commit
        self._clock = clock
        self._max_open = max_open_sessions
        self._states: OrderedDict[str, _SessionState] = OrderedDict()
        self._locks: dict[str, _LockEntry] = {}
        self._closed = False
        self._writers = [
            _Writer(
                index=i,
                using=using,
                group_commit=group_commit,
                max_batch=max_batch,
                idle_close_seconds=idle_close_seconds,
            )
            for i in range(writers)
        ]
        for writer in self._writers:
            writer.start()

    # -- locking --------------------------------------------------------------------

    @asynccontextmanager
    async def locked(self, *session_ids: Any) -> AsyncIterator[list[str]]:
        """Hold the locks of ``session_ids``, taken in sorted order (no deadlocks).

        Yields the canonical keys. Operations on a session are serialized by its lock;
        different sessions proceed concurrently.
        """
        keys = sorted({session_key(s) for s in session_ids})
        entries = []
        for key in keys:
            entry = self._locks.get(key)
            if entry is None:
                entry = self._locks[key] = _LockEntry()
            entry.users += 1
            entries.append(entry)
        acquired: list[_LockEntry] = []
        try:
            for entry in entries:
                await entry.lock.acquire()
                acquired.append(entry)
            yield keys
        finally:
            for entry in reversed(acquired):
                entry.lock.release()
            for key, entry in zip(keys, entries, strict=True):
                entry.users -= 1
                if entry.users == 0:
                    del self._locks[key]

    # -- writers --------------------------------------------------------------------

    def _writer_for(self, key: str) -> _Writer:
        # A session always lands on the same writer: its commits stay in order.
        return self._writers[uuid.UUID(key).int % len(self._writers)]

    async def _wait(self, request: _Request) -> Any:
        """Wait for a writer's answer; a cancelled caller still waits for the write.

        The write is shielded, so cancellation never detaches it; the cancellation is
        re-raised by the caller once the outcome is applied (see ``_persist_locked``).
        Returns ``(result, error, cancelled)``.
        """
        cancelled = False
        while True:
            try:
                await asyncio.shield(request.future)
            except asyncio.CancelledError:
                if not request.future.done():
                    cancelled = True
                    continue
                if request.future.cancelled():
                    raise
            except Exception:
                pass
            break
        error = request.future.exception()
        return (None if error else request.future.result()), error, cancelled

    async def call_in_writer(self, session_id: Any, fn: Callable[[], Any]) -> Any:
        """Run ``fn()`` on the writer thread (and connection) of ``session_id``.

        Returns what ``fn`` returns and raises what it raises. For diagnostics and tests
        (e.g. capturing the writer connection's queries).
        """
        if self._closed:
            raise store_closed()
        request = _Call(fn)
        self._writer_for(session_key(session_id)).submit(request)
        result, error, cancelled = await self._wait(request)
        if cancelled:
            raise asyncio.CancelledError
        if error is not None:
            raise error
        return result

    # -- opening --------------------------------------------------------------------

    def _load_sync(self, key: str) -> _SessionState:
        try:
            persisted = (
                Session.objects.using(self.using)
                .values_list("persisted_events", flat=True)
                .get(pk=key)
            )
        except Session.DoesNotExist:
            raise NotFoundError("store.session_not_found", f"no session {key}") from None
        history = [
            SessionEvent(seq=seq, type=etype, run_id=run_id, created_at=created_at, data=data)
            for seq, etype, run_id, created_at, data in Event.objects.using(self.using)
            .filter(session_id=key)
            .order_by("seq")
            .values_list("seq", "type", "run_id", "created_at", "data")
            .iterator(chunk_size=5000)
        ]
        contiguous = all(e.seq == i for i, e in enumerate(history, start=1))
        # Rows that disagree with the counter (written by an older code path, say) make
        # the next commit rewrite the session, which heals it.
        clean = persisted if contiguous and len(history) == persisted else 0
        return _SessionState(key, history, persisted, clean)

    async def _open_locked(self, key: str) -> _SessionState:
        state = self._states.get(key)
        if state is None:
            # Reads go through a thread of their own, not the writer: the writer's
            # connection is for commits (the session's lock orders this read after them).
            state = await db_call(self._load_sync, key)
            self._states[key] = state
            self._evict()
        else:
            self._states.move_to_end(key)
        return state

    def _evict(self) -> None:
        # Drop the least recently used sessions nobody is working on — looking only as far
        # into the order as it takes to find them (usually one: this runs per new session).
        excess = len(self._states) - self._max_open
        if excess <= 0:
            return
        victims = []
        for key in self._states:
            if key not in self._locks:
                victims.append(key)
                if len(victims) == excess:
                    break
        for key in victims:
            del self._states[key]

    # -- persisting -----------------------------------------------------------------

    async def _persist_locked(
        self,
        state: _SessionState,
        *,
        fence: Fence | None,
        restore: Callable[[], None],
        seqs: tuple[int, ...] = (),
        delete_runs: tuple[Any, ...] = (),
        transition: Transition | None = None,
    ) -> CommitResult:
        """Write what changed in ``state`` (and apply ``transition`` in the same
        transaction); undo the in-memory change if that fails."""
        replace = state.clean < state.persisted
        try:
            rows = dump_events(state.history, None if replace else state.persisted)
        except ValidationError:
            restore()
            raise
        total = len(state.history)
        if not rows and not replace and not delete_runs and transition is None:
            # Nothing new: not one statement.
            return CommitResult(
                session_id=state.key,
                seqs=seqs,
                persisted_events=state.persisted,
                written=0,
                replaced=False,
            )
        request = _Commit(
            session_id=state.key,
            fence=fence,
            replace=replace,
            rows=rows,
            delete_runs=delete_runs,
            expected=state.persisted,
            total=total,
            transition=transition,
        )
        try:
            self._writer_for(state.key).submit(request)
        except SageError:
            restore()
            raise
        _, error, cancelled = await self._wait(request)
        if error is not None:
            restore()
            if isinstance(error, ConflictError) and error.code == "store.session_conflict":
                # Our idea of the durable prefix is wrong: reload on next use.
                self._states.pop(state.key, None)
            if cancelled:
                raise asyncio.CancelledError from error
            raise error
        # Only now, after the transaction committed, does the durable prefix advance.
        state.persisted = total
        state.clean = total
        if request.rewritten:
            # The transition rewrote the session's rows: reload on next use.
            self._states.pop(state.key, None)
        result = CommitResult(
            session_id=state.key,
            seqs=seqs,
            persisted_events=total,
            written=len(rows),
            replaced=replace,
        )
        if cancelled:
            raise asyncio.CancelledError
        return result

    async def _commit_locked(
        self,
        key: str,
        *,
        run_id: Any,
        drafts: Sequence[EventDraft | tuple[str, Any]],
        fence: Fence | None,
        transition: Transition | None = None,
    ) -> CommitResult:
        state = await self._open_locked(key)
        history = state.history
        before = len(history)
        now = self._clock()
        for offset, item in enumerate(drafts, start=1):
            draft = _as_draft(item)
            history.append(
                SessionEvent(
                    seq=before + offset,
                    type=draft.type,
                    run_id=run_id,
                    created_at=now,
                    payload=draft.payload,
                )
            )

        def restore() -> None:
            del history[before:]

        return await self._persist_locked(
            state,
            fence=fence,
            restore=restore,
            seqs=tuple(range(before + 1, len(history) + 1)),
            transition=transition,
        )

    async def commit(
        self,
        session_id: Any,
        *,
        run_id: Any = None,
        drafts: Sequence[EventDraft | tuple[str, Any]] = (),
        fence: Fence | None = None,
        transition: Transition | None = None,
    ) -> CommitResult:
        """Append ``drafts`` (seqs continue the session's) and make them durable.

        ``transition`` (a run state change of ``scheduling.runs``) is applied in the same
        transaction, after the events: both commit or neither does.

        Only events after the persisted prefix are serialized and inserted; with nothing
        new no statement runs. Returns once the transaction has committed. Raises
        ``scheduler.fence_rejected`` when ``fence`` is stale, ``store.session_not_found``,
        ``store.session_conflict`` when another process moved the session on,
        ``store.event_not_serializable`` or ``store.write_failed``; on any of them the
        in-memory history is as it was before the call.
        """
        async with self.locked(session_id) as (key,):
            return await self._commit_locked(
                key, run_id=run_id, drafts=drafts, fence=fence, transition=transition
            )

    async def commit_many(self, specs: Sequence[CommitSpec]) -> list[CommitResult]:
        """Commit several sessions at once, their locks taken in sorted order.

        Commits on the same writer share one transaction (each in its savepoint). Every
        commit settles before this returns; the first error is then raised.
        """
        keys = [session_key(s.session_id) for s in specs]
        if len(set(keys)) != len(keys):
            raise ValueError("commit_many takes each session at most once")
        async with self.locked(*keys):
            outcomes = await asyncio.gather(
                *(
                    self._commit_locked(key, run_id=s.run_id, drafts=s.drafts, fence=s.fence)
                    for key, s in zip(keys, specs, strict=True)
                ),
                return_exceptions=True,
            )
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        return list(outcomes)  # type: ignore[arg-type]

    async def truncate(
        self, session_id: Any, *, length: int, fence: Fence | None = None
    ) -> CommitResult:
        """Cut the history to its first ``length`` events and persist that.

        The old rows are deleted and the whole remaining history written, in one
        transaction. Raises ``ValueError`` for a length outside ``0..len(history)`` and
        what :meth:`commit` raises.
        """
        async with self.locked(session_id) as (key,):
            state = await self._open_locked(key)
            if not 0 <= length <= len(state.history):
                raise ValueError(f"length must be within 0..{len(state.history)}")
            old_history, old_clean = state.history, state.clean
            state.history = old_history[:length]
            state.clean = min(state.clean, length)

            def restore() -> None:
                state.history, state.clean = old_history, old_clean

            return await self._persist_locked(state, fence=fence, restore=restore)

    async def delete_run(
        self, session_id: Any, run_id: Any, *, fence: Fence | None = None
    ) -> CommitResult:
        """Remove a run's events from the session, renumber the rest, delete the Run.

        One transaction: old rows deleted, the rewritten history inserted, then the run
        row deleted, then the session's counter — the original's order.
        """
        run_key = str(run_id)
        async with self.locked(session_id) as (key,):
            state = await self._open_locked(key)
            old_history, old_clean = state.history, state.clean
            first = next(
                (i for i, e in enumerate(old_history) if str(e.run_id) == run_key),
                len(old_history),
            )
            kept = old_history[:first]
            for event in old_history[first:]:
                if str(event.run_id) == run_key:
                    continue
                # Copies: the old objects must stay untouched for a restore.
                copy = SessionEvent(
                    seq=len(kept) + 1,
                    type=event.type,
                    run_id=event.run_id,
                    created_at=event.created_at,
                    payload=event._payload,
                    data=event.data,
                )
                kept.append(copy)
            state.history = kept
            state.clean = min(state.clean, first)

            def restore() -> None:
                state.history, state.clean = old_history, old_clean

            return await self._persist_locked(
                state, fence=fence, restore=restore, delete_runs=(run_id,)
            )

    # -- reading --------------------------------------------------------------------

    async def history(
        self, session_id: Any, *, fresh: bool = False, known_empty: bool = False
    ) -> list[SessionEvent]:
        """The session's current history (a new list of the shared event objects).

        ``known_empty``: the caller knows the session has no events (no read needed). With
        ``fresh``, a cached history is first checked against the database's durable
        prefix — its length and its last event (two primary-key reads) — and reloaded when
        another process has moved the session on or rewritten it (a rollback removes events,
        so a length alone could match again), so a run never starts from a stale
        conversation.
        """
        async with self.locked(session_id) as (key,):
            state = self._states.get(key)
            if state is None and known_empty:
                # The caller just read (under the run's lease) that the session has no
                # events yet: nothing to load. A wrong guess only costs a session_conflict
                # on the first commit, which reloads.
                self._states[key] = _SessionState(key, [], 0, 0)
                self._evict()
                return []
            if fresh and state is not None:
                durable = await db_call(self._durable_prefix_sync, key)
                if durable != _prefix_marker(state):
                    del self._states[key]
            return list((await self._open_locked(key)).history)

    def _durable_prefix_sync(self, key: str) -> tuple[Any, ...] | None:
        persisted = (
            Session.objects.using(self.using)
            .filter(pk=key)
            .values_list("persisted_events", flat=True)
            .first()
        )
        if persisted is None:
            return None
        last = (
            Event.objects.using(self.using)
            .filter(session_id=key, seq=persisted)
            .values_list("run_id", "type", "created_at")
            .first()
        )
        return (persisted, *_marker(last))

    async def persisted_events(self, session_id: Any) -> int:
        """The durable prefix length this coordinator knows for the session."""
        async with self.locked(session_id) as (key,):
            return (await self._open_locked(key)).persisted

    async def forget(self, session_id: Any) -> None:
        """Drop the session's in-memory state; the next use reloads it."""
        async with self.locked(session_id) as (key,):
            self._states.pop(key, None)

    def snapshot(self) -> dict[str, Any]:
        """Counters: open sessions, writers, transactions (``pipelined``: those of the
        pipelined group commit; ``redone``: its batches redone the general way after a
        check failed), commits, rejected, largest batch."""
        return {
            "open_sessions": len(self._states),
            "writers": len(self._writers),
            "group_commit": self.group_commit,
            "transactions": sum(w.transactions for w in self._writers),
            "pipelined": sum(w.pipelined for w in self._writers),
            "redone": sum(w.redone for w in self._writers),
            "commits": sum(w.commits for w in self._writers),
            "rejected": sum(w.rejected for w in self._writers),
            "largest_batch": max(w.largest_batch for w in self._writers),
        }

    async def close(self) -> None:
        """Stop the writers after the work already queued; waits for the threads."""
        self.close_nowait()
        await asyncio.to_thread(self._join)

    def close_nowait(self) -> None:
        """Ask the writers to stop after the queued work, without waiting."""
        if self._closed:
            return
        self._closed = True
        for writer in self._writers:
            writer.stop()

    def _join(self) -> None:
        for writer in self._writers:
            writer.join()


# ---------------------------------------------------------------------------------------
# The process default and the executor's entry point


_default: SessionStoreCoordinator | None = None
_default_loop: asyncio.AbstractEventLoop | None = None


def get_default_coordinator() -> SessionStoreCoordinator:
    """The process's coordinator for the running event loop (created on first use).

    A coordinator's locks and futures belong to one loop; when the loop changes (a new
    ``asyncio.run``), the old coordinator is stopped and a new one made.
    """
    global _default, _default_loop
    loop = asyncio.get_running_loop()
    if _default is None or _default_loop is not loop or _default._closed:
        if _default is not None:
            _default.close_nowait()
        _default = SessionStoreCoordinator()
        _default_loop = loop
    return _default


def default_snapshot() -> dict[str, Any] | None:
    """The process's coordinator's counters (`SessionStoreCoordinator.snapshot`), None
    while it has none: for the worker's published figures."""
    coordinator = _default
    return None if coordinator is None or coordinator._closed else coordinator.snapshot()


async def close_default_coordinator() -> None:
    """Stop the process default coordinator (worker shutdown, test teardown)."""
    global _default, _default_loop
    coordinator, _default, _default_loop = _default, None, None
    if coordinator is not None:
        await coordinator.close()


# A retryable storage failure (the database restarting, a dropped connection) is retried
# with this backoff until the write lands or the fence rejects it: a run whose lease ran out
# meanwhile is reclaimed and requeued, never failed by the outage.
RETRY_START, RETRY_MAX = 0.05, 2.0


async def append_events(
    *,
    session_id: Any,
    run_id: Any,
    events: Sequence[tuple[str, Any]],
    fence: Fence | None = None,
    transition: Transition | None = None,
) -> list[int]:
    """Commit ``events`` after the session's persisted prefix, fenced by ``fence``, with
    ``transition`` (a run state change) in the same transaction.

    Returns the seqs written. Raises ``scheduler.fence_rejected`` (and writes nothing)
    when the run's lease has moved on. ``store.write_failed`` and a session moved on by
    someone else are retried (the history is reloaded first). Goes through the process
    default coordinator.
    """
    if not events and transition is None:
        return []
    delay = RETRY_START
    while True:
        coordinator = get_default_coordinator()
        try:
            result = await coordinator.commit(
                session_id, run_id=run_id, drafts=events, fence=fence, transition=transition
            )
        except SageError as exc:
            if exc.code == "store.session_conflict":
                # Someone else appended (the coordinator dropped its copy): reload, retry.
                pass
            elif exc.code == "store.write_failed" and exc.retryable:
                logger.warning(
                    "store: writing run %s's events failed (%s); retrying in %.2fs",
                    run_id,
                    exc.__cause__ or exc,
                    delay,
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX)
            else:
                raise
            continue
        if result.seqs:
            # Stream clients of this session read the new durable events now, not at
            # their next poll.
            live.publish({"session": str(session_id), "type": "committed", "seq": result.seqs[-1]})
        return list(result.seqs)
