"""REST: operator requests to release idle Applications (``/api/v1/reclamations/``, staff
only); the worker answers them."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import (
    extend_schema,
)
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.permissions import IsAdminUser
from rest_framework.request import Request
from rest_framework.response import Response

from agents import services
from agents.models import ReclamationRequest
from sageproject.api import StrictFieldsMixin


class ReclamationCreateSerializer(StrictFieldsMixin, serializers.Serializer):
    scope = serializers.ChoiceField(
        choices=ReclamationRequest.Scope.choices, default=ReclamationRequest.Scope.IDLE
    )
    refs = serializers.ListField(
        child=serializers.CharField(max_length=64),
        required=False,
        default=list,
        max_length=100,
        help_text="The package refs to release; required (not empty) when scope is selected.",
    )
    min_idle_seconds = serializers.IntegerField(min_value=0, max_value=86_400, default=300)
    limit = serializers.IntegerField(min_value=1, max_value=1000, default=1)

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if attrs["scope"] == ReclamationRequest.Scope.SELECTED and not attrs["refs"]:
            raise serializers.ValidationError({"refs": ["list the package refs to release"]})
        return attrs


class ReclamationSerializer(serializers.ModelSerializer):
    requested_by = serializers.CharField(source="requested_by.username", default=None)

    class Meta:
        model = ReclamationRequest
        fields = [
            "id",
            "scope",
            "refs",
            "min_idle_seconds",
            "limit",
            "status",
            "outcome",
            "requested_by",
            "created_at",
            "finished_at",
        ]


class ReclamationViewSet(
    mixins.CreateModelMixin,
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    viewsets.GenericViewSet,
):
    """Staff: ask the worker to release idle, safe Applications; it answers each request
    with ``done`` (released N) or ``refused`` (and why) within a few seconds."""

    serializer_class = ReclamationSerializer
    permission_classes = [IsAdminUser]
    queryset = ReclamationRequest.objects.select_related("requested_by").all()

    @extend_schema(request=ReclamationCreateSerializer, responses={202: ReclamationSerializer})
    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        data = ReclamationCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        row = services.reclamation_create(user=request.user, **data.validated_data)
        return Response(ReclamationSerializer(row).data, status=status.HTTP_202_ACCEPTED)
