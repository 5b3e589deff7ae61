from __future__ import annotations

from django.contrib import admin, messages
from django.urls import reverse
from django.utils.html import format_html

from scheduling import runs
from scheduling.models import Event, Run, Session, WorkerSnapshot


class ReadOnlyAdmin(admin.ModelAdmin):
    def has_add_permission(self, request, obj=None) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False


class RunInline(admin.TabularInline):
    model = Run
    fields = ["id", "status", "attempts", "created_at", "finished_at"]
    readonly_fields = fields
    extra = 0
    show_change_link = True
    can_delete = False
    ordering = ["-created_at"]

    def has_add_permission(self, request, obj=None) -> bool:
        return False


@admin.register(Session)
class SessionAdmin(admin.ModelAdmin):
    list_display = [
        "id",
        "owner",
        "package_name",
        "agent_id",
        "kind",
        "persisted_events",
        "events_link",
        "created_at",
    ]
    list_filter = ["kind", "package_name"]
    search_fields = ["id", "owner__username", "package_name", "agent_id", "title"]
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
    inlines = [RunInline]
    date_hierarchy = "created_at"

    def has_add_permission(self, request, obj=None) -> bool:
        return False

    @admin.display(description="events")
    def events_link(self, obj: Session):
        url = reverse("admin:scheduling_event_changelist") + f"?session__id__exact={obj.pk}"
        return format_html('<a href="{}">view events</a>', url)


@admin.register(Event)
class EventAdmin(ReadOnlyAdmin):
    list_display = ["seq", "type", "session", "run", "created_at"]
    list_filter = ["type"]
    search_fields = ["session__id", "run__id", "type"]
    list_select_related = ["session", "run"]
    readonly_fields = ["session", "seq", "run", "type", "pretty_payload", "created_at"]
    fields = readonly_fields
    ordering = ["session", "seq"]

    @admin.display(description="payload")
    def pretty_payload(self, obj: Event):
        import json

        return format_html("<pre>{}</pre>", json.dumps(obj.payload, indent=2, ensure_ascii=False))


@admin.register(Run)
class RunAdmin(admin.ModelAdmin):
    list_display = [
        "id",
        "owner",
        "status",
        "queue",
        "priority",
        "attempts",
        "crashes",
        "lease_owner",
        "lease_token",
        "lease_expires_at",
        "created_at",
        "finished_at",
    ]
    list_filter = ["status", "queue", "cancel_requested", "ready"]
    search_fields = ["id", "owner__username", "session__id", "idempotency_key"]
    list_select_related = ["owner"]
    date_hierarchy = "created_at"
    readonly_fields = [f.name for f in Run._meta.fields]
    actions = ["cancel_runs"]

    def has_add_permission(self, request, obj=None) -> bool:
        return False

    @admin.action(description="Cancel selected runs")
    def cancel_runs(self, request, queryset) -> None:
        count = 0
        for run in queryset:
            if not run.is_terminal:
                runs.cancel(run.pk)
                count += 1
        self.message_user(request, f"Cancellation requested for {count} run(s).", messages.SUCCESS)


@admin.register(WorkerSnapshot)
class WorkerSnapshotAdmin(ReadOnlyAdmin):
    list_display = ["worker_id", "host", "pid", "started_at", "heartbeat_at", "stopped_at"]
    readonly_fields = [
        "worker_id",
        "host",
        "pid",
        "started_at",
        "heartbeat_at",
        "stopped_at",
        "capacity",
    ]
