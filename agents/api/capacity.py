"""REST: ``/api/v1/capacity`` — the live workers' latest snapshots (staff only)."""

from __future__ import annotations

from drf_spectacular.utils import (
    extend_schema,
)
from rest_framework.permissions import IsAdminUser
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from scheduling.models import (
    WorkerSnapshot,
)


class CapacityView(APIView):
    """The latest worker snapshots (staff only)."""

    permission_classes = [IsAdminUser]

    @extend_schema(responses={200: dict})
    def get(self, request: Request) -> Response:
        return Response({"workers": [s.summary() for s in WorkerSnapshot.objects.live()]})
