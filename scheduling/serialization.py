"""Event encoding (orjson, once per event) and JSON Lines session export/import.

An event's payload is serialized exactly once, by :func:`encode_payload`, when the
coordinator first needs it (its commit). The resulting text is what the ``Event.data``
column stores, and exports and streams embed that same text with ``orjson.Fragment``
instead of decoding and re-encoding it, so a long session costs nothing extra to export.

Export format (``sage.session-export/v1``), one JSON object per line:

- line 1, ``{"record": "header", "format": ..., "session": {...}, "bases": [{...}, ...]}``;
  ``bases`` lists the fork bases of a fork session, outermost first, each with the
  ``through_seq`` of its own events the export carries;
- ``{"record": "run", ...}`` for every run the exported events refer to, plus the
  session's own runs;
- ``{"record": "event", "session", "seq", "type", "run", "created_at", "payload"}`` in
  history order: a fork session's base events (1..fork_seq, recursively) first, then its
  own. ``session``/``seq`` name the row's own session, so an import puts each row back
  where it came from.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime
from typing import Any

import orjson
from django.contrib.auth import get_user_model
from django.db import transaction

from sageproject.errors import ConflictError, NotFoundError, ValidationError
from scheduling.models import Event, Run, Session, SessionKind

EXPORT_FORMAT = "sage.session-export/v1"

_MISSING: Any = object()


class _SerializerCounter:
    """How many payloads were serialized in this process (benchmarks and tests read it)."""

    __slots__ = ("_lock", "value")

    def __init__(self) -> None:
        self.value = 0
        self._lock = threading.Lock()

    def add(self, n: int = 1) -> None:
        with self._lock:
            self.value += n


serializer_calls = _SerializerCounter()


def encode_payload(payload: Any) -> str:
    """Serialize one event payload with orjson; the one serializer of the store.

    Returns the JSON text stored in ``Event.data``. Raises ``ValidationError``
    (``store.event_not_serializable``) for a payload orjson cannot encode.
    """
    serializer_calls.add()
    try:
        return orjson.dumps(payload).decode()
    except orjson.JSONEncodeError as exc:
        raise ValidationError(
            "store.event_not_serializable", f"event payload is not JSON-serializable: {exc}"
        ) from exc


class SessionEvent:
    """One event of an in-memory session history.

    ``data`` is the serialized payload; it is filled once (by :func:`ensure_encoded`) and
    then reused for the row, exports and streams. ``payload`` decodes ``data`` lazily for
    events loaded from the database, so opening a long session decodes nothing.
    """

    __slots__ = ("_payload", "created_at", "data", "run_id", "seq", "type")

    def __init__(
        self,
        *,
        seq: int,
        type: str,
        run_id: Any,
        created_at: datetime,
        payload: Any = _MISSING,
        data: str | None = None,
    ) -> None:
        if payload is _MISSING and data is None:
            raise ValueError("a SessionEvent needs a payload or its encoded data")
        self.seq = seq
        self.type = type
        self.run_id = run_id
        self.created_at = created_at
        self._payload = payload
        self.data = data

    @property
    def payload(self) -> Any:
        if self._payload is _MISSING:
            self._payload = orjson.loads(self.data)  # type: ignore[arg-type]
        return self._payload

    def forget_encoding(self) -> None:
        """Drop the cached text (benchmarks time a cold full serialization with it)."""
        if self._payload is _MISSING:
            self._payload = orjson.loads(self.data)  # type: ignore[arg-type]
        self.data = None

    def __repr__(self) -> str:
        return f"SessionEvent(seq={self.seq}, type={self.type!r})"


def ensure_encoded(event: SessionEvent) -> str:
    """Return the event's serialized payload, serializing it now if it never was."""
    data = event.data
    if data is None:
        data = event.data = encode_payload(event._payload)
    return data


def format_datetime(value: datetime | None) -> str | None:
    """ISO 8601 in UTC with microseconds, identical on every database backend."""
    if value is None:
        return None
    return value.astimezone(UTC).isoformat(timespec="microseconds")


def parse_datetime(value: str | None) -> datetime | None:
    if value is None:
        return None
    return datetime.fromisoformat(value)


def event_json(*, seq: int, type: str, run_id: Any, created_at: datetime, data: str) -> bytes:
    """The API/stream shape of one event, embedding the stored text without re-encoding."""
    return orjson.dumps(
        {
            "seq": seq,
            "type": type,
            "run": str(run_id) if run_id is not None else None,
            "payload": orjson.Fragment(data),
            "created_at": format_datetime(created_at),
        }
    )


# ---------------------------------------------------------------------------------------
# Export


def _id(value: Any) -> str | None:
    return None if value is None else str(value)


def _session_meta(session: Session, *, username: str) -> dict[str, Any]:
    return {
        "id": str(session.id),
        "owner": username,
        "package_ref": session.package_ref,
        "package_name": session.package_name,
        "agent_id": session.agent_id,
        "kind": session.kind,
        "fork_of": _id(session.fork_of_id),
        "fork_seq": session.fork_seq,
        "title": session.title,
        "created_at": format_datetime(session.created_at),
    }


def _fork_chain(session: Session, db: str) -> list[Session]:
    """The session and its fork bases, outermost base first, the session itself last."""
    chain: list[Session] = [session]
    seen = {session.pk}
    current = session
    while current.kind == SessionKind.FORK and current.fork_of_id is not None:
        base = Session.objects.using(db).filter(pk=current.fork_of_id).first()
        if base is None or base.pk in seen:  # deleted base, or a cycle: stop there
            break
        seen.add(base.pk)
        chain.append(base)
        current = base
    chain.reverse()
    return chain


def _export_segments(chain: list[Session], db: str) -> list[tuple[Session, int | None]]:
    """``[(session, own_limit), ...]``: which own rows of each chain member the export holds.

    The history a fork shows is its base's history through ``fork_seq`` followed by its
    own events (each session numbers its own rows 1..n). ``own_limit`` caps a member's
    own rows by seq (``None``: all of them).
    """

    def view(i: int, limit: int | None) -> tuple[list[tuple[Session, int | None]], int]:
        session = chain[i]
        segments: list[tuple[Session, int | None]] = []
        base_len = 0
        if i > 0:
            fork_seq = session.fork_seq or 0
            segments, base_len = view(i - 1, fork_seq if limit is None else min(fork_seq, limit))
        own_limit = None if limit is None else max(0, limit - base_len)
        segments.append((session, own_limit))
        if i == len(chain) - 1:
            return segments, 0  # the top's length is never needed
        rows = Event.objects.using(db).filter(session=session)
        if own_limit is not None:
            rows = rows.filter(seq__lte=own_limit)
        return segments, base_len + rows.count()

    return view(len(chain) - 1, None)[0]


def _run_line(run: Run, included: set[Any]) -> bytes:
    return (
        orjson.dumps(
            {
                "record": "run",
                "id": str(run.id),
                "session": str(run.session_id),
                "parent": _id(run.parent_id) if run.parent_id in included else None,
                "queue": run.queue,
                "priority": run.priority,
                "status": run.status,
                "input": run.input,
                "result": run.result,
                "error": run.error,
                "interaction": run.interaction,
                "cancel_requested": run.cancel_requested,
                "attempts": run.attempts,
                "created_at": format_datetime(run.created_at),
                "started_at": format_datetime(run.started_at),
                "finished_at": format_datetime(run.finished_at),
            },
            # PostgreSQL's jsonb reorders keys; sorting makes every backend export alike.
            option=orjson.OPT_SORT_KEYS,
        )
        + b"\n"
    )


def export_session_lines(
    session: Session, *, using: str | None = None, chunk_size: int = 2000
) -> Iterator[bytes]:
    """Yield the complete history of ``session`` as JSON Lines (each ends with ``\\n``).

    Fork-base events are included. Event payloads are the stored text, embedded without
    decoding. The iterator reads the database lazily in chunks, so a view can stream it.
    """
    db = using or session._state.db or "default"
    User = get_user_model()
    chain = _fork_chain(session, db)
    limits = _export_segments(chain, db)
    owners = dict(
        User._default_manager.using(db)
        .filter(pk__in={s.owner_id for s in chain})
        .values_list("pk", User.USERNAME_FIELD)
    )
    header = {
        "record": "header",
        "format": EXPORT_FORMAT,
        "session": _session_meta(session, username=owners[session.owner_id]),
        "bases": [
            {**_session_meta(s, username=owners[s.owner_id]), "through_seq": limit}
            for s, limit in limits[:-1]
        ],
    }
    yield orjson.dumps(header, option=orjson.OPT_SORT_KEYS) + b"\n"

    def rows(s: Session, limit: int | None) -> Any:
        qs = Event.objects.using(db).filter(session=s)
        if limit is not None:
            qs = qs.filter(seq__lte=limit)
        return qs.order_by("seq")

    run_ids: set[Any] = set(
        Run.objects.using(db).filter(session=session).values_list("id", flat=True)
    )
    for s, limit in limits:
        run_ids.update(
            r for r in rows(s, limit).exclude(run=None).values_list("run_id", flat=True).distinct()
        )
    chain_ids = {s.pk for s in chain}
    runs = list(
        Run.objects.using(db)
        .filter(pk__in=run_ids, session_id__in=chain_ids)
        .order_by("created_at", "id")
    )
    included = {r.id for r in runs}
    for run in runs:
        yield _run_line(run, included)
    for s, limit in limits:
        sid = str(s.pk)
        for seq, etype, run_id, created_at, data in (
            rows(s, limit)
            .values_list("seq", "type", "run_id", "created_at", "data")
            .iterator(chunk_size=chunk_size)
        ):
            yield (
                orjson.dumps(
                    {
                        "record": "event",
                        "session": sid,
                        "seq": seq,
                        "type": etype,
                        "run": str(run_id) if run_id in included else None,
                        "created_at": format_datetime(created_at),
                        "payload": orjson.Fragment(data),
                    }
                )
                + b"\n"
            )


# ---------------------------------------------------------------------------------------
# Import


def _bad(message: str) -> ValidationError:
    return ValidationError("store.import_invalid", message)


_PAYLOAD_KEY = b'"payload":'


def _raw_payload(raw: bytes | str, parsed: Any) -> str:
    """The payload text exactly as exported (the stored text, byte for byte).

    The export writes ``payload`` as the last key and no earlier value can contain the
    unescaped bytes ``"payload":``, so the first occurrence starts it.
    """
    line = raw.encode() if isinstance(raw, str) else raw
    start = line.find(_PAYLOAD_KEY)
    end = line.rstrip().rfind(b"}")
    if start < 0 or end <= start:
        return orjson.dumps(parsed).decode()
    return line[start + len(_PAYLOAD_KEY) : end].decode()


def _resolve_owner(username: str, *, db: str, create: bool, override: Any) -> Any:
    if override is not None:
        return override
    User = get_user_model()
    manager = User._default_manager.db_manager(db)
    try:
        return manager.get_by_natural_key(username)
    except User.DoesNotExist:
        if not create:
            raise NotFoundError(
                "store.owner_not_found",
                f"user {username!r} does not exist here (use --owner or --create-owner)",
            ) from None
        return manager.create_user(**{User.USERNAME_FIELD: username})


def import_session_lines(
    lines: Iterable[bytes | str],
    *,
    using: str = "default",
    owner: Any = None,
    create_owner: bool = False,
    batch_size: int = 1000,
) -> Session:
    """Restore an export made by :func:`export_session_lines` into database ``using``.

    Everything lands in one transaction. Fork bases that already exist there are kept as
    they are (their events are not re-imported); missing ones are created with the events
    the export carries. Returns the imported session. Raises ``ValidationError``
    (``store.import_invalid``) for a malformed file, ``ConflictError``
    (``store.session_exists``) when the session is already there, and ``NotFoundError``
    (``store.owner_not_found``) for an unknown owner without ``create_owner``.
    """
    # Here, not at the top: the state machine imports this module's encoding.
    from scheduling import runs

    iterator = iter(lines)
    try:
        header = orjson.loads(next(iterator))
    except StopIteration:
        raise _bad("the file is empty") from None
    except orjson.JSONDecodeError as exc:
        raise _bad(f"line 1 is not JSON: {exc}") from exc
    if header.get("record") != "header" or header.get("format") != EXPORT_FORMAT:
        raise _bad(f"line 1 must be a {EXPORT_FORMAT} header")
    metas = [*header.get("bases", []), header["session"]]
    with transaction.atomic(using=using):
        if Session.objects.using(using).filter(pk=header["session"]["id"]).exists():
            raise ConflictError(
                "store.session_exists", f"session {header['session']['id']} already exists"
            )
        created: set[str] = set()
        owners: dict[str, Any] = {}
        for meta in metas:
            if Session.objects.using(using).filter(pk=meta["id"]).exists():
                continue
            user = owners.get(meta["owner"])
            if user is None:
                user = owners[meta["owner"]] = _resolve_owner(
                    meta["owner"], db=using, create=create_owner, override=owner
                )
            fork_of = meta["fork_of"]
            if fork_of is not None and not Session.objects.using(using).filter(pk=fork_of).exists():
                fork_of = None
            Session.objects.using(using).create(
                id=meta["id"],
                owner=user,
                package_ref=meta["package_ref"],
                package_name=meta["package_name"],
                agent_id=meta["agent_id"],
                kind=meta["kind"],
                fork_of_id=fork_of,
                fork_seq=meta["fork_seq"],
                title=meta["title"],
            )
            created.add(meta["id"])
        session_owner: dict[str, Any] = dict(
            Session.objects.using(using)
            .filter(pk__in=[m["id"] for m in metas])
            .values_list("id", "owner_id")
        )
        session_owner = {str(k): v for k, v in session_owner.items()}
        counts: dict[str, int] = dict.fromkeys(created, 0)
        pending: list[Event] = []
        parents: list[tuple[str, str]] = []
        for number, raw in enumerate(iterator, start=2):
            try:
                line = orjson.loads(raw)
            except orjson.JSONDecodeError as exc:
                raise _bad(f"line {number} is not JSON: {exc}") from exc
            record = line.get("record")
            if record == "run":
                if line["session"] not in session_owner:
                    raise _bad(f"line {number}: run of a session outside the export")
                if Run.objects.using(using).filter(pk=line["id"]).exists():
                    continue
                runs.restore(
                    dict(
                        id=line["id"],
                        session_id=line["session"],
                        owner_id=session_owner[line["session"]],
                        queue=line["queue"],
                        priority=line["priority"],
                        status=line["status"],
                        input=line["input"],
                        result=line["result"],
                        error=line["error"],
                        interaction=line["interaction"],
                        cancel_requested=line["cancel_requested"],
                        attempts=line["attempts"],
                        created_at=parse_datetime(line["created_at"]),
                        started_at=parse_datetime(line["started_at"]),
                        finished_at=parse_datetime(line["finished_at"]),
                    ),
                    using=using,
                )
                if line["parent"] is not None:
                    parents.append((line["id"], line["parent"]))
            elif record == "event":
                sid = line["session"]
                if sid not in session_owner:
                    raise _bad(f"line {number}: event of a session outside the export")
                if sid not in created:
                    continue
                pending.append(
                    Event(
                        session_id=sid,
                        seq=line["seq"],
                        run_id=line["run"],
                        type=line["type"],
                        data=_raw_payload(raw, line["payload"]),
                        created_at=parse_datetime(line["created_at"]),
                    )
                )
                counts[sid] += 1
                if len(pending) >= batch_size:
                    Event.objects.using(using).bulk_create(pending)
                    pending.clear()
            else:
                raise _bad(f"line {number}: unknown record {record!r}")
        if pending:
            Event.objects.using(using).bulk_create(pending)
        for run_id, parent_id in parents:
            Run.objects.using(using).filter(pk=run_id).update(parent_id=parent_id)
        for meta in metas:
            if meta["id"] in created:
                Session.objects.using(using).filter(pk=meta["id"]).update(
                    persisted_events=counts[meta["id"]],
                    created_at=parse_datetime(meta["created_at"]),
                )
        return Session.objects.using(using).get(pk=header["session"]["id"])
