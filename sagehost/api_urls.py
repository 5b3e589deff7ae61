from __future__ import annotations

from django.urls import path
from rest_framework.routers import DefaultRouter

from agents.api import archives, capacity, mcp, packages, reclamations, runs, sessions
from agents.jobs.api import RunJobsView
from pooling import api as pooling_api

router = DefaultRouter()
# No `.json` twins of every route: the API speaks JSON only, and the custom actions do not
# take the suffix's `format` argument (each such URL answered 500).
router.include_format_suffixes = False
router.register("model-records", pooling_api.ModelRecordViewSet, basename="modelrecord")
router.register("packages", packages.PackageViewSet, basename="package")
router.register("sessions", sessions.SessionViewSet, basename="session")
router.register("runs", runs.RunViewSet, basename="run")
router.register("archives", archives.ArchiveViewSet, basename="archive")
router.register("reclamations", reclamations.ReclamationViewSet, basename="reclamation")
router.register("mcp-connections", mcp.McpConnectionViewSet, basename="mcpconnection")

urlpatterns = [
    path("capacity", capacity.CapacityView.as_view(), name="capacity"),
    path("capacity/", capacity.CapacityView.as_view()),
    path("runs/<uuid:run_id>/jobs", RunJobsView.as_view(), name="run-jobs"),
    path("runs/<uuid:run_id>/jobs/", RunJobsView.as_view()),
    *router.urls,
]
