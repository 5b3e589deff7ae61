"""The PostgreSQL pool's health check (sageproject.pgpool): no round trip for a connection
handed out moments ago, and still no dead connection handed out after the server ended it."""

from __future__ import annotations

import time

import psycopg
import pytest
from django.db import connection, connections
from psycopg_pool import ConnectionPool

from sageproject import pgpool
from tests.waiting import wait_until

pytestmark = [pytest.mark.storage, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def raw_connection():
    if connection.vendor != "postgresql":
        pytest.skip("the pool is PostgreSQL's")
    params = connection.get_connection_params()
    params.pop("cursor_factory", None)
    params.pop("context", None)
    conn = psycopg.connect(**params, autocommit=True)
    yield conn
    conn.close()


@pytest.fixture
def full_checks(monkeypatch):
    calls = []
    real = ConnectionPool.check_connection
    monkeypatch.setattr(
        ConnectionPool, "check_connection", staticmethod(lambda c: (calls.append(c), real(c)))
    )
    return calls


def terminate(conn) -> None:
    with connections["default"].cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(%s)", [conn.info.backend_pid])


def test_a_connection_handed_out_moments_ago_is_handed_out_again_without_a_query(
    raw_connection, full_checks
):
    pgpool.check(raw_connection)  # never handed out: checked
    pgpool.check(raw_connection)
    pgpool.check(raw_connection)
    assert full_checks == [raw_connection]


def test_a_connection_idle_long_is_checked(raw_connection, full_checks, monkeypatch):
    pgpool.check(raw_connection)  # never handed out
    monkeypatch.setattr(pgpool, "RECHECK_AFTER", 0.0)
    pgpool.check(raw_connection)  # handed out longer than RECHECK_AFTER ago
    assert full_checks == [raw_connection, raw_connection]


def test_the_pool_gives_connections_back_without_its_worker_thread():
    """No ``reset`` callback: with one, psycopg_pool returns every connection through a
    task of its worker thread — a thread hand-off for every request."""
    if connection.vendor != "postgresql" or connection.pool is None:
        pytest.skip("the pool is PostgreSQL's")
    assert connection.pool._reset is None
    assert connection.pool._check is pgpool.check


def test_a_connection_the_server_ended_is_refused_at_once(raw_connection):
    pgpool.check(raw_connection)  # handed out just now
    terminate(raw_connection)
    wait_until(
        lambda: not pgpool._quiet(raw_connection),
        timeout=5,
        interval=0.01,
        message="the server's goodbye on the socket",
    )
    with pytest.raises(psycopg.OperationalError):
        pgpool.check(raw_connection)


@pytest.mark.timing
def test_the_orm_never_gets_a_connection_the_server_ended(raw_connection):
    if connection.pool is None:
        pytest.skip("the database is configured without the pool")
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        first = cursor.fetchone()[0]
    connection.close()  # back to the pool: handed out just now
    raw_connection.execute("SELECT pg_terminate_backend(%s)", [first])
    time.sleep(0.2)
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        assert cursor.fetchone()[0] != first
