"""A thread's state: the user's threads (their own sessions), the state built from their
durable events (`agents.protocols.messages.Thread`), its checkpoints and history."""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping
from typing import Any

from django.db.models import Exists, OuterRef, Subquery
from rest_framework.request import Request
from rest_framework.response import Response

from agents.protocols import common
from agents.protocols.langgraph.assistants import assistant_uuid
from agents.protocols.langgraph.base import MAX_LIMIT, LangGraphView, int_param, json_body
from agents.protocols.messages import (
    ENDINGS,
    INTERACTION,
    MESSAGE,
    RESOLVED,
    TOOL_RESULTS,
    TOOL_STARTED,
    Thread,
    checkpoint_seq,
)
from sageproject.errors import NotFoundError
from scheduling.models import Event, Run, RunStatus, Session

# The events a thread's state is built from.
STATE_EVENTS = (MESSAGE, *TOOL_RESULTS, TOOL_STARTED, INTERACTION, RESOLVED, *ENDINGS)


def user_threads(user):
    """The user's own sessions (staff too: threads are personal), with what their status
    is computed from."""
    of_session = Run.objects.filter(session=OuterRef("pk"))
    return Session.objects.filter(owner=user).annotate(
        lg_busy=Exists(of_session.filter(status__in=[RunStatus.QUEUED, RunStatus.RUNNING])),
        lg_waiting=Exists(of_session.filter(status=RunStatus.SUSPENDED)),
        lg_last=Subquery(of_session.order_by("-created_at").values("status")[:1]),
    )


def own_thread(user, thread_id: Any) -> Session:
    """The user's thread; ``thread.not_found`` (404) for any other, another user's too."""
    session = user_threads(user).filter(pk=thread_id).first()
    if session is None:
        raise NotFoundError("thread.not_found", f"thread {thread_id} not found")
    return session


def bound_graph(session: Session) -> str | None:
    """The ``graph_id`` the thread runs, or None while it is bound to nothing."""
    if not session.package_ref:
        return None
    return f"{session.package_name}{common.SEPARATOR}{session.agent_id}"


def state_events(session_ids: Iterable[Any], upto: int | None = None):
    """The events the sessions' states are built from, in order (up to seq ``upto``)."""
    query = Event.objects.filter(session_id__in=list(session_ids), type__in=STATE_EVENTS)
    if upto is not None:
        query = query.filter(seq__lte=upto)
    return query.order_by("session_id", "seq")


def run_key(run_id: Any) -> str | None:
    """An event's run as `Thread` keys it (None: imported history)."""
    return str(run_id) if run_id is not None else None


def build_thread(session: Session, upto: int | None = None) -> Thread:
    """The thread's state from its durable events (up to seq ``upto``)."""
    graph = bound_graph(session)
    meta = {"graph_id": graph, "assistant_id": assistant_uuid(graph)} if graph else {}
    thread = Thread(str(session.pk), meta=meta)
    for event in state_events([session.pk], upto):
        thread.apply(event.seq, event.type, run_key(event.run_id), event.payload, event.created_at)
    if upto is not None:
        thread.last_seq = upto
    return thread


def persisted(session: Session) -> int:
    """The session's durable prefix now: the seq its next events follow."""
    return Session.objects.filter(pk=session.pk).values_list("persisted_events", flat=True)[0]


class ThreadState(LangGraphView):
    def get(self, request: Request, thread_id: uuid.UUID, checkpoint: str = "") -> Response:
        thread = build_thread(own_thread(request.user, thread_id))
        if not checkpoint:
            return Response(thread.state())
        return Response(_state_at(thread, checkpoint))

    def post(self, request: Request, thread_id: uuid.UUID) -> Response:
        thread = build_thread(own_thread(request.user, thread_id))
        return Response(_state_at(thread, json_body(request).get("checkpoint")))


def _state_at(thread: Thread, checkpoint: Any) -> dict[str, Any]:
    seq = checkpoint_seq(checkpoint)
    index = thread.index_of(seq) if seq is not None else None
    if index is None:
        raise NotFoundError("checkpoint.not_found", "no such checkpoint in this thread")
    return thread.state(index)


class ThreadHistory(LangGraphView):
    def get(self, request: Request, thread_id: uuid.UUID) -> Response:
        return self._history(request, thread_id, dict(request.query_params.items()))

    def post(self, request: Request, thread_id: uuid.UUID) -> Response:
        return self._history(request, thread_id, json_body(request))

    def _history(self, request: Request, thread_id: Any, body: Mapping[str, Any]) -> Response:
        thread = build_thread(own_thread(request.user, thread_id))
        limit = int_param(body, "limit", 10, 1, MAX_LIMIT)
        before = None
        if body.get("before"):
            before = checkpoint_seq(body["before"])
            if before is None:
                raise common.invalid("before", "must be a checkpoint of this thread")
        metadata = body.get("metadata") or None
        if metadata is not None and not isinstance(metadata, dict):
            raise common.invalid("metadata", "must be an object")
        return Response(thread.history(limit=limit, before=before, metadata=metadata))
