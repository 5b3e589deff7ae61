"""The host's own pages: the home redirect, liveness (``/healthz``) and readiness
(``/readyz``). Every API view lives with its app; these belong to the host as a whole."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import redirect

from sagehost import health


def home(request: HttpRequest) -> HttpResponse:
    return redirect("/admin/")


def healthz(request: HttpRequest) -> HttpResponse:
    """Liveness: the process answers. No database, no authentication, no details."""
    return JsonResponse({"status": "ok"}, headers={"Cache-Control": "no-store"})


def readyz(request: HttpRequest) -> HttpResponse:
    """Readiness (`health.readiness`): 200 when the database answers, every
    migration is applied and a worker's heartbeat is fresh, else 503 naming what failed.
    No authentication: only check names, statuses and short summaries, never a host,
    a version or an error's text."""
    checks = health.readiness()
    failed = [c.name for c in checks if c.status == health.FAIL]
    body = {
        "status": "not_ready" if failed else "ready",
        "checks": [{"name": c.name, "status": c.status, "detail": c.summary} for c in checks],
        "failed": failed,
    }
    response = JsonResponse(
        body, status=503 if failed else 200, headers={"Cache-Control": "no-store"}
    )
    # Not ready is an answer, not a server error: without this Django logs every polled
    # 503 as an ERROR (django.request).
    response._has_been_logged = True
    return response
