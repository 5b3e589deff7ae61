"""Admission: a new run, queued, in one transaction with everything it checks.

No global lock: the session row's lock orders an admission against the session's other
runs, and its pending places come from the host's and the user's counters
(`scheduling.pending`), so concurrent admissions never exceed the limits. A caller's
`Credential` (the express lane's cached token) is checked again in the same transaction.
On PostgreSQL an admission is one round trip (`statements.admission`).
"""

from __future__ import annotations

from typing import Any

from django.db import (
    DEFAULT_DB_ALIAS,
    IntegrityError,
    OperationalError,
    connections,
    transaction,
)

from sageproject.credentials import Credential, CredentialRefused, check_credential
from sageproject.db import one_transaction, pipelined, prepared
from sageproject.errors import ConflictError, NotFoundError
from scheduling import pending, wakeups
from scheduling.models import (
    UNFINISHED_STATUSES,
    Multitask,
    Run,
    RunQueue,
    Session,
    StopRequest,
)
from scheduling.protocol import queue_full_error
from scheduling.runs import statements
from scheduling.runs.transitions import stop


def session_busy_error() -> ConflictError:
    return ConflictError(
        "session.busy",
        "the session already has an unfinished run; wait for it, or submit with "
        "multitask=enqueue, interrupt or rollback",
    )


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
                stop(run_id, StopRequest(multitask.value), using=using)
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


def _admit_pipelined(
    run: Run, multitask: Multitask, credential: Credential | None, using: str, *, commit: bool
) -> Run:
    """`_admit` on PostgreSQL in one round trip (`statements.admission`): the session row's
    lock, and one statement that reads whether the session is busy, takes the pending
    places (`pending.take_ctes`), inserts the run and notifies the workers — sent together
    (`pipelined`). The second statement starts after the lock is held, so what it reads is
    from after any wait for it.

    With ``commit`` (no transaction is open) the round trip is the whole transaction (the
    pipeline's implicit one, `one_transaction`): a guard statement after the insert
    fails when the run was not inserted, which aborts the transaction — a place taken in the
    host's stripe while the user's was refused is never committed — and the statement's
    row, already received, says why. Without ``commit`` it runs in the caller's
    transaction, which the exception raised here rolls back. A ``credential`` is checked
    by the admission statement itself: the session counts as not found unless it holds."""
    connection = connections[using]
    lock_sql, sql, guard_sql, fields = statements.admission(
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
                if raw.pgconn.transaction_status != statements.IDLE:
                    raw.execute("ROLLBACK")
                if not isinstance(exc, statements.division_by_zero()):
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


def restore(fields: dict[str, Any], *, using: str = DEFAULT_DB_ALIAS) -> Run:
    """Insert a run from a session export (``import_session``) with the status it was
    exported with. Its pending places are not taken: the worker's periodic recount
    (`pending.reconcile`) counts imported queued runs."""
    return Run.objects.using(using).create(**fields)
