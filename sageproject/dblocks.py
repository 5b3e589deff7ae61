"""A named lock held until the surrounding transaction ends, on every supported database.

PostgreSQL: ``pg_advisory_xact_lock``; MySQL/MariaDB: ``GET_LOCK`` released after the
commit; SQLite: its IMMEDIATE transactions already serialize writers, so nothing to take.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager

from django.db import connection, transaction

LOCK_TIMEOUT_SECONDS = 30


def _key(name: str) -> int:
    # A stable signed 64-bit key for PostgreSQL's advisory lock space.
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big", signed=True)


@contextmanager
def named_lock(name: str) -> Iterator[None]:
    """Run the body in a transaction holding the lock ``name`` until it has committed.

    Raises ``TimeoutError`` if the lock is not granted within 30 seconds.
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
