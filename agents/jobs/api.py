"""REST: ``GET /api/v1/runs/{run_id}/jobs``, the background jobs of one run.

Reads ``JobRecord`` rows (kept by ``agents.jobs.records.JobEventRecorder``), so it answers from
any process, with or without a job runtime. Another user's run answers 404 like a missing
one; staff see every run.
"""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from agents import services
from agents.models import JobRecord
from sageproject.errors import NotFoundError
from scheduling.models import Run

# A run admits at most max_admitted_jobs at a time, but over its life it may start more:
# the listing is bounded, newest first.
MAX_JOBS_LISTED = 1000


class JobRecordSerializer(serializers.ModelSerializer):
    class Meta:
        model = JobRecord
        fields = [
            "job_id",
            "kind",
            "state",
            "output_bytes",
            "output_chunks",
            "output_truncated",
            "error",
            "created_at",
            "updated_at",
        ]


class RunJobsListSerializer(serializers.Serializer):
    results = JobRecordSerializer(many=True)


class RunJobsView(APIView):
    """The jobs a run started: state, output size and truncation, error."""

    @extend_schema(responses={200: RunJobsListSerializer})
    def get(self, request: Request, run_id: Any) -> Response:
        """200 ``{"results": [...]}`` oldest first; 404 ``run.not_found`` if not visible."""
        visible = Run.objects.visible_to(request.user).filter(pk=run_id)
        if not visible.exists():
            raise NotFoundError("run.not_found", "run not found")
        services.check_read_permission(request.user)  # after the lookup: others' are 404
        rows = JobRecord.objects.filter(run_id=run_id).order_by("-created_at")[:MAX_JOBS_LISTED]
        data = JobRecordSerializer(reversed(list(rows)), many=True).data
        return Response({"results": data})
