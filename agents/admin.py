from __future__ import annotations

from django.contrib import admin

from agents.models import (
    AgentPackage,
    ManagedAgentRecord,
    ReadinessReport,
    ReclamationRequest,
)


@admin.register(AgentPackage)
class AgentPackageAdmin(admin.ModelAdmin):
    list_display = ["name", "version", "owner", "active", "short_ref", "created_at"]
    list_filter = ["active", "name"]
    search_fields = ["name", "version", "ref", "owner__username"]
    readonly_fields = ["owner", "name", "version", "ref", "manifest", "files", "created_at"]

    def has_add_permission(self, request, obj=None) -> bool:
        return False  # packages are created from manifests (API or validate_package)

    @admin.display(description="ref")
    def short_ref(self, obj: AgentPackage) -> str:
        return obj.ref[:12]


@admin.register(ReadinessReport)
class ReadinessReportAdmin(admin.ModelAdmin):
    list_display = ["package", "valid", "ready", "strict", "checked_at"]
    list_filter = ["valid", "ready", "strict"]
    search_fields = ["package__name"]
    readonly_fields = ["package", "checked_at", "valid", "ready", "strict", "agents", "error"]

    def has_add_permission(self, request, obj=None) -> bool:
        return False


@admin.register(ManagedAgentRecord)
class ManagedAgentRecordAdmin(admin.ModelAdmin):
    list_display = ["run", "owner", "package_name", "agent_id", "status", "archived_at"]
    list_filter = ["status", "package_name"]
    search_fields = ["run__id", "owner__username", "package_name", "agent_id"]
    readonly_fields = [
        "run",
        "owner",
        "package_ref",
        "package_name",
        "agent_id",
        "status",
        "result",
        "error",
        "flow_outputs",
        "archived_at",
    ]

    def has_add_permission(self, request, obj=None) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False


@admin.register(ReclamationRequest)
class ReclamationRequestAdmin(admin.ModelAdmin):
    list_display = [
        "id",
        "scope",
        "min_idle_seconds",
        "limit",
        "status",
        "requested_by",
        "created_at",
        "finished_at",
    ]
    list_filter = ["status", "scope"]
    readonly_fields = ["status", "outcome", "requested_by", "created_at", "finished_at"]
