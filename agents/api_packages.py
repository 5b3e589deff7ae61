"""REST: agent packages (create from a manifest, list, get)."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.request import Request
from rest_framework.response import Response

from agents import packages, services
from agents.models import AgentPackage
from sageproject.api import StrictFieldsMixin


class PackageCreateSerializer(StrictFieldsMixin, serializers.Serializer):
    manifest = serializers.JSONField(help_text="The package manifest (DESIGN §4).")
    activate = serializers.BooleanField(default=True)


class PackageSerializer(serializers.ModelSerializer):
    class Meta:
        model = AgentPackage
        fields = ["id", "name", "version", "ref", "active", "manifest", "files", "created_at"]


class PackageViewSet(
    mixins.CreateModelMixin,
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    viewsets.GenericViewSet,
):
    """Agent packages you own. A version is immutable; saving it again is a no-op."""

    serializer_class = PackageSerializer

    def get_queryset(self):
        return services.scoped(AgentPackage.objects.all(), self.request.user)

    @extend_schema(request=PackageCreateSerializer, responses={201: PackageSerializer})
    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        data = PackageCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        package, created = packages.package_create(
            owner=request.user,
            manifest=data.validated_data["manifest"],
            activate=data.validated_data["activate"],
        )
        body = {**PackageSerializer(package).data, "reused": not created}
        return Response(body, status=status.HTTP_201_CREATED if created else status.HTTP_200_OK)
