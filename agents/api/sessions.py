"""REST: sessions (``/api/v1/sessions/``), their durable events, JSON Lines export and the
Server-Sent Events stream (durable events plus live deltas).

Every lookup is scoped to the caller (``visible_to``), so another user's session answers
404."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import orjson
from django.http import StreamingHttpResponse
from drf_spectacular.utils import (
    OpenApiParameter,
    OpenApiResponse,
    extend_schema,
)
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.reverse import reverse

from agents import services
from agents.api.permissions import READ_PERMISSIONS
from sageproject.api import ErrorEnvelopeSerializer, StrictFieldsMixin
from sageproject.parsers import (
    int_schema,
    query_int,
)
from scheduling import live
from scheduling.models import (
    Event,
    Session,
    SessionKind,
)
from scheduling.serialization import event_json, export_session_lines

EVENTS_DEFAULT_LIMIT = 100
EVENTS_MAX_LIMIT = 200
STREAM_DEFAULT_SECONDS = 30
STREAM_MAX_SECONDS = 300
# The largest event seq (a PositiveIntegerField): the bound of ``after``.
MAX_SEQ = 2_147_483_647


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
        help_text="The event type: a durable event's type, or message.delta / tool_call.delta "
        "/ tool.progress."
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
        return Session.objects.visible_to(self.request.user)

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


async def _event_stream(session_id: Any, after: int, seconds: float) -> AsyncIterator[bytes]:
    """The session as Server-Sent Events (`scheduling.live.follow`): durable events with
    ``id`` = seq, live ``message.delta``, ``tool_call.delta`` and ``tool.progress`` (an MCP
    tool call's progress) events without one (never
    persisted, so a reconnect with ``Last-Event-ID`` replays durable events and then joins
    the deltas), ``: dropped N deltas`` when this client read too slowly, and keep-alives.
    The first line, ``retry: 1000``, is sent once the stream is subscribed to the live
    channel: a client that starts a run after reading it misses none of its deltas."""
    subscription = await live.hub().subscribe(session_id)
    try:
        yield b"retry: 1000\n\n"
    except BaseException:
        await subscription.close()  # the client left before the follower took it over
        raise
    follower = live.follow(session_id, after, seconds, subscription=subscription)
    async with contextlib.aclosing(follower) as items:
        async for item in items:
            if isinstance(item, live.Delta):
                body = orjson.dumps({"type": item.type, "run": item.run, "payload": item.payload})
                yield b"event: %s\ndata: %s\n\n" % (item.type.encode(), body)
            elif isinstance(item, live.Dropped):
                yield b": dropped %d deltas\n\n" % item.count
            elif isinstance(item, live.KeepAlive):
                yield b": keep-alive\n\n"
            else:
                body = event_json(
                    seq=item.seq,
                    type=item.type,
                    run_id=item.run_id,
                    created_at=item.created_at,
                    data=item.data,
                )
                yield b"id: %d\nevent: %s\ndata: %s\n\n" % (item.seq, item.type.encode(), body)
