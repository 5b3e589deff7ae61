"""The transitions of a claimed or admitted run, one function (or value) each.

Every transition is one conditional ``UPDATE … WHERE`` on the state it expects — for a
leased run also its owner, token and an unexpired lease (by the database's clock) — in
one transaction with everything the transition writes:

- the lease side: **renew** (`renew`), **requeue** (`requeue`: graceful shutdown, the
  crash budget is not used), **reap** (`reap`: dead leases — requeued as a crash, or
  ended: a requested cancel as ``cancelled``, a used-up crash budget as ``failed``);
- the web side: **cancel** (`cancel`, `cancel_queued`, `cancel_leased`), **resume**
  (`resume`), and the scheduler protocol's `submit` of a suspended run;
- the worker side: **start** (`Start`), **suspend** (`Suspend`) and **finish** (`Finish`),
  written by the session store in the transaction of the events they come with; `finish`
  when the executor crashed; `Outcome`, what an executor returns.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections, transaction
from django.db.models import F, Q

from sageproject.db import prepared
from sageproject.errors import ErrorCategory, NotFoundError, SageError
from scheduling import pending, wakeups
from scheduling.models import (
    TERMINAL_STATUSES,
    Run,
    RunStatus,
    StopRequest,
    run_cancelled_error,
    run_interrupted_error,
)
from scheduling.protocol import FenceRejected, queue_full_error
from scheduling.runs import archive as archiving
from scheduling.runs import statements
from scheduling.runs.archive import archive_one, archive_records
from scheduling.runs.clock import Clock, DbNow, later_expr, now_expr, now_sql
from scheduling.runs.fences import Fence, check_fence, held
from scheduling.runs.selectors import queued_roots
from scheduling.runs.sessions import (
    TERMINAL_EVENTS,
    append_event,
    promote_next,
    remove_run_events,
    terminal_payload,
)

logger = logging.getLogger("sage.runs")


def worker_restarted_error() -> dict[str, Any]:
    return SageError(
        "execution.worker_restarted",
        "the run's worker stopped too many times; the run was failed",
        category=ErrorCategory.RESOURCE_LOST,
    ).record()


def dead_lease(clock: Clock) -> Q:
    """Running runs whose lease ran out (or never had an expiry)."""
    return Q(status=RunStatus.RUNNING) & (
        Q(lease_expires_at__lte=now_expr(clock)) | Q(lease_expires_at__isnull=True)
    )


def reapable(clock: Clock) -> Q:
    """Runs `reap` would end or queue again: dead leases, and queued runs with a cancel
    request (written by an older version)."""
    return dead_lease(clock) | Q(status=RunStatus.QUEUED, cancel_requested=True)


# ------------------------------------------------------------------------------ leases


def renew(
    fence: Fence,
    duration: timedelta,
    *,
    max_crashes: int | None = None,
    using: str = DEFAULT_DB_ALIAS,
    clock: Clock = None,
) -> datetime | None:
    """Extend a live lease to the database's now + ``duration``; returns the new expiry, or
    None when the lease is gone (superseded, released, cancelled, or expired — an expired
    run is reaped at once, as a crash)."""
    with transaction.atomic(using=using):
        if held(fence, using, clock).update(lease_expires_at=later_expr(duration, clock)) == 1:
            return (
                Run.objects.using(using)
                .filter(pk=fence.run_id)
                .values_list("lease_expires_at", flat=True)
                .get()
            )
        reap_locked(using, clock, max_crashes)
        return None


def requeue(
    fence: Fence,
    *,
    error: dict[str, Any] | None = None,
    using: str = DEFAULT_DB_ALIAS,
    clock: Clock = None,
    allow_expired: bool = False,
) -> bool:
    """Give a leased run back to the queue (graceful shutdown): it keeps its place and its
    session's turn, and the crash budget is not used. False when the lease was lost."""
    rows = Run.objects.using(using).filter(
        pk=fence.run_id,
        lease_owner=fence.lease_owner,
        lease_token=fence.lease_token,
        status=RunStatus.RUNNING,
    )
    if not allow_expired:
        rows = rows.filter(lease_expires_at__gt=now_expr(clock))
    values = {**_REQUEUE, "available_at": now_expr(clock)}
    if error is not None:
        values["error"] = error
    with transaction.atomic(using=using):
        requeued = rows.update(**values) == 1
        if requeued:
            _retake([fence.run_id], using)
            wakeups.notify("run", using=using)
        return requeued


def _retake(run_ids: list[Any], using: str) -> None:
    """Runs back in the queue take their pending places again."""
    rows = Run.objects.using(using).filter(pk__in=run_ids, parent__isnull=True)
    pending.retake(rows.values_list("owner_id", "admission_slot"), using=using)


# The token is cleared too, so a stale lease can never match a requeued row; the row keeps
# created_at and ready, so a run that lost its worker is not sent to the back.
_REQUEUE = {
    "status": RunStatus.QUEUED,
    "lease_owner": "",
    "lease_token": None,
    "lease_expires_at": None,
}


# ------------------------------------------------------------------------------ reap


def reap(
    *,
    max_crashes: int | None = None,
    using: str = DEFAULT_DB_ALIAS,
    clock: Clock = None,
) -> list[str]:
    """End every dead lease; returns the run ids touched."""
    with transaction.atomic(using=using):
        return reap_locked(using, clock, max_crashes)


def reap_locked(using: str, clock: Clock, max_crashes: int | None) -> list[str]:
    """A run whose lease is dead lost its worker (a crash): with a cancel requested it ends
    ``cancelled`` (or ``interrupted``); once ``max_crashes`` crashes are used up it ends
    ``failed`` (``execution.worker_restarted``); otherwise it is queued again with one more
    crash counted. Each ending writes its terminal event and archive here."""
    dead = Run.objects.using(using).filter(dead_lease(clock))
    rows = list(dead.values_list("pk", "session_id", "crashes", "cancel_requested", "stop_request"))
    # A cancel requested of a queued run (written by an older version) also ends here.
    stale_cancels = list(
        Run.objects.using(using)
        .filter(status=RunStatus.QUEUED, cancel_requested=True)
        .values_list("pk", flat=True)
    )
    touched: list[str] = []
    requeued: list[Any] = []
    for pk, session_id, crashes, cancel, stop in rows:
        expected = Q(pk=pk) & dead_lease(clock)
        if cancel:
            ended = _end(pk, session_id, expected, _stopped_status(stop), using=using)
            if ended and stop == StopRequest.ROLLBACK:
                remove_run_events(session_id, pk, using=using)
        elif max_crashes is not None and crashes + 1 >= max_crashes:
            ended = _end(
                pk,
                session_id,
                expected,
                RunStatus.FAILED,
                error=worker_restarted_error(),
                extra={"crashes": crashes + 1},
                using=using,
            )
            if ended:
                logger.warning("run %s failed: its worker stopped %d times", pk, crashes + 1)
        else:
            ended = (
                Run.objects.using(using)
                .filter(expected)
                .update(**_REQUEUE, crashes=F("crashes") + 1)
                == 1
            )
            if ended:
                requeued.append(pk)
                logger.info("run %s requeued: its worker stopped (crash %d)", pk, crashes + 1)
        if ended:
            touched.append(str(pk))
    if requeued:
        _retake(requeued, using)
    for pk in stale_cancels:
        if cancel_queued(pk, using=using):
            touched.append(str(pk))
    return touched


def _stopped_status(stop: str) -> str:
    if stop in (StopRequest.INTERRUPT, StopRequest.ROLLBACK):
        return RunStatus.INTERRUPTED
    return RunStatus.CANCELLED


def _error_for(status: str) -> dict[str, Any] | None:
    if status == RunStatus.CANCELLED:
        return run_cancelled_error()
    if status == RunStatus.INTERRUPTED:
        return run_interrupted_error()
    return None


def _end(
    pk: Any,
    session_id: Any,
    expected: Q,
    status: str,
    *,
    error: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    using: str,
) -> bool:
    """A run ended outside its worker: status, terminal event and archive, together."""
    error = error if error is not None else _error_for(status)
    done = (
        Run.objects.using(using)
        .filter(expected)
        .update(
            status=status,
            error=error,
            result=None,
            interaction=None,
            finished_at=DbNow(),
            lease_owner="",
            lease_expires_at=None,
            **(extra or {}),
        )
        == 1
    )
    if not done:
        return False
    append_event(
        session_id, pk, TERMINAL_EVENTS[status], terminal_payload(status, None, error), using=using
    )
    archive_one(pk, using)
    promote_next(session_id, using)
    return True


# ------------------------------------------------------------------------------ web side


def stop(run_id: Any, reason: StopRequest, *, using: str) -> None:
    """Stop an unfinished run: a queued or suspended one ends now, a running one is asked
    to stop (its worker ends it at its next step; the reaper if its worker is dead)."""
    if cancel_queued(run_id, reason=reason, using=using):
        return
    asked = (
        Run.objects.using(using)
        .filter(pk=run_id, status=RunStatus.RUNNING)
        .update(cancel_requested=True, stop_request=reason)
    )
    if asked:
        wakeups.notify("cancel", str(run_id), using=using)


def cancel_queued(
    run_id: Any, *, reason: StopRequest = StopRequest.CANCEL, using: str = DEFAULT_DB_ALIAS
) -> bool:
    """End a queued or suspended run now (cancelled or interrupted), with its event and
    archive; False if it is not queued or suspended."""
    with transaction.atomic(using=using, savepoint=False):
        row = (
            Run.objects.using(using)
            .filter(pk=run_id, status__in=[RunStatus.QUEUED, RunStatus.SUSPENDED])
            .values("session_id", "status", "owner_id", "admission_slot", "parent_id")
            .first()
        )
        if row is None:
            return False
        session_id = row["session_id"]
        ended = _end(
            run_id,
            session_id,
            Q(pk=run_id, status=row["status"]),
            _stopped_status(reason),
            extra={"cancel_requested": True, "stop_request": reason, "ready": True},
            using=using,
        )
        if ended and row["status"] == RunStatus.QUEUED:
            pending.release(pending.root_runs([row]), using=using)
        if ended and reason == StopRequest.ROLLBACK:
            remove_run_events(session_id, run_id, using=using)
        return ended


def cancel_leased(run_id: Any, *, using: str = DEFAULT_DB_ALIAS) -> bool:
    """End a running run now as cancelled (event and archive), whatever its lease: its
    worker's next write is refused. For operators and the scheduler protocol's cancel; the
    API asks the worker instead (`cancel`), which also stops the run's jobs."""
    session_id = (
        Run.objects.using(using).filter(pk=run_id).values_list("session_id", flat=True).first()
    )
    if session_id is None:
        return False
    return _end(
        run_id,
        session_id,
        Q(pk=run_id, status=RunStatus.RUNNING),
        RunStatus.CANCELLED,
        extra={"cancel_requested": True, "stop_request": StopRequest.CANCEL},
        using=using,
    )


def cancel(run_id: Any, *, rollback: bool = False, using: str = DEFAULT_DB_ALIAS) -> Run:
    """Cancel a run: a queued or suspended one at once (``run.cancelled`` event and archive
    in the same transaction), a running one through its worker at its next step — or, if
    its worker is dead, by the reaper. Idempotent: a terminal run is answered unchanged.
    ``rollback`` stops it as a multitask rollback does: ``interrupted``, its events removed."""
    with transaction.atomic(using=using):
        stop(run_id, StopRequest.ROLLBACK if rollback else StopRequest.CANCEL, using=using)
    run = Run.objects.using(using).filter(pk=run_id).first()
    if run is None:
        raise NotFoundError("run.not_found", "run not found")
    return run


def resume(run_id: Any, resolution: dict[str, Any], *, using: str = DEFAULT_DB_ALIAS) -> bool:
    """A suspended run's reply: queued again (it keeps its session's turn), with the
    resolution its next execution records once. False if it is no longer suspended."""
    with transaction.atomic(using=using):
        run = (
            Run.objects.using(using)
            .select_for_update()
            .filter(pk=run_id, status=RunStatus.SUSPENDED)
            .values("interaction", "owner_id", "admission_slot", "parent_id")
            .first()
        )
        if run is None:
            return False
        interaction = {**(run["interaction"] or {}), "resolution": resolution}
        resumed = (
            Run.objects.using(using)
            .filter(pk=run_id, status=RunStatus.SUSPENDED)
            .update(status=RunStatus.QUEUED, available_at=DbNow(), interaction=interaction)
            == 1
        )
        if resumed:
            pending.retake(pending.root_runs([run]), using=using)
            wakeups.notify("run", using=using)
        return resumed


def submit(
    run_id: Any,
    *,
    priority: int,
    available_at: datetime,
    queue: str | None = None,
    max_pending: int,
    using: str = DEFAULT_DB_ALIAS,
) -> bool | None:
    """The scheduler protocol's ``submit`` of an existing run: a suspended one is queued
    again (with ``priority``, ``available_at`` and, if given, ``queue``), a queued one is
    adopted as it is. False for a running or finished run; None when there is no such
    run. Raises ``scheduler.queue_full`` when ``max_pending`` root runs (of ``queue``, if
    given) are queued already."""
    with transaction.atomic(using=using):
        row = (
            Run.objects.using(using)
            .select_for_update()
            .filter(pk=run_id)
            .values("status", "parent_id", "owner_id", "admission_slot")
            .first()
        )
        if row is None:
            return None
        status = row["status"]
        if status in TERMINAL_STATUSES or status == RunStatus.RUNNING:
            return False
        if status == RunStatus.QUEUED:
            # Admitted already (by the API): the scheduler now knows its work item.
            return True
        if row["parent_id"] is None and queued_roots(queue, using=using).count() >= max_pending:
            raise queue_full_error(max_pending)
        values: dict[str, Any] = {
            "status": RunStatus.QUEUED,
            "priority": priority,
            "available_at": available_at,
        }
        if queue is not None:
            values["queue"] = queue
        if Run.objects.using(using).filter(pk=run_id, status=status).update(**values):
            pending.retake(pending.root_runs([row]), using=using)
        return True


# ------------------------------------------------------------------------------ worker side
#
# These run inside the session store's transaction, after the events they come with, so
# the events and the run's new state commit (or roll back) together. Each re-checks the
# fence with its own conditional UPDATE.


@dataclass(frozen=True, slots=True)
class Start:
    """The first commit of an execution: a recorded resolution is consumed (a later requeue
    does not emit ``interaction.resolved`` again)."""

    point = "start"

    fence: Fence
    clear_resolution: bool = False

    def __call__(self, using: str, clock: Clock = None) -> None:
        if not self.clear_resolution:
            return
        if held(self.fence, using, clock).update(interaction=None) != 1:
            raise FenceRejected(self.fence.run_id)

    @property
    def pipelinable(self) -> bool:
        """Whether `pipeline_many` may take it: one that consumes a resolution writes the
        run row, and goes the general way."""
        return not self.clear_resolution

    @classmethod
    def pipeline_many(cls, starts: list[Start], connection: Any) -> None:
        """Nothing beyond the commit's own fence check (`lock_fences`)."""


@dataclass(frozen=True, slots=True)
class Suspend:
    """Park the run as ``suspended`` with the interaction a reply resolves."""

    point = "suspend"

    fence: Fence
    interaction: dict[str, Any]

    def __call__(self, using: str, clock: Clock = None) -> None:
        updated = held(self.fence, using, clock).update(
            status=RunStatus.SUSPENDED,
            interaction=self.interaction,
            lease_owner="",
            lease_expires_at=None,
        )
        if updated != 1:
            raise FenceRejected(self.fence.run_id)


@dataclass(frozen=True, slots=True)
class Finish:
    """The terminal status, result and error, the archive row, and the session's next run
    made ready — in the transaction of the terminal event."""

    point = "finish"

    fence: Fence
    status: str
    result: Any = None
    error: Any = None
    flow_outputs: dict[str, Any] | None = None
    rollback: bool = False

    def __call__(self, using: str, clock: Clock = None) -> bool:
        updated = held(self.fence, using, clock).update(
            status=self.status,
            result=self.result,
            error=self.error,
            finished_at=now_expr(clock),
            lease_owner="",
            lease_expires_at=None,
            interaction=None,
            cancel_requested=self.status in (RunStatus.CANCELLED, RunStatus.INTERRUPTED),
        )
        if updated != 1:
            raise FenceRejected(self.fence.run_id)
        archive_one(self.fence.run_id, using, self.flow_outputs)
        session_id = (
            Run.objects.using(using)
            .filter(pk=self.fence.run_id)
            .values_list("session_id", flat=True)
            .get()
        )
        if self.rollback:
            remove_run_events(session_id, self.fence.run_id, using=using)
        promote_next(session_id, using)
        return self.rollback

    @property
    def batchable(self) -> bool:
        """Whether `apply_many` may take it (a rollback rewrites its session: alone)."""
        return not self.rollback

    @property
    def pipelinable(self) -> bool:
        """Whether `pipeline_many` may take it: not a rollback, and the archiver has its
        one-statement form."""
        return not self.rollback and archiving.archive_statement() is not None

    @classmethod
    def pipeline_many(cls, finishes: list[Finish], connection: Any) -> None:
        """`apply_many` for the session store's pipelined group commit on PostgreSQL, sent
        on the raw connection inside the caller's pipeline (its ``COMMIT`` follows them):
        the fenced terminal update (`statements.finish_unnest`) and the archive upsert, each
        failing the transaction unless every run was written (`statements.guarded`), and the
        sessions' next
        runs made ready, the workers woken if one was."""
        raw = connection.connection
        ids = [statements.as_uuid(f.fence.run_id) for f in finishes]
        sql, params = statements.finish_unnest(finishes, connection)
        prepared(raw, statements.guarded(sql), [*params, len(finishes)])
        archive_statement = archiving.archive_statement()
        assert archive_statement is not None
        as_json = statements.json_text(Run._meta.get_field("result"))
        prepared(
            raw,
            statements.guarded(archive_statement(connection) + " RETURNING 1"),
            [
                ids,
                [f.status for f in finishes],
                [as_json(f.result) for f in finishes],
                [as_json(f.error) for f in finishes],
                [as_json(f.flow_outputs) for f in finishes],
                len(finishes),
            ],
        )
        prepared(
            raw,
            statements.promote_and_notify(connection.alias),
            [ids, wakeups.CHANNEL, "run"],
        )

    @classmethod
    def apply_many(cls, finishes: list[Finish], using: str) -> None:
        """Finish many runs in a fixed number of statements (the session store's group
        commit): one pipelined conditional UPDATE per run, one archive upsert, one look for
        sessions with a run waiting its turn. Raises ``scheduler.fence_rejected`` if any
        run's lease no longer holds (the caller then retries them one by one)."""
        connection = connections[using]
        if connection.vendor == "postgresql":
            sessions = cls._update_unnest(finishes, connection)
        else:
            cls._update_each(finishes, connection)
            sessions = None
        ids = [statements.as_uuid(f.fence.run_id) for f in finishes]
        archiver = archiving.archiver()
        if archiver is not None:
            outcomes = {
                statements.as_uuid(f.fence.run_id): (f.status, f.result, f.error, f.flow_outputs)
                for f in finishes
            }
            archiver(archive_records(ids, outcomes, using), using)
        if sessions is None:
            sessions = Run.objects.using(using).filter(pk__in=ids).values("session_id")
        waiting = (
            Run.objects.using(using)
            .filter(session_id__in=sessions, status=RunStatus.QUEUED, ready=False)
            .values_list("session_id", flat=True)
            .distinct()
        )
        for session_id in list(waiting):
            promote_next(session_id, using)

    @staticmethod
    def _update_unnest(finishes: list[Finish], connection: Any) -> list[Any]:
        """PostgreSQL: every run's terminal update in one ``UPDATE … FROM UNNEST(…)``, each
        row still fenced on its own; returns the runs' sessions. Raises FenceRejected
        unless every run was updated."""
        with connection.cursor() as cursor:
            cursor.execute(*statements.finish_unnest(finishes, connection))
            sessions = [session_id for (session_id,) in cursor.fetchall()]
        if len(sessions) != len(finishes):
            raise FenceRejected(None)
        return sessions

    @staticmethod
    def _update_each(finishes: list[Finish], connection: Any) -> None:
        """Other databases: one conditional UPDATE per run, sent with ``executemany``."""
        sql = statements.finish_each(connection, now_sql(connection.vendor))
        pk = Run._meta.pk
        json_field = Run._meta.get_field("result")
        params = [
            (
                f.status,
                json_field.get_db_prep_value(f.result, connection),
                json_field.get_db_prep_value(f.error, connection),
                f.status in (RunStatus.CANCELLED, RunStatus.INTERRUPTED),
                pk.get_db_prep_value(statements.as_uuid(f.fence.run_id), connection),
                f.fence.lease_owner,
                f.fence.lease_token,
                RunStatus.RUNNING,
            )
            for f in finishes
        ]
        with connection.cursor() as cursor:
            cursor.executemany(sql, params)
            touched = cursor.rowcount
        if touched != len(finishes):
            raise FenceRejected(None)


def finish(
    fence: Fence,
    status: str,
    *,
    result: Any = None,
    error: Any = None,
    using: str = DEFAULT_DB_ALIAS,
    clock: Clock = None,
) -> None:
    """Finish a leased run outside the session store (its executor crashed, or the
    scheduler protocol's ``release``): the terminal event is appended under the session
    lock, then `Finish`, in one transaction. Raises ``scheduler.fence_rejected``."""
    with transaction.atomic(using=using):
        check_fence(fence, using=using, clock=clock)
        session_id = (
            Run.objects.using(using)
            .filter(pk=fence.run_id)
            .values_list("session_id", flat=True)
            .get()
        )
        append_event(
            session_id,
            fence.run_id,
            TERMINAL_EVENTS[status],
            terminal_payload(status, result, error),
            using=using,
        )
        Finish(fence, status, result, error)(using, clock)


@dataclass(frozen=True, slots=True, kw_only=True)
class Outcome:
    """How an execution ended, as the executor reports it to the dispatcher, which commits
    it in one transaction (`events` with `transition`): a terminal status with its result
    or error, or ``suspended`` with the interaction a reply resolves. ``rollback`` removes
    the run's events (multitask rollback); ``pending`` are the execution's events not
    committed yet, written first."""

    status: str
    session_id: Any
    result: Any = None
    error: dict[str, Any] | None = None
    flow_outputs: dict[str, Any] | None = None
    interaction: dict[str, Any] | None = None
    rollback: bool = False
    pending: tuple[tuple[str, Any], ...] = ()

    def events(self) -> list[tuple[str, Any]]:
        if self.status == RunStatus.SUSPENDED:
            own = [
                ("run.suspended", {"code": (self.interaction or {}).get("code")}),
                ("interaction.requested", self.interaction),
            ]
        else:
            payload = terminal_payload(self.status, self.result, self.error)
            own = [(TERMINAL_EVENTS[self.status], payload)]
        return [*self.pending, *own]

    def transition(self, fence: Fence) -> Suspend | Finish:
        if self.status == RunStatus.SUSPENDED:
            return Suspend(fence, dict(self.interaction or {}))
        return Finish(
            fence,
            self.status,
            self.result,
            self.error,
            self.flow_outputs,
            rollback=self.rollback,
        )
