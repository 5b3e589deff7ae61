"""Admin for operators: packages (validate), readiness reports (what is missing, at a
glance), terminal archives (read-only) and release requests the worker answers.

Every action calls the same functions as the API and the management commands
(``agents.packages``, ``agents.reclamations``); nothing here holds domain logic.
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils.html import format_html, format_html_join

from agents.models import (
    AgentPackage,
    ManagedAgentRecord,
    McpConnection,
    McpOAuthClient,
    ReadinessReport,
    ReclamationRequest,
    Visibility,
)
from agents.services import packages
from agents.services.mcp import mcp_connection_revoke
from agents.services.reclamations import reclamation_create
from sageproject import admin_display as show
from sageproject.errors import SageError


def _validate(
    modeladmin: admin.ModelAdmin, request: HttpRequest, rows: list[AgentPackage], *, strict: bool
) -> None:
    """Validate each package (a report is stored either way) and say what was found."""
    for package in rows:
        try:
            body = packages.package_validate(
                owner=package.owner, package=package, readiness=True, strict=strict
            )
        except SageError as exc:
            modeladmin.message_user(
                request, f"{package}: {exc.code}: {exc.message}", level=messages.ERROR
            )
            continue
        readiness = body["readiness"] or {}
        if readiness.get("ready"):
            modeladmin.message_user(request, f"{package}: valid and ready", messages.SUCCESS)
        else:
            modeladmin.message_user(
                request,
                f"{package}: valid but not ready ({_missing_summary(readiness.get('agents', {}))})",
                level=messages.WARNING,
            )


def _missing_summary(agents: dict[str, Any]) -> str:
    parts = []
    for agent_id, report in agents.items():
        what = []
        if report.get("missing_tools"):
            what.append("tools " + ", ".join(report["missing_tools"]))
        if report.get("missing_skills"):
            what.append("skills " + ", ".join(report["missing_skills"]))
        if report.get("missing_model"):
            what.append(f"model {report['missing_model']}")
        if report.get("unverified"):
            what.append(f"{len(report['unverified'])} unverified")
        if what:
            parts.append(f"{agent_id}: {'; '.join(what)}")
    return " | ".join(parts) or "nothing missing"


@admin.register(AgentPackage)
class AgentPackageAdmin(admin.ModelAdmin):
    list_display = [
        "name",
        "version",
        "owner",
        "active",
        "visibility",
        "short_ref",
        "readiness",
        "created",
    ]
    list_filter = ["active", "visibility", "name", "owner"]
    search_fields = ["name", "version", "ref", "owner__username"]
    list_select_related = ["owner"]
    date_hierarchy = "created_at"
    readonly_fields = ["owner", "name", "version", "ref", "manifest", "files", "created_at"]
    filter_horizontal = ["shared_with"]
    actions = [
        "validate_packages",
        "validate_packages_strictly",
        "publish_to_everyone",
        "make_private",
        "release_selected",
    ]

    @admin.action(description="Publish to every user")
    def publish_to_everyone(self, request: HttpRequest, queryset) -> None:
        self._publish(request, queryset, Visibility.EVERYONE)

    @admin.action(description="Make private (owner only)")
    def make_private(self, request: HttpRequest, queryset) -> None:
        self._publish(request, queryset, Visibility.PRIVATE)

    def _publish(self, request: HttpRequest, queryset, visibility: str) -> None:
        """Publishing is for staff (the admin is); another user's sessions on a version
        made private stop running it (their runs fail ``package.not_found``)."""
        names = []
        for package in queryset:
            packages.package_publish(package, visibility)
            names.append(str(package))
        label = Visibility(visibility).label
        self.message_user(request, f"{', '.join(names)}: {label}", messages.SUCCESS)

    def has_add_permission(self, request, obj=None) -> bool:
        return False  # packages are created from manifests (API or validate_package --save)

    short_ref = show.id_column("ref", "ref")
    created = show.time_column("created_at")

    @admin.display(description="last readiness")
    def readiness(self, obj: AgentPackage) -> str:
        report = obj.reports.order_by("-checked_at").first()
        if report is None:
            return "—"
        return _ready_badge(report.ready)

    @admin.action(description="Validate (readiness report)")
    def validate_packages(self, request: HttpRequest, queryset) -> None:
        _validate(self, request, list(queryset.select_related("owner")), strict=False)

    @admin.action(description="Validate strictly (refuse when anything is missing)")
    def validate_packages_strictly(self, request: HttpRequest, queryset) -> None:
        _validate(self, request, list(queryset.select_related("owner")), strict=True)

    @admin.action(description="Release selected (only if safe)")
    def release_selected(self, request: HttpRequest, queryset) -> HttpResponse:
        refs = sorted(set(queryset.values_list("ref", flat=True)))
        row = reclamation_create(
            user=request.user,
            scope=ReclamationRequest.Scope.SELECTED,
            refs=refs,
            min_idle_seconds=0,
            limit=len(refs),
        )
        self.message_user(
            request,
            f"Reclamation #{row.pk} requested for {len(refs)} package version(s); the worker "
            "answers within a few seconds.",
            messages.SUCCESS,
        )
        return HttpResponseRedirect(
            reverse("admin:agents_reclamationrequest_change", args=[row.pk])
        )


def _ready_badge(ready: bool) -> str:
    colour, text = ("#2e7d32", "ready") if ready else ("#ba2121", "not ready")
    return format_html('<strong style="color: {}">{}</strong>', colour, text)


def _items(values: list[str]) -> str:
    if not values:
        return format_html('<span style="color: {}">none</span>', "#2e7d32")
    return format_html(
        '<ul style="margin: 0; padding-left: 1.2em; color: #ba2121">{}</ul>',
        format_html_join("", "<li>{}</li>", ((v,) for v in values)),
    )


@admin.register(ReadinessReport)
class ReadinessReportAdmin(admin.ModelAdmin):
    list_display = ["package", "owner", "valid", "ready", "strict", "missing", "checked"]
    list_filter = ["valid", "ready", "strict"]
    search_fields = ["package__name"]
    readonly_fields = ["package", "checked_at", "valid", "ready", "strict", "agents_table"]
    exclude = ["agents", "error"]
    actions = ["revalidate"]

    def has_add_permission(self, request, obj=None) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def get_queryset(self, request):
        return super().get_queryset(request).select_related("package", "package__owner")

    @admin.display(description="owner")
    def owner(self, obj: ReadinessReport) -> str:
        return obj.package.owner.username

    checked = show.time_column("checked_at")

    @admin.display(description="what is missing")
    def missing(self, obj: ReadinessReport) -> str:
        return _missing_summary(obj.agents or {})

    @admin.display(description="agents")
    def agents_table(self, obj: ReadinessReport) -> str:
        """One row per agent: missing tools, missing skills, unverified, model; red/green."""
        rows = format_html_join(
            "",
            "<tr><td><strong>{}</strong></td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>"
            "<td>{}</td></tr>",
            (
                (
                    agent_id,
                    _ready_badge(bool(report.get("ready"))),
                    _items(report.get("missing_tools") or []),
                    _items(report.get("missing_skills") or []),
                    _items(report.get("unverified") or []),
                    _items([report["missing_model"]] if report.get("missing_model") else []),
                )
                for agent_id, report in (obj.agents or {}).items()
            ),
        )
        return format_html(
            '<table class="readiness-table"><thead><tr><th>Agent</th><th>Status</th>'
            "<th>Missing tools</th><th>Missing skills</th><th>Unverified bindings</th>"
            "<th>Missing model record</th></tr></thead><tbody>{}</tbody></table>",
            rows,
        )

    @admin.action(description="Re-validate (store a fresh report)")
    def revalidate(self, request: HttpRequest, queryset) -> None:
        package_ids = set(queryset.values_list("package_id", flat=True))
        rows = list(AgentPackage.objects.filter(pk__in=package_ids).select_related("owner"))
        _validate(self, request, rows, strict=False)


@admin.register(ManagedAgentRecord)
class ManagedAgentRecordAdmin(admin.ModelAdmin):
    list_display = [
        "run_id_cell",
        "status_badge",
        "owner",
        "package_name",
        "agent_id",
        "short_ref",
        "error_code",
        "archived",
    ]
    list_display_links = ["run_id_cell"]
    list_filter = ["status", "owner", "package_name"]
    search_fields = ["run__id", "owner__username", "package_name", "agent_id"]
    list_select_related = ["owner"]
    date_hierarchy = "archived_at"
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

    run_id_cell = show.id_column("run_id", "run")
    status_badge = show.badge_column("status")
    short_ref = show.id_column("package_ref", "ref")
    error_code = show.error_column("error")
    archived = show.time_column("archived_at")


class ReleaseIdleForm(forms.Form):
    min_idle_seconds = forms.IntegerField(
        label="Minimum idle time (seconds)", min_value=0, max_value=86_400, initial=300
    )
    limit = forms.IntegerField(label="Release at most", min_value=1, max_value=1000, initial=4)


@admin.register(ReclamationRequest)
class ReclamationRequestAdmin(admin.ModelAdmin):
    list_display = [
        "id",
        "scope",
        "min_idle_seconds",
        "limit",
        "status",
        "answer",
        "requested_by",
        "created",
        "finished",
    ]
    list_filter = ["status", "scope"]
    readonly_fields = [
        "scope",
        "refs",
        "min_idle_seconds",
        "limit",
        "status",
        "answer",
        "outcome",
        "requested_by",
        "created_at",
        "finished_at",
    ]
    change_list_template = "admin/agents/reclamationrequest/change_list.html"
    change_form_template = "admin/agents/reclamationrequest/change_form.html"

    def has_add_permission(self, request, obj=None) -> bool:
        return False  # requests come from "Release idle (safe)" and "Release selected"

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    created = show.time_column("created_at")
    finished = show.time_column("finished_at")

    @admin.display(description="answer")
    def answer(self, obj: ReclamationRequest) -> str:
        if obj.status == "pending":
            return "waiting for the worker…"
        return str((obj.outcome or {}).get("message", ""))

    def get_urls(self):
        return [
            path(
                "release-idle/",
                self.admin_site.admin_view(self.release_idle_view),
                name="agents_reclamationrequest_release_idle",
            ),
            *super().get_urls(),
        ]

    def release_idle_view(self, request: HttpRequest) -> HttpResponse:
        """The intermediate form of "Release idle (safe)": minimum idle time and limit."""
        if not request.user.is_staff:
            return HttpResponseRedirect(reverse("admin:login"))
        form = ReleaseIdleForm(request.POST or None)
        if request.method == "POST" and form.is_valid():
            row = reclamation_create(
                user=request.user,
                scope=ReclamationRequest.Scope.IDLE,
                min_idle_seconds=form.cleaned_data["min_idle_seconds"],
                limit=form.cleaned_data["limit"],
            )
            self.message_user(
                request,
                f"Reclamation #{row.pk} requested; the worker answers within a few seconds.",
                messages.SUCCESS,
            )
            return HttpResponseRedirect(
                reverse("admin:agents_reclamationrequest_change", args=[row.pk])
            )
        context = {
            **self.admin_site.each_context(request),
            "title": "Release idle Applications (safe)",
            "form": form,
            "opts": self.model._meta,
        }
        return TemplateResponse(
            request, "admin/agents/reclamationrequest/release_idle.html", context
        )


# The jobs package registers its own admin (JobRecord, with the cancel action).
import agents.jobs.admin  # noqa: E402, F401


class McpConnectionStateFilter(admin.SimpleListFilter):
    """Live or revoked (``active`` is True or NULL: the unique constraint's trick)."""

    title = "state"
    parameter_name = "state"

    def lookups(self, request, model_admin):
        return [("live", "live"), ("revoked", "revoked")]

    def queryset(self, request, queryset):
        if self.value() == "live":
            return queryset.filter(active=True)
        if self.value() == "revoked":
            return queryset.filter(active__isnull=True)
        return queryset


@admin.register(McpConnection)
class McpConnectionAdmin(admin.ModelAdmin):
    """Users' connections to remote MCP servers: who connected what, and when; never the
    secret. Operators revoke any (the owner's runs then ask to connect again)."""

    list_display = ["server", "owner", "kind", "state", "last_used", "updated"]
    list_filter = ["kind", McpConnectionStateFilter]
    search_fields = ["server_url", "owner__username"]
    list_select_related = ["owner"]
    fields = [
        "owner",
        "server_url",
        "kind",
        "state",
        "created_at",
        "updated_at",
        "last_used_at",
        "revoked_at",
    ]
    readonly_fields = fields
    actions = ["revoke"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # users connect through the API: the secret is theirs to give

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    @admin.display(description="server", ordering="server_url")
    def server(self, obj: McpConnection) -> str:
        return show.preview(obj.server_url, 60)

    @admin.display(description="state")
    def state(self, obj: McpConnection) -> str:
        return show.badge("active" if obj.active else "revoked")

    last_used = show.time_column("last_used_at", "last used")
    updated = show.time_column("updated_at")

    @admin.action(description="Revoke the selected connections")
    def revoke(self, request: HttpRequest, queryset: Any) -> None:
        count = 0
        for row in queryset.filter(active=True):
            mcp_connection_revoke(user=request.user, connection_id=row.pk, operator=True)
            count += 1
        self.message_user(request, f"revoked {count} connection(s)", messages.SUCCESS)


@admin.register(McpOAuthClient)
class McpOAuthClientAdmin(admin.ModelAdmin):
    """Our client's registrations with MCP servers' authorization servers (one per
    issuer, shared by every user; the client information is never shown). Delete one the
    authorization server forgot: the next authorization registers again."""

    list_display = ["issuer", "created_at"]
    search_fields = ["issuer"]
    fields = ["issuer", "created_at"]
    readonly_fields = fields

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
