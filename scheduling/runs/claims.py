"""Claims: the best ready queued runs leased to a worker, fairly, under the limits.

Two ways to one choice. The long way (any database, and any claim that reaps or runs in
a caller's transaction): the claim lock, the running counts, each eligible user's heads
(`_heads`), picked one at a time by the shared rule (`_pick`, `fair_order`), then leased.
The short way (PostgreSQL): one pipelined round trip (`_claim_pipelined`) whose one
statement (`statements.claim`) makes the same choice in SQL.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db import DEFAULT_DB_ALIAS, IntegrityError, connections, transaction
from django.db.models import BigIntegerField, Case, F, Q, Value, When
from django.db.models.functions import Coalesce

from sageproject.db import one_transaction, pipelined, prepared
from scheduling import pending
from scheduling.faults import crash_point, is_armed
from scheduling.models import FenceSequence, Run, RunStatus
from scheduling.protocol import ClaimCandidate, ClaimOrder, fair_order
from scheduling.runs import statements
from scheduling.runs.clock import Clock, DbNow, later_expr, now_expr
from scheduling.runs.clock import now_sql as clock_now_sql
from scheduling.runs.statements import MAX_CLAIM_TENANTS
from scheduling.runs.transitions import reap_locked, reapable

# How long PostgreSQL lets a claim transaction sit idle (its process frozen, say) before it
# ends the session and releases the claim lock for every other worker.
CLAIM_IDLE_TIMEOUT_MS = 2000


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


# ------------------------------------------------------------------------------ claim


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
    for asked, where in ((work, _claimable(queue, clock)), (reap, reapable(clock))):
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
            reaped = reap_locked(db, clock, max_crashes) if reap else []
            if running is None or reaped:
                # Read (again) after the reaper changed who runs and what is queued.
                owners = None
                with connection.cursor() as cursor:
                    cursor.execute(statements.running_query(connection))
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
                    # Their places in the pending counts are released in the statement.
                    rows = _lease_returning(db, picked, first_token, worker_id, duration, clock)
                else:
                    rows = _lease(db, picked, first_token, worker_id, duration, clock)
                    pending.release(pending.root_runs(rows), using=db)
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
        statement = statements.claim(
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
        running = prepared(raw, statements.running_query(connection))
        owners = prepared(raw, *statements.owners_query(connection, queue))
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
    if idle_timeout:
        raw.execute(f"SET LOCAL idle_in_transaction_session_timeout = {CLAIM_IDLE_TIMEOUT_MS}")
    return prepared(raw, statements.claim_lock(connection), [count])


def _claim_pipelined(
    connection: Any, limit: int, duration: timedelta, statement: tuple[str, list[Any]]
) -> list[Grant]:
    """`claim` on PostgreSQL in one round trip (`pipelined`), one transaction (the
    pipeline's implicit one, `one_transaction`): the claim lock with ``limit`` fencing
    tokens (the fence-sequence row), then the ``statement`` that picks and leases
    (`statements.claim`). The statement starts after the lock is held, so it reads what the
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
            rows = statements.leased_rows(connection, leased.fetchall())
            if not commit_at_once:
                if rows:
                    statements.rearm_idle_timeout(raw)
                    crash_point("claim.before_commit")
                raw.execute("COMMIT")
        except BaseException:
            if raw.pgconn.transaction_status != statements.IDLE:
                raw.execute("ROLLBACK")
            raise
    grants = [Grant.leased(row, duration) for row in rows]
    if grants:
        crash_point("claim.after_commit")
    return grants


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
    """`_lease` on PostgreSQL in one statement (`statements.lease_returning`)."""
    connection = connections[db]
    sql, params = statements.lease_returning(
        connection, picked, first_token, worker_id, duration, clock
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        rows = {row["pk"]: row for row in statements.leased_rows(connection, cursor.fetchall())}
    return [rows[pk] for pk in picked if pk in rows]


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


@dataclass(frozen=True, slots=True)
class _Head:
    pk: Any
    owner_id: Any
    priority: int
    created_at: datetime
    parent_id: Any


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
    with the number of queued runs: the users (`statements.owners_query`, unless given
    as ``owners``), then one ``UNION ALL`` of per-user ``ORDER BY … LIMIT`` subqueries
    (`statements.heads`) reads their heads.
    """
    connection = connections[db]
    if owners is None:
        with connection.cursor() as cursor:
            if connection.vendor == "mysql" and not connection.mysql_is_mariadb:
                # MySQL 8 stops a recursive query after 1,000 rounds by default: one round
                # per user with queued runs here. (MariaDB and PostgreSQL set no such limit.)
                cursor.execute("SET SESSION cte_max_recursion_depth = 1000000")
            cursor.execute(*statements.owners_query(connection, queue))
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
        now_sql, now_params = clock_now_sql(connection.vendor), []
    wanted: list[tuple[Any, int, bool]] = []
    for o in eligible:
        room = limit
        if per_tenant is not None:
            room = min(limit, max(per_tenant - running.get(o, 0), 0))
        wanted.append((o, room, False))
    wanted += [(o, limit, True) for o in children_only]
    if not wanted:
        return []
    with connection.cursor() as cursor:
        cursor.execute(*statements.heads(connection, queue, now_sql, now_params, wanted))
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
