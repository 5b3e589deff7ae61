"""Threads: a thread is one of the user's Sessions, whichever door made it. ``POST
threads`` makes one bound to nothing that its first run binds; its metadata is kept in
`agents.models.ThreadMetadata`, with ``graph_id``/``assistant_id`` added once bound.
Writes go through `agents.services` (``thread_create``, ``thread_metadata_update``,
``thread_delete``)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

from django.db.models import Q
from django.db.models.fields.json import KeyTransform
from rest_framework.request import Request
from rest_framework.response import Response

from agents import services
from agents.models import ThreadMetadata
from agents.protocols import common
from agents.protocols.langgraph.assistants import assistant_uuid, resolve
from agents.protocols.langgraph.base import MAX_LIMIT, LangGraphView, int_param, json_body
from agents.protocols.langgraph.state import (
    bound_graph,
    build_thread,
    own_thread,
    run_key,
    state_events,
    user_threads,
)
from agents.protocols.messages import Thread
from sageproject.errors import ConflictError, NotFoundError, ValidationError
from scheduling.models import RunStatus, Session


def _status_of(session: Session) -> str:
    if session.lg_busy:
        return "busy"
    if session.lg_waiting:
        return "interrupted"
    return "error" if session.lg_last == RunStatus.FAILED else "idle"


STATUS_Q = {
    "busy": Q(lg_busy=True),
    "interrupted": Q(lg_busy=False, lg_waiting=True),
    "error": Q(lg_busy=False, lg_waiting=False, lg_last=RunStatus.FAILED),
    "idle": Q(lg_busy=False, lg_waiting=False)
    & (Q(lg_last__isnull=True) | ~Q(lg_last=RunStatus.FAILED)),
}


def _thread_metadata(session: Session, stored: Mapping[str, Any] | None) -> dict[str, Any]:
    metadata = dict(stored or {})
    graph = bound_graph(session)
    if graph is not None:
        metadata.update(graph_id=graph, assistant_id=assistant_uuid(graph))
    return metadata


def thread_json(
    session: Session, thread: Thread, stored: Mapping[str, Any] | None
) -> dict[str, Any]:
    interrupts = {}
    if thread.pending is not None:
        interrupts[thread.task_id(thread.pending[1])] = thread.interrupts
    return {
        "thread_id": str(session.pk),
        "created_at": session.created_at.isoformat(),
        "updated_at": session.updated_at.isoformat(),
        "state_updated_at": session.updated_at.isoformat(),
        "metadata": _thread_metadata(session, stored),
        "status": _status_of(session),
        "config": {},
        "values": thread.values,
        "interrupts": interrupts,
        "error": None,
    }


def _stored(session_ids: Iterable[Any]) -> dict[Any, dict[str, Any]]:
    rows = ThreadMetadata.objects.filter(session_id__in=list(session_ids))
    return {row.session_id: row.metadata for row in rows}


def _search_threads(user, body: Mapping[str, Any]):
    threads = user_threads(user)
    metadata = body.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise common.invalid("metadata", "must be an object")
    for index, (key, value) in enumerate(metadata.items()):
        if key in ("graph_id", "assistant_id") and isinstance(value, str):
            literal = Q(**{f"thread_metadata__metadata__{key}": value})
            try:
                named = resolve(user, value)
            except (NotFoundError, ValidationError):
                threads = threads.filter(literal)
            else:
                threads = threads.filter(
                    Q(package_name=named.package.name, agent_id=named.agent) | literal
                )
        else:
            if not isinstance(value, str | int | float | bool):
                raise common.invalid(
                    f"metadata.{key}", "only text, number or boolean values filter"
                )
            name = f"lg_meta_{index}"
            threads = threads.alias(**{name: KeyTransform(key, "thread_metadata__metadata")})
            threads = threads.filter(**{name: value})
    if body.get("values"):
        raise common.invalid("values", "filtering threads by their values is not supported")
    if body.get("ids"):
        ids = body["ids"]
        if not isinstance(ids, list):
            raise common.invalid("ids", "must be a list of thread ids")
        valid = []
        for value in ids:
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                valid.append(uuid.UUID(str(value)))
        threads = threads.filter(pk__in=valid)
    status = body.get("status")
    if status:
        if status not in STATUS_Q:
            raise common.invalid("status", f"must be one of {', '.join(STATUS_Q)}")
        threads = threads.filter(STATUS_Q[status])
    return threads


def _order(threads, body: Mapping[str, Any]):
    field = {
        "thread_id": "pk",
        "created_at": "created_at",
        "updated_at": "updated_at",
        "state_updated_at": "updated_at",
    }.get(str(body.get("sort_by") or "updated_at"), "updated_at")
    descending = (body.get("sort_order") or "desc") != "asc"
    return threads.order_by(f"-{field}" if descending else field, "-pk")


def _select(item: dict[str, Any], select: Any) -> dict[str, Any]:
    if not select:
        return item
    if not isinstance(select, list):
        raise common.invalid("select", "must be a list of field names")
    return {k: v for k, v in item.items() if k in select}


def _named_assistant(user, metadata: Mapping[str, Any]) -> common.Assistant | None:
    """The assistant a new thread's metadata names (``assistant_id`` or ``graph_id``), if
    it is one of the user's: the thread is bound to it at once."""
    named = metadata.get("assistant_id") or metadata.get("graph_id")
    if not isinstance(named, str) or not named:
        return None
    with contextlib.suppress(NotFoundError, ValidationError):
        return resolve(user, named)
    return None


class Threads(LangGraphView):
    def post(self, request: Request) -> Response:
        body = json_body(request)
        if body.get("supersteps"):
            raise common.invalid(
                "supersteps", "creating a thread with state updates is not supported"
            )
        metadata = body.get("metadata") or {}
        if not isinstance(metadata, dict):
            raise common.invalid("metadata", "must be an object")
        thread_id = body.get("thread_id")
        if thread_id is not None:
            try:
                thread_id = uuid.UUID(str(thread_id))
            except ValueError:
                raise common.invalid("thread_id", "must be a UUID") from None
            existing = Session.objects.filter(pk=thread_id).first()
            if existing is not None:
                if existing.owner_id == request.user.pk and body.get("if_exists") == "do_nothing":
                    return self._answer(own_thread(request.user, thread_id))
                raise ConflictError("thread.exists", f"thread {thread_id} already exists")
        assistant = _named_assistant(request.user, metadata)
        session = services.thread_create(
            owner=request.user,
            thread_id=thread_id,
            package=assistant.package if assistant else None,
            agent=assistant.agent if assistant else "",
            metadata=metadata,
        )
        return self._answer(own_thread(request.user, session.pk))

    def _answer(self, session: Session) -> Response:
        return Response(
            thread_json(session, build_thread(session), _stored([session.pk]).get(session.pk))
        )


class ThreadSearch(LangGraphView):
    def post(self, request: Request) -> Response:
        body = json_body(request)
        offset = int_param(body, "offset", 0, 0, 10**9)
        limit = int_param(body, "limit", 10, 1, MAX_LIMIT)
        sessions = list(_order(_search_threads(request.user, body), body)[offset : offset + limit])
        ids = [s.pk for s in sessions]
        stored = _stored(ids)
        states: dict[Any, Thread] = {s.pk: Thread(str(s.pk)) for s in sessions}
        for event in state_events(ids):
            states[event.session_id].apply(
                event.seq, event.type, run_key(event.run_id), event.payload, event.created_at
            )
        return Response(
            [
                _select(thread_json(s, states[s.pk], stored.get(s.pk)), body.get("select"))
                for s in sessions
            ]
        )


class ThreadCount(LangGraphView):
    def post(self, request: Request) -> Response:
        return Response(_search_threads(request.user, json_body(request)).count())


class ThreadDetail(LangGraphView):
    def get(self, request: Request, thread_id: uuid.UUID) -> Response:
        session = own_thread(request.user, thread_id)
        stored = _stored([session.pk]).get(session.pk)
        return Response(thread_json(session, build_thread(session), stored))

    def patch(self, request: Request, thread_id: uuid.UUID) -> Response:
        session = own_thread(request.user, thread_id)
        metadata = json_body(request).get("metadata") or {}
        if not isinstance(metadata, dict):
            raise common.invalid("metadata", "must be an object")
        stored = services.thread_metadata_update(session=session, metadata=metadata)
        if request.headers.get("Prefer") == "return=minimal":
            return Response(status=204)
        session = own_thread(request.user, thread_id)
        return Response(thread_json(session, build_thread(session), stored))

    def delete(self, request: Request, thread_id: uuid.UUID) -> Response:
        """Cancel the thread's unfinished runs, then delete the session with its runs,
        events and archives; 409 ``session.busy`` while a running one is still stopping
        (its worker must not lose the row under it): delete again in a moment."""
        session = own_thread(request.user, thread_id)
        services.thread_delete(session=session)
        return Response(status=204)
