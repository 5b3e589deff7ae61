"""The Run state machine: the only code that changes a run's status.

```
            admit                 claim                    finish
  (new) ─────────► queued ──────────────► running ───────────────► completed | failed |
                    ▲  ▲                   │  │  │                  cancelled | interrupted
        resume      │  │ requeue (shutdown,│  │  │ suspend
   (reply "retry")  │  │ lease lost: reap) │  │  ▼
                    │  └───────────────────┘  │ suspended ──► cancelled (cancel) |
                    └─────────────────────────┼──────────┘    interrupted (newer run)
                                              └─ reap: cancelled (cancel requested) |
                                                 failed (crash budget used up)
```

Every transition is one conditional ``UPDATE … WHERE`` on the state it expects — for a
leased run also its owner, token and an unexpired lease (measured by the database's clock)
— in one transaction with everything the transition writes:

- **admit** (`admit`): the row, queued; ``ready`` when it is its session's oldest unfinished
  run. Pending limits, the idempotency key and the session's multitask rule are checked in
  the same transaction.
- **claim** (`claim`): the best ready queued run under the global and per-user limits,
  with a fresh fencing token and a lease whose expiry is the database's time at grant plus
  the lease length.
- **renew** (`renew`), **requeue** (`requeue`: graceful shutdown, the crash budget is not
  used), **reap** (`reap`: dead leases — requeued as a crash, or ended: a requested cancel
  finishes as ``cancelled``, a used-up crash budget as ``failed``, each with its terminal
  event and archive).
- **start** (`Start`), **suspend** (`Suspend`) and **finish** (`Finish`) are written by the
  worker's session store in the same transaction as the events they come with (the
  terminal event, the status, the result and the archive row commit together).
- **cancel** (`cancel`) and **resume** (`resume`) for the web side.

When a run leaves the unfinished states its session's next queued run becomes ``ready``
(`_promote_next`), so a session executes one run at a time, in submission order.

Terminal events written outside the worker's store (reaper, web cancels) are appended with
`append_event` under the session row's lock; the store's own commits are conditional on the
session's durable prefix, so the two never interleave sequence numbers.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import (
    DEFAULT_DB_ALIAS,
    IntegrityError,
    OperationalError,
    connections,
    transaction,
)
from django.db.models import (
    BigIntegerField,
    Case,
    DateTimeField,
    ExpressionWrapper,
    F,
    Q,
    Value,
    When,
)
from django.db.models.functions import Coalesce, Now
from django.utils import timezone

from sageproject.credentials import Credential, CredentialRefused, check_credential
from sageproject.db import one_transaction, pipelined, prepared
from sageproject.errors import (
    ConflictError,
    ErrorCategory,
    NotFoundError,
    RateLimitedError,
    SageError,
)
from scheduling import pending, wakeups
from scheduling.faults import crash_point, is_armed
from scheduling.leases import ClaimCandidate, ClaimOrder, FenceRejected, fair_order
from scheduling.models import (
    UNFINISHED_STATUSES,
    Event,
    FenceSequence,
    Multitask,
    Run,
    RunQueue,
    RunStatus,
    Session,
    StopRequest,
    run_cancelled_error,
    run_interrupted_error,
)
from scheduling.serialization import encode_payload

logger = logging.getLogger("sage.runs")

Clock = Callable[[], datetime] | None

TERMINAL_EVENTS = {
    RunStatus.COMPLETED: "run.completed",
    RunStatus.FAILED: "run.failed",
    RunStatus.CANCELLED: "run.cancelled",
    RunStatus.INTERRUPTED: "run.interrupted",
}

# How long PostgreSQL lets a claim transaction sit idle (its process frozen, say) before it
# ends the session and releases the claim lock for every other worker.
CLAIM_IDLE_TIMEOUT_MS = 2000


def worker_restarted_error() -> dict[str, Any]:
    return SageError(
        "execution.worker_restarted",
        "the run's worker stopped too many times; the run was failed",
        category=ErrorCategory.RESOURCE_LOST,
    ).record()


# ------------------------------------------------------------------------------ values


@dataclass(frozen=True, slots=True, kw_only=True)
class Fence:
    """What a write must still hold: the run's current lease owner and token."""

    run_id: Any
    lease_owner: str
    lease_token: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Grant:
    """One claimed run: its row fields, fencing token and lease expiry (database time)."""

    row: dict[str, Any]
    token: int
    expires_at: datetime
    granted_at: datetime

    @classmethod
    def leased(cls, row: dict[str, Any], duration: timedelta) -> Grant:
        """The grant of a leased run's row (its lease fields taken out of ``row``)."""
        row.pop("admission_slot")
        expires = row.pop("lease_expires_at")
        return cls(
            row=row,
            token=row.pop("lease_token"),
            expires_at=expires,
            granted_at=expires - duration,
        )


# ------------------------------------------------------------------------------ archiver

# The archive row (``ManagedAgentRecord``) belongs to the agents app; it registers its writer
# here at start-up (``AgentsConfig.ready``) so scheduling never imports agents.


@dataclass(frozen=True, slots=True, kw_only=True)
class ArchiveRecord:
    """What the archive of a terminal run holds (``flow_outputs`` None: left as it is)."""

    run_id: Any
    owner_id: Any
    package_ref: str
    package_name: str
    agent_id: str
    status: str
    result: Any
    error: Any
    flow_outputs: dict[str, Any] | None = None


Archiver = Callable[[list[ArchiveRecord], str], Any]
_archiver: Archiver | None = None

_ARCHIVE_FIELDS = (
    "pk",
    "owner_id",
    "session__package_ref",
    "session__package_name",
    "session__agent_id",
)


# ``statement(connection)``: the archiver's one SQL statement for PostgreSQL, taking five
# arrays (run ids, statuses, results, errors, flow outputs — the last three as JSON text,
# outputs NULL: left as they are) and reading the rest from the run and session rows. With
# it, the session store's pipelined group commit archives without a round trip of its own.
ArchiveStatement = Callable[[Any], str]
_archive_statement: ArchiveStatement | None = None


def set_archiver(fn: Archiver | None, statement: ArchiveStatement | None = None) -> None:
    """Register ``fn(records, using)``: writes (or refreshes) the archive rows of terminal
    runs, called inside the transaction that ends them; ``statement``: the same write as
    one PostgreSQL statement (see `ArchiveStatement`), optional."""
    global _archiver, _archive_statement
    _archiver = fn
    _archive_statement = statement


def _archive_records(
    run_ids: list[Any], outcomes: dict[Any, tuple[str, Any, Any, Any]], using: str
) -> list[ArchiveRecord]:
    """Archive records of ``run_ids``; ``outcomes[run_id] = (status, result, error,
    flow_outputs)`` (read from the rows when missing). One query."""
    fields = (
        _ARCHIVE_FIELDS
        if len(outcomes) == len(run_ids)
        else (
            *_ARCHIVE_FIELDS,
            "status",
            "result",
            "error",
        )
    )
    records = []
    for row in Run.objects.using(using).filter(pk__in=run_ids).values(*fields):
        status, result, error, flow_outputs = outcomes.get(
            row["pk"], (row.get("status"), row.get("result"), row.get("error"), None)
        )
        records.append(
            ArchiveRecord(
                run_id=row["pk"],
                owner_id=row["owner_id"],
                package_ref=row["session__package_ref"],
                package_name=row["session__package_name"],
                agent_id=row["session__agent_id"],
                status=status,
                result=result,
                error=error,
                flow_outputs=flow_outputs,
            )
        )
    return records


def archive(
    run_ids: list[Any],
    *,
    flow_outputs: dict[Any, dict[str, Any] | None] | None = None,
    using: str = DEFAULT_DB_ALIAS,
) -> None:
    """Write (or refresh) the archive rows of terminal runs from their rows, with their
    flow outputs (``{run_id: outputs}``, where known), in one query and one upsert."""
    if _archiver is None or not run_ids:
        return
    records = _archive_records(run_ids, {}, using)
    if flow_outputs:
        outputs = {str(run_id): value for run_id, value in flow_outputs.items()}
        records = [replace(r, flow_outputs=outputs.get(str(r.run_id))) for r in records]
    _archiver(records, using)


def _archive(run_id: Any, using: str, flow_outputs: dict[str, Any] | None = None) -> None:
    archive([run_id], flow_outputs={run_id: flow_outputs}, using=using)


# ------------------------------------------------------------------------------ clocks


# SQLite has no server and its own clock reads milliseconds (``STRFTIME('%f')``), while a
# run's times are this host's to the microsecond: a run admitted at 12:00:00.123456 would
# not be claimable by ``available_at <= now`` until 12:00:00.124, and the worker woken for
# it within that millisecond would find nothing. Every SQLite connection gets this host's
# clock as a SQL function instead (`register_sqlite_clock`), in the format Django stores.
SQLITE_NOW = "sage_utc_now"


def _sqlite_utc_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")


def register_sqlite_clock(sender: Any, connection: Any, **kwargs: Any) -> None:
    """``connection_created`` receiver for SQLite's connections (`scheduling.apps`):
    ``sage_utc_now()`` on a new connection."""
    # Declared deterministic, as SQLite's own ``'now'`` behaves: read once per execution of
    # a statement, not for every row compared with it (undeclared, a claim with 10,000 runs
    # queued took 38 to 50 ms instead of 15).
    connection.connection.create_function(SQLITE_NOW, 0, _sqlite_utc_now, deterministic=True)


class DbNow(Now):
    """The database server's current time, in UTC on every backend (Django's ``Now`` is
    MySQL's session-time-zone ``CURRENT_TIMESTAMP``); on SQLite this host's, to the
    microsecond (`SQLITE_NOW`)."""

    def as_mysql(self, compiler: Any, connection: Any, **extra: Any) -> Any:
        return self.as_sql(compiler, connection, template="UTC_TIMESTAMP(6)", **extra)

    def as_sqlite(self, compiler: Any, connection: Any, **extra: Any) -> Any:
        return self.as_sql(compiler, connection, template=f"{SQLITE_NOW}()", **extra)


def now_expr(clock: Clock = None) -> Any:
    """The current time as the database sees it (``Now()``), or ``clock()`` when given
    (tests move time by hand)."""
    if clock is not None:
        return Value(clock(), output_field=DateTimeField())
    return DbNow()


def later_expr(duration: timedelta, clock: Clock = None) -> Any:
    """``now + duration`` in the database's clock."""
    if clock is not None:
        return Value(clock() + duration, output_field=DateTimeField())
    return ExpressionWrapper(DbNow() + Value(duration), output_field=DateTimeField())


def db_now(using: str = DEFAULT_DB_ALIAS, clock: Clock = None) -> datetime:
    """The database server's current time (this host's on SQLite, which has no server)."""
    if clock is not None:
        return clock()
    connection = connections[using]
    if connection.vendor == "postgresql":
        sql = "SELECT clock_timestamp()"
    elif connection.vendor == "mysql":
        sql = "SELECT UTC_TIMESTAMP(6)"
    else:
        return timezone.now()
    with connection.cursor() as cursor:
        cursor.execute(sql)
        value = cursor.fetchone()[0]
    if timezone.is_naive(value):
        value = timezone.make_aware(value, timezone.UTC)
    return value


# ------------------------------------------------------------------------------ fences


def held(fence: Fence, using: str = DEFAULT_DB_ALIAS, clock: Clock = None) -> Any:
    """The run row while ``fence`` still owns it: running, same owner and token, and its
    lease not yet expired by the database's clock."""
    return Run.objects.using(using).filter(
        pk=fence.run_id,
        lease_owner=fence.lease_owner,
        lease_token=fence.lease_token,
        status=RunStatus.RUNNING,
        lease_expires_at__gt=now_expr(clock),
    )


def check_fence(fence: Fence, *, using: str = DEFAULT_DB_ALIAS, clock: Clock = None) -> None:
    """Conditional UPDATE of the run row inside the caller's transaction.

    Raises ``scheduler.fence_rejected`` when no row matches: another owner, a newer token,
    the run no longer running, or its lease expired (even if nobody reclaimed it yet).
    """
    if held(fence, using, clock).update(updated_at=timezone.now()) != 1:
        raise FenceRejected(fence.run_id)


# ------------------------------------------------------------------------------ events


def _locked_prefix(session_id: Any, using: str) -> int:
    """The session's durable event count, its row locked until the caller's transaction
    ends."""
    return (
        Session.objects.using(using)
        .select_for_update()
        .values_list("persisted_events", flat=True)
        .get(pk=session_id)
    )


def append_event(
    session_id: Any, run_id: Any, event_type: str, payload: Any, *, using: str = DEFAULT_DB_ALIAS
) -> int:
    """Append one event after the session's durable prefix (inside the caller's
    transaction, under the session row's lock); returns its seq."""
    with transaction.atomic(using=using):
        seq = _locked_prefix(session_id, using) + 1
        Event.objects.using(using).create(
            session_id=session_id,
            seq=seq,
            run_id=run_id,
            type=event_type,
            data=encode_payload(payload),
        )
        Session.objects.using(using).filter(pk=session_id).update(
            persisted_events=seq, updated_at=timezone.now()
        )
        return seq


def append_unleased_event(
    session_id: Any, run_id: Any, event_type: str, payload: Any, *, using: str = DEFAULT_DB_ALIAS
) -> int:
    """Append an event of ``run_id`` written by someone who holds no lease of it (a job
    that outlived its run's execution): accepted while the run is not running; while it is
    running, only its lease holder may write (``scheduler.fence_rejected``)."""
    with transaction.atomic(using=using):
        status = (
            Run.objects.using(using)
            .select_for_update()
            .filter(pk=run_id)
            .values_list("status", flat=True)
            .first()
        )
        if status == RunStatus.RUNNING:
            raise FenceRejected(run_id)
        return append_event(session_id, run_id, event_type, payload, using=using)


def terminal_payload(status: str, result: Any, error: Any) -> dict[str, Any]:
    """The payload of a terminal event: the result of a completed run, else its error."""
    return {"result": result} if status == RunStatus.COMPLETED else {"error": error}


# ------------------------------------------------------------------------------ sessions


def _promote_next(session_id: Any, using: str) -> None:
    """Make the session's oldest queued run ready, unless another run is still unfinished
    and ready (running, suspended or queued ahead)."""
    runs = Run.objects.using(using).filter(session_id=session_id)
    if runs.filter(status__in=UNFINISHED_STATUSES, ready=True).exists():
        return
    head = (
        runs.filter(status=RunStatus.QUEUED, ready=False)
        .order_by("created_at", "id")
        .values_list("pk", flat=True)
        .first()
    )
    if head is not None:
        runs.filter(pk=head).update(ready=True)
        wakeups.notify("run", using=using)


def session_busy_error() -> ConflictError:
    return ConflictError(
        "session.busy",
        "the session already has an unfinished run; wait for it, or submit with "
        "multitask=enqueue, interrupt or rollback",
    )


def queue_full_error(limit: int, *, per_user: bool = False) -> RateLimitedError:
    whose = "you have" if per_user else "the host has"
    return RateLimitedError(
        "scheduler.queue_full",
        f"{whose} {limit} queued runs, the limit; try again shortly",
        resumable=True,
        details={"max_pending_per_user" if per_user else "max_pending": limit, "retry_after": 2},
    )


# ------------------------------------------------------------------------------ admit


def admit(
    *,
    owner: Any,
    session_id: Any,
    input: Any,
    idempotency_key: str | None = None,
    queue: str = RunQueue.CHAT,
    priority: int = 0,
    multitask: str = Multitask.ENQUEUE,
    credential: Credential | None = None,
    using: str = DEFAULT_DB_ALIAS,
) -> tuple[Run, bool]:
    """Admit a run (queued) into ``owner``'s session; returns (run, created).

    One transaction, no global lock: the session row's lock orders it against the
    session's other runs, and its pending places are taken from the host's and the user's
    counters (`scheduling.pending`), so concurrent admissions never exceed the limits. A
    repeated ``idempotency_key`` answers the run it created first. Raises
    ``session.not_found`` (404) for a session that is not the owner's,
    ``scheduler.queue_full`` (429) at the pending limits and ``session.busy`` (409) for
    ``multitask=reject`` on a session with an unfinished run. With ``interrupt`` or
    ``rollback`` the session's unfinished runs are stopped (queued and suspended ones at
    once, a running one by its worker at its next step) and the new run follows them.
    With a ``credential`` (`Credential`) it is checked first, in the same transaction.
    """
    owner_id = getattr(owner, "pk", owner)
    args = (
        owner_id,
        session_id,
        input,
        idempotency_key,
        queue,
        priority,
        Multitask(multitask),
        credential,
    )
    slot = None
    for attempt in range(ADMIT_ATTEMPTS):
        try:
            try:
                return _admit(*args, slot, using)
            except pending.StripeFull:
                # Another stripe has room, or the host is full (refused here).
                slot = pending.roomiest(owner_id, using=using)
        except pending.Missing as missing:
            # A new user (or an emptied table): its counter rows are created on their
            # own, then the admission runs again from the start.
            pending.create(missing.scopes, using=using)
            slot = None
        except pending.Full as full:
            raise queue_full_error(full.limit, per_user=full.per_user) from None
        except OperationalError as exc:
            # A deadlock with another writer of the counters (an interrupting admission
            # gives places back while taking one): the database rolled this one back.
            if attempt == ADMIT_ATTEMPTS - 1 or not is_deadlock(exc):
                raise
            slot = None
    raise queue_full_error(pending.host_limit())


# Attempts of one admission: its stripe full, then each stripe `roomiest` named filled by
# others meanwhile; after that the host is as good as full.
ADMIT_ATTEMPTS = 8


def is_deadlock(exc: BaseException) -> bool:
    """The database chose this transaction as a deadlock's victim (PostgreSQL 40P01,
    MySQL 1213)."""
    cause = exc.__cause__
    return getattr(cause, "sqlstate", None) == "40P01" or (
        bool(getattr(cause, "args", None)) and cause.args[0] == 1213
    )


def _admit(
    owner_id: Any,
    session_id: Any,
    input: Any,
    idempotency_key: str | None,
    queue: str,
    priority: int,
    multitask: Multitask,
    credential: Credential | None,
    slot: int | None,
    using: str,
) -> tuple[Run, bool]:
    runs = Run.objects.using(using)
    run = Run(
        session_id=session_id,
        owner_id=owner_id,
        input=input,
        idempotency_key=idempotency_key or None,
        queue=queue,
        priority=priority,
        admission_slot=pending.pick(slot),
    )
    one_statement = _admits_in_one_statement(using, run, multitask)
    if one_statement and not connections[using].in_atomic_block:
        # Its own transaction, begun and committed in the same round trip.
        return _admit_pipelined(run, multitask, credential, using, commit=True), True
    with transaction.atomic(using=using):
        if credential is not None:  # in each attempt's transaction
            check_credential(credential, using)
        if idempotency_key:
            existing = runs.filter(owner_id=owner_id, idempotency_key=idempotency_key).first()
            if existing is not None:
                return existing, False
        if one_statement:
            return _admit_pipelined(run, multitask, None, using, commit=False), True
        # The session row's lock orders this admission against the session's finishing
        # run (which hands the session's turn on under the same lock).
        locked = Session.objects.using(using).filter(pk=session_id, owner_id=owner_id)
        features = connections[using].features
        if features.has_select_for_update:
            locked = locked.select_for_update()
        if locked.values_list("pk").first() is None:
            raise NotFoundError("session.not_found", "session not found")
        # Read after the lock, in a statement of its own: read in the locking statement, it
        # would come from before the wait (PostgreSQL), and a finish committed during the
        # wait would leave this run waiting for a turn that was already handed out.
        unfinished = runs.filter(session_id=session_id, status__in=UNFINISHED_STATUSES)
        busy = unfinished.exists()
        if busy and multitask is Multitask.REJECT:
            raise session_busy_error()
        if busy and multitask in (Multitask.INTERRUPT, Multitask.ROLLBACK):
            for run_id in list(unfinished.values_list("pk", flat=True)):
                _stop(run_id, StopRequest(multitask.value), using=using)
            busy = unfinished.exists()
        run.ready = not busy
        try:
            # A savepoint only where a concurrent twin can make the insert fail.
            with transaction.atomic(using=using, savepoint=bool(idempotency_key)):
                pending.take(owner_id, run.admission_slot, using=using)
                run.save(force_insert=True, using=using)
        except IntegrityError:
            if not idempotency_key:
                raise
            # A concurrent admission with the same key committed first: answer its run.
            return runs.get(owner_id=owner_id, idempotency_key=idempotency_key), False
        if run.ready:
            wakeups.notify("run", using=using)
    return run, True


def _admits_in_one_statement(using: str, run: Run, multitask: Multitask) -> bool:
    """Whether `_admit_pipelined` can admit ``run``: on PostgreSQL, without an idempotency
    key (whose twin needs a savepoint) and without runs to stop first."""
    return (
        connections[using].vendor == "postgresql"
        and run.idempotency_key is None
        and multitask in (Multitask.ENQUEUE, Multitask.REJECT)
    )


def rearm_idle_timeout(raw: Any) -> None:
    """After a pipeline that left its transaction open — only where a crash point is armed
    before its ``COMMIT`` (tests) — one plain statement: PostgreSQL arms its idle-in-
    transaction timeout when it waits for a statement outside a pipeline, not reliably
    after one. A
    process frozen at that crash point then has its transaction ended by the server, as a
    process frozen inside any other transaction does, instead of holding its locks (and
    every claim behind them) until it dies."""
    raw.execute("SELECT 1")


class _SecondReport(logging.Filter):
    """Drops psycopg's "error ignored terminating <Pipeline>: pipeline aborted": a statement
    of the pipeline failed and that error is already on its way to the caller (an
    admission refused by its guard, a group commit redone) — the same failure twice."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (
            str(record.msg).startswith("error ignored terminating")
            and "pipeline aborted" in record.getMessage()
        )


logging.getLogger("psycopg").addFilter(_SecondReport())


@functools.cache
def _admission_statements(
    using: str, credential_sql: str | None
) -> tuple[str, str, str, tuple[Any, ...]]:
    """`_admit_pipelined`'s statements on database ``using`` — the session lock, the
    admission, the guard — and the run's fields whose values the admission's parameters
    carry, in order ("ready" is computed in SQL). With ``credential_sql`` (`Credential`) the
    admission's parameters begin with the credential's, and the session counts as found
    only while it holds. Built once per database and credential: they depend only on its
    quoting."""
    quote = connections[using].ops.quote_name
    authorized = f"({credential_sql})" if credential_sql else "TRUE"
    run_table, session_table = quote(Run._meta.db_table), quote(Session._meta.db_table)
    places, _ = pending.take_ctes(quote, 0, 0, "SELECT found AND NOT (busy AND %s) FROM b")
    columns, values, fields = [], [], []
    for field in Run._meta.concrete_fields:
        columns.append(quote(field.column))
        if field.name == "ready":
            values.append("NOT (SELECT busy FROM b)")
        else:
            values.append("%s")
            fields.append(field)
    sql = (
        f"WITH c AS (SELECT {authorized} AS authorized),"
        f" b AS (SELECT EXISTS (SELECT 1 FROM {run_table} WHERE session_id = %s"
        f" AND status IN ({', '.join(['%s'] * len(UNFINISHED_STATUSES))})) AS busy,"
        f" (SELECT authorized FROM c) AND EXISTS (SELECT 1 FROM {session_table}"
        f" WHERE id = %s AND owner_id = %s) AS found),"
        f" {places},"
        f" r AS (INSERT INTO {run_table} ({', '.join(columns)}) SELECT {', '.join(values)}"
        f" WHERE EXISTS (SELECT 1 FROM user_place) RETURNING ready),"
        f" n AS (SELECT pg_notify(%s, %s) FROM r WHERE ready AND %s)"
        f" SELECT found, busy, EXISTS (SELECT 1 FROM host_place),"
        f" EXISTS (SELECT 1 FROM user_place), (SELECT ready FROM r),"
        f" (SELECT count(*) FROM n), {pending.user_row_sql(quote)},"
        f" (SELECT authorized FROM c) FROM b"
    )
    lock_sql = f"SELECT 1 FROM {session_table} WHERE id = %s AND owner_id = %s FOR UPDATE"
    # Fails (the transaction aborts) unless the run is there.
    guard_sql = guarded(f"SELECT id FROM {run_table} WHERE id = %s")
    return lock_sql, sql, guard_sql, tuple(fields)


# libpq's PQTRANS_IDLE: no transaction open on the connection.
_IDLE = 0


@functools.cache
def division_by_zero() -> type[Exception]:
    import psycopg

    return psycopg.errors.DivisionByZero


def _admit_pipelined(
    run: Run, multitask: Multitask, credential: Credential | None, using: str, *, commit: bool
) -> Run:
    """`_admit` on PostgreSQL in one round trip: the session row's lock, and one statement
    that reads whether the session is busy, takes the pending places (`pending.take_ctes`),
    inserts the run and notifies the workers — sent together (`pipelined`). The second
    statement starts after the lock is held, so what it reads is from after any wait for it.

    With ``commit`` (no transaction is open) the round trip is the whole transaction (the
    pipeline's implicit one, `one_transaction`): a guard statement after the insert
    fails when the run was not inserted, which aborts the transaction — a place taken in the
    host's stripe while the user's was refused is never committed — and the statement's
    row, already received, says why. Without ``commit`` it runs in the caller's
    transaction, which the exception raised here rolls back. A ``credential`` is checked
    by the admission statement itself: the session counts as not found unless it holds."""
    connection = connections[using]
    lock_sql, sql, guard_sql, fields = _admission_statements(
        using, credential.sql if credential is not None else None
    )
    reject = multitask is Multitask.REJECT
    places = pending.take_params(run.owner_id, run.admission_slot)
    notify = wakeups.backend(using) == "postgresql"
    params = [
        *(credential.params if credential is not None else ()),
        run.session_id,
        *UNFINISHED_STATUSES,
        run.session_id,
        run.owner_id,
        *places[:2],
        reject,
        *places[2:],
        *(field.get_db_prep_save(field.pre_save(run, True), connection) for field in fields),
        wakeups.CHANNEL,
        "run",
        notify,
        pending.user_scope(run.owner_id),
    ]
    connection.ensure_connection()
    raw = connection.connection
    with connection.wrap_database_errors:
        try:
            with one_transaction(raw) if commit else pipelined(raw):
                prepared(raw, lock_sql, [run.session_id, run.owner_id])
                cursor = prepared(raw, sql, params)
                if commit:
                    prepared(raw, guard_sql, [run.pk, 1])
        except Exception as exc:
            if commit:
                if raw.pgconn.transaction_status != _IDLE:
                    raw.execute("ROLLBACK")
                if not isinstance(exc, division_by_zero()):
                    raise
            else:
                raise
    found, busy, host, user, ready, _, user_row, authorized = cursor.fetchone()
    if not authorized:
        raise CredentialRefused
    if credential is not None:
        credential.checked = True
    if not found:
        raise NotFoundError("session.not_found", "session not found")
    if busy and reject:
        raise session_busy_error()
    pending.taken(run.owner_id, run.admission_slot, host=host, user=user, user_row=user_row)
    run.ready = ready
    run._state.adding = False
    run._state.db = using
    if ready and not notify:
        wakeups.notify("run", using=using)
    return run


# ------------------------------------------------------------------------------ claim


def _dead_lease(clock: Clock) -> Q:
    return Q(status=RunStatus.RUNNING) & (
        Q(lease_expires_at__lte=now_expr(clock)) | Q(lease_expires_at__isnull=True)
    )


def _reapable(clock: Clock) -> Q:
    """Runs `reap` would end or queue again: dead leases, and queued runs with a cancel
    request (written by an older version)."""
    return _dead_lease(clock) | Q(status=RunStatus.QUEUED, cancel_requested=True)


def _claimable(queue: str | None, clock: Clock) -> Q:
    available = Q(
        status=RunStatus.QUEUED,
        ready=True,
        available_at__lte=now_expr(clock),
        cancel_requested=False,
    )
    if queue is not None:
        available &= Q(queue=queue)
    return available


def _look(db: str, queue: str | None, clock: Clock, *, work: bool, reap: bool) -> tuple[bool, bool]:
    """(whether a run is claimable, whether one is reapable), in one statement that takes
    no lock: what a claim looks at before the claim lock. A question not asked (``work`` or
    ``reap`` false) is answered true for work and false for reaping."""
    if clock is None:
        sql, params = _look_statement(db, queue, work, reap)
    else:  # a test's clock: its time is a value of the statement
        sql, params = _look_sql(db, queue, clock, work, reap)
    # Not a prepared statement: a generic plan would not know the statuses (the partial
    # index of claimable runs is chosen on them); prepared, it measured a worse latency p99.
    with connections[db].cursor() as cursor:
        cursor.execute(sql, params)
        row = cursor.fetchone()
    answers = iter(bool(value) for value in row)
    return (next(answers) if work else True), (next(answers) if reap else False)


@functools.cache
def _look_statement(
    db: str, queue: str | None, work: bool, reap: bool
) -> tuple[str, tuple[Any, ...]]:
    """`_look_sql` on the database's clock: the same text and values every time, compiled
    once (the claim's look compiled two ORM queries per claim)."""
    sql, params = _look_sql(db, queue, None, work, reap)
    return sql, tuple(params)


def _look_sql(
    db: str, queue: str | None, clock: Clock, work: bool, reap: bool
) -> tuple[str, list[Any]]:
    questions: list[str] = []
    params: list[Any] = []
    for asked, where in ((work, _claimable(queue, clock)), (reap, _reapable(clock))):
        if asked:
            query = Run.objects.using(db).filter(where).order_by().values("pk")[:1].query
            sql, values = query.get_compiler(db).as_sql()
            questions.append(f"EXISTS ({sql})")
            params += values
    return f"SELECT {', '.join(questions)}", params


_ROW_FIELDS = ("pk", "owner_id", "priority", "available_at", "attempts", "queue", "parent_id")


def claim(
    *,
    worker_id: str,
    duration: timedelta,
    order: ClaimOrder = ClaimOrder.FAIR,
    max_active: int | None = None,
    per_tenant: int | None = None,
    queue: str | None = None,
    limit: int = 1,
    max_crashes: int | None = None,
    reap: bool = True,
    look_first: bool = True,
    share_with: int = 1,
    using: str = DEFAULT_DB_ALIAS,
    clock: Clock = None,
) -> tuple[list[Grant], list[str]]:
    """Claim up to ``limit`` runs in one transaction; returns (grants, reaped run ids).

    ``share_with``: the live workers (this one included). When all the runs this claim may
    take fit in it with room to spare (a burst that woke every worker at once, or the
    global limit's last places), it takes only its part of them, rounded up: the others,
    claiming right after it, get theirs. A full batch (a deep queue) is never cut.

    Idle polling takes no lock (a frozen worker inside the claim transaction would stall
    every other worker's claims): it looks for work first, unless ``look_first`` is false
    (a wake-up said there is some). The claim itself serializes on the fence-sequence row; on
    PostgreSQL a transaction left idle by a frozen process is ended after
    ``CLAIM_IDLE_TIMEOUT_MS`` (MySQL: its connection is dropped). Dead leases are reaped
    first (see `reap`). A fixed number of statements whatever
    ``limit``, none of which scans the queue (see `_heads`).
    """
    db = using
    if look_first or reap:
        work, reap = _look(db, queue, clock, work=look_first, reap=reap)
        if not (work or reap):
            return [], []
        # With nothing to reap (the common case) the claim goes its short way. A claim that
        # reaps takes the long one, several round trips under the claim lock — the run a
        # wake-up announced would wait for it.

    def attempt() -> tuple[list[Grant], list[str]]:
        postgres = connection.vendor == "postgresql"
        with _claim_guard(connection), transaction.atomic(using=db):
            running: dict[Any, int] | None = None
            owners: list[Any] | None = None
            if postgres:
                # The claim lock, the tokens and what picking needs in one round trip.
                first_token, running, owners = _claim_reads(connection, limit, queue)
            else:
                first_token = _fence_row(db).value + 1
            reaped = _reap_locked(db, clock, max_crashes) if reap else []
            if running is None or reaped:
                # Read (again) after the reaper changed who runs and what is queued.
                owners = None
                with connection.cursor() as cursor:
                    cursor.execute(_running_query(connection))
                    running = dict(cursor.fetchall())
            picked = _pick(
                _heads(db, queue, clock, running, per_tenant, max_active, limit, owners),
                running,
                order=order,
                limit=limit,
                max_active=max_active,
                per_tenant=per_tenant,
            )
            if share_with > 1 and 1 < len(picked) < limit:
                picked = picked[: -(-len(picked) // share_with)]
            grants: list[Grant] = []
            if picked:
                if postgres:
                    # Their places in the pending counts are given back in the statement.
                    rows = _lease_returning(db, picked, first_token, worker_id, duration, clock)
                else:
                    rows = _lease(db, picked, first_token, worker_id, duration, clock)
                    pending.give_back(pending.root_runs(rows), using=db)
                grants = [Grant.leased(row, duration) for row in rows]
                if not postgres and grants:
                    FenceSequence.objects.using(db).filter(pk=1).update(
                        value=first_token - 1 + len(picked)
                    )
            if grants:
                crash_point("claim.before_commit")
        return grants, reaped

    _ensure_fence_row(db)
    connection = connections[db]
    if connection.vendor == "postgresql" and not reap and not connection.in_atomic_block:
        # The common claim: one round trip, the claim lock held only while the database
        # works (`_claim_pipelined`). A claim that reaps, or one inside a transaction of
        # the caller, goes the long way below.
        statement = _claim_statement(
            connection,
            worker_id,
            duration,
            order,
            max_active,
            per_tenant,
            queue,
            limit,
            share_with,
            clock,
        )
        try:
            grants = _claim_pipelined(connection, limit, duration, statement)
        except _FenceRowMissing:
            _fence_rows.discard(db)
            _ensure_fence_row(db)
        else:
            return grants, []
    try:
        grants, reaped = attempt()
    except _FenceRowMissing:
        # The table was emptied since this process created its row: create it again,
        # outside any claim transaction, and try once more.
        _fence_rows.discard(db)
        _ensure_fence_row(db)
        grants, reaped = attempt()
    if grants:
        crash_point("claim.after_commit")
    return grants, reaped


def _claim_reads(
    connection: Any, count: int, queue: str | None
) -> tuple[int, dict[Any, int], list[Any]]:
    """PostgreSQL, in one round trip (`pipelined`): the claim transaction's idle timeout,
    the claim lock (the fence-sequence row) with a range of ``count`` fencing tokens — unused
    ones are skipped: tokens only have to increase — then the running runs per user and the
    users with ready queued runs, read after the lock is held, as the statements run in
    order. Returns (first token, running, owners)."""
    raw = connection.connection
    with connection.wrap_database_errors, pipelined(raw):
        tokens = _take_claim_lock(connection, count)
        running = prepared(raw, _running_query(connection))
        owners = prepared(raw, *_owners_query(connection, queue))
    row = tokens.fetchone()
    if row is None:
        raise _FenceRowMissing
    return (
        row[0] - count + 1,
        dict(running.fetchall()),
        [o for (o,) in owners.fetchall()],
    )


def _take_claim_lock(connection: Any, count: int, *, idle_timeout: bool = True) -> Any:
    """PostgreSQL, in the claim's transaction: its idle timeout (unless the transaction
    never waits for this process: a pipeline's implicit one), then the claim lock (the
    fence-sequence row) with a range of ``count`` fencing tokens; returns the cursor whose
    row is the range's last token (none: the row is missing)."""
    raw = connection.connection
    table = connection.ops.quote_name(FenceSequence._meta.db_table)
    if idle_timeout:
        raw.execute(f"SET LOCAL idle_in_transaction_session_timeout = {CLAIM_IDLE_TIMEOUT_MS}")
    return prepared(
        raw, f"UPDATE {table} SET value = value + %s::bigint WHERE id = 1 RETURNING value", [count]
    )


def _claim_pipelined(
    connection: Any, limit: int, duration: timedelta, statement: tuple[str, list[Any]]
) -> list[Grant]:
    """`claim` on PostgreSQL in one round trip (`pipelined`), one transaction (the
    pipeline's implicit one, `one_transaction`): the claim lock with ``limit`` fencing
    tokens (the fence-sequence row), then the ``statement`` that picks and leases
    (`_claim_statement`). The statement starts after the lock is held, so it reads what the
    previous claim committed; the lock is held only while the database works, never across
    a round trip to this process — which, on a busy host, is what the claim rate of several
    workers turns on.

    Leases are taken only if this transaction moved the fence row (its ``xmin``): a row
    recreated by another process meanwhile (the table emptied) raises `_FenceRowMissing`
    with nothing leased. With the ``claim.before_commit`` crash point armed the
    transaction is explicit, with its idle timeout, and its ``COMMIT`` is sent after it."""
    connection.ensure_connection()
    commit_at_once = not is_armed("claim.before_commit")
    raw = connection.connection
    sql, params = statement
    with connection.wrap_database_errors:
        try:
            with one_transaction(raw, at_once=commit_at_once) as explicit:
                tokens = _take_claim_lock(connection, limit, idle_timeout=explicit)
                leased = prepared(raw, sql, params)
            if tokens.fetchone() is None:
                raise _FenceRowMissing
            rows = _leased_rows(connection, leased.fetchall())
            if not commit_at_once:
                if rows:
                    rearm_idle_timeout(raw)
                    crash_point("claim.before_commit")
                raw.execute("COMMIT")
        except BaseException:
            if raw.pgconn.transaction_status != _IDLE:
                raw.execute("ROLLBACK")
            raise
    grants = [Grant.leased(row, duration) for row in rows]
    if grants:
        crash_point("claim.after_commit")
    return grants


def _claim_statement(
    connection: Any,
    worker_id: str,
    duration: timedelta,
    order: ClaimOrder,
    max_active: int | None,
    per_tenant: int | None,
    queue: str | None,
    limit: int,
    share_with: int,
    clock: Clock,
) -> tuple[str, list[Any]]:
    """The pick-and-lease statement of `_claim_pipelined`: the same choice as `_heads` +
    `_pick` (+ ``share_with``) + `_lease_returning`, in SQL.

    The users with ready queued runs (the loose index scan of `_owners_query`) and their
    running root runs; the open ones (under ``per_tenant``, and the host under
    ``max_active``), fewest running first, at most `MAX_CLAIM_TENANTS`, give their best
    heads (as many as they have room for); the others give child runs only. A user's
    k-th root head weighs its running runs + k, a child run 0: ordered by that weight
    (``FAIR``; not for ``OLDEST``), then priority (higher first), then submit order —
    which is what picking one head at a time by `fair_order` gives — root runs past the
    host's room left out, the first ``limit`` are taken (a burst shared with the other
    live workers: their part, rounded up) and leased with ``SKIP LOCKED``, token = the
    fence row's new value - ``limit`` + position; the pending counts give their places
    back in the same statement."""
    queue_params = [] if queue is None else [queue]
    now_params = [] if clock is None else [clock()]
    no_limit = 2**31 - 1
    tenant_cap = no_limit if per_tenant is None else per_tenant
    host_cap = no_limit if max_active is None else max_active
    sql = _claim_sql(
        connection.alias, queue is not None, ClaimOrder(order) is ClaimOrder.FAIR, clock is not None
    )
    params = [
        *queue_params,
        *queue_params,
        tenant_cap,
        host_cap,
        *queue_params,
        *now_params,
        limit,
        tenant_cap,
        *queue_params,
        *now_params,
        limit,
        host_cap,
        limit,
        limit,
        max(1, share_with),
        limit,
        worker_id,
        limit,
        *now_params,
        duration,
        *now_params,
    ]
    return sql, params


@functools.cache
def _claim_sql(using: str, by_queue: bool, fair_order_: bool, clocked: bool) -> str:
    """`_claim_statement`'s text, built once per database and shape."""
    connection = connections[using]
    quote = connection.ops.quote_name
    run, session = quote(Run._meta.db_table), quote(Session._meta.db_table)
    fence = quote(FenceSequence._meta.db_table)
    queue = "" if by_queue else None  # the queue's placeholder, or none
    owners, _ = _owners_cte(connection, queue)
    queued, _ = _queued_where(connection, queue)
    now = "%s::timestamptz" if clocked else "STATEMENT_TIMESTAMP()"
    heads_cols = "id, owner_id, priority, created_at, parent_id"
    best = "ORDER BY priority DESC, created_at, id"
    fair = "k.load, " if fair_order_ else ""
    key = f"{fair}k.priority DESC, k.created_at, k.id::text"
    sql = (
        f"WITH RECURSIVE {owners},"
        f" running (o, n) AS ({_running_query(connection)}),"
        f" total AS (SELECT COALESCE(SUM(n), 0) AS n FROM running),"
        f" loads AS (SELECT owners.o, COALESCE(running.n, 0) AS n,"
        f" COALESCE(running.n, 0) < %s AND (SELECT n FROM total) < %s AS open"
        f" FROM owners LEFT JOIN running ON running.o = owners.o WHERE owners.o IS NOT NULL),"
        f" eligible AS (SELECT o, n FROM loads WHERE open ORDER BY n, o LIMIT {MAX_CLAIM_TENANTS}),"
        f" saturated AS (SELECT o FROM loads WHERE o NOT IN (SELECT o FROM eligible)"
        f" ORDER BY o LIMIT {MAX_CLAIM_TENANTS}),"
        f" heads AS (SELECT h.*, e.n AS base FROM eligible e CROSS JOIN LATERAL"
        f" (SELECT {heads_cols} FROM {run} WHERE {queued} AND owner_id = e.o"
        f" AND available_at <= {now} {best} LIMIT LEAST(%s, GREATEST(%s - e.n, 0))) h"
        f" UNION ALL SELECT h.*, 0 FROM saturated t CROSS JOIN LATERAL"
        f" (SELECT {heads_cols} FROM {run} WHERE {queued} AND owner_id = t.o"
        f" AND available_at <= {now} AND parent_id IS NOT NULL {best} LIMIT %s) h),"
        f" k AS (SELECT id, owner_id, priority, created_at, parent_id,"
        f" CASE WHEN parent_id IS NULL THEN base - 1 + ROW_NUMBER() OVER"
        f" (PARTITION BY owner_id, parent_id IS NULL {best}) ELSE 0 END AS load FROM heads),"
        f" counted AS (SELECT k.*, SUM(CASE WHEN k.parent_id IS NULL THEN 1 ELSE 0 END)"
        f" OVER (ORDER BY {key} ROWS UNBOUNDED PRECEDING) AS roots FROM k),"
        f" allowed AS (SELECT k.id, ROW_NUMBER() OVER (ORDER BY {key}) AS pos FROM counted k"
        f" WHERE k.parent_id IS NOT NULL OR k.roots <= %s - (SELECT n FROM total)),"
        f" picked AS (SELECT id, pos FROM allowed WHERE pos <= %s),"
        f" cut AS (SELECT id, pos FROM picked WHERE pos <= CASE"
        f" WHEN (SELECT COUNT(*) FROM picked) BETWEEN 2 AND %s - 1"
        f" THEN CEIL((SELECT COUNT(*) FROM picked)::numeric / %s) ELSE %s END),"
        f" leased AS (UPDATE {run} r SET status = '{RunStatus.RUNNING}', lease_owner = %s,"
        f" lease_token = f.value - %s + c.pos, lease_expires_at = {now} + %s,"
        f" attempts = r.attempts + 1, started_at = COALESCE(r.started_at, {now})"
        f" FROM cut c, {session} s, {fence} f"
        f" WHERE r.id = c.id AND f.id = 1 AND f.xmin = pg_current_xact_id()::xid"
        f" AND s.id = r.session_id AND r.id IN"
        f" (SELECT id FROM {run} WHERE id = ANY(ARRAY(SELECT id FROM cut))"
        f" AND status = '{RunStatus.QUEUED}' AND ready FOR UPDATE SKIP LOCKED)"
        f" RETURNING {', '.join(_leased_columns(quote))}, c.pos),"
        f" {pending.give_back_ctes(quote, 'leased')}"
        f" SELECT * FROM leased ORDER BY pos"
    )
    return sql


def _lease(
    db: str, picked: list[Any], first_token: int, worker_id: str, duration: Any, clock: Clock
) -> list[dict[str, Any]]:
    """Lease the picked runs still queued and ready (skipping rows another transaction
    holds), token ``first_token + i`` for the i-th pick; returns their rows in pick order."""
    locked = Run.objects.using(db).filter(pk__in=picked, status=RunStatus.QUEUED, ready=True)
    if connections[db].features.has_select_for_update_skip_locked:
        # A row another transaction is changing is skipped, never waited for.
        locked = locked.select_for_update(skip_locked=True)
    granted = set(locked.values_list("pk", flat=True))
    tokens = {pk: first_token + i for i, pk in enumerate(picked) if pk in granted}
    if not tokens:
        return []
    Run.objects.using(db).filter(pk__in=list(tokens)).update(
        status=RunStatus.RUNNING,
        lease_owner=worker_id,
        lease_token=Case(
            *(When(pk=pk, then=Value(token)) for pk, token in tokens.items()),
            output_field=BigIntegerField(),
        ),
        lease_expires_at=later_expr(duration, clock),
        attempts=F("attempts") + 1,
        started_at=Coalesce(F("started_at"), now_expr(clock)),
    )
    rows = {
        row["pk"]: row
        for row in Run.objects.using(db).filter(pk__in=list(tokens)).values(*_LEASED_FIELDS)
    }
    return [rows[pk] for pk in picked if pk in rows]


def _lease_returning(
    db: str, picked: list[Any], first_token: int, worker_id: str, duration: Any, clock: Clock
) -> list[dict[str, Any]]:
    """`_lease` on PostgreSQL in one statement: ``UPDATE … FROM`` the sessions over the
    picked rows locked with ``SKIP LOCKED``, ``RETURNING`` what the executor needs."""
    connection = connections[db]
    quote = connection.ops.quote_name
    run_table, session_table = quote(Run._meta.db_table), quote(Session._meta.db_table)
    if clock is not None:
        now, now_params = "%s", [clock()]
    else:
        now, now_params = "STATEMENT_TIMESTAMP()", []
    columns = _leased_columns(quote)
    sql = (
        f"WITH leased AS (UPDATE {run_table} r SET status = %s, lease_owner = %s,"
        f" lease_token = %s + array_position(%s::uuid[], r.id) - 1,"
        f" lease_expires_at = {now} + %s, attempts = r.attempts + 1,"
        f" started_at = COALESCE(r.started_at, {now})"
        f" FROM {session_table} s"
        f" WHERE r.id IN (SELECT id FROM {run_table} WHERE id = ANY(%s::uuid[])"
        f" AND status = %s AND ready FOR UPDATE SKIP LOCKED) AND s.id = r.session_id"
        f" RETURNING {', '.join(columns)}),"
        f" {pending.give_back_ctes(quote, 'leased')}"
        f" SELECT * FROM leased"
    )
    params = [
        RunStatus.RUNNING,
        worker_id,
        first_token,
        picked,
        *now_params,
        duration,
        *now_params,
        picked,
        RunStatus.QUEUED,
    ]
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        rows = {row["pk"]: row for row in _leased_rows(connection, cursor.fetchall())}
    return [rows[pk] for pk in picked if pk in rows]


def _leased_columns(quote: Any) -> list[str]:
    """What a PostgreSQL claim returns of each leased run (``r``) and its session (``s``)."""
    return [
        *(f"r.{quote(Run._meta.get_field(f).column)}" for f in _RUN_RETURNED),
        *(f"s.{quote(f)}" for f in _SESSION_RETURNED),
    ]


def _leased_rows(connection: Any, fetched: Iterable[Sequence[Any]]) -> list[dict[str, Any]]:
    """The rows of `_leased_columns` as dicts (``_RUN_KEYS``, then ``session__…``)."""
    json_fields = [(i, Run._meta.get_field(f)) for i, f in enumerate(_RUN_RETURNED)]
    json_fields = [(i, f) for i, f in json_fields if f.get_internal_type() == "JSONField"]
    keys = [*_RUN_KEYS, *(f"session__{f}" for f in _SESSION_RETURNED)]
    rows = []
    for values in fetched:
        values = list(values)
        for i, field in json_fields:
            values[i] = field.from_db_value(values[i], None, connection)
        rows.append(dict(zip(keys, values[: len(keys)], strict=True)))
    return rows


# What a claim reads back besides the queue fields: what an executor needs to prepare the
# run without another query.
CLAIMED_FIELDS = (
    "session_id",
    "input",
    "interaction",
    "session__package_ref",
    "session__package_name",
    "session__agent_id",
    "session__kind",
    "session__persisted_events",
)
_LEASED_FIELDS = (
    *_ROW_FIELDS,
    *CLAIMED_FIELDS,
    "lease_expires_at",
    "lease_token",
    "admission_slot",
)
# The same, as `_lease_returning` reads them: run fields (their keys), then session fields.
_RUN_RETURNED = (
    "id",
    "owner",
    "priority",
    "available_at",
    "attempts",
    "queue",
    "parent",
    "session",
    "input",
    "interaction",
    "lease_expires_at",
    "lease_token",
    "admission_slot",
)
_RUN_KEYS = (
    "pk",
    "owner_id",
    "priority",
    "available_at",
    "attempts",
    "queue",
    "parent_id",
    "session_id",
    "input",
    "interaction",
    "lease_expires_at",
    "lease_token",
    "admission_slot",
)
_SESSION_RETURNED = ("package_ref", "package_name", "agent_id", "kind", "persisted_events")

# At most this many users' queues are looked at per claim (those with the fewest running
# runs first): the claim's cost depends on it, never on the number of queued runs.
MAX_CLAIM_TENANTS = 256


@dataclass(frozen=True, slots=True)
class _Head:
    pk: Any
    owner_id: Any
    priority: int
    created_at: datetime
    parent_id: Any


def _now_sql(vendor: str) -> str:
    if vendor == "postgresql":
        return "STATEMENT_TIMESTAMP()"
    if vendor == "mysql":
        return "UTC_TIMESTAMP(6)"
    return f"{SQLITE_NOW}()"


def _queued_where(connection: Any, queue: str | None, alias: str = "") -> tuple[str, list[Any]]:
    """Ready queued runs not being cancelled (of ``queue``): SQL condition and params.

    The constant part is written out, as the ``run_claimable_by_owner`` partial index
    states it, so the planner matches the index also in a prepared (generic) plan."""
    quote = connection.ops.quote_name
    clause = (
        f"{alias}{quote('status')} = '{RunStatus.QUEUED}' AND {alias}{quote('ready')}"
        f" AND NOT {alias}{quote('cancel_requested')}"
    )
    params: list[Any] = []
    if queue is not None:
        clause += f" AND {alias}{quote('queue')} = %s"
        params.append(queue)
    return clause, params


def _owners_cte(connection: Any, queue: str | None) -> tuple[str, list[Any]]:
    """``owners (o) AS (…)``: the users with ready queued runs, by a loose index scan — a
    recursive query seeking the next owner (a NULL row ends it) — and its parameters."""
    quote = connection.ops.quote_name
    table, owner = quote(Run._meta.db_table), quote("owner_id")
    base, params = _queued_where(connection, queue)
    inner, _ = _queued_where(connection, queue, "r.")
    # ORDER BY … LIMIT 1 rather than MIN(): only an index in owner order serves it, so
    # the planner takes the claimable-runs index whatever its statistics say.
    sql = (
        f"owners (o) AS ("
        f" SELECT (SELECT {owner} FROM {table} WHERE {base} ORDER BY {owner} LIMIT 1)"
        f" UNION ALL"
        f" SELECT (SELECT r.{owner} FROM {table} r WHERE {inner}"
        f" AND r.{owner} > owners.o ORDER BY r.{owner} LIMIT 1)"
        f" FROM owners WHERE owners.o IS NOT NULL)"
    )
    return sql, params + params


def _owners_query(connection: Any, queue: str | None) -> tuple[str, list[Any]]:
    """The users with ready queued runs (`_owners_cte`)."""
    cte, params = _owners_cte(connection, queue)
    return f"WITH RECURSIVE {cte} SELECT o FROM owners WHERE o IS NOT NULL", params


def _running_query(connection: Any) -> str:
    """Running root runs per user: ``(owner_id, n)`` rows."""
    quote = connection.ops.quote_name
    return (
        f"SELECT {quote('owner_id')}, COUNT(*) FROM {quote(Run._meta.db_table)}"
        f" WHERE {quote('status')} = '{RunStatus.RUNNING}' AND {quote('parent_id')} IS NULL"
        f" GROUP BY {quote('owner_id')}"
    )


def _heads(
    db: str,
    queue: str | None,
    clock: Clock,
    running: dict[Any, int],
    per_tenant: int | None,
    max_active: int | None,
    limit: int,
    owners: list[Any] | None = None,
) -> list[_Head]:
    """Each eligible user's best ready queued runs (up to ``limit`` each), best first.

    Two statements whose cost grows with the number of users that have queued runs, not
    with the number of queued runs: the users (`_owners_query`, unless given as
    ``owners``), then one ``UNION ALL`` of per-user ``ORDER BY … LIMIT`` subqueries reads
    their heads.
    """
    connection = connections[db]
    quote = connection.ops.quote_name
    table = quote(Run._meta.db_table)
    owner = quote("owner_id")
    base, base_params = _queued_where(connection, queue)
    if owners is None:
        with connection.cursor() as cursor:
            if connection.vendor == "mysql" and not connection.mysql_is_mariadb:
                # MySQL 8 stops a recursive query after 1,000 rounds by default: one round
                # per user with queued runs here. (MariaDB and PostgreSQL set no such limit.)
                cursor.execute("SET SESSION cte_max_recursion_depth = 1000000")
            cursor.execute(*_owners_query(connection, queue))
            owners = [row[0] for row in cursor.fetchall()]
    saturated_total = max_active is not None and sum(running.values()) >= max_active
    eligible = [
        o
        for o in owners
        if not saturated_total and (per_tenant is None or running.get(o, 0) < per_tenant)
    ]
    eligible.sort(key=lambda o: running.get(o, 0))
    eligible = eligible[:MAX_CLAIM_TENANTS]
    # Child runs count against no quota: a user whose own runs are saturated may still
    # start them, so saturated users' heads are read for child runs only.
    children_only = [o for o in owners if o not in set(eligible)][:MAX_CLAIM_TENANTS]
    if clock is not None:
        now_sql, now_params = "%s", [clock()]
    else:
        now_sql, now_params = _now_sql(connection.vendor), []
    columns = ", ".join(quote(c) for c in ("id", "owner_id", "priority", "created_at", "parent_id"))
    order_by = f"{quote('priority')} DESC, {quote('created_at')}, {quote('id')}"
    parts: list[str] = []
    params: list[Any] = []
    for owners_, extra in (
        (eligible, ""),
        (children_only, f" AND {quote('parent_id')} IS NOT NULL"),
    ):
        for o in owners_:
            parts.append(
                f"SELECT * FROM (SELECT {columns} FROM {table} WHERE {base}"
                f" AND {owner} = %s AND {quote('available_at')} <= {now_sql}{extra}"
                f" ORDER BY {order_by} LIMIT %s) h{len(parts)}"
            )
            room = limit
            if not extra and per_tenant is not None:
                room = min(limit, max(per_tenant - running.get(o, 0), 0))
            params += [*base_params, o, *now_params, room]
    if not parts:
        return []
    with connection.cursor() as cursor:
        cursor.execute(" UNION ALL ".join(parts), params)
        rows = cursor.fetchall()
    # Raw values: ``created_at`` compares consistently within one database (a string on
    # SQLite, a datetime elsewhere), which is all the ordering needs.
    return [
        _Head(
            pk=Run._meta.pk.to_python(pk),
            owner_id=o,
            priority=int(priority),
            created_at=created,
            parent_id=parent,
        )
        for pk, o, priority, created, parent in rows
    ]


def _pick(
    heads: list[_Head],
    running: dict[Any, int],
    *,
    order: ClaimOrder,
    limit: int,
    max_active: int | None,
    per_tenant: int | None,
) -> list[Any]:
    """Up to ``limit`` run ids in claim order under the shared `fair_order` rule, counting
    each pick against its user's and the global limits."""
    queues: dict[Any, list[_Head]] = {}
    for head in heads:
        key = head.owner_id if head.parent_id is None else ("child", head.pk)
        queues.setdefault(key, []).append(head)
    for items in queues.values():
        items.sort(key=lambda h: (-h.priority, h.created_at, str(h.pk)))
    counts = dict(running)
    total = sum(running.values())
    picked: list[Any] = []
    while len(picked) < limit and queues:
        candidates = [
            ClaimCandidate(
                tenant_id=items[0].owner_id if items[0].parent_id is None else None,
                priority=items[0].priority,
                submit_order=(items[0].created_at, str(items[0].pk)),
                ref=key,
            )
            for key, items in queues.items()
        ]
        chosen = None
        for candidate in fair_order(
            candidates, counts, order=order, max_active_per_tenant=per_tenant
        ):
            if candidate.tenant_id is not None and max_active is not None and total >= max_active:
                continue
            chosen = candidate
            break
        if chosen is None:
            break
        head = queues[chosen.ref].pop(0)
        if not queues[chosen.ref]:
            del queues[chosen.ref]
        picked.append(head.pk)
        if head.parent_id is None:
            counts[head.owner_id] = counts.get(head.owner_id, 0) + 1
            total += 1
    return picked


@contextmanager
def _claim_guard(connection: Any) -> Iterator[None]:
    """On MySQL/MariaDB, which cannot end a transaction left idle, the claim connection's
    ``wait_timeout`` is lowered for the claim: a process frozen inside it is disconnected
    (its transaction rolled back, the claim lock released) after a few seconds."""
    if connection.vendor != "mysql":
        yield
        return
    seconds = max(1, CLAIM_IDLE_TIMEOUT_MS // 1000)
    with connection.cursor() as cursor:
        cursor.execute("SELECT @@SESSION.wait_timeout")
        (previous,) = cursor.fetchone()
        cursor.execute(f"SET SESSION wait_timeout = {seconds}")
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f"SET SESSION wait_timeout = {int(previous)}")


_fence_rows: set[str] = set()


def _ensure_fence_row(db: str) -> None:
    """Create the fence-sequence row once, outside any claim transaction (locking a row
    that does not exist yet takes gap locks on MySQL, which deadlock concurrent claims)."""
    if db in _fence_rows:
        return
    try:
        FenceSequence.objects.using(db).get_or_create(pk=1, defaults={"value": 0})
    except IntegrityError:  # another process created it first
        pass
    _fence_rows.add(db)


class _FenceRowMissing(Exception):
    """The fence-sequence table was emptied since this process created its row."""


def _fence_row(db: str) -> FenceSequence:
    row = FenceSequence.objects.using(db).select_for_update().filter(pk=1).first()
    if row is None:
        raise _FenceRowMissing
    return row


def next_due(queue: str | None = None, *, using: str = DEFAULT_DB_ALIAS) -> datetime | None:
    """The next time (database values) a queued run becomes available or a live lease
    expires; None when nothing is due later (what is due now is the claim's business)."""
    later = Run.objects.using(using).filter(
        status=RunStatus.QUEUED, ready=True, available_at__gt=DbNow()
    )
    if queue is not None:
        later = later.filter(queue=queue)
    times = [
        later.order_by("available_at").values_list("available_at", flat=True).first(),
        Run.objects.using(using)
        .filter(status=RunStatus.RUNNING, lease_expires_at__gt=DbNow())
        .order_by("lease_expires_at")
        .values_list("lease_expires_at", flat=True)
        .first(),
    ]
    due = [t for t in times if t is not None]
    return min(due) if due else None


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
        _reap_locked(using, clock, max_crashes)
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
            _put_back([fence.run_id], using)
            wakeups.notify("run", using=using)
        return requeued


def _put_back(run_ids: list[Any], using: str) -> None:
    """Runs back in the queue take their pending places again."""
    rows = Run.objects.using(using).filter(pk__in=run_ids, parent__isnull=True)
    pending.put_back(rows.values_list("owner_id", "admission_slot"), using=using)


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
        return _reap_locked(using, clock, max_crashes)


def _reap_locked(using: str, clock: Clock, max_crashes: int | None) -> list[str]:
    """A run whose lease is dead lost its worker (a crash): with a cancel requested it ends
    ``cancelled`` (or ``interrupted``); once ``max_crashes`` crashes are used up it ends
    ``failed`` (``execution.worker_restarted``); otherwise it is queued again with one more
    crash counted. Each ending writes its terminal event and archive here."""
    dead = Run.objects.using(using).filter(_dead_lease(clock))
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
        expected = Q(pk=pk) & _dead_lease(clock)
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
        _put_back(requeued, using)
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
    _archive(pk, using)
    _promote_next(session_id, using)
    return True


# ------------------------------------------------------------------------------ web side


def _stop(run_id: Any, reason: StopRequest, *, using: str) -> None:
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
            pending.give_back(pending.root_runs([row]), using=using)
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
        _stop(run_id, StopRequest.ROLLBACK if rollback else StopRequest.CANCEL, using=using)
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
            pending.put_back(pending.root_runs([run]), using=using)
            wakeups.notify("run", using=using)
        return resumed


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
        _archive(self.fence.run_id, using, self.flow_outputs)
        session_id = (
            Run.objects.using(using)
            .filter(pk=self.fence.run_id)
            .values_list("session_id", flat=True)
            .get()
        )
        if self.rollback:
            remove_run_events(session_id, self.fence.run_id, using=using)
        _promote_next(session_id, using)
        return self.rollback

    @property
    def batchable(self) -> bool:
        """Whether `apply_many` may take it (a rollback rewrites its session: alone)."""
        return not self.rollback

    @property
    def pipelinable(self) -> bool:
        """Whether `pipeline_many` may take it: not a rollback, and the archiver has its
        one-statement form."""
        return not self.rollback and _archive_statement is not None

    @classmethod
    def pipeline_many(cls, finishes: list[Finish], connection: Any) -> None:
        """`apply_many` for the session store's pipelined group commit on PostgreSQL, sent
        on the raw connection inside the caller's pipeline (its ``COMMIT`` follows them):
        the fenced terminal update (`_update_unnest`'s) and the archive upsert, each failing
        the transaction unless every run was written (`guarded`), and the sessions' next
        runs made ready, the workers woken if one was."""
        raw = connection.connection
        ids = [_as_uuid(f.fence.run_id) for f in finishes]
        sql, params = cls._unnest_statement(finishes, connection)
        prepared(raw, guarded(sql), [*params, len(finishes)])
        assert _archive_statement is not None
        as_json = _json_text(Run._meta.get_field("result"))
        prepared(
            raw,
            guarded(_archive_statement(connection) + " RETURNING 1"),
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
            f"WITH promoted AS ({_promote_sql(connection.alias)})"
            " SELECT pg_notify(%s, %s) FROM (SELECT 1 FROM promoted LIMIT 1) any_promoted",
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
        ids = [_as_uuid(f.fence.run_id) for f in finishes]
        if _archiver is not None:
            outcomes = {
                _as_uuid(f.fence.run_id): (f.status, f.result, f.error, f.flow_outputs)
                for f in finishes
            }
            _archiver(_archive_records(ids, outcomes, using), using)
        if sessions is None:
            sessions = Run.objects.using(using).filter(pk__in=ids).values("session_id")
        waiting = (
            Run.objects.using(using)
            .filter(session_id__in=sessions, status=RunStatus.QUEUED, ready=False)
            .values_list("session_id", flat=True)
            .distinct()
        )
        for session_id in list(waiting):
            _promote_next(session_id, using)

    @staticmethod
    def _update_unnest(finishes: list[Finish], connection: Any) -> list[Any]:
        """PostgreSQL: every run's terminal update in one ``UPDATE … FROM UNNEST(…)``, each
        row still fenced on its own; returns the runs' sessions. Raises FenceRejected
        unless every run was updated."""
        with connection.cursor() as cursor:
            cursor.execute(*Finish._unnest_statement(finishes, connection))
            sessions = [session_id for (session_id,) in cursor.fetchall()]
        if len(sessions) != len(finishes):
            raise FenceRejected(None)
        return sessions

    @staticmethod
    def _unnest_statement(finishes: list[Finish], connection: Any) -> tuple[str, list[Any]]:
        """`_update_unnest`'s statement and parameters."""
        quote = connection.ops.quote_name
        as_json = _json_text(Run._meta.get_field("result"))
        columns = list(
            zip(
                *(
                    (
                        _as_uuid(f.fence.run_id),
                        f.status,
                        as_json(f.result),
                        as_json(f.error),
                        f.status in (RunStatus.CANCELLED, RunStatus.INTERRUPTED),
                        f.fence.lease_owner,
                        f.fence.lease_token,
                    )
                    for f in finishes
                ),
                strict=True,
            )
        )
        sql = (
            f"UPDATE {quote(Run._meta.db_table)} r SET status = f.status,"
            f" result = f.result::jsonb, error = f.error::jsonb,"
            f" finished_at = STATEMENT_TIMESTAMP(), lease_owner = '', lease_expires_at = NULL,"
            f" interaction = NULL, cancel_requested = f.cancel,"
            f" updated_at = STATEMENT_TIMESTAMP()"
            f" FROM UNNEST(%s::uuid[], %s::varchar[], %s::text[], %s::text[], %s::bool[],"
            f" %s::varchar[], %s::bigint[]) AS f(id, status, result, error, cancel, owner, token)"
            f" WHERE r.id = f.id AND r.lease_owner = f.owner AND r.lease_token = f.token"
            f" AND r.status = '{RunStatus.RUNNING}' AND r.lease_expires_at > STATEMENT_TIMESTAMP()"
            f" RETURNING r.session_id"
        )
        return sql, [list(column) for column in columns]

    @staticmethod
    def _update_each(finishes: list[Finish], connection: Any) -> None:
        """Other databases: one conditional UPDATE per run, sent with ``executemany``."""
        quote = connection.ops.quote_name
        now_sql = _now_sql(connection.vendor)
        pk = Run._meta.pk
        json_field = Run._meta.get_field("result")
        sql = (
            f"UPDATE {quote(Run._meta.db_table)} SET {quote('status')} = %s,"
            f" {quote('result')} = %s, {quote('error')} = %s, {quote('finished_at')} = {now_sql},"
            f" {quote('lease_owner')} = '', {quote('lease_expires_at')} = NULL,"
            f" {quote('interaction')} = NULL, {quote('cancel_requested')} = %s,"
            f" {quote('updated_at')} = {now_sql}"
            f" WHERE {quote('id')} = %s AND {quote('lease_owner')} = %s"
            f" AND {quote('lease_token')} = %s AND {quote('status')} = %s"
            f" AND {quote('lease_expires_at')} > {now_sql}"
        )
        params = [
            (
                f.status,
                json_field.get_db_prep_value(f.result, connection),
                json_field.get_db_prep_value(f.error, connection),
                f.status in (RunStatus.CANCELLED, RunStatus.INTERRUPTED),
                pk.get_db_prep_value(_as_uuid(f.fence.run_id), connection),
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


def _json_text(field: Any) -> Callable[[Any], str | None]:
    """JSON text of a value as ``field`` (a JSONField) encodes it; None stays NULL."""

    def as_json(value: Any) -> str | None:
        return None if value is None else json.dumps(value, cls=field.encoder)

    return as_json


@functools.cache
def _promote_sql(using: str) -> str:
    """PostgreSQL: `_promote_next` for the sessions of many finished runs (one array of run
    ids) in one statement, after their terminal update: each session's oldest waiting run
    made ready unless another run of it is unfinished and ready; returns the runs made
    ready."""
    quote = connections[using].ops.quote_name
    table = quote(Run._meta.db_table)
    unfinished = ", ".join(f"'{status}'" for status in UNFINISHED_STATUSES)
    return (
        f"UPDATE {table} SET ready = TRUE WHERE id IN ("
        f"SELECT DISTINCT ON (q.session_id) q.id FROM {table} q"
        f" WHERE q.session_id IN (SELECT session_id FROM {table} WHERE id = ANY(%s::uuid[]))"
        f" AND q.status = '{RunStatus.QUEUED}' AND NOT q.ready"
        f" AND NOT EXISTS (SELECT 1 FROM {table} u WHERE u.session_id = q.session_id"
        f" AND u.status IN ({unfinished}) AND u.ready)"
        f" ORDER BY q.session_id, q.created_at, q.id) RETURNING id"
    )


def lock_fences(fences: Sequence[Fence], connection: Any) -> None:
    """PostgreSQL, for a pipeline on the raw connection: lock (in id order) the run rows
    that ``fences`` still own — running, same owner and token, lease not expired by the
    database's clock — and fail the statement (division by zero: the transaction is
    aborted, its ``COMMIT`` skipped) unless every fence's run is held."""
    table = connection.ops.quote_name(Run._meta.db_table)
    wanted = {(str(f.run_id), f.lease_owner, f.lease_token) for f in fences}
    ids, owners, tokens = zip(*sorted(wanted), strict=True) if wanted else ((), (), ())
    prepared(
        connection.connection,
        guarded(
            f"SELECT r.id FROM {table} r"
            f" JOIN UNNEST(%s::uuid[], %s::varchar[], %s::bigint[]) AS f(id, owner, token)"
            f" ON r.id = f.id WHERE r.lease_owner = f.owner AND r.lease_token = f.token"
            f" AND r.status = '{RunStatus.RUNNING}'"
            f" AND r.lease_expires_at > STATEMENT_TIMESTAMP() ORDER BY r.id FOR UPDATE OF r"
        ),
        [[_as_uuid(i) for i in ids], list(owners), list(tokens), len(wanted)],
    )


def guarded(sql: str) -> str:
    """``sql`` (a query, or a statement ``RETURNING`` something) as one that fails —
    division by zero, aborting the transaction — unless it returned as many rows as its
    last parameter says: a check that holds inside a pipeline whose ``COMMIT`` is already
    sent."""
    return f"WITH changed AS ({sql}) SELECT 1 / (count(*) = %s)::int FROM changed"


def _as_uuid(value: Any) -> Any:
    import uuid

    return value if isinstance(value, uuid.UUID) else uuid.UUID(str(value))


def remove_run_events(session_id: Any, run_id: Any, *, using: str = DEFAULT_DB_ALIAS) -> int:
    """Remove a run's events from its session and renumber the later ones (multitask
    rollback), under the session row's lock; returns how many were removed."""
    with transaction.atomic(using=using):
        persisted = _locked_prefix(session_id, using)
        events = Event.objects.using(using).filter(session_id=session_id)
        first = events.filter(run_id=run_id).order_by("seq").values_list("seq", flat=True).first()
        if first is None:
            return 0
        later = list(events.filter(seq__gte=first).order_by("seq"))
        removed = sum(1 for event in later if event.run_id == run_id)
        events.filter(seq__gte=first).delete()
        kept = [event for event in later if event.run_id != run_id]
        for seq, event in enumerate(kept, start=first):
            event.pk = None
            event.seq = seq
        Event.objects.using(using).bulk_create(kept)
        Session.objects.using(using).filter(pk=session_id).update(
            persisted_events=persisted - removed, updated_at=timezone.now()
        )
        return removed


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
