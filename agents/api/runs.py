"""REST: runs (``/api/v1/runs/``) — submit (202, or 429 when the queue is full), read,
list, cancel, reply. Another user's run answers 404."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import (
    OpenApiParameter,
    OpenApiResponse,
    extend_schema,
)
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from agents import services
from agents.api.permissions import READ_PERMISSIONS
from sageproject.api import ErrorEnvelopeSerializer, FieldsOnceMixin, StrictFieldsMixin
from sageproject.parsers import (
    parse_json,
    query_choice,
    query_uuid,
)
from scheduling.models import (
    Multitask,
    Run,
    RunStatus,
)
from scheduling.runs import Credential


class RunSubmitSerializer(FieldsOnceMixin, StrictFieldsMixin, serializers.Serializer):
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
    edits = serializers.DictField(
        child=serializers.JSONField(),
        required=False,
        help_text=(
            "With decision edit (an approval): the new arguments (a JSON object) of "
            "waiting calls, by call id; the other calls run as the model asked."
        ),
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


def submit_run(
    user: Any, body: Any, key: str | None, credential: Credential | None = None
) -> Response:
    """A submission: ``body`` validated (`RunSubmitSerializer`), the run admitted
    (``services.run_submit``; with ``credential``, a `Credential` the admission checks),
    the answer 202 with the run — 200 for a repeated ``Idempotency-Key``, which answers the
    run it made first. Raises what the API's exception handler turns into its envelope."""
    data = RunSubmitSerializer(data=body)
    data.is_valid(raise_exception=True)
    key = key or None
    if key is not None and len(key) > 200:
        raise serializers.ValidationError({"Idempotency-Key": ["at most 200 characters"]})
    run, created = services.run_submit(
        owner=user,
        session_id=data.validated_data["session"],
        input=data.validated_data["input"],
        idempotency_key=key,
        priority=data.validated_data["priority"],
        multitask=data.validated_data["multitask"],
        credential=credential,
    )
    if not created:  # a repeated key answers an existing run, perhaps finished: a read
        services.check_read_permission(user)
    code = status.HTTP_202_ACCEPTED if created else status.HTTP_200_OK
    return Response(RunSerializer(run).data, status=code)


def submit(request: HttpRequest, user: Any, credential: Credential) -> Response:
    """``POST /api/v1/runs/`` on the web process's express lane (`sagehost.express`):
    the body parsed as the API's JSON parser parses it (an empty one is no fields, as DRF
    reads it), then `submit_run` as the view does, the admission checking ``credential``."""
    body = parse_json(request.body) if request.body else {}
    return submit_run(user, body, request.headers.get("Idempotency-Key"), credential)


class RunViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Runs: submit (202, or 429 when the host's queue is full), read, cancel."""

    serializer_class = RunSerializer
    permission_classes = READ_PERMISSIONS

    def get_queryset(self):
        query = Run.objects.visible_to(self.request.user)
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
        return submit_run(request.user, request.data, request.headers.get("Idempotency-Key"))

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
        """Answer a suspended run (decision ``retry`` resumes it, ``cancel`` ends it; an
        approval's ``approve``, ``reject`` or ``edit`` with ``edits``)."""
        data = RunReplySerializer(data=request.data)
        data.is_valid(raise_exception=True)
        run = services.run_reply(
            run=self.get_object(),
            decision=data.validated_data["decision"],
            interaction_id=data.validated_data.get("interaction"),
            edits=data.validated_data.get("edits"),
        )
        return Response(RunSerializer(run).data, status=status.HTTP_202_ACCEPTED)
