"""Exact pending limits without a global lock: counters of queued runs.

A run is *pending* while it is queued and has no parent (child runs of a flow are not
admitted, so they are not counted). Two limits apply at admission:
``SAGE_SERVER_MAX_PENDING_RUNS`` for the host and ``SAGE_SERVER_MAX_PENDING_RUNS_PER_USER``
for each user. Counting queued rows at every admission would serialize every submission
behind one lock (two concurrent counts both see room) and cost more as the queue grows, so
the counts are kept in `PendingCount` rows instead, changed in the transaction of every
transition into or out of the queue:

- the host's count is split over `STRIPES` rows (``host.00`` … ``host.15``); a new run
  takes a place in one stripe (chosen at random, stored in ``Run.admission_slot``) with one
  conditional ``UPDATE … SET pending = pending + 1 WHERE pending < cap``. The stripes' caps
  add up to the host limit, so the host never holds more than the limit; concurrent
  admissions of different stripes never wait for each other. Only when its stripe is full
  does an admission read the others (`roomiest`) and start again in the one with the most
  room — so a submission is refused only when every stripe is full, that is when the host
  holds exactly its limit.
- each user has one row (``user.<id>``), taken the same way: a user's admissions wait for
  each other, never for other users'.

Leaving the queue (claim, cancel) releases the places (`release`); coming back to it
(requeue after a lost worker, a resumed suspension) takes them again without a cap
(`retake`) — those runs were admitted already. Rows are always locked host stripe first,
then user: the one order every transaction follows, so counters never deadlock.

Rows of queued runs can also disappear without a transition (a session deleted with its
runs, an import): `reconcile` recounts from the runs themselves under the counters' locks;
the worker's reaper calls it every `RECONCILE_SECONDS`.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterable
from typing import Any

from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, connections, transaction
from django.db.models import Count

from scheduling.models import PendingCount

# Rows the host's count is split over: admissions of different stripes never wait for
# each other. More stripes, less waiting, and a slower `reconcile`.
STRIPES = 16
RECONCILE_SECONDS = 60.0

HOST = "host."
USER = "user."


def host_scope(slot: int) -> str:
    return f"{HOST}{slot:02d}"


def user_scope(owner_id: Any) -> str:
    return f"{USER}{owner_id}"


def stripe_cap(slot: int, limit: int) -> int:
    """The share of ``limit`` stripe ``slot`` may hold: the caps add up to ``limit``."""
    return limit // STRIPES + (1 if slot < limit % STRIPES else 0)


def host_limit() -> int:
    return settings.SAGE["SAGE_SERVER_MAX_PENDING_RUNS"]


def user_limit() -> int:
    return settings.SAGE["SAGE_SERVER_MAX_PENDING_RUNS_PER_USER"]


class Full(Exception):
    """The host (``per_user`` False) or the user is at its pending limit."""

    def __init__(self, limit: int, *, per_user: bool) -> None:
        super().__init__(limit, per_user)
        self.limit = limit
        self.per_user = per_user


class Missing(Exception):
    """Counter rows an admission needs do not exist yet: `create` them outside the
    admission's transaction, then admit again. (Creating them inside it would let
    concurrent admissions of a new user deadlock on MySQL: each waits on the others'
    duplicate-key locks.)"""

    def __init__(self, scopes: list[str]) -> None:
        super().__init__(scopes)
        self.scopes = scopes


def _table() -> str:
    return PendingCount._meta.db_table


def _take_sql(quote: Any) -> str:
    """One counter place, if the row has room (params: scope, cap)."""
    return (
        f"UPDATE {quote(_table())} SET {quote('pending')} = {quote('pending')} + 1"
        f" WHERE {quote('scope')} = %s AND {quote('pending')} < %s"
    )


def _take(cursor: Any, quote: Any, scope: str, cap: int) -> bool:
    cursor.execute(_take_sql(quote), [scope, cap])
    return cursor.rowcount == 1


def create(scopes: Iterable[str], *, using: str = DEFAULT_DB_ALIAS) -> None:
    """Create the counter rows ``scopes`` (at zero) that do not exist; best outside any
    transaction (see `Missing`)."""
    PendingCount.objects.using(using).bulk_create(
        [PendingCount(scope=scope, pending=0) for scope in scopes], ignore_conflicts=True
    )


class StripeFull(Exception):
    """The stripe an admission tried is full: admit again with `roomiest`'s stripe."""


def take(owner_id: Any, slot: int | None = None, *, using: str = DEFAULT_DB_ALIAS) -> int:
    """Take a pending place for a new run of ``owner_id`` inside the admission's
    transaction: in host stripe ``slot`` (default: one at random), then in the user's
    row; returns the stripe, the run's ``admission_slot``. Raises `StripeFull` when that
    stripe is full, `Full` when the user is, and `Missing` when a counter row does not
    exist yet; the caller's transaction then rolls back, giving back anything taken.

    An admission never waits for a second host stripe while holding one (two admissions
    doing so in opposite orders would deadlock): a full stripe ends the transaction, and
    the admission starts again with the stripe `roomiest` names.
    """
    connection = connections[using]
    quote = connection.ops.quote_name
    slot = pick(slot)
    with connection.cursor() as cursor:
        host = _take(cursor, quote, host_scope(slot), stripe_cap(slot, host_limit()))
        user = host and _take(cursor, quote, user_scope(owner_id), user_limit())
        user_row = user or (
            host and PendingCount.objects.using(using).filter(scope=user_scope(owner_id)).exists()
        )
    taken(owner_id, slot, host=host, user=user, user_row=user_row)
    return slot


def pick(slot: int | None) -> int:
    """The host stripe an admission tries first: ``slot``, or one at random."""
    return random.randrange(STRIPES) if slot is None else slot


def take_ctes(quote: Any, owner_id: Any, slot: int, guard: str) -> tuple[str, list[Any]]:
    """`take` as two common table expressions of the admission's statement (PostgreSQL):
    ``host_place`` takes a place in stripe ``slot`` when the SQL condition ``guard``
    holds, ``user_place`` one in the user's row when the host's was taken; each returns a
    row when it took its place. Give what they returned to `taken`."""
    sql = (
        f"host_place AS ({_take_sql(quote)} AND ({guard}) RETURNING 1),"
        f" user_place AS ({_take_sql(quote)} AND EXISTS (SELECT 1 FROM host_place) RETURNING 1)"
    )
    return sql, take_params(owner_id, slot)


def take_params(owner_id: Any, slot: int) -> list[Any]:
    """The parameters of `take_ctes`'s SQL for ``owner_id`` in stripe ``slot``, in order
    (the guard's own parameters go between the second and the third)."""
    return [host_scope(slot), stripe_cap(slot, host_limit()), user_scope(owner_id), user_limit()]


def user_row_sql(quote: Any) -> str:
    """Whether the user's counter row exists (param: `user_scope`)."""
    return f"EXISTS (SELECT 1 FROM {quote(_table())} WHERE {quote('scope')} = %s)"


def taken(owner_id: Any, slot: int, *, host: bool, user: bool, user_row: bool) -> None:
    """Raise what an admission that took (or did not take) its places must: `StripeFull`
    when stripe ``slot`` had no room, `Missing` when the user has no counter row, `Full`
    when the user is at the limit."""
    if not host:
        raise StripeFull(slot)
    if not user:
        if not user_row:
            raise Missing([user_scope(owner_id)])
        raise Full(user_limit(), per_user=True)


def roomiest(owner_id: Any, *, using: str = DEFAULT_DB_ALIAS) -> int:
    """The host stripe with the most room, read without a lock; raises `Full` when none
    has any — when the host holds its whole limit — and `Missing` for absent rows."""
    limit = host_limit()
    counts = dict(
        PendingCount.objects.using(using)
        .filter(scope__startswith=HOST)
        .values_list("scope", "pending")
    )
    if len(counts) < STRIPES:
        # An emptied table: the user's row is likely gone too.
        hosts = [host_scope(s) for s in range(STRIPES) if host_scope(s) not in counts]
        raise Missing([*hosts, user_scope(owner_id)])
    room, slot = max((stripe_cap(s, limit) - counts[host_scope(s)], s) for s in range(STRIPES))
    if room <= 0:
        raise Full(limit, per_user=False)
    return slot


def release(runs: Iterable[tuple[Any, int]], *, using: str = DEFAULT_DB_ALIAS) -> None:
    """Runs that left the queue release their places (each count - 1):
    ``(owner_id, admission_slot)`` of each root run."""
    _add(runs, -1, using)


def retake(runs: Iterable[tuple[Any, int]], *, using: str = DEFAULT_DB_ALIAS) -> None:
    """Runs that came back to the queue (admitted before) take their places again (each
    count + 1, no cap)."""
    _add(runs, 1, using)


def _add(runs: Iterable[tuple[Any, int]], sign: int, using: str) -> None:
    hosts: Counter[str] = Counter()
    users: Counter[str] = Counter()
    for owner_id, slot in runs:
        hosts[host_scope(slot)] += sign
        users[user_scope(owner_id)] += sign
    if not hosts:
        return
    connection = connections[using]
    quote = connection.ops.quote_name
    with connection.cursor() as cursor:
        # Host stripes first, then users, each in key order: the order every writer of
        # these rows follows.
        for deltas in (hosts, users):
            scopes = sorted(deltas)
            case = " ".join(f"WHEN %s THEN {int(deltas[s])}" for s in scopes)
            cursor.execute(
                f"UPDATE {quote(_table())} SET {quote('pending')} = {quote('pending')}"
                f" + CASE {quote('scope')} {case} ELSE 0 END"
                f" WHERE {quote('scope')} IN ({', '.join(['%s'] * len(scopes))})",
                [*scopes, *scopes],
            )


def release_ctes(quote: Any, source: str) -> str:
    """`release` as two common table expressions of a claim's statement (PostgreSQL):
    the places of the root runs the CTE ``source`` returns (its columns ``owner_id``,
    ``admission_slot`` and ``parent_id``), host stripes first, then users (the users' update
    waits for the stripes' by reading it)."""
    table, pending_ = quote(_table()), quote("pending")

    def back(name: str, scope_sql: str, after: str) -> str:
        return (
            f"{name} AS (UPDATE {table} p SET {pending_} = p.{pending_} - d.n"
            f" FROM (SELECT {scope_sql} AS scope, COUNT(*) AS n FROM {source}"
            f" WHERE parent_id IS NULL GROUP BY 1) d"
            f" WHERE p.{quote('scope')} = d.scope{after} RETURNING 1)"
        )

    return ", ".join(
        (
            back("host_back", f"'{HOST}' || LPAD(admission_slot::text, 2, '0')", ""),
            back(
                "user_back",
                f"'{USER}' || owner_id::text",
                " AND (SELECT COUNT(*) FROM host_back) >= 0",
            ),
        )
    )


def root_runs(rows: Iterable[dict[str, Any]]) -> list[tuple[Any, int]]:
    """``(owner_id, admission_slot)`` of the root runs among run rows (dicts)."""
    return [(r["owner_id"], r["admission_slot"]) for r in rows if r.get("parent_id") is None]


def reconcile(*, using: str = DEFAULT_DB_ALIAS) -> int:
    """Set every counter to the queued root runs it counts, under the counters' locks (in
    their one order; admissions wait a moment); returns how many counters were wrong."""
    with transaction.atomic(using=using):
        create((host_scope(s) for s in range(STRIPES)), using=using)
        rows = PendingCount.objects.using(using).order_by("scope")
        if connections[using].features.has_select_for_update:
            rows = rows.select_for_update()
        held = dict(rows.values_list("scope", "pending"))
        from scheduling.runs.selectors import queued_roots

        queued = queued_roots(using=using)
        truth: dict[str, int] = {scope: 0 for scope in held}
        for slot, n in queued.values_list("admission_slot").annotate(n=Count("pk")).order_by():
            truth[host_scope(slot)] = truth.get(host_scope(slot), 0) + n
        for owner_id, n in queued.values_list("owner_id").annotate(n=Count("pk")).order_by():
            truth[user_scope(owner_id)] = n
        wrong = {scope: n for scope, n in truth.items() if held.get(scope) != n}
        missing = [scope for scope in wrong if scope not in held]
        create(missing, using=using)
        for scope, n in wrong.items():
            PendingCount.objects.using(using).filter(scope=scope).update(pending=n)
        return len(wrong)


def snapshot(*, using: str = DEFAULT_DB_ALIAS) -> dict[str, int]:
    """The host's count and each user's (``{"host": n, "user.<id>": n, ...}``), for
    operators and tests."""
    counts = dict(PendingCount.objects.using(using).values_list("scope", "pending"))
    host = sum(n for scope, n in counts.items() if scope.startswith(HOST))
    return {"host": host, **{s: n for s, n in counts.items() if s.startswith(USER) and n}}
