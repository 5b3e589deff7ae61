"""The admin site: Django's, plus the capacity dashboard operators watch."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.contrib import admin
from django.contrib.auth import get_user_model
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import path
from django.utils import timezone

# A snapshot older than this means its worker stopped publishing (crashed or paused).
STALE_AFTER = timedelta(seconds=30)


def _rows(value: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """Flatten nested capacity JSON into (dotted name, scalar) rows for a table."""
    rows: list[tuple[str, Any]] = []
    if isinstance(value, dict):
        for key, item in value.items():
            if key in ("history", "resident"):
                continue  # drawn as a chart / its own table, not listed
            rows += _rows(item, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        for index, item in enumerate(value):
            rows += _rows(item, f"{prefix}[{index}]")
    else:
        rows.append((prefix, value))
    return rows


def _charts(value: Any, prefix: str = "") -> list[dict[str, Any]]:
    """Every ``history`` series ([t, created, in_use] samples) as SVG polyline points."""
    charts: list[dict[str, Any]] = []
    if isinstance(value, dict):
        history = value.get("history")
        if isinstance(history, list) and len(history) >= 2:
            charts.append(_chart(prefix, history))
        for key, item in value.items():
            if key != "history":
                charts += _charts(item, f"{prefix}.{key}" if prefix else str(key))
    return charts


def _chart(name: str, history: list[list[float]], width: int = 480, height: int = 120) -> dict:
    t0, t1 = history[0][0], history[-1][0]
    span = max(t1 - t0, 1e-9)
    top = max(max(s[1] for s in history), max(s[2] for s in history), 1)

    def points(index: int) -> str:
        return " ".join(
            f"{(s[0] - t0) / span * width:.1f},{height - s[index] / top * (height - 10):.1f}"
            for s in history
        )

    return {"name": name, "created": points(1), "in_use": points(2), "top": top,
            "minutes": round(span / 60, 1), "width": width, "height": height}


def _resident(capacity: Any) -> list[dict[str, Any]]:
    """The management service's resident Applications of a worker snapshot."""
    try:
        rows = capacity["executor"]["management"]["resident"]
    except (KeyError, TypeError):
        return []
    return [row for row in rows if isinstance(row, dict)] if isinstance(rows, list) else []


class SageAdminSite(admin.AdminSite):
    site_header = "Sage Host administration"
    site_title = "Sage Host"
    index_title = "Operations"

    def get_urls(self):
        return [
            path("capacity/", self.admin_view(self.capacity_view), name="capacity"),
            *super().get_urls(),
        ]

    def capacity_view(self, request: HttpRequest) -> HttpResponse:
        from scheduling.models import Run, RunStatus, WorkerSnapshot

        now = timezone.now()
        workers = []
        for snapshot in WorkerSnapshot.objects.live():
            workers.append({
                "snapshot": snapshot,
                "stale": now - snapshot.heartbeat_at > STALE_AFTER,
                "rows": _rows(snapshot.capacity),
                "charts": _charts(snapshot.capacity),
                "resident": _resident(snapshot.capacity),
            })
        # Snapshots carry owner ids; show operators the usernames.
        owner_ids = {app.get("owner") for w in workers for app in w["resident"]}
        names = dict(
            get_user_model().objects.filter(pk__in=[i for i in owner_ids if i is not None])
            .values_list("pk", "username")
        )
        for worker in workers:
            for app in worker["resident"]:
                app["owner_name"] = names.get(app.get("owner"), app.get("owner"))
        counts = {status: Run.objects.filter(status=status).count()
                  for status in (RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.SUSPENDED)}
        context = {**self.each_context(request), "title": "Capacity", "workers": workers,
                   "counts": counts}
        return TemplateResponse(request, "admin/capacity.html", context)
