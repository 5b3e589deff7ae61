"""REST: archived results (``/api/v1/archives/``), read from the database with no worker
involved."""

from __future__ import annotations

import uuid

from rest_framework import mixins, serializers, viewsets
from rest_framework.request import Request
from rest_framework.response import Response

from agents import archives
from agents.api.permissions import READ_PERMISSIONS
from agents.models import ManagedAgentRecord
from sageproject.errors import NotFoundError


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


class ArchiveViewSet(mixins.ListModelMixin, viewsets.GenericViewSet):
    """Terminal results, served from the database with no worker involved."""

    serializer_class = ArchiveSerializer
    lookup_field = "run_id"
    permission_classes = READ_PERMISSIONS  # retrieve: archive_read checks it after ownership

    def get_queryset(self):
        return ManagedAgentRecord.objects.visible_to(self.request.user)

    def retrieve(self, request: Request, run_id: str | None = None) -> Response:
        """404 ``archive.not_found`` for a run id that is malformed, another user's or not
        archived; 403 ``run.read_forbidden`` when the caller's read permission is revoked.
        Anything else is a server error, not a missing archive."""
        try:
            key = uuid.UUID(str(run_id))
        except ValueError:
            raise NotFoundError("archive.not_found", "no archived result for that run") from None
        record = archives.archive_read(user=request.user, run_id=key)
        return Response(ArchiveSerializer(record).data)
