"""The health check of PostgreSQL's connection pool, without a round trip per checkout.

Django's pool (``CONN_HEALTH_CHECKS``) checks every connection it hands out with an empty
query: one more round trip for every request and every worker database call, each a wake-up
of the server on a busy host. The check here keeps what it is for (after a database restart
no caller gets a dead connection) and pays the round trip only when it can matter:

- a connection handed out less than ``RECHECK_AFTER`` seconds ago (so in use, or given
  back, within that time), whose socket has nothing to read, is handed out as it is. A
  server that restarted or ended the backend has written its goodbye (``FATAL:
  terminating connection``) or closed the socket: either makes the socket readable, so
  the full check runs and the pool drops the connection;
- any other connection (idle longer, readable, never handed out) gets the full check.

This is pgbouncer's ``server_check_delay`` with a look at the socket added. The time kept
is the last hand-out, not the last give-back: a ``reset`` callback (the pool's only hook on
give-back) makes the pool return every connection through its worker thread, a thread
hand-off per request. No Django here: the settings module installs it (``OPTIONS["pool"]``
``check``).
"""

from __future__ import annotations

import select
import time
import weakref
from typing import Any

# Seconds a connection handed out is trusted without a query when its socket is quiet.
RECHECK_AFTER = 5.0

_handed_out: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()


def check(conn: Any) -> None:
    """The pool's ``check`` callback: raises when the connection is not usable."""
    from psycopg_pool import ConnectionPool

    now = time.monotonic()
    since = _handed_out.get(conn)
    if since is None or now - since >= RECHECK_AFTER or not _quiet(conn):
        ConnectionPool.check_connection(conn)
    _handed_out[conn] = now


def _quiet(conn: Any) -> bool:
    """True when the connection is open, idle and its socket has nothing to read."""
    if conn.closed or conn.broken:
        return False
    try:
        readable, _, _ = select.select([conn.pgconn.socket], [], [], 0)
    except Exception:  # no socket any more (psycopg raises once the connection closed)
        return False
    return not readable
