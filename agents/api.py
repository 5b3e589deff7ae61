"""REST: packages, sessions, events, runs, archives and capacity (DESIGN §7).

Views are thin: input serializer → service → output serializer. Every queryset is
scoped to its owner, so another user's object answers 404.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson
from asgiref.sync import sync_to_async
from django.http import StreamingHttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.permissions import BasePermission, IsAdminUser, IsAuthenticated
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.reverse import reverse
from rest_framework.views import APIView

from agents import services
from agents.models import ManagedAgentRecord
from sageproject.api import ErrorEnvelopeSerializer, StrictFieldsMixin
from sageproject.errors import NotFoundError, SageError
from sageproject.parsers import int_schema, query_choice, query_int, query_uuid
from scheduling import live
from scheduling.models import (
    Event,
    Multitask,
    Run,
    RunStatus,
    Session,
    SessionKind,
    WorkerSnapshot,
)
from scheduling.serialization import event_json, export_session_lines

EVENTS_DEFAULT_LIMIT = 100
EVENTS_MAX_LIMIT = 200
STREAM_DEFAULT_SECONDS = 30
STREAM_MAX_SECONDS = 300
STREAM_POLL_SECONDS = 0.25
STREAM_KEEPALIVE_SECONDS = 15
# The largest event seq (a PositiveIntegerField): the bound of ``after``.
MAX_SEQ = 2_147_483_647


# --- serializers ---------------------------------------------------------------------


class SessionCreateSerializer(StrictFieldsMixin, serializers.Serializer):
    package = serializers.CharField(max_length=100, help_text="Package name or ref.")
    agent = serializers.CharField(max_length=100)
    kind = serializers.ChoiceField(choices=SessionKind.choices, default=SessionKind.MASTER)
    title = serializers.CharField(max_length=200, required=False, default="", allow_blank=True)


class SessionSerializer(serializers.ModelSerializer):
    package = serializers.CharField(source="package_ref")
    agent = serializers.CharField(source="agent_id")
    events = serializers.IntegerField(source="persisted_events")

    class Meta:
        model = Session
        fields = [
            "id",
            "package",
            "package_name",
            "agent",
            "kind",
            "title",
            "events",
            "fork_of",
            "fork_seq",
            "created_at",
            "updated_at",
        ]


class EventSerializer(serializers.Serializer):
    seq = serializers.IntegerField()
    type = serializers.CharField()
    run = serializers.UUIDField(source="run_id", allow_null=True)
    payload = serializers.JSONField()
    created_at = serializers.DateTimeField()


class EventPageSerializer(serializers.Serializer):
    results = EventSerializer(many=True)
    next = serializers.URLField(allow_null=True, help_text="The next page; null at the end.")


class StreamEventSerializer(serializers.Serializer):
    """One Server-Sent Event of ``GET /sessions/{id}/stream/``, modelled as the OpenAPI
    Media Type Registry models a ``text/event-stream`` event (the fields of the SSE
    format; OpenAPI 3.2 calls this schema ``itemSchema``, before 3.2 tools read ``schema``
    as it). The body itself is the event stream, UTF-8 text: ``retry: 1000`` first, then
    events, and comment lines (``: keep-alive``, ``: dropped N deltas``)."""

    event = serializers.CharField(
        help_text="The event type: a durable event's type, or message.delta / tool_call.delta."
    )
    data = serializers.CharField(
        help_text="One JSON object: a durable event as GET .../events/ gives it, or a delta "
        "({type, run, payload})."
    )
    id = serializers.RegexField(
        r"\A[0-9]+\Z",
        required=False,
        help_text="The durable event's seq (resume with Last-Event-ID); deltas have none.",
    )
    retry = serializers.IntegerField(
        required=False, help_text="Reconnection delay in milliseconds (1000)."
    )


class RunSubmitSerializer(StrictFieldsMixin, serializers.Serializer):
    session = serializers.UUIDField()
    input = serializers.CharField(max_length=100_000, allow_blank=False, trim_whitespace=False)
    priority = serializers.IntegerField(default=0, min_value=-100, max_value=100)
    multitask = serializers.ChoiceField(
        choices=Multitask.choices,
        default=Multitask.ENQUEUE,
        help_text=(
            "When the session already has an unfinished run: enqueue (wait in order), "
            "reject (409 session.busy), interrupt (stop it at its next step, then run) or "
            "rollback (as interrupt, and remove the interrupted run's events)."
        ),
    )


class RunReplySerializer(StrictFieldsMixin, serializers.Serializer):
    decision = serializers.CharField(
        max_length=50, help_text="One of the interaction's allowed_decisions, e.g. retry or cancel."
    )
    interaction = serializers.CharField(
        max_length=64, required=False, help_text="The interaction id being answered."
    )


class RunSerializer(serializers.ModelSerializer):
    session = serializers.UUIDField(source="session_id")

    class Meta:
        model = Run
        fields = [
            "id",
            "session",
            "status",
            "queue",
            "priority",
            "input",
            "result",
            "error",
            "interaction",
            "attempts",
            "crashes",
            "cancel_requested",
            "parent",
            "created_at",
            "started_at",
            "finished_at",
        ]

    def to_representation(self, run: Run) -> dict[str, Any]:
        """What the fields above give (they stay the schema), built directly: a
        ModelSerializer builds its sixteen fields anew for every run it renders, a fifth of
        the CPU of a submission and most of a page of runs."""
        return {
            "id": str(run.pk),
            "session": str(run.session_id),
            "status": run.status,
            "queue": run.queue,
            "priority": run.priority,
            "input": run.input,
            "result": run.result,
            "error": run.error,
            "interaction": run.interaction,
            "attempts": run.attempts,
            "crashes": run.crashes,
            "cancel_requested": run.cancel_requested,
            "parent": str(run.parent_id) if run.parent_id is not None else None,
            "created_at": _TIMESTAMP.to_representation(run.created_at),
            "started_at": _TIMESTAMP.to_representation(run.started_at),
            "finished_at": _TIMESTAMP.to_representation(run.finished_at),
        }


# Renders a timestamp as every DateTimeField of the API does.
_TIMESTAMP = serializers.DateTimeField()


class ArchiveSerializer(serializers.ModelSerializer):
    run = serializers.UUIDField(source="run_id")

    class Meta:
        model = ManagedAgentRecord
        fields = [
            "run",
            "status",
            "result",
            "error",
            "flow_outputs",
            "package_ref",
            "package_name",
            "agent_id",
            "archived_at",
        ]


# --- views -----------------------------------------------------------------------------


class CanReadResults(BasePermission):
    """The caller's current permission to read runs and what they produced
    (``services.check_read_permission``: revoked → 403 ``run.read_forbidden``).

    Checked on lists before they are read, and on one object after the ownership-scoped
    lookup (``get_object``), so another user's object still answers 404. Every action on
    one session or run answers with its content (cancel and reply return the run), so
    every one of them is checked.
    """

    def has_permission(self, request: Request, view: Any) -> bool:
        if getattr(view, "action", None) == "list":
            services.check_read_permission(request.user)
        return True

    def has_object_permission(self, request: Request, view: Any, obj: Any) -> bool:
        services.check_read_permission(request.user)
        return True


READ_PERMISSIONS = [IsAuthenticated, CanReadResults]


class SessionViewSet(
    mixins.CreateModelMixin,
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    viewsets.GenericViewSet,
):
    """Conversations with one agent of a package."""

    serializer_class = SessionSerializer
    permission_classes = READ_PERMISSIONS

    def get_queryset(self):
        return services.scoped(Session.objects.all(), self.request.user)

    @extend_schema(
        request=SessionCreateSerializer,
        responses={
            201: SessionSerializer,
            400: OpenApiResponse(
                ErrorEnvelopeSerializer,
                description="A field that breaks its rule (request.invalid, details.fields "
                "names it), or an agent that is none of the package's agents or flows "
                "(session.agent_not_found).",
            ),
        },
    )
    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        data = SessionCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        session = services.session_create(owner=request.user, **data.validated_data)
        return Response(SessionSerializer(session).data, status=status.HTTP_201_CREATED)

    @extend_schema(
        parameters=[
            OpenApiParameter(
                "after", int_schema(0, MAX_SEQ), description="Only events with seq > after."
            ),
            OpenApiParameter(
                "limit",
                int_schema(1, EVENTS_MAX_LIMIT),
                description=f"1..{EVENTS_MAX_LIMIT}, default {EVENTS_DEFAULT_LIMIT}.",
            ),
        ],
        responses={200: EventPageSerializer},
    )
    @action(detail=True, methods=["get"])
    def events(self, request: Request, pk: str | None = None) -> Response:
        """Durable events in seq order, paged by ``after`` and ``limit``."""
        session = self.get_object()
        after = query_int(request, "after", 0, minimum=0, maximum=MAX_SEQ)
        limit = query_int(
            request, "limit", EVENTS_DEFAULT_LIMIT, minimum=1, maximum=EVENTS_MAX_LIMIT
        )
        rows = list(
            Event.objects.filter(session=session, seq__gt=after).order_by("seq")[: limit + 1]
        )
        more = len(rows) > limit
        rows = rows[:limit]
        next_url = None
        if more:
            base = reverse("session-events", args=[session.pk], request=request)
            next_url = f"{base}?after={rows[-1].seq}&limit={limit}"
        return Response({"results": EventSerializer(rows, many=True).data, "next": next_url})

    @extend_schema(responses={(200, "application/x-ndjson"): bytes})
    @action(detail=True, methods=["get"])
    def export(self, request: Request, pk: str | None = None) -> StreamingHttpResponse:
        """The complete history as JSON Lines (header, runs, events; fork bases included)."""
        session = self.get_object()
        response = StreamingHttpResponse(
            export_session_lines(session), content_type="application/x-ndjson"
        )
        response["Content-Disposition"] = f'attachment; filename="session-{session.pk}.jsonl"'
        return response

    @extend_schema(
        parameters=[
            OpenApiParameter(
                "after",
                int_schema(0, MAX_SEQ),
                description="Start after this seq (or send Last-Event-ID).",
            ),
            OpenApiParameter(
                "timeout",
                int_schema(1, STREAM_MAX_SECONDS),
                description=f"Seconds to keep the stream open, "
                f"1..{STREAM_MAX_SECONDS} (default {STREAM_DEFAULT_SECONDS}); "
                "reconnect with Last-Event-ID to continue.",
            ),
        ],
        responses={
            (200, "text/event-stream"): OpenApiResponse(
                StreamEventSerializer,
                description="Server-Sent Events (UTF-8 text); the schema is one event's.",
            )
        },
    )
    @action(detail=True, methods=["get"])
    def stream(self, request: Request, pk: str | None = None) -> StreamingHttpResponse:
        """Durable events as Server-Sent Events (``id`` = seq), resumable by Last-Event-ID;
        while a model streams, live ``message.delta`` and ``tool_call.delta`` events (no
        ``id``: never persisted)."""
        session = self.get_object()
        last = request.headers.get("Last-Event-ID")
        after = query_int(request, "after", 0, minimum=0, maximum=MAX_SEQ)
        if last and last.isascii() and last.isdigit() and len(last) <= 10:
            after = max(after, min(int(last), MAX_SEQ))
        timeout = query_int(
            request, "timeout", STREAM_DEFAULT_SECONDS, minimum=1, maximum=STREAM_MAX_SECONDS
        )
        response = StreamingHttpResponse(
            _event_stream(session.pk, after, timeout), content_type="text/event-stream"
        )
        response["Cache-Control"] = "no-cache"
        response["X-Accel-Buffering"] = "no"
        return response


EVENT_PAGE = 200


def _events_after(session_id: Any, after: int, limit: int = EVENT_PAGE) -> list[Event]:
    return list(Event.objects.filter(session_id=session_id, seq__gt=after).order_by("seq")[:limit])


async def _event_stream(session_id: Any, after: int, seconds: float) -> AsyncIterator[bytes]:
    """Durable events from the database (the source of truth for every process, ``id`` =
    seq) and, live, the workers' ``message.delta`` and ``tool_call.delta`` events (no
    ``id``: never persisted, so a reconnect with ``Last-Event-ID`` replays durable events
    and then joins the deltas).

    A ``committed`` notice from a worker makes the stream read new durable events at once;
    without one it polls every ``STREAM_POLL_SECONDS``. Deltas wait in a bounded queue per
    client: a client that does not read loses deltas (counted in ``: dropped N`` comments)
    and never slows a run.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    quiet_since = loop.time()
    subscription = await live.hub().subscribe(session_id)
    reported = 0
    try:
        yield b"retry: 1000\n\n"
        read = True
        while loop.time() < deadline:
            if read:
                rows = await sync_to_async(_events_after, thread_sensitive=False)(session_id, after)
                for row in rows:
                    body = event_json(
                        seq=row.seq,
                        type=row.type,
                        run_id=row.run_id,
                        created_at=row.created_at,
                        data=row.data,
                    )
                    yield b"id: %d\nevent: %s\ndata: %s\n\n" % (row.seq, row.type.encode(), body)
                    after = row.seq
                if rows:
                    quiet_since = loop.time()
                    if len(rows) >= EVENT_PAGE:
                        continue  # more are waiting
            if subscription.dropped > reported:
                reported = subscription.dropped
                yield b": dropped %d deltas\n\n" % reported
            if loop.time() - quiet_since > STREAM_KEEPALIVE_SECONDS:
                quiet_since = loop.time()
                yield b": keep-alive\n\n"
            message = await subscription.get(
                min(STREAM_POLL_SECONDS, max(deadline - loop.time(), 0.001))
            )
            read = message is None  # the poll interval passed: look at the database
            while message is not None:
                kind = message.get("type")
                if kind in live.DELTA_TEXT:
                    quiet_since = loop.time()
                    body = orjson.dumps(
                        {"type": kind, "run": message.get("run"), "payload": message.get("payload")}
                    )
                    yield b"event: %s\ndata: %s\n\n" % (kind.encode(), body)
                elif kind == "committed" and int(message.get("seq", 0)) > after:
                    read = True
                try:
                    message = subscription.queue.get_nowait()
                except asyncio.QueueEmpty:
                    message = None
    finally:
        await subscription.close()


class RunViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Runs: submit (202, or 429 when the host's queue is full), read, cancel."""

    serializer_class = RunSerializer
    permission_classes = READ_PERMISSIONS

    def get_queryset(self):
        query = services.scoped(Run.objects.all(), self.request.user)
        if self.action != "list":
            return query
        session = query_uuid(self.request, "session")
        if session is not None:
            query = query.filter(session_id=session)
        run_status = query_choice(self.request, "status", RunStatus.values)
        if run_status is not None:
            query = query.filter(status=run_status)
        return query

    @extend_schema(
        parameters=[
            OpenApiParameter("session", OpenApiTypes.UUID, description="Only this session's."),
            OpenApiParameter("status", str, enum=RunStatus.values, description="Only these."),
        ]
    )
    def list(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return super().list(request, *args, **kwargs)

    @extend_schema(
        request=RunSubmitSerializer,
        parameters=[
            OpenApiParameter(
                "Idempotency-Key",
                str,
                OpenApiParameter.HEADER,
                description="Repeat a submit safely: same key, same run.",
            )
        ],
        responses={
            200: OpenApiResponse(RunSerializer, description="A repeated Idempotency-Key."),
            202: RunSerializer,
            429: OpenApiResponse(ErrorEnvelopeSerializer, description="scheduler.queue_full"),
        },
    )
    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        data = RunSubmitSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        key = request.headers.get("Idempotency-Key") or None
        if key is not None and len(key) > 200:
            raise serializers.ValidationError({"Idempotency-Key": ["at most 200 characters"]})
        run, created = services.run_submit(
            owner=request.user,
            session_id=data.validated_data["session"],
            input=data.validated_data["input"],
            idempotency_key=key,
            priority=data.validated_data["priority"],
            multitask=data.validated_data["multitask"],
        )
        if not created:  # a repeated key answers an existing run, perhaps finished: a read
            services.check_read_permission(request.user)
        code = status.HTTP_202_ACCEPTED if created else status.HTTP_200_OK
        return Response(RunSerializer(run).data, status=code)

    @extend_schema(request=None, responses={202: RunSerializer})
    @action(detail=True, methods=["post"])
    def cancel(self, request: Request, pk: str | None = None) -> Response:
        """Cancel: queued and suspended runs end at once, running ones at their next step."""
        run = services.run_cancel(run=self.get_object())
        return Response(RunSerializer(run).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(
        request=RunReplySerializer,
        responses={
            202: RunSerializer,
            429: OpenApiResponse(ErrorEnvelopeSerializer, description="scheduler.queue_full"),
        },
    )
    @action(detail=True, methods=["post"])
    def reply(self, request: Request, pk: str | None = None) -> Response:
        """Answer a suspended run (decision ``retry`` resumes it, ``cancel`` ends it)."""
        data = RunReplySerializer(data=request.data)
        data.is_valid(raise_exception=True)
        run = services.run_reply(
            run=self.get_object(),
            decision=data.validated_data["decision"],
            interaction_id=data.validated_data.get("interaction"),
        )
        return Response(RunSerializer(run).data, status=status.HTTP_202_ACCEPTED)


class ArchiveViewSet(mixins.ListModelMixin, viewsets.GenericViewSet):
    """Terminal results, served from the database with no worker involved."""

    serializer_class = ArchiveSerializer
    lookup_field = "run_id"
    permission_classes = READ_PERMISSIONS  # retrieve: archive_read checks it after ownership

    def get_queryset(self):
        return services.scoped(ManagedAgentRecord.objects.all(), self.request.user)

    def retrieve(self, request: Request, run_id: str | None = None) -> Response:
        try:
            record = services.archive_read(user=request.user, run_id=run_id)
        except Exception as exc:
            if isinstance(exc, SageError):  # not found, or read permission revoked (403)
                raise
            raise NotFoundError("archive.not_found", "no archived result for that run") from None
        return Response(ArchiveSerializer(record).data)


class CapacityView(APIView):
    """The latest worker snapshots (staff only)."""

    permission_classes = [IsAdminUser]

    @extend_schema(responses={200: dict})
    def get(self, request: Request) -> Response:
        snapshots = WorkerSnapshot.objects.filter(stopped_at__isnull=True)[:20]
        return Response(
            {
                "workers": [
                    {
                        "worker_id": s.worker_id,
                        "host": s.host,
                        "pid": s.pid,
                        "started_at": s.started_at,
                        "heartbeat_at": s.heartbeat_at,
                        "capacity": s.capacity,
                    }
                    for s in snapshots
                ],
            }
        )
