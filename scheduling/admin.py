"""Admin for sessions, runs, events and worker snapshots.

A run's page shows its facts (status, times, attempts, crashes, the lease) and its events
as a timeline (``scheduling.timeline``); a session's page its runs and its whole
conversation. Lists show short monospace ids so they stay one line a row. Cancelling, from
the list or a run's page, goes through the Run state machine (``scheduling.runs.cancel``).
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.contrib import admin, messages
from django.db.models import Count, IntegerField, JSONField, OuterRef, QuerySet, Subquery
from django.db.models.functions import Coalesce
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.urls import path, reverse
from django.utils import timezone
from django.utils.html import format_html

from sageproject import admin_display as show
from scheduling import runs, timeline
from scheduling.models import Event, Run, RunStatus, Session, WorkerSnapshot

# Events drawn on one page; the rest are a click away in the event list.
TIMELINE_LIMIT = 500
# Runs listed on a session's page (newest first).
SESSION_RUNS_LIMIT = 200


class ReadOnlyAdmin(admin.ModelAdmin):
    def has_add_permission(self, request, obj=None) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False


def _events_url(**filters: Any) -> str:
    query = "&".join(f"{key}={value}" for key, value in filters.items())
    return reverse("admin:scheduling_event_changelist") + f"?{query}"


def _timeline(events: QuerySet[Event], *, newest: bool, runs_by_id=None) -> dict[str, Any]:
    """At most ``TIMELINE_LIMIT`` events as timeline entries: the first ones, or the
    newest ones when ``newest``."""
    total = events.count()
    if newest:
        rows = list(events.order_by("-seq")[:TIMELINE_LIMIT])[::-1]
    else:
        rows = list(events.order_by("seq")[:TIMELINE_LIMIT])
    return {
        "entries": timeline.entries(rows, runs=runs_by_id),
        "total": total,
        "shown": len(rows),
        "newest": newest,
    }


def _times(run: Run, now) -> list[tuple[str, str]]:
    """The run's times for its page: the date once, then clock times, with the waits."""
    day = timezone.localtime(run.created_at).date()

    def clock(moment) -> str:
        local = timezone.localtime(moment)
        return local.strftime("%H:%M:%S" if local.date() == day else "%Y-%m-%d %H:%M:%S")

    rows = [("created", timezone.localtime(run.created_at).strftime("%Y-%m-%d %H:%M:%S"))]
    if run.started_at:
        waited = show.duration(run.created_at, run.started_at)
        rows.append(("started", f"{clock(run.started_at)} (queued {waited})"))
    if run.finished_at:
        rows.append(("finished", clock(run.finished_at)))
        if run.started_at:
            rows.append(("took", show.duration(run.started_at, run.finished_at)))
    elif run.status == RunStatus.RUNNING and run.started_at:
        rows.append(("running for", show.duration(run.started_at, now)))
    elif run.status == RunStatus.SUSPENDED:
        rows.append(("suspended", f"since {clock(run.updated_at)}"))
    elif run.status == RunStatus.QUEUED:
        rows.append(("queued for", show.duration(run.available_at, now)))
    rows.append(("updated", clock(run.updated_at)))
    return rows


def _cancel(modeladmin: admin.ModelAdmin, request: HttpRequest, rows) -> int:
    """Cancel the unfinished runs of ``rows`` through the state machine; say how many."""
    count = 0
    for run in rows:
        if not run.is_terminal:
            runs.cancel(run.pk)
            count += 1
    modeladmin.message_user(
        request, f"Cancellation requested for {count} run(s).", messages.SUCCESS
    )
    return count


@admin.register(Session)
class SessionAdmin(admin.ModelAdmin):
    list_display = [
        "short_id",
        "title_or_first_input",
        "owner",
        "package_agent",
        "kind",
        "run_count",
        "events_link",
        "created",
    ]
    list_display_links = ["short_id"]
    list_filter = ["kind", "package_name"]
    search_fields = ["id", "owner__username", "package_name", "agent_id", "title"]
    list_select_related = ["owner"]
    readonly_fields = [
        "id",
        "owner",
        "package_ref",
        "package_name",
        "agent_id",
        "kind",
        "fork_of",
        "fork_seq",
        "persisted_events",
        "created_at",
        "updated_at",
    ]
    fields = [*readonly_fields[:3], "title", *readonly_fields[3:]]
    date_hierarchy = "created_at"
    change_form_template = "admin/scheduling/session/change_form.html"

    def has_add_permission(self, request, obj=None) -> bool:
        return False

    def get_queryset(self, request):
        # Per-row subqueries over the (session, created_at) index: only the page's rows pay.
        own = Run.objects.filter(session=OuterRef("pk")).order_by()
        return (
            super()
            .get_queryset(request)
            .annotate(
                run_total=Coalesce(
                    Subquery(
                        own.values("session").annotate(n=Count("pk")).values("n"),
                        output_field=IntegerField(),
                    ),
                    0,
                ),
                first_input=Subquery(
                    own.order_by("created_at").values("input")[:1], output_field=JSONField()
                ),
            )
        )

    short_id = show.id_column("pk", "session")

    @admin.display(description="title / first input")
    def title_or_first_input(self, obj: Session) -> str:
        if obj.title:
            return show.preview(obj.title, 48)
        return show.preview(obj.first_input, 48)

    @admin.display(description="package / agent", ordering="package_name")
    def package_agent(self, obj: Session) -> str:
        return f"{obj.package_name} / {obj.agent_id}"

    @admin.display(description="runs", ordering="run_total")
    def run_count(self, obj: Session) -> str:
        url = reverse("admin:scheduling_run_changelist") + f"?session__id__exact={obj.pk}"
        return format_html('<a href="{}">{}</a>', url, obj.run_total)

    @admin.display(description="events", ordering="persisted_events")
    def events_link(self, obj: Session) -> str:
        return format_html(
            '<a href="{}">{}</a>', _events_url(session__id__exact=obj.pk), obj.persisted_events
        )

    created = show.time_column("created_at")

    def change_view(self, request, object_id, form_url="", extra_context=None):
        session = self.get_object(request, object_id)
        extra: dict[str, Any] = dict(extra_context or {})
        if session is not None:
            session_runs = list(
                session.runs.order_by("-created_at").select_related("owner")[:SESSION_RUNS_LIMIT]
            )
            extra.update(
                session_runs=session_runs,
                run_total=session.runs.count(),
                timeline=_timeline(
                    session.events.all(),
                    newest=True,
                    runs_by_id={run.pk: run for run in session_runs},
                ),
                events_url=_events_url(session__id__exact=session.pk),
            )
        return super().change_view(request, object_id, form_url, extra_context=extra)


@admin.register(Event)
class EventAdmin(ReadOnlyAdmin):
    list_display = ["seq", "type_badge", "summary", "session_id_link", "run_id_link", "created"]
    list_display_links = ["seq"]
    list_filter = ["type"]
    search_fields = ["session__id", "run__id", "type"]
    readonly_fields = ["session", "seq", "run", "type", "pretty_payload", "created_at"]
    fields = readonly_fields
    date_hierarchy = "created_at"
    ordering = ["-created_at", "-id"]

    def get_ordering(self, request: HttpRequest) -> list[str]:
        # One session's or run's events in their order; across sessions, the newest first.
        if {"session__id__exact", "run__id__exact"} & set(request.GET):
            return ["session", "seq"]
        return super().get_ordering(request)

    @admin.display(description="type", ordering="type")
    def type_badge(self, obj: Event) -> str:
        tone = "error" if obj.type in ("run.failed", "tool.call.failed") else None
        return show.badge(obj.type, tone or ("info" if obj.type.startswith("tool.") else "muted"))

    @admin.display(description="what")
    def summary(self, obj: Event) -> str:
        payload = obj.payload
        error = payload.get("error") if isinstance(payload, dict) else None
        if isinstance(error, dict) or obj.type in ("run.suspended", "interaction.requested"):
            return show.error_code(error if isinstance(error, dict) else payload)
        return show.preview(timeline.one_line(obj.type, payload), 52)

    session_id_link = show.id_column("session_id", "session", "scheduling_session")
    run_id_link = show.id_column("run_id", "run", "scheduling_run")
    created = show.time_column("created_at")

    @admin.display(description="payload")
    def pretty_payload(self, obj: Event):
        import json

        return format_html("<pre>{}</pre>", json.dumps(obj.payload, indent=2, ensure_ascii=False))


@admin.register(Run)
class RunAdmin(admin.ModelAdmin):
    list_display = [
        "short_id",
        "status_badge",
        "owner",
        "package_agent",
        "session_link",
        "tries",
        "input_preview",
        "error_code",
        "created",
        "took",
    ]
    list_display_links = ["short_id"]
    list_filter = ["status", "queue", "cancel_requested", "ready", "session__package_name"]
    search_fields = ["id", "owner__username", "session__id", "idempotency_key"]
    list_select_related = ["owner", "session"]
    date_hierarchy = "created_at"
    readonly_fields = [f.name for f in Run._meta.fields]
    actions = ["cancel_runs"]
    change_form_template = "admin/scheduling/run/change_form.html"

    def has_add_permission(self, request, obj=None) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False  # read-only: runs change through the state machine (cancel, reply)

    short_id = show.id_column("pk", "run")
    status_badge = show.badge_column("status")

    @admin.display(description="package", ordering="session__package_name")
    def package_agent(self, obj: Run) -> str:
        return format_html(
            '<span title="agent {}">{}</span>', obj.session.agent_id, obj.session.package_name
        )

    session_link = show.id_column("session_id", "session", "scheduling_session")

    @admin.display(description="attempts", ordering="attempts")
    def tries(self, obj: Run) -> str:
        if obj.crashes:
            return format_html(
                '{} <span class="sage-warn-text">({} crash{})</span>',
                obj.attempts,
                obj.crashes,
                "" if obj.crashes == 1 else "es",
            )
        return str(obj.attempts)

    @admin.display(description="input")
    def input_preview(self, obj: Run) -> str:
        return show.preview(obj.input, 30)

    error_code = show.error_column("error")
    created = show.time_column("created_at")

    @admin.display(description="took")
    def took(self, obj: Run) -> str:
        return show.duration(obj.started_at, obj.finished_at)

    @admin.action(description="Cancel selected runs")
    def cancel_runs(self, request, queryset) -> None:
        _cancel(self, request, queryset)

    def get_urls(self):
        return [
            path(
                "<path:object_id>/cancel/",
                self.admin_site.admin_view(self.cancel_view),
                name="scheduling_run_cancel",
            ),
            *super().get_urls(),
        ]

    def cancel_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """The run page's "Cancel run" button (POST): the same as the list's action."""
        run = self.get_object(request, object_id)
        if run is None or not self.has_view_permission(request, run):
            raise Http404("no such run")
        if request.method == "POST":
            _cancel(self, request, [run])
        return HttpResponseRedirect(reverse("admin:scheduling_run_change", args=[run.pk]))

    def change_view(self, request, object_id, form_url="", extra_context=None):
        run = self.get_object(request, object_id)
        extra: dict[str, Any] = dict(extra_context or {})
        if run is not None:
            now = runs.db_now()  # leases are given on the database's clock
            extra.update(
                run=run,
                times=_times(run, now),
                lease_left=show.duration(now, run.lease_expires_at)
                if run.lease_expires_at and run.lease_expires_at > now
                else None,
                children=list(run.children.order_by("created_at")[:50]),
                input_value=timeline.value(run.input if run.input is not None else ""),
                result_text=run.result.get("text") if isinstance(run.result, dict) else None,
                result_summary=timeline.result_summary(run.result),
                result_value=timeline.value(run.result, collapse=isinstance(run.result, dict))
                if run.result is not None
                else None,
                error=timeline.error_view(run.error) if run.error else None,
                max_crashes=settings.SAGE["SAGE_MAX_RUN_ATTEMPTS"],
                show_offset=True,
                timeline=_timeline(Event.objects.filter(run=run), newest=False),
                events_url=_events_url(run__id__exact=run.pk),
            )
        return super().change_view(request, object_id, form_url, extra_context=extra)


@admin.register(WorkerSnapshot)
class WorkerSnapshotAdmin(ReadOnlyAdmin):
    list_display = ["worker_id", "host", "pid", "started", "heartbeat", "stopped"]
    list_filter = [("stopped_at", admin.EmptyFieldListFilter)]
    search_fields = ["worker_id", "host"]
    readonly_fields = [
        "worker_id",
        "host",
        "pid",
        "started_at",
        "heartbeat_at",
        "stopped_at",
        "capacity",
    ]

    started = show.time_column("started_at")
    heartbeat = show.time_column("heartbeat_at", "last heartbeat")
    stopped = show.time_column("stopped_at")
