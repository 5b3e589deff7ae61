"""Session export / import as JSON Lines (issue 5 item 4), round-tripped across databases."""

from __future__ import annotations

import io
import os
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group, Permission
from django.contrib.contenttypes.models import ContentType
from django.core.management import call_command
from django.db import connections

from sageproject import config as sage_config
from sageproject.errors import ConflictError, NotFoundError
from scheduling.models import Event, Run, RunStatus, Session, SessionKind
from scheduling.serialization import export_session_lines, import_session_lines
from tests.conftest import CI, service_reachable

T0 = datetime(2026, 3, 1, 12, 0, 0, 123456, tzinfo=UTC)


def _session(owner: Any, *, using: str = "default", **fields: Any) -> Session:
    session = Session.objects.using(using).create(
        owner=owner,
        package_ref="c0ffee",
        package_name="demo",
        agent_id="assistant",
        title="a title",
        **fields,
    )
    Session.objects.using(using).filter(pk=session.pk).update(created_at=T0)
    session.refresh_from_db(using=using)
    return session


def _events(
    session: Session, payloads: list[Any], *, run: Run | None = None, using: str = "default"
) -> None:
    Event.objects.using(using).bulk_create(
        [
            Event(
                session=session,
                seq=i,
                run=run,
                type="message",
                data=orjson.dumps(p).decode(),
                created_at=T0 + timedelta(seconds=i),
            )
            for i, p in enumerate(payloads, start=1)
        ]
    )
    Session.objects.using(using).filter(pk=session.pk).update(persisted_events=len(payloads))


def _export(session: Session, using: str = "default") -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in export_session_lines(session, using=using)]


def _build_fork(owner: Any, using: str = "default") -> tuple[Session, Session]:
    """A master with 4 events (the first two by a run) and a fork of it at seq 2 with 2 own."""
    master = _session(owner, using=using)
    run = Run.objects.using(using).create(
        session=master,
        owner=owner,
        status=RunStatus.COMPLETED,
        input="hello",
        result={"b": 1, "a": [1.5, "é"]},
        created_at=T0,
    )
    Event.objects.using(using).bulk_create(
        [
            Event(
                session=master,
                seq=i,
                run=run if i <= 2 else None,
                type=f"t{i}",
                data=orjson.dumps({"n": i, "text": "ünïcødé ✓", "f": 0.25}).decode(),
                created_at=T0 + timedelta(seconds=i),
            )
            for i in range(1, 5)
        ]
    )
    Session.objects.using(using).filter(pk=master.pk).update(persisted_events=4)
    fork = _session(owner, using=using, kind=SessionKind.FORK, fork_of=master, fork_seq=2)
    _events(fork, [{"own": 1}, {"own": 2, "nested": {"z": None, "a": True}}], using=using)
    return master, fork


# -- export ----------------------------------------------------------------------------


@pytest.mark.django_db
def test_it_starts_the_export_with_a_header_holding_the_session_metadata(alice):
    session = _session(alice)

    header = _export(session)[0]

    assert header["record"] == "header"
    assert header["format"] == "sage.session-export/v1"
    assert header["session"] == {
        "id": str(session.id),
        "owner": "alice",
        "package_ref": "c0ffee",
        "package_name": "demo",
        "agent_id": "assistant",
        "kind": "master",
        "fork_of": None,
        "fork_seq": None,
        "title": "a title",
        "created_at": "2026-03-01T12:00:00.123456+00:00",
    }


@pytest.mark.django_db
def test_it_exports_the_complete_history_in_order(alice):
    session = _session(alice)
    _events(session, [{"i": i} for i in range(1, 6)])

    events = [line for line in _export(session) if line["record"] == "event"]

    assert [(e["seq"], e["payload"]) for e in events] == [(i, {"i": i}) for i in range(1, 6)]


@pytest.mark.django_db
def test_it_exports_a_forks_base_events_first(alice):
    master, fork = _build_fork(alice)

    lines = _export(fork)
    events = [(e["session"], e["seq"]) for e in lines if e["record"] == "event"]

    assert events == [
        (str(master.id), 1),
        (str(master.id), 2),
        (str(fork.id), 1),
        (str(fork.id), 2),
    ]
    assert [b["id"] for b in lines[0]["bases"]] == [str(master.id)]
    assert lines[0]["bases"][0]["through_seq"] == 2


@pytest.mark.django_db
def test_it_exports_the_runs_its_events_refer_to(alice):
    master, fork = _build_fork(alice)

    runs = [line for line in _export(fork) if line["record"] == "run"]

    assert [r["session"] for r in runs] == [str(master.id)]
    assert runs[0]["result"] == {"a": [1.5, "é"], "b": 1}


@pytest.mark.django_db
def test_it_embeds_the_stored_payload_text_unchanged(alice):
    session = _session(alice)
    Event.objects.create(session=session, seq=1, type="m", data='{"b": 1,  "a": 2}')

    last = list(export_session_lines(session))[-1]

    assert last.endswith(b'"payload":{"b": 1,  "a": 2}}\n')


# -- import ----------------------------------------------------------------------------


@pytest.mark.django_db
def test_it_restores_an_export_so_that_a_second_export_is_identical(alice):
    master, fork = _build_fork(alice)
    first = b"".join(export_session_lines(fork))
    Session.objects.filter(pk__in=[master.pk, fork.pk]).delete()

    imported = import_session_lines(io.BytesIO(first))

    assert b"".join(export_session_lines(imported)) == first


@pytest.mark.django_db
def test_it_refuses_to_import_a_session_that_exists(alice):
    session = _session(alice)
    data = b"".join(export_session_lines(session))

    with pytest.raises(ConflictError) as raised:
        import_session_lines(io.BytesIO(data))

    assert raised.value.code == "store.session_exists"


@pytest.mark.django_db
def test_it_refuses_an_unknown_owner_unless_asked_to_create_it(alice):
    session = _session(alice)
    data = b"".join(export_session_lines(session)).replace(b'"alice"', b'"zed"')
    Session.objects.filter(pk=session.pk).delete()

    with pytest.raises(NotFoundError):
        import_session_lines(io.BytesIO(data))
    imported = import_session_lines(io.BytesIO(data), create_owner=True)

    assert imported.owner.username == "zed"


@pytest.mark.django_db
def test_it_exports_and_imports_through_the_commands(alice, tmp_path):
    master, fork = _build_fork(alice)
    path = tmp_path / "fork.jsonl"
    call_command("export_session", str(fork.id), output=str(path))
    original = path.read_bytes()
    Session.objects.filter(pk__in=[master.pk, fork.pk]).delete()

    out = io.StringIO()
    call_command("import_session", str(path), stdout=out)
    again = io.StringIO()
    call_command("export_session", str(fork.id), stdout=again)

    assert f"imported session {fork.id}" in out.getvalue()
    assert again.getvalue().encode() == original


# -- the round trip SQLite → PostgreSQL → MySQL ------------------------------------------


def _server_up(name: str, host: str, port: int) -> bool:
    if service_reachable(host, port):
        return True
    if CI:
        pytest.fail(f"{name} is not reachable at {host}:{port} (required under CI=true)")
    return False


def _create_tables(alias: str) -> None:
    User = get_user_model()
    with connections[alias].schema_editor() as editor:
        for model in (ContentType, Permission, Group, User, Session, Run, Event):
            editor.create_model(model)


def _add_alias(alias: str, url: str, base_dir: str) -> None:
    entry = sage_config.parse_database_url(url, base_dir=base_dir)
    entry["OPTIONS"].pop("pool", None)
    configured = connections.configure_settings(
        {"default": dict(connections.settings["default"]), alias: entry}
    )
    connections.settings[alias] = configured[alias]


def _drop_alias(alias: str) -> None:
    if alias in connections.settings:
        connections[alias].close()
        del connections[alias]
        del connections.settings[alias]


@pytest.fixture
def round_trip_databases(django_db_blocker, tmp_path) -> Iterator[list[str]]:
    """Fresh temporary databases as aliases: SQLite, then PostgreSQL and MySQL if up."""
    name = f"sage_rt_{uuid.uuid4().hex[:10]}"
    aliases: list[str] = []
    drops: list[Any] = []
    with django_db_blocker.unblock():
        _add_alias("rt_sqlite", f"sqlite:///{tmp_path / 'rt.sqlite3'}", str(tmp_path))
        aliases.append("rt_sqlite")
        if _server_up("PostgreSQL", "127.0.0.1", 5432):
            import psycopg

            with psycopg.connect(
                "postgresql://postgres@127.0.0.1:5432/postgres", autocommit=True
            ) as admin:
                admin.execute(f'CREATE DATABASE "{name}"')

            def drop_pg() -> None:
                with psycopg.connect(
                    "postgresql://postgres@127.0.0.1:5432/postgres", autocommit=True
                ) as admin:
                    admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

            drops.append(drop_pg)
            _add_alias("rt_postgres", f"postgres://postgres@127.0.0.1:5432/{name}?pool=0", "")
            aliases.append("rt_postgres")
        if _server_up("MySQL", "127.0.0.1", 3306):
            import MySQLdb

            admin = MySQLdb.connect(host="127.0.0.1", port=3306, user="root", password="")
            admin.cursor().execute(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4")

            def drop_mysql() -> None:
                admin.cursor().execute(f"DROP DATABASE IF EXISTS `{name}`")
                admin.close()

            drops.append(drop_mysql)
            _add_alias("rt_mysql", f"mysql://root@127.0.0.1:3306/{name}", "")
            aliases.append("rt_mysql")
        try:
            for alias in aliases:
                _create_tables(alias)
            yield aliases
        finally:
            for alias in aliases:
                _drop_alias(alias)
            for drop in drops:
                drop()


@pytest.mark.storage
def test_it_round_trips_a_fork_from_sqlite_through_postgresql_to_mysql(
    round_trip_databases, django_db_blocker
):
    if len(round_trip_databases) == 1 and not os.environ.get("SAGE_ALLOW_SQLITE_ONLY"):
        pytest.skip("neither PostgreSQL nor MySQL is reachable")
    with django_db_blocker.unblock():
        source = round_trip_databases[0]
        owner = get_user_model()._default_manager.db_manager(source).create_user("alice")
        _, fork = _build_fork(owner, using=source)
        first = b"".join(export_session_lines(fork, using=source))
        exports = [first]
        for target in round_trip_databases[1:]:
            imported = import_session_lines(
                io.BytesIO(exports[-1]), using=target, create_owner=True
            )
            exports.append(b"".join(export_session_lines(imported, using=target)))

    assert len(exports) == len(round_trip_databases)
    assert all(export == first for export in exports[1:])
    assert first.count(b'"record":"event"') == 4
