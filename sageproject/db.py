"""Running ORM work from the worker's event loop; prepared statements and pipelines on
PostgreSQL; a named lock held for a transaction, on every supported database.

Every blocking database call of the worker goes through ``db_call``: it runs in a thread
(never on the loop) and gives the thread's connection back afterwards when the connection
settings say so. With PostgreSQL's connection pool (CONN_MAX_AGE 0) that returns the
connection to the pool after each call, so idle threads never pin pool slots; SQLite
(persistent) and MySQL (CONN_MAX_AGE 60) keep theirs.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any, ParamSpec, TypeVar

from asgiref.sync import sync_to_async
from django.db import (
    InterfaceError,
    InternalError,
    OperationalError,
    close_old_connections,
    connection,
    transaction,
)

logger = logging.getLogger("sage.db")

P = ParamSpec("P")
T = TypeVar("T")


def _call_and_release[T](fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    try:
        return fn(*args, **kwargs)
    finally:
        close_old_connections()


async def db_call[T](fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run ``fn(*args, **kwargs)`` in a worker thread and return its result."""
    return await sync_to_async(_call_and_release, thread_sensitive=False)(fn, *args, **kwargs)


def database_url(alias: str = "default", name: str | None = None) -> str:
    """A ``DATABASE_URL`` for a subprocess: this process's database (the test database under
    the test runner), or the database ``name`` on the same server. Raises ValueError for an
    in-memory SQLite database, which no other process can open."""
    from urllib.parse import quote, urlencode

    from django.db import connections

    s = connections[alias].settings_dict
    vendor = connections[alias].vendor
    if vendor == "sqlite":
        path = str(name or s["NAME"])
        if path == ":memory:" or path.startswith("file:"):
            raise ValueError("a subprocess needs a file database, not an in-memory one")
        return f"sqlite:///{path}"
    scheme = {"postgresql": "postgres", "mysql": "mysql"}[vendor]
    auth = quote(s["USER"] or "")
    if s["PASSWORD"]:
        auth += ":" + quote(s["PASSWORD"])
    host = s["HOST"] or "127.0.0.1"
    port = f":{s['PORT']}" if s["PORT"] else ""
    query: dict[str, Any] = {}
    if vendor == "postgresql":
        options = dict(s.get("OPTIONS") or {})
        pool = options.pop("pool", None)
        options.pop("options", None)  # set again by sageproject.config
        if isinstance(pool, dict):
            query["pool_max"] = pool.get("max_size", 20)
        elif not pool:
            query["pool"] = "0"
        if options.pop("prepare_threshold", None) is None:
            query["prepared"] = "0"
        query.update({k: v for k, v in options.items() if isinstance(v, str | int)})
    suffix = f"?{urlencode(query)}" if query else ""
    return f"{scheme}://{auth}@{host}{port}/{quote(name or s['NAME'])}{suffix}"


@functools.cache
def _transient_classes() -> tuple[type[BaseException], ...]:
    classes: list[type[BaseException]] = [OperationalError, InterfaceError, InternalError]
    try:
        import psycopg
    except ImportError:  # no PostgreSQL driver installed
        return tuple(classes)
    # The driver's own, raised where a statement runs on the raw connection outside
    # Django's error wrapper (a listener's connection, the connection pool).
    return (*classes, psycopg.OperationalError, psycopg.InterfaceError, psycopg.InternalError)


def transient_database_error(exc: BaseException) -> bool:
    """The database restarting, unreachable, or ending the session — PostgreSQL's class 25
    (a session left idle in its transaction) comes as ``InternalError`` — rather than a
    statement it refused (a programming, integrity or data error). The one rule for "retry
    it" of the worker's claims, its outcomes' commits and the session store's writes."""
    return isinstance(exc, _transient_classes())


async def retry_transient(
    fn: Callable[..., Any], *args: Any, what: str = "database call", **kwargs: Any
) -> Any:
    """``await fn(*args, **kwargs)``, retried with backoff (0.05 s → 2 s) while it fails with
    a transient database error; other errors propagate. Whoever holds a lease is stopped by
    its renewer if the outage outlasts the lease."""
    delay = 0.05
    while True:
        try:
            return await fn(*args, **kwargs)
        except Exception as exc:
            if not transient_database_error(exc):
                raise
            logger.warning("%s failed (%s); retrying in %.2fs", what, exc, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)


def prepared(raw: Any, sql: str, params: Sequence[Any] = ()) -> Any:
    """Execute ``sql`` on the psycopg connection ``raw`` as a prepared statement — parsed
    and planned the first time on each connection, after that only bound and run (the
    connection's ``plan_cache_mode`` is ``force_generic_plan``, `sageproject.config`:
    PostgreSQL would otherwise plan some statements again for every run's values) — and
    return its cursor (in a pipeline, its rows arrive with the pipeline's results). For
    the hot path's own statements: the claim's, the admission's, the group commit's and
    the API token lookup, which cost more to plan than to run.
    Parameters are bound on the server, so each must have a type PostgreSQL can use (a
    cast where ``None`` or an empty list can appear). With prepared statements off
    (``prepared=0`` in ``DATABASE_URL``: psycopg's ``prepare_threshold`` is None) it is an
    ordinary statement."""
    import psycopg

    cursor = psycopg.Cursor(raw)
    cursor.execute(sql, params, prepare=True)
    return cursor


@functools.cache
def pipeline_supported() -> bool:
    """Whether libpq here has pipeline mode (see `pipelined`)."""
    import psycopg

    return psycopg.Pipeline.is_supported()


def pipelined(raw: Any) -> Any:
    """libpq's pipeline mode on the psycopg connection ``raw``: the statements issued in
    it go out together, in one write at the block's end (or when a result is read inside
    it), and run in order — one round trip (without it, where libpq is too old, one round
    trip each — the same statements, the same results).

    psycopg's own pipeline sends each statement as it is issued (two polls and a write
    each); the held pipeline keeps them until the block ends, so the database is woken
    once per transaction rather than once per statement, and its end sends no flush
    request after the sync. A pipelined admission makes three system calls instead of
    about twenty (docs/PERFORMANCE.md).

    The holding overrides psycopg's private pipeline methods. No public API holds the
    writes: psycopg's pipeline and ``executemany`` write each statement as it is queued,
    and libpq's own calls (``psycopg.pq``) would leave adaptation, prepared statements and
    results to redo here. So ``SAGE_PG_HELD_PIPELINE=0`` turns it off (psycopg's own
    pipeline: the same statements and results, in more writes), and
    `tests/test_db_pipeline.py` pins psycopg's version and the methods overridden."""
    if not pipeline_supported():
        return nullcontext()
    if raw._pipeline is None and held_pipeline_enabled():
        raw._pipeline = _held_pipeline_class()(raw)
    return raw.pipeline()


def held_pipeline_enabled() -> bool:
    """Whether `pipelined` holds its statements (``SAGE_PG_HELD_PIPELINE``, on by default)."""
    from django.conf import settings

    return bool(getattr(settings, "SAGE", {}).get("SAGE_PG_HELD_PIPELINE", True))


@contextmanager
def one_transaction(raw: Any, *, at_once: bool = True) -> Iterator[bool]:
    """The block's statements, pipelined (`pipelined`) on the psycopg connection ``raw``, as
    one transaction; yields whether it is an explicit one.

    Committed at the block's end (``at_once``), it is the pipeline's implicit transaction:
    PostgreSQL runs every statement up to the sync as one, which the sync commits — or rolls
    back after a failed statement, leaving the connection idle — so no ``BEGIN``, no
    ``COMMIT`` and, after a refusal, no ``ROLLBACK`` are sent (psycopg's rollback would
    also deallocate every prepared statement of the connection, and the next admission,
    claim and token lookup would be planned again). Otherwise — its ``COMMIT`` sent later
    by the caller (a test's crash point before it), or no pipeline mode in libpq (each
    statement would commit on its own) — the block begins with ``BEGIN``."""
    explicit = not (at_once and pipeline_supported())
    with pipelined(raw):
        if explicit:
            raw.execute("BEGIN")
        yield explicit
        if explicit and at_once:
            raw.execute("COMMIT")


@functools.cache
def _held_pipeline_class() -> type:
    import psycopg
    from psycopg.generators import send

    class HeldPipeline(psycopg.Pipeline):
        """A psycopg pipeline that sends its queued statements only when it has to: at a
        sync (the block's end, a nested pipeline, a rollback) or when a result is fetched.
        psycopg calls ``_communicate_gen`` after queuing each statement; here that call
        does nothing while the statements are held. Written against psycopg 3.3.9 (pinned
        in requirements.txt): `tests/test_db_pipeline.py` fails when the pin or the
        private methods overridden here change, and checks the holding."""

        holding = True

        def _queue_all(self) -> None:
            # Every held statement into libpq's buffer (libpq writes nothing yet, below
            # 64 KiB), to be written in one go.
            while self.command_queue:
                self.command_queue.popleft()()

        def _release(self) -> Any:
            self._queue_all()
            yield from psycopg.Pipeline._communicate_gen(self)

        def _communicate_gen(self) -> Any:
            if self.holding:
                return
            yield from self._release()

        def _sync_gen(self) -> Any:
            self.holding = False
            try:
                yield from super()._sync_gen()
            finally:
                self.holding = True

        def _exit_gen(self) -> Any:
            # psycopg's: the sync, then a flush request to fetch the results by — which
            # the sync already makes the server send, so the request only woke it again.
            self.holding = False
            try:
                self._enqueue_sync()
                self._queue_all()
                yield from send(self.pgconn)  # all of it written
                yield from psycopg.Pipeline._fetch_gen(self, flush=False)
            finally:
                self.holding = True

        def _fetch_gen(self, *, flush: bool) -> Any:
            if self.command_queue:
                yield from self._release()
            yield from super()._fetch_gen(flush=flush)

    return HeldPipeline


# ------------------------------------------------------------------------ named locks

LOCK_TIMEOUT_SECONDS = 30


def _key(name: str) -> int:
    # A stable signed 64-bit key for PostgreSQL's advisory lock space.
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big", signed=True)


@contextmanager
def named_lock(name: str) -> Iterator[None]:
    """Run the body in a transaction holding the lock ``name`` until it has committed.

    PostgreSQL: ``pg_advisory_xact_lock``; MySQL/MariaDB: ``GET_LOCK``, released after the
    commit; SQLite: its IMMEDIATE transactions already serialize writers, so nothing to
    take. Raises ``TimeoutError`` if the lock is not granted within 30 seconds.
    """
    vendor = connection.vendor
    if vendor == "mysql":
        # GET_LOCK belongs to the connection, not the transaction: take it before the
        # transaction and release it only after the commit, so the next holder's reads
        # (READ COMMITTED) already see what this one wrote.
        with connection.cursor() as cursor:
            cursor.execute("SELECT GET_LOCK(%s, %s)", [name[:64], LOCK_TIMEOUT_SECONDS])
            (granted,) = cursor.fetchone()
        if granted != 1:
            raise TimeoutError(f"could not take lock {name!r}")
        try:
            with transaction.atomic():
                yield
        finally:
            with connection.cursor() as cursor:
                cursor.execute("SELECT RELEASE_LOCK(%s)", [name[:64]])
        return
    with transaction.atomic():
        if vendor == "postgresql":
            # Released by the commit itself.
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_advisory_xact_lock(%s)", [_key(name)])
        yield
