"""The LangGraph server API under ``/lg/`` (a client is given ``http://HOST:PORT/lg``): the
subset the official SDK (``langgraph_sdk``) and agent-chat-ui use, as a thin layer over
the services every door calls (`agents.services`) — the same ownership (another user's
thread or run is 404), limits (429 ``scheduler.queue_full`` with ``Retry-After``),
idempotency (an ``Idempotency-Key`` header on a run) and read permission; no engine of its
own. Auth: ``X-Api-Key: <our API token>`` (or ``Authorization: Token <key>``). Errors keep
our envelope with the status codes the SDK expects (404, 409 ``session.busy`` for
``multitask_strategy="reject"``, 429).

**Mapping.** An *assistant* is an agent or flow of a package version the user may use
(`agents.protocols.common.assistants`): its ``graph_id`` is ``<package>/<agent>`` and its
``assistant_id`` a UUID derived from that; either, or ``<package>`` alone (the entrypoint),
names it. A *thread* is a Session of the user's own (every session, whichever door made
it). LangGraph threads have no assistant until their first run, so ``POST /threads``
creates a session bound to nothing (an empty package), which its first run binds to the
run's assistant (a thread keeps that assistant: another answers 409
``thread.assistant_conflict``); metadata given at creation or by ``PATCH`` is kept in
`agents.models.ThreadMetadata`, and ``graph_id``/``assistant_id`` are added once bound. A
*run* is a Run: its input is the text of the human messages of ``input.messages``
(content as text or ``{"type": "text"}`` parts). The thread's state, checkpoints, history
and a run's Server-Sent Events are built from durable events
(`agents.protocols.messages`). A suspended run's interaction is the thread's interrupt;
``command={"resume": ...}`` answers it through ``run_reply`` and the "new" run is that
run, resumed. ``multitask_strategy`` (default ``reject``, as LangGraph's) is the session's
multitask rule.

**Checkpoints.** A run given the thread's head checkpoint (agent-chat-ui sends it on every
submit) runs as usual; one given an earlier checkpoint replaces the turns after it — the
later runs (finished) are rolled back, their events removed, as ``rollback`` does — and,
without input, runs the turn's human message again (regenerate). Sessions are linear: the
replaced turns do not stay as a branch.

Left out: assistants' create / update / delete / versions (assistants are packages:
publish a package instead); ``threads.update_state`` / ``copy`` / ``prune``, thread
streams (``/threads/{id}/stream``); crons; the store; ``stream_mode`` ``custom``,
``debug``, ``tasks`` and ``checkpoints`` (accepted, nothing to send);
``interrupt_before`` / ``interrupt_after``, ``config``, ``context``, ``webhook``,
``after_seconds``, ``on_completion``, ``durability`` (accepted and ignored); a run's own
``metadata`` is not stored.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any
from urllib.parse import urlencode

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Exists, OuterRef, Q, Subquery
from django.db.models.fields.json import KeyTransform
from django.http import HttpResponse, JsonResponse, StreamingHttpResponse
from django.urls import path
from django.utils import timezone
from rest_framework.negotiation import DefaultContentNegotiation
from rest_framework.permissions import IsAuthenticated
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from agents import services
from agents.models import ThreadMetadata
from agents.protocols import common
from agents.protocols.messages import (
    ENDINGS,
    INTERACTION,
    MESSAGE,
    RESOLVED,
    TOOL_RESULTS,
    TOOL_STARTED,
    RunStream,
    Thread,
    checkpoint_seq,
    decision,
    parse_event_id,
)
from sageproject.authentication import TokenAuthentication
from sageproject.errors import ConflictError, NotFoundError, ValidationError
from scheduling import live, runs
from scheduling.models import (
    TERMINAL_STATUSES,
    UNFINISHED_STATUSES,
    Event,
    Multitask,
    Run,
    RunStatus,
    Session,
    SessionKind,
)

# Assistant ids are UUIDs of this namespace and the assistant's graph id.
NAMESPACE = uuid.UUID("8a1e6c2e-3f3b-5d2c-9a57-5a6e1b0f4c21")
# Run status → LangGraph's (a run waiting for its interaction reads "interrupted").
RUN_STATUS = {
    RunStatus.QUEUED: "pending",
    RunStatus.RUNNING: "running",
    RunStatus.SUSPENDED: "interrupted",
    RunStatus.COMPLETED: "success",
    RunStatus.FAILED: "error",
    RunStatus.CANCELLED: "interrupted",
    RunStatus.INTERRUPTED: "interrupted",
}
STATUS_FILTER = {
    "pending": [RunStatus.QUEUED],
    "running": [RunStatus.RUNNING],
    "success": [RunStatus.COMPLETED],
    "error": [RunStatus.FAILED],
    "interrupted": [RunStatus.SUSPENDED, RunStatus.CANCELLED, RunStatus.INTERRUPTED],
    "timeout": [],
}
# The stream modes LangGraph defines (the SDK's ``StreamMode``).
KNOWN_MODES = frozenset(
    {
        "values",
        "messages",
        "updates",
        "events",
        "tasks",
        "checkpoints",
        "debug",
        "custom",
        "messages-tuple",
        "tools",
        "lifecycle",
    }
)
# The events a thread's state is built from.
STATE_EVENTS = (MESSAGE, *TOOL_RESULTS, TOOL_STARTED, INTERACTION, RESOLVED, *ENDINGS)
MAX_LIMIT = 1000
# Response headers a browser page on another origin may read (the SDK reads these).
EXPOSED_HEADERS = "Content-Location, Location, Retry-After, X-Pagination-Next"
ALLOWED_HEADERS = (
    "x-api-key, authorization, content-type, last-event-id, cache-control, "
    "x-auth-scheme, idempotency-key"
)


# ------------------------------------------------------------------------ the door


class ApiKeyAuthentication(TokenAuthentication):
    """The LangGraph SDK's ``X-Api-Key`` header, carrying one of our API tokens."""

    def authenticate(self, request: Request) -> Any:
        key = request.headers.get("X-Api-Key")
        if not key:
            return None
        return self.authenticate_credentials(key)


def _allowed_origin(request: Any) -> str | None:
    """The ``Access-Control-Allow-Origin`` for the request's ``Origin`` (an origin
    ``SAGE_LANGGRAPH_CORS_ORIGINS`` lists, or ``*`` when it says so); None otherwise."""
    origin = request.headers.get("Origin")
    allowed = settings.SAGE.get("SAGE_LANGGRAPH_CORS_ORIGINS") or ()
    if not origin:
        return None
    if "*" in allowed:
        return "*"
    return origin if origin.rstrip("/") in allowed else None


class JSONAnswers(DefaultContentNegotiation):
    """Errors and JSON answers in JSON whatever ``Accept`` says (a stream request asks
    for ``text/event-stream``; its errors come as JSON, as LangGraph's do)."""

    def select_renderer(self, request: Request, renderers: list, format_suffix: Any = None):
        return renderers[0], renderers[0].media_type


class LangGraphView(APIView):
    """A ``/lg/`` endpoint: our token as ``X-Api-Key``, the read permission where the
    answer carries results, CORS for the origins the operator allows (preflights are
    answered before authentication: browsers send them without credentials). Not part of
    the REST API's OpenAPI schema."""

    authentication_classes = [ApiKeyAuthentication, TokenAuthentication]
    permission_classes = [IsAuthenticated]
    content_negotiation_class = JSONAnswers
    schema = None
    # Whether the answer carries what runs produced (``check_read_permission``).
    reads_results = True

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        super().initial(request, *args, **kwargs)
        if self.reads_results:
            services.check_read_permission(request.user)

    def dispatch(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        origin = _allowed_origin(request)
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
            response = HttpResponse(status=204)
            if origin is not None:
                response["Access-Control-Allow-Methods"] = "GET, POST, PATCH, DELETE, OPTIONS"
                asked = request.headers.get("Access-Control-Request-Headers")
                response["Access-Control-Allow-Headers"] = asked or ALLOWED_HEADERS
                response["Access-Control-Max-Age"] = "600"
        else:
            response = super().dispatch(request, *args, **kwargs)
        if origin is not None:
            response["Access-Control-Allow-Origin"] = origin
            response["Access-Control-Expose-Headers"] = EXPOSED_HEADERS
        response["Vary"] = "Origin"
        return response


def _body(request: Request) -> dict[str, Any]:
    data = request.data
    if not data:
        return {}
    if not isinstance(data, dict):
        raise common.invalid("body", "must be a JSON object")
    return data


def _int(body: Mapping[str, Any], name: str, default: int, lo: int, hi: int) -> int:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise common.invalid(name, f"must be an integer from {lo} to {hi}")
    return value


def _flag(value: Any) -> bool:
    return str(value).lower() in ("1", "true", "yes", "on")


# ------------------------------------------------------------------------ assistants


def graph_id(assistant: common.Assistant) -> str:
    return f"{assistant.package.name}{common.SEPARATOR}{assistant.agent}"


def assistant_uuid(graph: str) -> str:
    return str(uuid.uuid5(NAMESPACE, graph))


def _visible(user) -> list[common.Assistant]:
    """The user's assistants, each once (under ``<package>/<agent>``)."""
    return [a for a in common.assistants(user) if common.SEPARATOR in a.id]


def resolve(user, value: Any) -> common.Assistant:
    """The assistant an ``assistant_id`` names: its UUID, ``<package>/<agent>``,
    ``<package>`` (the entrypoint), or an agent id only one of the user's packages has."""
    if not isinstance(value, str) or not value:
        raise common.invalid("assistant_id", "is required")
    try:
        uuid.UUID(value)
    except ValueError:
        pass
    else:
        for assistant in _visible(user):
            if assistant_uuid(graph_id(assistant)) == value.lower():
                return assistant
        raise NotFoundError("assistant.not_found", f"no assistant {value!r}")
    try:
        found = common.assistant_resolve(user, value)
    except NotFoundError:
        named = [a for a in _visible(user) if a.agent == value]
        if len(named) != 1:
            raise
        found = named[0]
    return common.Assistant(graph_id(found), found.package, found.agent)


def assistant_json(assistant: common.Assistant) -> dict[str, Any]:
    package = assistant.package
    graph = graph_id(assistant)
    return {
        "assistant_id": assistant_uuid(graph),
        "graph_id": graph,
        "name": graph,
        "description": f"{'flow' if assistant.flow else 'agent'} {assistant.agent} of "
        f"{package.name} {package.version}",
        "config": {},
        "context": {},
        "metadata": {
            "package": package.name,
            "version": package.version,
            "ref": package.ref,
            "agent": assistant.agent,
            "kind": "flow" if assistant.flow else "agent",
        },
        "version": 1,
        "created_at": package.created_at.isoformat(),
        "updated_at": package.created_at.isoformat(),
    }


def _graph(assistant: common.Assistant) -> dict[str, Any]:
    """The assistant as a graph: an agent is ``model`` ⇄ ``tools``; a flow, its nodes."""
    manifest = assistant.package.manifest
    nodes = [{"id": "__start__", "type": "schema", "data": "__start__"}]
    edges: list[dict[str, Any]] = []
    if assistant.flow:
        flow = (manifest.get("flows") or {})[assistant.agent]
        for node_id, node in (flow.get("nodes") or {}).items():
            nodes.append({"id": node_id, "type": "runnable", "data": {"name": node_id, **node}})
            if node.get("type") == "end":
                edges.append({"source": node_id, "target": "__end__", "conditional": False})
        edges.append({"source": "__start__", "target": flow.get("start"), "conditional": False})
        for edge in flow.get("edges") or ():
            conditional = bool(edge.get("when"))
            edges.append({"source": edge["from"], "target": edge["to"], "conditional": conditional})
    else:
        agent = (manifest.get("agents") or {}).get(assistant.agent) or {}
        nodes.append({"id": "model", "type": "runnable", "data": {"name": "model"}})
        edges.append({"source": "__start__", "target": "model", "conditional": False})
        edges.append({"source": "model", "target": "__end__", "conditional": True})
        if agent.get("tools"):
            nodes.append({"id": "tools", "type": "runnable", "data": {"name": "tools"}})
            edges.append({"source": "model", "target": "tools", "conditional": True})
            edges.append({"source": "tools", "target": "model", "conditional": False})
    nodes.append({"id": "__end__", "type": "schema", "data": "__end__"})
    return {"nodes": nodes, "edges": edges}


MESSAGES_SCHEMA = {
    "type": "object",
    "properties": {
        "messages": {
            "type": "array",
            "items": {"type": "object"},
            "description": "LangChain messages (human / ai / tool).",
        }
    },
    "required": ["messages"],
}


def _schemas(assistant: common.Assistant) -> dict[str, Any]:
    return {
        "graph_id": graph_id(assistant),
        "input_schema": {**MESSAGES_SCHEMA, "title": "Input"},
        "output_schema": {**MESSAGES_SCHEMA, "title": "Output"},
        "state_schema": {**MESSAGES_SCHEMA, "title": "State"},
        "config_schema": {"type": "object", "properties": {}, "title": "Config"},
        "context_schema": None,
    }


def _search_assistants(user, body: Mapping[str, Any]) -> list[common.Assistant]:
    found = _visible(user)
    if body.get("graph_id"):
        found = [a for a in found if graph_id(a) == body["graph_id"]]
    if body.get("name"):
        found = [a for a in found if str(body["name"]).lower() in graph_id(a).lower()]
    metadata = body.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise common.invalid("metadata", "must be an object")
    if metadata:
        found = [
            a
            for a in found
            if all(assistant_json(a)["metadata"].get(k) == v for k, v in metadata.items())
        ]
    return found


class Info(LangGraphView):
    authentication_classes: list[Any] = []
    permission_classes: list[Any] = []
    reads_results = False

    def get(self, request: Request) -> Response:
        return Response(
            {
                "version": "sage-host",
                "flags": {"assistants": True, "crons": False, "langsmith": False},
                "host": {"kind": "sage-host", "project_id": None, "revision_id": None},
            }
        )


class Ok(Info):
    def get(self, request: Request) -> Response:
        return Response({"ok": True})


class AssistantSearch(LangGraphView):
    reads_results = False

    def post(self, request: Request) -> Response:
        body = _body(request)
        found = _search_assistants(request.user, body)
        offset = _int(body, "offset", 0, 0, 10**9)
        limit = _int(body, "limit", 10, 1, MAX_LIMIT)
        page = [assistant_json(a) for a in found[offset : offset + limit]]
        sort_by = body.get("sort_by")
        if sort_by in ("assistant_id", "graph_id", "name", "created_at", "updated_at"):
            page.sort(key=lambda a: a[sort_by], reverse=body.get("sort_order") == "desc")
        response = Response(page)
        if offset + limit < len(found):
            response["X-Pagination-Next"] = str(offset + limit)
        return response


class AssistantCount(LangGraphView):
    reads_results = False

    def post(self, request: Request) -> Response:
        return Response(len(_search_assistants(request.user, _body(request))))


class AssistantDetail(LangGraphView):
    reads_results = False

    def get(self, request: Request, assistant_id: str, part: str = "") -> Response:
        assistant = resolve(request.user, assistant_id)
        if part == "graph":
            return Response(_graph(assistant))
        if part == "schemas":
            return Response(_schemas(assistant))
        if part == "subgraphs":
            return Response({})
        return Response(assistant_json(assistant))


# ------------------------------------------------------------------------ threads


def _threads(user):
    """The user's own sessions (staff too: threads are personal), with what their status
    is computed from."""
    of_session = Run.objects.filter(session=OuterRef("pk"))
    return Session.objects.filter(owner=user).annotate(
        lg_busy=Exists(of_session.filter(status__in=[RunStatus.QUEUED, RunStatus.RUNNING])),
        lg_waiting=Exists(of_session.filter(status=RunStatus.SUSPENDED)),
        lg_last=Subquery(of_session.order_by("-created_at").values("status")[:1]),
    )


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


def _thread(user, thread_id: Any) -> Session:
    """The user's thread; ``thread.not_found`` (404) for any other, another user's too."""
    session = _threads(user).filter(pk=thread_id).first()
    if session is None:
        raise NotFoundError("thread.not_found", f"thread {thread_id} not found")
    return session


def _bound_graph(session: Session) -> str | None:
    if not session.package_ref:
        return None
    return f"{session.package_name}{common.SEPARATOR}{session.agent_id}"


def _thread_metadata(session: Session, stored: Mapping[str, Any] | None) -> dict[str, Any]:
    metadata = dict(stored or {})
    graph = _bound_graph(session)
    if graph is not None:
        metadata.update(graph_id=graph, assistant_id=assistant_uuid(graph))
    return metadata


def _state_events(session_ids: Iterable[Any], upto: int | None = None):
    query = Event.objects.filter(session_id__in=list(session_ids), type__in=STATE_EVENTS)
    if upto is not None:
        query = query.filter(seq__lte=upto)
    return query.order_by("session_id", "seq")


def _build(session: Session, upto: int | None = None) -> Thread:
    """The thread's state from its durable events (up to seq ``upto``)."""
    graph = _bound_graph(session)
    meta = {"graph_id": graph, "assistant_id": assistant_uuid(graph)} if graph else {}
    thread = Thread(str(session.pk), meta=meta)
    for event in _state_events([session.pk], upto):
        thread.apply(event.seq, event.type, _run_key(event.run_id), event.payload, event.created_at)
    if upto is not None:
        thread.last_seq = upto
    return thread


def _run_key(run_id: Any) -> str | None:
    return str(run_id) if run_id is not None else None


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


def _create_thread(
    user, *, thread_id: Any = None, metadata: Mapping[str, Any] | None = None
) -> Session:
    """A new session bound to nothing (its first run binds it), with its metadata — bound
    at once when the metadata names an assistant of the user's."""
    assistant = None
    named = (metadata or {}).get("assistant_id") or (metadata or {}).get("graph_id")
    if isinstance(named, str) and named:
        with contextlib.suppress(NotFoundError, ValidationError):
            assistant = resolve(user, named)
    with transaction.atomic():
        session = Session.objects.create(
            id=thread_id or uuid.uuid4(),
            owner=user,
            package_ref=assistant.package.ref if assistant else "",
            package_name=assistant.package.name if assistant else "",
            agent_id=assistant.agent if assistant else "",
            kind=SessionKind.MASTER,
        )
        if metadata:
            ThreadMetadata.objects.create(session=session, metadata=dict(metadata))
    return session


def _bind(session: Session, assistant: common.Assistant) -> Session:
    """Bind an unbound thread to ``assistant``; a thread bound to another is a conflict."""
    if not session.package_ref:
        Session.objects.filter(pk=session.pk, package_ref="").update(
            package_ref=assistant.package.ref,
            package_name=assistant.package.name,
            agent_id=assistant.agent,
        )
        session.refresh_from_db(fields=["package_ref", "package_name", "agent_id"])
    if (session.package_name, session.agent_id) != (assistant.package.name, assistant.agent):
        raise ConflictError(
            "thread.assistant_conflict",
            f"thread {session.pk} runs {_bound_graph(session)}, not {graph_id(assistant)}",
        )
    return session


def _search_threads(user, body: Mapping[str, Any]):
    threads = _threads(user)
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


class Threads(LangGraphView):
    def post(self, request: Request) -> Response:
        body = _body(request)
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
                    return self._answer(_thread(request.user, thread_id))
                raise ConflictError("thread.exists", f"thread {thread_id} already exists")
        try:
            session = _create_thread(request.user, thread_id=thread_id, metadata=metadata)
        except IntegrityError:
            raise ConflictError("thread.exists", f"thread {thread_id} already exists") from None
        return self._answer(_thread(request.user, session.pk))

    def _answer(self, session: Session) -> Response:
        return Response(
            thread_json(session, _build(session), _stored([session.pk]).get(session.pk))
        )


class ThreadSearch(LangGraphView):
    def post(self, request: Request) -> Response:
        body = _body(request)
        offset = _int(body, "offset", 0, 0, 10**9)
        limit = _int(body, "limit", 10, 1, MAX_LIMIT)
        sessions = list(_order(_search_threads(request.user, body), body)[offset : offset + limit])
        ids = [s.pk for s in sessions]
        stored = _stored(ids)
        states: dict[Any, Thread] = {s.pk: Thread(str(s.pk)) for s in sessions}
        for event in _state_events(ids):
            states[event.session_id].apply(
                event.seq, event.type, _run_key(event.run_id), event.payload, event.created_at
            )
        return Response(
            [
                _select(thread_json(s, states[s.pk], stored.get(s.pk)), body.get("select"))
                for s in sessions
            ]
        )


class ThreadCount(LangGraphView):
    def post(self, request: Request) -> Response:
        return Response(_search_threads(request.user, _body(request)).count())


class ThreadDetail(LangGraphView):
    def get(self, request: Request, thread_id: uuid.UUID) -> Response:
        session = _thread(request.user, thread_id)
        stored = _stored([session.pk]).get(session.pk)
        return Response(thread_json(session, _build(session), stored))

    def patch(self, request: Request, thread_id: uuid.UUID) -> Response:
        session = _thread(request.user, thread_id)
        metadata = _body(request).get("metadata") or {}
        if not isinstance(metadata, dict):
            raise common.invalid("metadata", "must be an object")
        with transaction.atomic():
            row, _ = ThreadMetadata.objects.select_for_update().get_or_create(session=session)
            row.metadata = {**row.metadata, **metadata}
            row.save(update_fields=["metadata"])
        Session.objects.filter(pk=session.pk).update(updated_at=timezone.now())
        if request.headers.get("Prefer") == "return=minimal":
            return Response(status=204)
        session = _thread(request.user, thread_id)
        return Response(thread_json(session, _build(session), row.metadata))

    def delete(self, request: Request, thread_id: uuid.UUID) -> Response:
        """Cancel the thread's unfinished runs, then delete the session with its runs,
        events and archives; 409 ``session.busy`` while a running one is still stopping
        (its worker must not lose the row under it): delete again in a moment."""
        session = _thread(request.user, thread_id)
        for run in Run.objects.filter(session=session, status__in=list(UNFINISHED_STATUSES)):
            services.run_cancel(run=run)
        with transaction.atomic():
            if Run.objects.filter(session=session, status=RunStatus.RUNNING).exists():
                raise ConflictError(
                    "session.busy", "the thread's run is stopping; delete the thread again soon"
                )
            session.delete()
        return Response(status=204)


class ThreadState(LangGraphView):
    def get(self, request: Request, thread_id: uuid.UUID, checkpoint: str = "") -> Response:
        thread = _build(_thread(request.user, thread_id))
        if not checkpoint:
            return Response(thread.state())
        return Response(_state_at(thread, checkpoint))

    def post(self, request: Request, thread_id: uuid.UUID) -> Response:
        thread = _build(_thread(request.user, thread_id))
        return Response(_state_at(thread, _body(request).get("checkpoint")))


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
        return self._history(request, thread_id, _body(request))

    def _history(self, request: Request, thread_id: Any, body: Mapping[str, Any]) -> Response:
        thread = _build(_thread(request.user, thread_id))
        limit = _int(body, "limit", 10, 1, MAX_LIMIT)
        before = None
        if body.get("before"):
            before = checkpoint_seq(body["before"])
            if before is None:
                raise common.invalid("before", "must be a checkpoint of this thread")
        metadata = body.get("metadata") or None
        if metadata is not None and not isinstance(metadata, dict):
            raise common.invalid("metadata", "must be an object")
        return Response(thread.history(limit=limit, before=before, metadata=metadata))


# ------------------------------------------------------------------------ runs


def run_json(run: Run, session: Session, multitask: str | None = None) -> dict[str, Any]:
    graph = _bound_graph(session)
    return {
        "run_id": str(run.pk),
        "thread_id": str(run.session_id),
        "assistant_id": assistant_uuid(graph) if graph else None,
        "created_at": run.created_at.isoformat(),
        "updated_at": run.updated_at.isoformat(),
        "status": RUN_STATUS[run.status],
        "metadata": {},
        "multitask_strategy": multitask,
        "kwargs": {"input": {"messages": [{"type": "human", "content": run.input}]}},
    }


def input_text(value: Any) -> str:
    """The run's input from LangGraph ``input``: the human messages of ``messages``
    (``{"role": "user" | "human"}`` or ``{"type": "human"}``, content text or text
    parts; a bare string is one), joined by blank lines."""
    if isinstance(value, dict):
        messages = value.get("messages")
    else:
        messages = value
    if isinstance(messages, str | dict):
        messages = [messages]
    if not isinstance(messages, list):
        raise common.invalid("input", 'must be {"messages": [...]} with a human message')
    texts = []
    for message in messages:
        if isinstance(message, str):
            texts.append(message)
            continue
        if not isinstance(message, dict):
            raise common.invalid("input", "every message must be an object or a string")
        kind = message.get("type") or message.get("role")
        if kind not in ("human", "user"):
            continue
        texts.append(common_text(message.get("content")))
    text = "\n\n".join(t for t in texts if t)
    if not text.strip():
        raise common.invalid("input", "needs a human message with text")
    return text


def common_text(content: Any) -> str:
    """A message's content as text: a string, or the text of its ``text`` parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(part.get("text", ""))
            for part in content
            if isinstance(part, dict) and part.get("type") in ("text", "input_text")
        )
    raise common.invalid("input", "message content must be text or a list of text parts")


def _modes(value: Any) -> list[str]:
    if value is None:
        return ["values"]
    modes = [value] if isinstance(value, str) else value
    if not isinstance(modes, list) or any(m not in KNOWN_MODES for m in modes):
        raise common.invalid(
            "stream_mode", f"every mode must be one of {', '.join(sorted(KNOWN_MODES))}"
        )
    return modes or ["values"]


def _regenerate(session: Session, checkpoint: Any, text: str | None) -> str | None:
    """Run from an earlier checkpoint: roll back the (finished) runs after it; returns the
    input to run — ``text``, or the human message of the turn being replaced."""
    seq = checkpoint_seq(checkpoint)
    if seq is None:
        raise common.invalid("checkpoint", "must be a checkpoint of this thread")
    thread = _build(session)
    if thread.index_of(seq) is None:
        raise NotFoundError("checkpoint.not_found", "no such checkpoint in this thread")
    if seq == thread.checkpoints[-1].seq:
        return text
    later = Event.objects.filter(session=session, seq__gt=seq)
    if later.filter(run__isnull=True).exists():
        raise ConflictError(
            "checkpoint.not_replaceable", "the turns after this checkpoint were imported"
        )
    replaced = list(dict.fromkeys(later.order_by("seq").values_list("run_id", flat=True)))
    if Run.objects.filter(pk__in=replaced, status__in=list(UNFINISHED_STATUSES)).exists():
        raise ConflictError("session.busy", "the thread has an unfinished run")
    if text is None:
        human = [
            m
            for m in thread.messages[: thread.checkpoints[thread.index_of(seq)].count]
            if m["type"] == "human"
        ]
        if not human:
            raise common.invalid("input", "needs a human message with text")
        text = str(human[-1]["content"])
    for run_id in replaced:
        runs.remove_run_events(session.pk, run_id)
    return text


def _persisted(session: Session) -> int:
    return Session.objects.filter(pk=session.pk).values_list("persisted_events", flat=True)[0]


def _resume(session: Session, command: Mapping[str, Any]) -> tuple[Run, int]:
    """Answer the thread's suspended run with ``command["resume"]``: (the run, the seq
    its new events follow)."""
    run = (
        Run.objects.filter(session=session, status=RunStatus.SUSPENDED)
        .order_by("-created_at")
        .first()
    )
    if run is None:
        raise ConflictError("run.not_suspended", "the thread has no interrupt to resume")
    interaction = run.interaction or {}
    choice = decision(command.get("resume"), interaction)
    if not isinstance(choice, str):
        allowed = interaction.get("allowed_decisions") or []
        raise common.invalid("command.resume", f"must choose one of {', '.join(allowed)}")
    after = _persisted(session)
    run = services.run_reply(run=run, decision=choice, interaction_id=interaction.get("id"))
    return run, after


def create_run(
    request: Request, thread_id: Any, body: Mapping[str, Any]
) -> tuple[Session, Run, int, str | None]:
    """Create (or, with ``command.resume``, resume) a run: (the session, the run, the seq
    its events follow, the multitask strategy used)."""
    user = request.user
    assistant = resolve(user, body.get("assistant_id"))
    if thread_id is None:
        session = _create_thread(user)
    else:
        session = Session.objects.filter(pk=thread_id, owner=user).first()
        if session is None:
            if body.get("if_not_exists") != "create":
                raise NotFoundError("thread.not_found", f"thread {thread_id} not found")
            try:
                session = _create_thread(user, thread_id=thread_id)
            except IntegrityError:
                raise NotFoundError("thread.not_found", f"thread {thread_id} not found") from None
    _bind(session, assistant)
    command = body.get("command")
    if command is not None:
        if not isinstance(command, dict) or "resume" not in command:
            raise common.invalid("command", "only a command with resume is supported")
        run, after = _resume(session, command)
        return session, run, after, None
    raw_input = body.get("input")
    text = input_text(raw_input) if raw_input is not None else None
    checkpoint = body.get("checkpoint") or (
        {"checkpoint_id": body["checkpoint_id"]} if body.get("checkpoint_id") else None
    )
    if checkpoint:
        text = _regenerate(session, checkpoint, text)
    if text is None:
        raise common.invalid("input", "needs a human message with text")
    multitask = body.get("multitask_strategy") or Multitask.REJECT
    if multitask not in Multitask.values:
        raise common.invalid("multitask_strategy", f"must be one of {', '.join(Multitask.values)}")
    key = common.idempotency_key(request)
    run, _ = services.run_submit(
        owner=user, session_id=session.pk, input=text, multitask=multitask, idempotency_key=key
    )
    return session, run, common.run_start(run), multitask


def _locations(response: HttpResponse, run: Run, tail: str) -> HttpResponse:
    """``Content-Location`` (the run) and ``Location`` (where the SDK reconnects: a stream
    keeps its modes there, as the SDK sends no parameters when it reconnects), relative to
    the API's root as a LangGraph server's are."""
    base = f"/threads/{run.session_id}/runs/{run.pk}"
    response["Content-Location"] = base
    response["Location"] = f"{base}/{tail}"
    return response


def _stream_location(modes: Iterable[str]) -> str:
    return "stream?" + urlencode([("stream_mode", mode) for mode in modes])


def _own_run(user, thread_id: Any, run_id: Any) -> tuple[Session, Run]:
    session = _thread(user, thread_id)
    run = Run.objects.filter(pk=run_id, session=session, owner=user).first()
    if run is None:
        raise NotFoundError("run.not_found", f"run {run_id} not found")
    return session, run


def _still_waiting(run_id: Any, interaction_id: Any) -> bool:
    return Run.objects.filter(
        pk=run_id, status=RunStatus.SUSPENDED, interaction__id=interaction_id
    ).exists()


def _cancel_run(run_id: Any) -> None:
    run = Run.objects.filter(pk=run_id).first()
    if run is not None:
        services.run_cancel(run=run)


def _finished(run: Run) -> bool:
    return run.status in TERMINAL_STATUSES or run.status == RunStatus.SUSPENDED


async def _sse(
    session_id: Any,
    stream: RunStream,
    *,
    seconds: float,
    cancel_on_disconnect: bool,
) -> AsyncIterator[bytes]:
    """A run's Server-Sent Events (`RunStream`) from `scheduling.live.follow`, for
    ``seconds`` at most (then the SDK reconnects with ``Last-Event-ID``); ends after its
    ``end`` or ``error``. A client that disconnects before cancels the run when it asked
    (``on_disconnect="cancel"``)."""
    still_waiting = sync_to_async(_still_waiting, thread_sensitive=False)
    run_id = stream.run
    done = False
    try:
        for part in stream.opening():
            yield part.encode()
        after = stream.thread.last_seq
        async with contextlib.aclosing(live.follow(session_id, after, seconds)) as items:
            async for item in items:
                if isinstance(item, live.Delta):
                    if item.run == run_id:
                        for part in stream.delta(item.type, item.payload):
                            yield part.encode()
                elif isinstance(item, live.Dropped):
                    stream.dropped()
                elif isinstance(item, live.KeepAlive):
                    yield b": keep-alive\n\n"
                else:
                    for part in stream.durable(item):
                        yield part.encode()
                    closing = stream.closing(item)
                    if closing is None:
                        continue
                    if item.type == INTERACTION and not await still_waiting(
                        run_id, item.payload.get("id")
                    ):
                        continue  # answered since: the run goes on
                    done = True
                    yield closing.encode()
                    return
    except asyncio.CancelledError:
        if cancel_on_disconnect and not done:
            cancel = sync_to_async(_cancel_run, thread_sensitive=False)
            await asyncio.shield(cancel(run_id))
        raise


def stream_response(
    session: Session,
    run: Run,
    after: int,
    modes: Iterable[str],
    *,
    last_event_id: str | None = None,
    live_start: bool = True,
    cancel_on_disconnect: bool = False,
) -> StreamingHttpResponse:
    """The run's event stream from seq ``after`` (or where ``last_event_id`` says)."""
    resume = parse_event_id(last_event_id)
    start = resume.seq if resume is not None else after
    thread = _build(session, upto=start)
    graph = _bound_graph(session)
    meta = {
        "thread_id": str(session.pk),
        "graph_id": graph,
        "assistant_id": assistant_uuid(graph) if graph else None,
    }
    stream = RunStream(thread, str(run.pk), modes, meta, resume=resume, live=live_start)
    seconds = settings.SAGE.get("SAGE_LANGGRAPH_STREAM_SECONDS") or 300
    response = StreamingHttpResponse(
        _sse(session.pk, stream, seconds=seconds, cancel_on_disconnect=cancel_on_disconnect),
        content_type="text/event-stream",
    )
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"
    return _locations(response, run, _stream_location(modes))


# How often a waiting answer reads its run's status when no event says it ended (a run
# rolled back leaves no terminal event: its events are removed).
WAIT_CHECK_SECONDS = 2.0


async def _until_finished(run: Run) -> None:
    """Wait (`scheduling.live.follow`) until ``run`` ends or waits for its interaction."""
    reload = sync_to_async(lambda: Run.objects.filter(pk=run.pk).first(), thread_sensitive=False)
    after = await sync_to_async(common.run_start, thread_sensitive=False)(run)
    while True:
        current = await reload()
        if current is None or _finished(current):
            return
        window = live.follow(run.session_id, after, WAIT_CHECK_SECONDS)
        async with contextlib.aclosing(window) as items:
            async for item in items:
                if isinstance(item, Event):
                    after = item.seq
                    ends = item.type in ENDINGS or item.type == INTERACTION
                    if ends and str(item.run_id) == str(run.pk):
                        break


def _final_values(session_id: Any, run_id: Any) -> dict[str, Any]:
    """What ``wait`` and ``join`` answer: the thread's values when the run ended (with
    ``__interrupt__`` while it waits for its interaction), ``__error__`` when it failed."""
    run = Run.objects.get(pk=run_id)
    session = Session.objects.get(pk=session_id)
    if run.status == RunStatus.FAILED:
        error = run.error or {}
        return {"__error__": {"error": error.get("code"), "message": error.get("message")}}
    thread = _build(session)
    values = thread.values
    if run.status == RunStatus.SUSPENDED and thread.interrupts:
        values = {**values, "__interrupt__": thread.interrupts}
    return values


def wait_response(run: Run, tail: str) -> HttpResponse:
    """An answer that waits for ``run`` on the event loop (`common.DeferredResponse`)."""

    async def compute() -> HttpResponse:
        await _until_finished(run)
        values = await sync_to_async(_final_values, thread_sensitive=False)(run.session_id, run.pk)
        return JsonResponse(values, safe=False)

    return _locations(common.DeferredResponse(compute), run, tail)


class RunCreate(LangGraphView):
    """``POST /threads/{id}/runs`` (a background run), and ``POST /runs`` (in a new thread)."""

    def post(self, request: Request, thread_id: uuid.UUID | None = None) -> Response:
        session, run, _, multitask = create_run(request, thread_id, _body(request))
        response = Response(run_json(run, session, multitask))
        return _locations(response, run, "join")


class ThreadRuns(RunCreate):
    def get(self, request: Request, thread_id: uuid.UUID) -> Response:
        session = _thread(request.user, thread_id)
        params = request.query_params
        limit = _int(params, "limit", 10, 1, MAX_LIMIT)
        offset = _int(params, "offset", 0, 0, 10**9)
        query = Run.objects.filter(session=session, owner=request.user).order_by("-created_at")
        status = params.get("status")
        if status:
            if status not in STATUS_FILTER:
                raise common.invalid("status", f"must be one of {', '.join(STATUS_FILTER)}")
            query = query.filter(status__in=STATUS_FILTER[status])
        return Response([run_json(r, session) for r in query[offset : offset + limit]])


class RunStreamView(LangGraphView):
    def post(self, request: Request, thread_id: uuid.UUID | None = None) -> Any:
        body = _body(request)
        modes = _modes(body.get("stream_mode"))
        session, run, after, _ = create_run(request, thread_id, body)
        return stream_response(
            session,
            run,
            after,
            modes,
            cancel_on_disconnect=body.get("on_disconnect") == "cancel",
        )


class RunWait(LangGraphView):
    def post(self, request: Request, thread_id: uuid.UUID | None = None) -> Any:
        _, run, _, _ = create_run(request, thread_id, _body(request))
        return wait_response(run, "join")


class RunDetail(LangGraphView):
    def get(self, request: Request, thread_id: uuid.UUID, run_id: uuid.UUID) -> Response:
        session, run = _own_run(request.user, thread_id, run_id)
        return Response(run_json(run, session))


class RunJoin(LangGraphView):
    def get(self, request: Request, thread_id: uuid.UUID, run_id: uuid.UUID) -> Any:
        _, run = _own_run(request.user, thread_id, run_id)
        return wait_response(run, "join")


class RunJoinStream(LangGraphView):
    def get(self, request: Request, thread_id: uuid.UUID, run_id: uuid.UUID) -> Any:
        session, run = _own_run(request.user, thread_id, run_id)
        modes = [m for m in request.query_params.getlist("stream_mode") if m]
        last = request.headers.get("Last-Event-ID")
        if last == "-1":
            # From the run's first event (agent-chat-ui's rejoin).
            after, last = common.run_start(run), None
        elif parse_event_id(last) is None:
            # Without a position: what happens from now on.
            after, last = _persisted(session), None
            if _finished(run) and after >= _last_seq(run):
                return _ended(run)
        else:
            after = 0
        return stream_response(
            session,
            run,
            after,
            _modes(modes or None),
            last_event_id=last,
            live_start=run.status == RunStatus.QUEUED,
            cancel_on_disconnect=_flag(request.query_params.get("cancel_on_disconnect")),
        )


def _last_seq(run: Run) -> int:
    last = (
        Event.objects.filter(session_id=run.session_id, run=run)
        .order_by("-seq")
        .values_list("seq", flat=True)
        .first()
    )
    return last or 0


def _ended(run: Run) -> StreamingHttpResponse:
    """The stream of a run that has nothing more to say: its ``end``."""

    async def parts() -> AsyncIterator[bytes]:
        seq = await sync_to_async(_last_seq, thread_sensitive=False)(run)
        yield f"id: {seq}-15\nevent: end\ndata: null\n\n".encode()

    response = StreamingHttpResponse(parts(), content_type="text/event-stream")
    return _locations(response, run, "stream")


class RunCancel(LangGraphView):
    def post(self, request: Request, thread_id: uuid.UUID, run_id: uuid.UUID) -> Any:
        _, run = _own_run(request.user, thread_id, run_id)
        action = request.query_params.get("action") or "interrupt"
        if action not in ("interrupt", "rollback"):
            raise common.invalid("action", "must be interrupt or rollback")
        run = services.run_cancel(run=run, rollback=action == "rollback")
        if not _flag(request.query_params.get("wait")):
            return Response(status=202)

        async def compute() -> HttpResponse:
            await _until_finished(run)
            return HttpResponse(status=204)

        return common.DeferredResponse(compute)


# ------------------------------------------------------------------------ URLs

THREAD = "threads/<uuid:thread_id>"
RUN = f"{THREAD}/runs/<uuid:run_id>"

urlpatterns = [
    path("info", Info.as_view()),
    path("ok", Ok.as_view()),
    path("assistants/search", AssistantSearch.as_view()),
    path("assistants/count", AssistantCount.as_view()),
    path("assistants/<path:assistant_id>/graph", AssistantDetail.as_view(), {"part": "graph"}),
    path("assistants/<path:assistant_id>/schemas", AssistantDetail.as_view(), {"part": "schemas"}),
    path(
        "assistants/<path:assistant_id>/subgraphs", AssistantDetail.as_view(), {"part": "subgraphs"}
    ),
    path("assistants/<path:assistant_id>", AssistantDetail.as_view()),
    path("threads", Threads.as_view()),
    path("threads/search", ThreadSearch.as_view()),
    path("threads/count", ThreadCount.as_view()),
    path(THREAD, ThreadDetail.as_view()),
    path(f"{THREAD}/state", ThreadState.as_view()),
    path(f"{THREAD}/state/checkpoint", ThreadState.as_view()),
    path(f"{THREAD}/state/<str:checkpoint>", ThreadState.as_view()),
    path(f"{THREAD}/history", ThreadHistory.as_view()),
    path(f"{THREAD}/runs", ThreadRuns.as_view()),
    path(f"{THREAD}/runs/stream", RunStreamView.as_view()),
    path(f"{THREAD}/runs/wait", RunWait.as_view()),
    path(RUN, RunDetail.as_view()),
    path(f"{RUN}/join", RunJoin.as_view()),
    path(f"{RUN}/stream", RunJoinStream.as_view()),
    path(f"{RUN}/cancel", RunCancel.as_view()),
    path("runs", RunCreate.as_view()),
    path("runs/stream", RunStreamView.as_view()),
    path("runs/wait", RunWait.as_view()),
]
