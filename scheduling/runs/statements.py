"""Every hand-written SQL statement of the Run state machine, by name.

The portable code (ORM queries) is the reference; a statement here either speeds one up
or says what the ORM cannot. Each has a one-line "why". PostgreSQL's statements send a
whole transition in one round trip (`sageproject.db.pipelined`); their portable twins
live beside their callers in `admission`, `claims`, `transitions` and the session
store's writer (`scheduling.store_writer`, whose group commit is `group_commit` here).
The claim's fair rule exists twice: `claim` here, `claims._heads` + `claims._pick` in
Python; ``tests/scheduling/test_claim_rule.py`` checks that both choose the same runs.

Texts that depend only on the database's quoting are built once (``functools.cache``),
so a prepared statement (`sageproject.db.prepared`) is planned once per connection.
"""

from __future__ import annotations

import functools
import json
import logging
import uuid
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django.db import connections

from scheduling import pending
from scheduling.models import UNFINISHED_STATUSES, Event, FenceSequence, Run, RunStatus, Session
from scheduling.protocol import ClaimOrder
from scheduling.runs.clock import Clock

if TYPE_CHECKING:
    from scheduling.runs.fences import Fence
    from scheduling.runs.transitions import Finish

# At most this many users' queues are looked at per claim (those with the fewest running
# runs first): the claim's cost depends on it, never on the number of queued runs.
MAX_CLAIM_TENANTS = 256


# ------------------------------------------------------------------------ pipelines


# libpq's PQTRANS_IDLE: no transaction open on the connection.
IDLE = 0


def guarded(sql: str) -> str:
    """``sql`` (a query, or a statement ``RETURNING`` something) as one that fails —
    division by zero, aborting the transaction — unless it returned as many rows as its
    last parameter says: a check that holds inside a pipeline whose ``COMMIT`` is already
    sent."""
    return f"WITH changed AS ({sql}) SELECT 1 / (count(*) = %s)::int FROM changed"


@functools.cache
def division_by_zero() -> type[Exception]:
    """The error a `guarded` statement fails with (psycopg's class for it)."""
    import psycopg

    return psycopg.errors.DivisionByZero


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


def as_uuid(value: Any) -> Any:
    """A run id as a `uuid.UUID` (PostgreSQL's arrays are typed ``uuid[]``)."""
    return value if isinstance(value, uuid.UUID) else uuid.UUID(str(value))


def json_text(field: Any) -> Callable[[Any], str | None]:
    """JSON text of a value as ``field`` (a JSONField) encodes it; None stays NULL."""

    def as_json(value: Any) -> str | None:
        return None if value is None else json.dumps(value, cls=field.encoder)

    return as_json


# ------------------------------------------------------------------------ admission


@functools.cache
def admission(using: str, credential_sql: str | None) -> tuple[str, str, str, tuple[Any, ...]]:
    """`admission._admit_pipelined`'s statements on database ``using`` — the session lock,
    the admission, the guard — and the run's fields whose values the admission's parameters
    carry, in order ("ready" is computed in SQL). With ``credential_sql`` (`Credential`) the
    admission's parameters begin with the credential's, and the session counts as found
    only while it holds. Why: a whole admission in one round trip (PostgreSQL)."""
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


# ------------------------------------------------------------------------ claim: shared parts


def queued_where(connection: Any, queue: str | None, alias: str = "") -> tuple[str, list[Any]]:
    """Ready queued runs not being cancelled (of ``queue``): SQL condition and params.

    Why written out: the constant part is the ``run_claimable_by_owner`` partial index's
    condition, so the planner matches the index also in a prepared (generic) plan."""
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


def owners_cte(connection: Any, queue: str | None) -> tuple[str, list[Any]]:
    """``owners (o) AS (…)``: the users with ready queued runs, by a loose index scan — a
    recursive query seeking the next owner (a NULL row ends it) — and its parameters.
    Why: the ORM has no loose index scan; its cost grows with users, not runs."""
    quote = connection.ops.quote_name
    table, owner = quote(Run._meta.db_table), quote("owner_id")
    base, params = queued_where(connection, queue)
    inner, _ = queued_where(connection, queue, "r.")
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


def owners_query(connection: Any, queue: str | None) -> tuple[str, list[Any]]:
    """The users with ready queued runs (`owners_cte`)."""
    cte, params = owners_cte(connection, queue)
    return f"WITH RECURSIVE {cte} SELECT o FROM owners WHERE o IS NOT NULL", params


def running_query(connection: Any) -> str:
    """Running root runs per user: ``(owner_id, n)`` rows. Why raw: the claim's pipeline
    prepares it, and the SQL claim embeds it."""
    quote = connection.ops.quote_name
    return (
        f"SELECT {quote('owner_id')}, COUNT(*) FROM {quote(Run._meta.db_table)}"
        f" WHERE {quote('status')} = '{RunStatus.RUNNING}' AND {quote('parent_id')} IS NULL"
        f" GROUP BY {quote('owner_id')}"
    )


def heads(
    connection: Any,
    queue: str | None,
    now_sql: str,
    now_params: list[Any],
    owners: Iterable[tuple[Any, int, bool]],
) -> tuple[str, list[Any]]:
    """Each user's best ready queued runs: one ``UNION ALL`` of per-user ``ORDER BY …
    LIMIT`` subqueries. ``owners``: ``(owner, how many, child runs only)``.
    Why: one statement whose cost grows with users, not with queued runs."""
    quote = connection.ops.quote_name
    table = quote(Run._meta.db_table)
    owner = quote("owner_id")
    base, base_params = queued_where(connection, queue)
    columns = ", ".join(quote(c) for c in ("id", "owner_id", "priority", "created_at", "parent_id"))
    order_by = f"{quote('priority')} DESC, {quote('created_at')}, {quote('id')}"
    parts: list[str] = []
    params: list[Any] = []
    for o, room, children_only in owners:
        extra = f" AND {quote('parent_id')} IS NOT NULL" if children_only else ""
        parts.append(
            f"SELECT * FROM (SELECT {columns} FROM {table} WHERE {base}"
            f" AND {owner} = %s AND {quote('available_at')} <= {now_sql}{extra}"
            f" ORDER BY {order_by} LIMIT %s) h{len(parts)}"
        )
        params += [*base_params, o, *now_params, room]
    return " UNION ALL ".join(parts), params


def claim_lock(connection: Any) -> str:
    """The claim lock: the fence-sequence row moved on by a range of fencing tokens (param:
    how many). Why raw: ``RETURNING`` the new value in the same statement."""
    table = connection.ops.quote_name(FenceSequence._meta.db_table)
    return f"UPDATE {table} SET value = value + %s::bigint WHERE id = 1 RETURNING value"


# What a PostgreSQL claim returns of each leased run (their keys in the row it makes), then
# of its session: what an executor needs to prepare the run without another query.
RUN_RETURNED = (
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
RUN_KEYS = (
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
SESSION_RETURNED = ("package_ref", "package_name", "agent_id", "kind", "persisted_events")


def leased_columns(quote: Any) -> list[str]:
    """What a PostgreSQL claim returns of each leased run (``r``) and its session (``s``)."""
    return [
        *(f"r.{quote(Run._meta.get_field(f).column)}" for f in RUN_RETURNED),
        *(f"s.{quote(f)}" for f in SESSION_RETURNED),
    ]


def leased_rows(connection: Any, fetched: Iterable[Sequence[Any]]) -> list[dict[str, Any]]:
    """The rows of `leased_columns` as dicts (``RUN_KEYS``, then ``session__…``)."""
    json_fields = [(i, Run._meta.get_field(f)) for i, f in enumerate(RUN_RETURNED)]
    json_fields = [(i, f) for i, f in json_fields if f.get_internal_type() == "JSONField"]
    keys = [*RUN_KEYS, *(f"session__{f}" for f in SESSION_RETURNED)]
    rows = []
    for values in fetched:
        values = list(values)
        for i, field in json_fields:
            values[i] = field.from_db_value(values[i], None, connection)
        rows.append(dict(zip(keys, values[: len(keys)], strict=True)))
    return rows


# ------------------------------------------------------------------------ claim: PostgreSQL


def lease_returning(
    connection: Any,
    picked: list[Any],
    first_token: int,
    worker_id: str,
    duration: Any,
    clock: Clock,
) -> tuple[str, list[Any]]:
    """`claims._lease` in one statement: ``UPDATE … FROM`` the sessions over the picked rows
    locked with ``SKIP LOCKED``, ``RETURNING`` what the executor needs, the pending places
    released in the same statement. Why: the long claim's lease in one round trip."""
    quote = connection.ops.quote_name
    run_table, session_table = quote(Run._meta.db_table), quote(Session._meta.db_table)
    if clock is not None:
        now, now_params = "%s", [clock()]
    else:
        now, now_params = "STATEMENT_TIMESTAMP()", []
    columns = leased_columns(quote)
    sql = (
        f"WITH leased AS (UPDATE {run_table} r SET status = %s, lease_owner = %s,"
        f" lease_token = %s + array_position(%s::uuid[], r.id) - 1,"
        f" lease_expires_at = {now} + %s, attempts = r.attempts + 1,"
        f" started_at = COALESCE(r.started_at, {now})"
        f" FROM {session_table} s"
        f" WHERE r.id IN (SELECT id FROM {run_table} WHERE id = ANY(%s::uuid[])"
        f" AND status = %s AND ready FOR UPDATE SKIP LOCKED) AND s.id = r.session_id"
        f" RETURNING {', '.join(columns)}),"
        f" {pending.release_ctes(quote, 'leased')}"
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
    return sql, params


def claim(
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
    """The pick-and-lease statement of `claims._claim_pipelined`: the same choice as
    `claims._heads` + `claims._pick` (+ ``share_with``) + `lease_returning`, in SQL. Why:
    the claim lock is held only while the database works, never across a round trip.

    The users with ready queued runs (the loose index scan of `owners_query`) and their
    running root runs; the open ones (under ``per_tenant``, and the host under
    ``max_active``), fewest running first, at most `MAX_CLAIM_TENANTS`, give their best
    heads (as many as they have room for); the others give child runs only. A user's
    k-th root head weighs its running runs + k, a child run 0: ordered by that weight
    (``FAIR``; not for ``OLDEST``), then priority (higher first), then submit order —
    which is what picking one head at a time by `fair_order` gives — root runs past the
    host's room left out, the first ``limit`` are taken (a burst shared with the other
    live workers: their part, rounded up) and leased with ``SKIP LOCKED``, token = the
    fence row's new value - ``limit`` + position; the pending counts release their places
    in the same statement."""
    queue_params = [] if queue is None else [queue]
    now_params = [] if clock is None else [clock()]
    no_limit = 2**31 - 1
    tenant_cap = no_limit if per_tenant is None else per_tenant
    host_cap = no_limit if max_active is None else max_active
    sql = claim_sql(
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
def claim_sql(using: str, by_queue: bool, fair_order_: bool, clocked: bool) -> str:
    """`claim`'s text, built once per database and shape."""
    connection = connections[using]
    quote = connection.ops.quote_name
    run, session = quote(Run._meta.db_table), quote(Session._meta.db_table)
    fence = quote(FenceSequence._meta.db_table)
    queue = "" if by_queue else None  # the queue's placeholder, or none
    owners, _ = owners_cte(connection, queue)
    queued, _ = queued_where(connection, queue)
    now = "%s::timestamptz" if clocked else "STATEMENT_TIMESTAMP()"
    heads_cols = "id, owner_id, priority, created_at, parent_id"
    best = "ORDER BY priority DESC, created_at, id"
    fair = "k.load, " if fair_order_ else ""
    key = f"{fair}k.priority DESC, k.created_at, k.id::text"
    sql = (
        f"WITH RECURSIVE {owners},"
        f" running (o, n) AS ({running_query(connection)}),"
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
        f" RETURNING {', '.join(leased_columns(quote))}, c.pos),"
        f" {pending.release_ctes(quote, 'leased')}"
        f" SELECT * FROM leased ORDER BY pos"
    )
    return sql


# ------------------------------------------------------------------------ the store's commits


@functools.cache
def group_commit(using: str) -> tuple[str, str, str]:
    """The pipelined group commit's statements on database ``using`` (PostgreSQL): lock the
    sessions, move their durable counts on where they are still as expected, insert the
    events — the last two failing unless they wrote every row (`guarded`).

    Why: a batch of many runs' events commits in one round trip
    (`scheduling.store_writer`); the portable twin is the writer's ORM path."""
    quote = connections[using].ops.quote_name
    sessions, events = quote(Session._meta.db_table), quote(Event._meta.db_table)
    columns = ", ".join(
        quote(Event._meta.get_field(name).column)
        for name in ("session", "seq", "run", "type", "data", "created_at")
    )
    count = quote(Session._meta.get_field("persisted_events").column)
    return (
        f"SELECT id FROM {sessions} WHERE id = ANY(%s::uuid[]) ORDER BY id FOR UPDATE",
        guarded(
            f"UPDATE {sessions} s SET {count} = c.total, updated_at = %s"
            f" FROM UNNEST(%s::uuid[], %s::int[], %s::int[]) AS c(id, expected, total)"
            f" WHERE s.id = c.id AND s.{count} = c.expected RETURNING 1"
        ),
        guarded(
            f"INSERT INTO {events} ({columns}) SELECT * FROM UNNEST(%s::uuid[], %s::int[],"
            f" %s::uuid[], %s::varchar[], %s::text[], %s::timestamptz[]) RETURNING 1"
        ),
    )


def lock_fences(fences: Sequence[Fence], connection: Any) -> tuple[str, list[Any]]:
    """`fences.lock_fences`'s statement: lock (in id order) the run rows that ``fences``
    still own, failing unless every one is held. Why: the store's pipelined commit checks
    every fence of a batch in one statement."""
    table = connection.ops.quote_name(Run._meta.db_table)
    wanted = {(str(f.run_id), f.lease_owner, f.lease_token) for f in fences}
    ids, owners, tokens = zip(*sorted(wanted), strict=True) if wanted else ((), (), ())
    return (
        guarded(
            f"SELECT r.id FROM {table} r"
            f" JOIN UNNEST(%s::uuid[], %s::varchar[], %s::bigint[]) AS f(id, owner, token)"
            f" ON r.id = f.id WHERE r.lease_owner = f.owner AND r.lease_token = f.token"
            f" AND r.status = '{RunStatus.RUNNING}'"
            f" AND r.lease_expires_at > STATEMENT_TIMESTAMP() ORDER BY r.id FOR UPDATE OF r"
        ),
        [[as_uuid(i) for i in ids], list(owners), list(tokens), len(wanted)],
    )


def finish_unnest(finishes: list[Finish], connection: Any) -> tuple[str, list[Any]]:
    """PostgreSQL: every run's terminal update in one ``UPDATE … FROM UNNEST(…)``, each row
    still fenced on its own, ``RETURNING`` the runs' sessions. Why: a group commit's
    finishes in one statement."""
    quote = connection.ops.quote_name
    as_json = json_text(Run._meta.get_field("result"))
    columns = list(
        zip(
            *(
                (
                    as_uuid(f.fence.run_id),
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


def finish_each(connection: Any, now_sql: str) -> str:
    """Other databases: one conditional terminal UPDATE of a run (sent with
    ``executemany``). Why raw: ``executemany`` of one text, not an ORM query per run."""
    quote = connection.ops.quote_name
    return (
        f"UPDATE {quote(Run._meta.db_table)} SET {quote('status')} = %s,"
        f" {quote('result')} = %s, {quote('error')} = %s, {quote('finished_at')} = {now_sql},"
        f" {quote('lease_owner')} = '', {quote('lease_expires_at')} = NULL,"
        f" {quote('interaction')} = NULL, {quote('cancel_requested')} = %s,"
        f" {quote('updated_at')} = {now_sql}"
        f" WHERE {quote('id')} = %s AND {quote('lease_owner')} = %s"
        f" AND {quote('lease_token')} = %s AND {quote('status')} = %s"
        f" AND {quote('lease_expires_at')} > {now_sql}"
    )


@functools.cache
def promote(using: str) -> str:
    """PostgreSQL: `sessions.promote_next` for the sessions of many finished runs (one array
    of run ids) in one statement, after their terminal update: each session's oldest
    waiting run made ready unless another run of it is unfinished and ready; returns the
    runs made ready. Why: a group commit hands every session's turn on at once."""
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


def promote_and_notify(using: str) -> str:
    """`promote`, then one wake-up for the workers if a run was made ready (params: run
    ids, channel, kind). Why: the wake-up rides in the commit's pipeline."""
    return (
        f"WITH promoted AS ({promote(using)})"
        " SELECT pg_notify(%s, %s) FROM (SELECT 1 FROM promoted LIMIT 1) any_promoted"
    )
