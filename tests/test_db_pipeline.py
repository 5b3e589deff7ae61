"""`sageproject.db.pipelined` and `one_transaction` on PostgreSQL, under both settings of
``SAGE_PG_HELD_PIPELINE``, and the pin of the psycopg internals the held pipeline overrides.

The held pipeline subclasses psycopg's private pipeline methods (no public API holds the
writes). These tests fail when psycopg's version leaves the pin in requirements.txt, or
when the methods it overrides or relies on change: read the new ones, adapt
``_held_pipeline_class``, then record the new hashes here."""

from __future__ import annotations

import hashlib
import importlib.metadata
import inspect
import re
import socket
import struct
from pathlib import Path
from typing import Any

import pytest
from django.db import connections

from sageproject.db import one_transaction, pipelined

ROOT = Path(__file__).resolve().parent.parent

PINNED = "3.3.9"
# sha256 (first 16 hex digits) of the source of each psycopg function the held pipeline
# overrides, calls or is called by, as in the pinned version.
PSYCOPG_SOURCES = {
    "BasePipeline._enter_gen": "6b574af4645f28b7",
    "BasePipeline._sync_gen": "e808e0941b7e2a3b",
    "BasePipeline._exit_gen": "fd7793ca0482bd86",
    "BasePipeline._communicate_gen": "e1b241de73fce8e7",
    "BasePipeline._fetch_gen": "c2bcdf56de27f102",
    "BasePipeline._enqueue_sync": "976a6bf02bf2dbe0",
    "Pipeline.__exit__": "0f93e86e8d39eda8",
    "Connection.pipeline": "954640e51e5dda3e",
    "BaseCursor._execute_gen": "d4128fe2e2207fb5",
    "Cursor._fetch_pipeline": "cee672b7f290d399",
    "generators._send": "2f814f6ef80a7987",
}


def _psycopg_functions() -> dict[str, Any]:
    import psycopg
    from psycopg import _cursor_base, _pipeline_base, generators

    base = _pipeline_base.BasePipeline
    return {
        "BasePipeline._enter_gen": base._enter_gen,
        "BasePipeline._sync_gen": base._sync_gen,
        "BasePipeline._exit_gen": base._exit_gen,
        "BasePipeline._communicate_gen": base._communicate_gen,
        "BasePipeline._fetch_gen": base._fetch_gen,
        "BasePipeline._enqueue_sync": base._enqueue_sync,
        "Pipeline.__exit__": psycopg.Pipeline.__exit__,
        "Connection.pipeline": psycopg.Connection.pipeline,
        "BaseCursor._execute_gen": _cursor_base.BaseCursor._execute_gen,
        "Cursor._fetch_pipeline": psycopg.Cursor._fetch_pipeline,
        "generators._send": generators._send,
    }


def test_it_runs_on_the_psycopg_version_pinned_in_requirements():
    requirements = (ROOT / "requirements.txt").read_text()
    pinned = re.search(r"^psycopg\[[^\]]*\]==(\S+)", requirements, re.MULTILINE)
    assert pinned and pinned.group(1) == PINNED
    assert importlib.metadata.version("psycopg") == PINNED
    try:  # the C implementation ships with the same version
        assert importlib.metadata.version("psycopg-binary") == PINNED
    except importlib.metadata.PackageNotFoundError:
        pass


def test_the_psycopg_methods_the_held_pipeline_overrides_are_unchanged():
    found = {
        name: hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:16]
        for name, fn in _psycopg_functions().items()
    }
    assert found == PSYCOPG_SOURCES


# ---------------------------------------------------------------- behaviour, PostgreSQL


@pytest.fixture(params=[True, False], ids=["held", "psycopg"])
def held(request, settings) -> bool:
    """Each test once with ``SAGE_PG_HELD_PIPELINE`` on, once off."""
    settings.SAGE = {**settings.SAGE, "SAGE_PG_HELD_PIPELINE": request.param}
    return request.param


@pytest.fixture
def raw(db) -> Any:
    """A psycopg connection of the test's own to the test database, in autocommit mode
    (skips the test on other databases: pipeline mode is the PostgreSQL path's)."""
    import psycopg

    if connections["default"].vendor != "postgresql":
        pytest.skip("libpq's pipeline mode is the PostgreSQL path's")
    params = connections["default"].get_connection_params()
    for key in ("cursor_factory", "context", "server_side_binding"):
        params.pop(key, None)
    with psycopg.connect(**params, autocommit=True) as conn:
        yield conn


def _data_segments_sent(raw: Any) -> int:
    """The TCP data segments the connection has sent (Linux ``tcp_info``): one per write,
    for writes this small on loopback (libpq sets TCP_NODELAY)."""
    sock = socket.fromfd(raw.pgconn.socket, socket.AF_INET, socket.SOCK_STREAM)
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    finally:
        sock.close()
    return struct.unpack_from("I", info, 156)[0]  # tcpi_data_segs_out


def _transaction(raw: Any) -> list[Any]:
    with pipelined(raw):
        raw.execute("BEGIN")
        cursors = [raw.execute("SELECT %s::int", [n]) for n in range(5)]
        raw.execute("COMMIT")
    return [cursor.fetchone() for cursor in cursors]


@pytest.mark.storage
def test_a_held_pipeline_sends_a_transaction_in_one_write(raw, held):
    """Held: the transaction's seven statements and the sync go out in one write; psycopg's
    own pipeline writes each statement as it is issued. The same results either way."""
    _transaction(raw)  # the first use prepares nothing, but warms the connection
    before = _data_segments_sent(raw)
    assert _transaction(raw) == [(n,) for n in range(5)]
    writes = _data_segments_sent(raw) - before
    if held:
        assert writes == 1
    else:
        assert writes > 1
    assert raw.pgconn.transaction_status == 0  # committed: idle


@pytest.mark.storage
def test_a_pipeline_holds_its_statements_until_a_result_is_needed(raw, settings):
    """`pipelined` sends a transaction's statements in one write: while the block issues
    them they wait in the pipeline (psycopg's own pipeline sends each at once); reading a
    result inside the block sends them, the block's end sends the rest."""
    settings.SAGE = {**settings.SAGE, "SAGE_PG_HELD_PIPELINE": True}
    with pipelined(raw):
        raw.execute("BEGIN")
        first = raw.execute("SELECT 1")
        assert len(raw._pipeline.command_queue) == 2  # nothing sent yet
        assert first.fetchone() == (1,)  # reading sends them
        assert not raw._pipeline.command_queue
        last = raw.execute("SELECT 2")
        raw.execute("COMMIT")
        assert len(raw._pipeline.command_queue) == 2
    assert last.fetchone() == (2,)
    assert raw.pgconn.transaction_status == 0  # committed: idle


@pytest.mark.storage
def test_a_failed_statement_fails_the_block_and_leaves_the_connection_usable(raw, held):
    import psycopg

    with pytest.raises(psycopg.errors.DivisionByZero):
        with pipelined(raw):
            raw.execute("BEGIN")
            raw.execute("SELECT 1 / 0")
            raw.execute("COMMIT")
    raw.execute("ROLLBACK")
    assert raw.execute("SELECT 3").fetchone() == (3,)


@pytest.mark.storage
def test_a_transaction_committed_at_once_sends_no_begin_and_is_still_one(raw, held):
    """What the admission, the claim and the group commit rely on (`one_transaction`): with
    its commit at the block's end no ``BEGIN`` is queued, yet the statements up to the
    pipeline's sync are one transaction, committed by the sync, or rolled back by it after
    a failed statement, leaving the connection idle with nothing written. With the commit
    left to the caller, the block begins one."""
    import psycopg

    raw.execute("CREATE TEMPORARY TABLE t (x int)")
    with pytest.raises(psycopg.errors.DivisionByZero):
        with one_transaction(raw) as explicit:
            raw.execute("INSERT INTO t VALUES (1)")
            assert not explicit
            if held:
                assert len(raw._pipeline.command_queue) == 1  # no BEGIN
            raw.execute("SELECT 1 / 0")
    assert raw.pgconn.transaction_status == 0  # idle: nothing to roll back
    assert raw.execute("SELECT count(*) FROM t").fetchone() == (0,)

    with one_transaction(raw):
        raw.execute("INSERT INTO t VALUES (2)")
        first = raw.execute("SELECT pg_current_xact_id()::text")
        second = raw.execute("SELECT pg_current_xact_id()::text")
    assert first.fetchone() == second.fetchone()  # one transaction
    assert raw.pgconn.transaction_status == 0
    assert raw.execute("SELECT count(*) FROM t").fetchone() == (1,)

    with one_transaction(raw, at_once=False) as explicit:
        raw.execute("INSERT INTO t VALUES (3)")
    assert explicit and raw.pgconn.transaction_status == 2  # open: the caller commits
    raw.execute("COMMIT")
    assert raw.execute("SELECT count(*) FROM t").fetchone() == (2,)
