"""The session store's writers: threads that commit events in groups.

Each writer owns one Django database connection and is fed by a queue. It takes every
commit waiting for it, from any number of sessions, into one database transaction (group
commit); each commit runs in its own savepoint with its own lease-fence check, so a stale
run's commit is rejected alone while the rest of the batch lands. On PostgreSQL a batch
is one pipelined round trip. `scheduling.store.SessionStoreCoordinator` feeds them.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from collections.abc import Callable
from typing import Any

from django.db import (
    DatabaseError,
    IntegrityError,
    connections,
    transaction,
)
from django.utils import timezone

from sageproject.db import (
    one_transaction,
    pipeline_supported,
    prepared,
    transient_database_error,
)
from sageproject.errors import (
    ConflictError,
    SageError,
    UnavailableError,
)
from scheduling import runs
from scheduling.faults import crash_point, is_armed
from scheduling.models import Event, Run, RunStatus, Session
from scheduling.protocol import FenceRejected
from scheduling.runs import Fence, check_fence, db_now, statements
from scheduling.serialization import (
    SessionEvent,
)

logger = logging.getLogger("scheduling.store")

# Rows per INSERT statement when a whole history is rewritten (MySQL's packet limit).
REWRITE_BATCH_SIZE = 2000


def fence_rejected(run_id: Any) -> FenceRejected:
    return FenceRejected(run_id)


def session_conflict(session_id: Any) -> ConflictError:
    return ConflictError(
        "store.session_conflict",
        f"session {session_id} was written by someone else; reload it and try again",
        retryable=True,
    )


def store_closed() -> UnavailableError:
    return UnavailableError("store.closed", "the session store is closed")


class _Request:
    """A unit of work for a writer thread, answered on its caller's event loop."""

    __slots__ = ("future", "loop")

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.future: asyncio.Future[Any] = self.loop.create_future()

    def settle(self, result: Any = None, error: BaseException | None = None) -> None:
        try:
            self.loop.call_soon_threadsafe(_settle, self.future, result, error)
        except RuntimeError:  # the caller's loop is gone; nobody is waiting any more
            logger.warning("store: a caller's event loop closed before its answer")


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class _Call(_Request):
    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[], Any]) -> None:
        super().__init__()
        self.fn = fn


class _Commit(_Request):
    __slots__ = (
        "delete_runs",
        "expected",
        "fence",
        "replace",
        "rewritten",
        "rows",
        "session_id",
        "total",
        "transition",
    )

    def __init__(
        self,
        *,
        session_id: str,
        fence: Fence | None,
        replace: bool,
        rows: list[SessionEvent],
        delete_runs: tuple[Any, ...],
        expected: int,
        total: int,
        transition: Transition | None = None,
    ) -> None:
        super().__init__()
        self.transition = transition
        # Set by a transition that rewrote the session's rows (a rollback): the caller's
        # in-memory copy is then stale.
        self.rewritten = False
        self.session_id = session_id
        self.fence = fence
        self.replace = replace
        self.rows = rows
        self.delete_runs = delete_runs
        self.expected = expected
        self.total = total

    def event_rows(self) -> list[Event]:
        """The commit's new events as ``Event`` rows to insert."""
        return [
            Event(
                session_id=self.session_id,
                seq=e.seq,
                run_id=e.run_id,
                type=e.type,
                data=e.data,
                created_at=e.created_at,
            )
            for e in self.rows
        ]


_STOP = object()

# A run transition applied in a commit's transaction after its events (see
# ``scheduling.runs``: ``Start``, ``Suspend``, ``Finish``); called with the writer's database
# alias; a true return means it rewrote the session's event rows.
Transition = Callable[[str], Any]


def _set_prefixes(using: str, totals: list[tuple[str, int]]) -> int:
    """One UPDATE setting ``persisted_events`` of many sessions; returns rows touched.

    Raw SQL because building a ``Case(When(...))`` per session costs the ORM more than
    the statement costs the database.
    """
    connection = connections[using]
    quote = connection.ops.quote_name
    pk_field = Session._meta.pk
    ids = [pk_field.get_db_prep_value(uuid.UUID(key), connection) for key, _ in totals]
    whens = " ".join(["WHEN %s THEN %s"] * len(totals))
    marks = ", ".join(["%s"] * len(totals))
    sql = (
        f"UPDATE {quote(Session._meta.db_table)} SET "
        f"{quote('persisted_events')} = CASE {quote(pk_field.column)} {whens} END, "
        f"{quote('updated_at')} = %s WHERE {quote(pk_field.column)} IN ({marks})"
    )
    params: list[Any] = []
    for db_id, (_, total) in zip(ids, totals, strict=True):
        params += [db_id, total]
    params.append(connection.ops.adapt_datetimefield_value(timezone.now()))
    params += ids
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.rowcount


def _event_columns(commits: list[_Commit]) -> list[list[Any]]:
    """The events of ``commits`` as the insert's column arrays."""
    columns: list[list[Any]] = [[], [], [], [], [], []]
    for commit in commits:
        session = uuid.UUID(commit.session_id)
        for e in commit.rows:
            columns[0].append(session)
            columns[1].append(e.seq)
            columns[2].append(None if e.run_id is None else _uuid_or_none(e.run_id))
            columns[3].append(e.type)
            columns[4].append(e.data)
            columns[5].append(e.created_at)
    return columns


# libpq's transaction status of a connection with no transaction open.
_IDLE = 0


class _BatchFailed(Exception):
    """The batched form of a group commit failed; the batch is redone with savepoints."""


def _uuid_or_none(value: Any) -> uuid.UUID | None:
    try:
        return value if isinstance(value, uuid.UUID) else uuid.UUID(str(value))
    except ValueError:
        return None


class _Writer(threading.Thread):
    """One serial writer: a thread that owns one database connection."""

    def __init__(
        self,
        *,
        index: int,
        using: str,
        group_commit: bool,
        max_batch: int,
        idle_close_seconds: float,
    ) -> None:
        super().__init__(name=f"sage-store-writer-{index}", daemon=True)
        self.using = using
        self.group_commit = group_commit
        self.max_batch = max_batch
        self.idle_close_seconds = idle_close_seconds
        self.queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.closed = False
        self.transactions = 0
        self.commits = 0
        self.rejected = 0
        self.largest_batch = 0
        # Whether batches may take the pipelined group commit (PostgreSQL); known once the
        # thread first commits.
        self.pipeline: bool | None = None
        self.pipelined = 0  # transactions that took it
        self.redone = 0  # batches it gave back to the general way

    def submit(self, request: _Request) -> None:
        if self.closed:
            raise store_closed()
        self.queue.put(request)

    def stop(self) -> None:
        self.closed = True
        self.queue.put(_STOP)

    def run(self) -> None:
        try:
            while True:
                try:
                    item = self.queue.get(timeout=self.idle_close_seconds)
                except queue.Empty:
                    # Idle: give the connection back so an idle worker holds none open.
                    connections[self.using].close()
                    continue
                if item is _STOP:
                    break
                batch = [item]
                stopping = False
                if self.group_commit:
                    # Group commit: everything already waiting joins this transaction.
                    while len(batch) < self.max_batch:
                        try:
                            more = self.queue.get_nowait()
                        except queue.Empty:
                            break
                        if more is _STOP:
                            stopping = True
                            break
                        batch.append(more)
                self._process(batch)
                if stopping:
                    break
        finally:
            connections[self.using].close()
            # Anything submitted after stop() is answered, never left hanging.
            while True:
                try:
                    item = self.queue.get_nowait()
                except queue.Empty:
                    break
                if isinstance(item, _Request):
                    item.settle(error=store_closed())

    def _process(self, batch: list[_Request]) -> None:
        commits: list[_Commit] = []
        for item in batch:
            if isinstance(item, _Commit):
                commits.append(item)
                continue
            assert isinstance(item, _Call)
            try:
                item.settle(result=item.fn())
            except Exception as exc:
                item.settle(error=exc)
        if commits:
            self._commit_batch(commits)

    def _commit_batch(self, commits: list[_Commit]) -> None:
        self.largest_batch = max(self.largest_batch, len(commits))
        if self._pipelinable(commits):
            outcomes = self._commit_pipelined(commits)
            if outcomes is not None:
                self._settle_all(commits, outcomes)
                return
        if len(commits) == 1:
            # Alone in its transaction: the transaction is its savepoint.
            self._settle_all(commits, self._in_transaction(commits, self._apply_one))
            return
        try:
            outcomes = self._in_transaction(commits, self._apply_batched)
        except _BatchFailed as failed:
            # A statement of the batched form failed (a row nobody expected, a deadlock):
            # redo the batch commit by commit, each in its own savepoint, so the culprit
            # is rejected alone and the others still land.
            logger.warning(
                "store: batched group commit failed (%s); retrying with savepoints",
                failed.__cause__,
            )
            outcomes = self._in_transaction(commits, self._apply_savepointed)
        self._settle_all(commits, outcomes)

    def _in_transaction(
        self, commits: list[_Commit], apply: Callable[[list[_Commit]], list[BaseException | None]]
    ) -> list[BaseException | None]:
        """One transaction around ``apply``; a failure of the transaction fails them all."""
        points = sorted({_point(commit) for commit in commits})
        try:
            with transaction.atomic(using=self.using):
                outcomes = apply(commits)
                for point in points:
                    crash_point(f"{point}.before_commit")
            for point in points:
                crash_point(f"{point}.after_commit")
        except _BatchFailed:
            raise
        except Exception as exc:
            error = _translate(exc, commits[0].session_id if len(commits) == 1 else None)
            if isinstance(exc, DatabaseError) and not isinstance(exc, IntegrityError):
                # The connection may be broken; the next batch reconnects.
                connections[self.using].close()
            outcomes = [error] * len(commits)
        self.transactions += 1
        return outcomes

    def _pipelinable(self, commits: list[_Commit]) -> bool:
        """Whether the batch can take `_commit_pipelined`: PostgreSQL (with libpq's pipeline
        mode), every commit fenced, appending (no rewrite, no run deleted), its transition
        none or one with a pipelined form."""
        if self.pipeline is None:
            connection = connections[self.using]
            self.pipeline = connection.vendor == "postgresql" and pipeline_supported()
        if not self.pipeline:
            return False
        return all(
            commit.fence is not None
            and not commit.replace
            and not commit.delete_runs
            and (commit.transition is None or getattr(commit.transition, "pipelinable", False))
            for commit in commits
        )

    def _commit_pipelined(self, commits: list[_Commit]) -> list[BaseException | None] | None:
        """The group commit on PostgreSQL in one round trip, whatever the batch's size.

        Sent together in libpq's pipeline mode, as one transaction (the pipeline's implicit
        one, `one_transaction`): the run rows the commits' fences still own, locked in
        id order (`runs.lock_fences`); the sessions' rows, locked in id order; each
        session's durable count moved on where it is still the count this process believes
        in; the events (one ``INSERT … UNNEST``); the run transitions
        (`Finish.pipeline_many`: the fenced terminal update, the archive, the next runs made
        ready); the pipeline's sync commits. Each check is a statement that fails unless it
        holds (every fence, every count, every row written: `runs.guarded`), which aborts
        the transaction: the sync rolls it back. The transaction never waits on this process:
        a worker cut off mid-commit leaves no transaction holding its runs' locks (after a
        pipeline, PostgreSQL does not reliably arm its idle-in-transaction timeout again).

        Returns the outcomes: all None, or all the same failure when the connection was lost
        with the pipeline sent (whether it committed is unknown, as with any lost
        ``COMMIT``);
        None if a check failed or a statement was refused — nothing was written, and the
        caller redoes the batch the general way, which refuses the culprit alone with its
        own error. With a ``before_commit`` crash point armed (tests) the transaction is
        explicit and its ``COMMIT`` goes after the pipeline, once the crash point is
        passed."""
        connection = connections[self.using]
        sessions = sorted({commit.session_id for commit in commits})
        rows = sum(len(commit.rows) for commit in commits)
        lock_sessions, move_sessions, insert_events = statements.group_commit(self.using)
        points = sorted({_point(commit) for commit in commits})
        at_once = not any(is_armed(f"{point}.before_commit") for point in points)
        try:
            connection.ensure_connection()
            raw = connection.connection
            with connection.wrap_database_errors:
                try:
                    with one_transaction(raw, at_once=at_once):
                        runs.lock_fences([c.fence for c in commits], connection)
                        prepared(raw, lock_sessions, [[uuid.UUID(s) for s in sessions]])
                        prepared(
                            raw,
                            move_sessions,
                            [
                                timezone.now(),
                                [uuid.UUID(c.session_id) for c in commits],
                                [c.expected for c in commits],
                                [c.total for c in commits],
                                len(commits),
                            ],
                        )
                        if rows:
                            prepared(raw, insert_events, [*_event_columns(commits), rows])
                        grouped: dict[Any, list[Any]] = {}
                        for commit in commits:
                            if commit.transition is not None:
                                many = type(commit.transition).pipeline_many
                                grouped.setdefault(many, []).append(commit.transition)
                        for many, group in grouped.items():
                            many(group, connection)
                    if not at_once:
                        runs.rearm_idle_timeout(raw)
                        for point in points:
                            crash_point(f"{point}.before_commit")
                        raw.execute("COMMIT")
                except BaseException:
                    if not raw.closed and raw.pgconn.transaction_status != _IDLE:
                        raw.execute("ROLLBACK")
                    raise
        except DatabaseError as exc:
            if connection.connection is None or connection.connection.closed:
                # Lost with the COMMIT perhaps sent: whether it landed is unknown.
                connection.close()
                self.transactions += 1
                only = commits[0].session_id if len(commits) == 1 else None
                return [_translate(exc, only)] * len(commits)
            if not isinstance(exc.__cause__, runs.division_by_zero()):
                # Not a check (a stale fence, a session moved on) but a refused statement:
                # a deadlock, a row nobody expected.
                logger.warning("store: pipelined group commit failed (%s); redoing it", exc)
            self.redone += 1
            return None
        for point in points:
            crash_point(f"{point}.after_commit")
        self.transactions += 1
        self.pipelined += 1
        return [None] * len(commits)

    def _settle_all(self, commits: list[_Commit], outcomes: list[BaseException | None]) -> None:
        # Answers go out only now: the transaction has committed (or failed).
        for commit, outcome in zip(commits, outcomes, strict=True):
            if outcome is None:
                self.commits += 1
                commit.settle(result=None)
            else:
                self.rejected += 1
                commit.settle(error=outcome)

    def _apply_one(self, commits: list[_Commit]) -> list[BaseException | None]:
        self._apply(commits[0])
        return [None]

    def _apply_savepointed(self, commits: list[_Commit]) -> list[BaseException | None]:
        outcomes: list[BaseException | None] = []
        for commit in commits:
            try:
                with transaction.atomic(using=self.using):
                    self._apply(commit)
            except Exception as exc:
                outcomes.append(_translate(exc, commit.session_id))
            else:
                outcomes.append(None)
        return outcomes

    def _apply_batched(self, commits: list[_Commit]) -> list[BaseException | None]:
        """The whole batch in a fixed number of statements, whatever its size.

        Each commit still gets its own fence check and its own prefix check: the run and
        session rows are read under ``FOR UPDATE`` (row locks held to the commit, so the
        check is as good as the single commit's conditional UPDATE), and a commit that
        fails either check is left out of the writes — rejected alone.
        """
        using = self.using
        outcomes: list[BaseException | None] = [None] * len(commits)
        fenced = [(i, c.fence) for i, c in enumerate(commits) if c.fence is not None]
        if fenced:
            leases = {
                str(run_id): (owner, token, status, expires)
                for run_id, owner, token, status, expires in Run.objects.using(using)
                .select_for_update()
                .filter(pk__in=[_uuid_or_none(f.run_id) for _, f in fenced])
                .order_by("pk")
                .values_list("id", "lease_owner", "lease_token", "status", "lease_expires_at")
            }
            now = db_now(using)
            for i, fence in fenced:
                owner, token, status, expires = leases.get(
                    str(_uuid_or_none(fence.run_id)), (None, None, None, None)
                )
                if (
                    (owner, token, status)
                    != (fence.lease_owner, fence.lease_token, RunStatus.RUNNING)
                    or expires is None
                    or expires <= now
                ):
                    outcomes[i] = fence_rejected(fence.run_id)
        live = [i for i, outcome in enumerate(outcomes) if outcome is None]
        if not live:
            return outcomes
        prefixes = {
            str(pk): persisted
            for pk, persisted in Session.objects.using(using)
            .select_for_update()
            .filter(pk__in=[commits[i].session_id for i in live])
            .order_by("pk")
            .values_list("id", "persisted_events")
        }
        for i in live:
            if prefixes.get(commits[i].session_id) != commits[i].expected:
                outcomes[i] = session_conflict(commits[i].session_id)
        live = [i for i in live if outcomes[i] is None]
        if not live:
            return outcomes
        try:
            replaced = [commits[i].session_id for i in live if commits[i].replace]
            if replaced:
                Event.objects.using(using).filter(session_id__in=replaced).delete()
            rows = [row for i in live for row in commits[i].event_rows()]
            if rows:
                Event.objects.using(using).bulk_create(rows, batch_size=REWRITE_BATCH_SIZE)
            for i in live:
                for run_id in commits[i].delete_runs:
                    Run.objects.using(using).filter(pk=run_id).delete()
            touched = _set_prefixes(
                using, [(commits[i].session_id, commits[i].total) for i in live]
            )
            if touched != len(live):
                raise session_conflict("(batch)")
            # Run transitions: those of one kind that can be applied together (finishes)
            # go in one set of statements; the rest one by one.
            grouped: dict[Any, list[_Commit]] = {}
            for i in live:
                transition = commits[i].transition
                if transition is None:
                    continue
                many = getattr(type(transition), "apply_many", None)
                if many is None or not getattr(transition, "batchable", False):
                    commits[i].rewritten = bool(transition(using))
                else:
                    grouped.setdefault(many, []).append(commits[i])
            for many, group in grouped.items():
                many([c.transition for c in group], using)
        except Exception as exc:
            raise _BatchFailed from exc
        return outcomes

    def _apply(self, commit: _Commit) -> None:
        using = self.using
        if commit.fence is not None:
            check_fence(commit.fence, using=using)
        if commit.replace:
            # Truncation or a rewritten history: drop the old rows, write the whole one.
            Event.objects.using(using).filter(session_id=commit.session_id).delete()
        if commit.rows:
            Event.objects.using(using).bulk_create(
                commit.event_rows(), batch_size=REWRITE_BATCH_SIZE
            )
        # Run deletion after the event rows, before the count: the original's order.
        for run_id in commit.delete_runs:
            Run.objects.using(using).filter(pk=run_id).delete()
        # Conditional on the prefix this process believes in: a writer elsewhere that
        # moved the session on makes this commit fail instead of interleaving seqs.
        touched = (
            Session.objects.using(using)
            .filter(pk=commit.session_id, persisted_events=commit.expected)
            .update(persisted_events=commit.total, updated_at=timezone.now())
        )
        if touched != 1:
            raise session_conflict(commit.session_id)
        if commit.transition is not None:
            commit.rewritten = bool(commit.transition(using))


def _point(commit: _Commit) -> str:
    """The crash-point prefix of a commit: its transition's kind, else ``append``."""
    return getattr(commit.transition, "point", "append")


def _translate(exc: BaseException, session_id: str | None) -> BaseException:
    if isinstance(exc, SageError):
        return exc
    # The database being unreachable, restarting or ending the session is worth retrying;
    # a statement it refuses (a programming or data error) is not.
    transient = transient_database_error(exc)
    if isinstance(exc, IntegrityError):
        error: SageError = session_conflict(session_id or "?")
    elif transient or isinstance(exc, DatabaseError):
        error = UnavailableError(
            "store.write_failed", f"the event write failed: {exc}", retryable=transient
        )
    else:
        return exc
    error.__cause__ = exc
    return error
