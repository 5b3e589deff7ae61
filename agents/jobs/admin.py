"""Admin for background jobs: ``JobRecord`` rows (read-only) and "Cancel selected jobs".

Importing this module registers the admin (``agents/admin.py`` imports it). The cancel action
only sets ``cancel_requested``: the worker that runs the job applies it
(``agents.jobs.reconcile.apply_cancel_requests``), because the admin process holds no runtime.
"""

from __future__ import annotations

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from agents.jobs.records import unfinished
from agents.models import JobRecord
from sageproject import admin_display as show


@admin.register(JobRecord)
class JobRecordAdmin(admin.ModelAdmin):
    list_display = [
        "short_job_id",
        "kind",
        "state_badge",
        "run_link",
        "owner",
        "output_size",
        "output_chunks",
        "output_truncated",
        "cancel_requested",
        "error_code",
        "created",
    ]
    list_display_links = ["short_job_id"]
    list_filter = ["state", "kind", "output_truncated", "cancel_requested"]
    search_fields = ["job_id", "kind", "owner__username", "run__id"]
    list_select_related = ["owner"]
    date_hierarchy = "created_at"
    ordering = ["-created_at"]
    # Every field but the key, none editable: the rows mirror the job runtime.
    readonly_fields = [f.name for f in JobRecord._meta.fields if not f.primary_key]
    actions = ["cancel_jobs"]

    short_job_id = show.id_column("job_id", "job")
    state_badge = show.badge_column("state")
    run_link = show.id_column("run_id", "run", "scheduling_run")

    @admin.display(description="output", ordering="output_bytes")
    def output_size(self, obj: JobRecord) -> str:
        return show.size(obj.output_bytes)

    error_code = show.error_column("error")
    created = show.time_column("created_at")

    def has_add_permission(self, request: HttpRequest, obj: JobRecord | None = None) -> bool:
        return False  # rows mirror the job runtime; only the runtime creates them

    def has_change_permission(self, request: HttpRequest, obj: JobRecord | None = None) -> bool:
        # Viewing only; actions check their own permission (below).
        return False

    def has_delete_permission(self, request: HttpRequest, obj: JobRecord | None = None) -> bool:
        # Deleting a row would lose track of a job that may still be running.
        return False

    def has_cancel_permission(self, request: HttpRequest) -> bool:
        # Cancelling changes a job: it takes the change permission, not just staff status.
        return request.user.has_perm(f"{self.opts.app_label}.change_jobrecord")

    @admin.action(description="Cancel selected jobs", permissions=["cancel"])
    def cancel_jobs(self, request: HttpRequest, queryset: QuerySet[JobRecord]) -> None:
        """Mark the selected unfinished jobs for cancellation; the worker stops them."""
        count = unfinished(queryset).filter(cancel_requested=False).update(cancel_requested=True)
        self.message_user(
            request,
            f"Cancellation requested for {count} job(s); the worker stops them within seconds.",
            messages.SUCCESS,
        )
