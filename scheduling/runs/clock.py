"""The database's clock, as every transition reads it.

Lease times come from the database server's clock, never from a worker's; SQLite, which
has no server, reads this host's clock through a SQL function of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections
from django.db.models import DateTimeField, ExpressionWrapper, Value
from django.db.models.functions import Now
from django.utils import timezone

# A test's clock (tests move time by hand); None: the database's.
Clock = Callable[[], datetime] | None


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


def now_sql(vendor: str) -> str:
    """The current time in SQL: the statement's time where the database has one."""
    if vendor == "postgresql":
        return "STATEMENT_TIMESTAMP()"
    if vendor == "mysql":
        return "UTC_TIMESTAMP(6)"
    return f"{SQLITE_NOW}()"
