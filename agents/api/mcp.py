"""REST: the caller's connections to remote MCP servers (``/api/v1/mcp-connections/``).

Secrets are write-only: a bearer token or headers go in, and no answer ever carries them
(nor the header names). Only the caller's own live connections are listed; another
user's answers 404, staff included (operators revoke any in the admin).
"""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.request import Request
from rest_framework.response import Response

from agents.models import McpConnection
from agents.services import mcp as services
from pooling.api import URL_VALIDATOR
from sageproject.api import JSONObjectField, StrictFieldsMixin


class McpConnectionSaveSerializer(StrictFieldsMixin, serializers.Serializer):
    server_url = serializers.CharField(
        max_length=2000,
        trim_whitespace=False,
        # The schema states the syntax (its pattern); the service checks the rest.
        validators=[URL_VALIDATOR],
        help_text="The server's Streamable HTTP endpoint (http or https).",
    )
    bearer_token = serializers.CharField(
        write_only=True,
        required=False,
        max_length=services.MAX_SECRET_CHARS,
        trim_whitespace=False,
        style={"input_type": "password"},
        help_text="Sent as `Authorization: Bearer <token>`; give this or `headers`.",
    )
    headers = JSONObjectField(
        write_only=True,
        required=False,
        help_text="Header name → value sent with every request; give this or `bearer_token`.",
    )

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if ("bearer_token" in attrs) == ("headers" in attrs):
            raise serializers.ValidationError(
                {"bearer_token": ["give either bearer_token or headers"]}
            )
        return attrs


class McpConnectionSerializer(serializers.ModelSerializer):
    class Meta:
        model = McpConnection
        fields = ["id", "server_url", "kind", "created_at", "updated_at", "last_used_at"]


class McpConnectionViewSet(
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.DestroyModelMixin,
    viewsets.GenericViewSet,
):
    """Your connections to remote MCP servers: save one (a run waiting with
    `mcp.auth_required` then resumes on a `retry` reply), list them, revoke one."""

    serializer_class = McpConnectionSerializer

    def get_queryset(self):
        return services.mcp_connection_list(user=self.request.user)

    @extend_schema(request=McpConnectionSaveSerializer, responses={201: McpConnectionSerializer})
    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        """Save credentials for a server: the live connection to it is replaced."""
        data = McpConnectionSaveSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        row = services.mcp_connection_save(user=request.user, **data.validated_data)
        return Response(McpConnectionSerializer(row).data, status=status.HTTP_201_CREATED)

    def perform_destroy(self, instance: McpConnection) -> None:
        services.mcp_connection_revoke(user=self.request.user, connection_id=instance.pk)
