"""The one door for writes and workflows on packages, sessions and runs.

Views, admin actions, management commands and the worker call these functions; none of
them re-implements their checks.
"""

from __future__ import annotations

from typing import Any

from django.db import connections

from agents.models import AgentPackage, ManagedAgentRecord
from agents.packages import package_resolve, package_validate, strict_mode
from sageproject.errors import (
    ConflictError,
    ErrorCategory,
    NotFoundError,
    SageError,
    ValidationError,
)
from scheduling import runs
from scheduling.models import (
    Multitask,
    Run,
    RunQueue,
    RunStatus,
    Session,
    SessionKind,
)
from scheduling.runs import ArchiveRecord


def session_create(
    *, owner, package: str, agent: str, kind: str = SessionKind.MASTER, title: str = ""
) -> Session:
    """Open a session on the owner's package and one of its agents (or flows: a run of a
    flow session runs that flow)."""
    pkg = package_resolve(owner=owner, name_or_ref=package)
    if agent not in (pkg.manifest.get("agents") or {}) and agent not in (
        pkg.manifest.get("flows") or {}
    ):
        raise ValidationError(
            "session.agent_not_found",
            f"package {pkg.name!r} has no agent or flow {agent!r}",
            details={"fields": {"agent": [f"unknown agent {agent!r}"]}},
        )
    return Session.objects.create(
        owner=owner,
        package_ref=pkg.ref,
        package_name=pkg.name,
        agent_id=agent,
        kind=kind,
        title=title,
    )


def run_submit(
    *,
    owner,
    session_id: Any,
    input: Any,
    idempotency_key: str | None = None,
    queue: str = RunQueue.CHAT,
    priority: int = 0,
    multitask: str = Multitask.ENQUEUE,
) -> tuple[Run, bool]:
    """Admit a run (queued) into the owner's session; returns (run, created).

    A repeated ``idempotency_key`` answers the run it created first. Raises
    ``session.not_found`` (404), ``scheduler.queue_full`` (429) at the pending limits and
    ``session.busy`` (409) for ``multitask=reject`` while the session has an unfinished
    run, and ``run.priority_forbidden`` (403) for a priority above 0 from a user who is not
    staff (``check_priority``). Concurrent submissions never exceed the limits, never lose
    a run and never create two runs for one key, without waiting for each other
    (``scheduling.pending``). A session runs one run at a time: later runs wait in order
    (see ``scheduling.runs.admit``).
    """
    check_priority(owner, priority)
    if strict_mode():
        session = Session.objects.filter(pk=session_id, owner=owner).first()
        if session is None:
            raise NotFoundError("session.not_found", "session not found")
        package = AgentPackage.objects.filter(owner=owner, ref=session.package_ref).first()
        if package is None:
            raise NotFoundError("package.not_found", "the session's package version is gone")
        package_validate(owner=owner, package=package, strict=True)
    return runs.admit(
        owner=owner,
        session_id=session_id,
        input=input,
        idempotency_key=idempotency_key,
        queue=queue,
        priority=priority,
        multitask=multitask,
    )


# The highest priority a user who is not staff may give their runs. Claims order users by
# their running runs first and priority second, so at equal load a higher priority would put
# one user's runs ahead of everyone else's: priorities above 0 are for operators (staff).
# Anyone may lower their own runs (-100..0), which also orders them among themselves.
MAX_USER_PRIORITY = 0


def check_priority(owner, priority: int) -> None:
    """Raise ``run.priority_forbidden`` (403) when ``owner`` may not submit ``priority``."""
    if priority > MAX_USER_PRIORITY and not owner.is_staff:
        raise SageError(
            "run.priority_forbidden",
            f"a priority above {MAX_USER_PRIORITY} is reserved for staff",
            category=ErrorCategory.AUTHORIZATION,
            details={"fields": {"priority": [f"at most {MAX_USER_PRIORITY} unless staff"]}},
        )


def run_cancel(*, run: Run) -> Run:
    """Cancel a run: a queued or suspended one at once (its ``run.cancelled`` event and
    archive with it), a running one through its worker at its next step (or the reaper, if
    its worker died). Idempotent: a terminal run is answered unchanged."""
    return runs.cancel(run.pk)


def run_reply(*, run: Run, decision: str, interaction_id: str | None = None) -> Run:
    """Answer a suspended run's interaction: ``retry`` queues it again, ``cancel`` ends it.

    Raises ``run.not_suspended`` (409) when there is nothing to answer, and
    ``run.decision_invalid`` (400) for a decision the interaction does not allow.
    """
    interaction = run.interaction or {}
    if run.status != RunStatus.SUSPENDED or not interaction:
        raise ConflictError("run.not_suspended", f"run is {run.status}; there is nothing to answer")
    if interaction_id is not None and interaction_id != interaction.get("id"):
        raise ConflictError(
            "interaction.revision_conflict", "that interaction is no longer pending"
        )
    allowed = interaction.get("allowed_decisions", [])
    if decision not in allowed:
        raise ValidationError(
            "run.decision_invalid",
            f"decision must be one of {', '.join(allowed)}",
            details={"fields": {"decision": [f"must be one of {allowed}"]}},
        )
    if decision == "cancel":
        return run_cancel(run=run)
    resolution = {"interaction_id": interaction.get("id"), "decision": decision}
    if not runs.resume(run.pk, resolution):
        raise ConflictError("run.not_suspended", "the run changed state; read it again")
    return Run.objects.get(pk=run.pk)


def archive_records(records: list[ArchiveRecord], using: str = "default") -> None:
    """Write (or refresh) the archive rows of terminal runs in one statement (registered
    with ``scheduling.runs`` as the archiver of every terminal transition)."""
    rows = [
        ManagedAgentRecord(
            run_id=r.run_id,
            owner_id=r.owner_id,
            package_ref=r.package_ref,
            package_name=r.package_name,
            agent_id=r.agent_id,
            status=r.status,
            result=r.result,
            error=r.error,
            flow_outputs=r.flow_outputs,
        )
        for r in records
    ]
    update = ["owner", "package_ref", "package_name", "agent_id", "status", "result", "error"]
    # MySQL's upsert names no conflict target (ON DUPLICATE KEY UPDATE); the others must.
    target = (
        {"unique_fields": ["run"]}
        if connections[using].features.supports_update_conflicts_with_target
        else {}
    )
    for with_outputs in (False, True):
        part = [row for row in rows if (row.flow_outputs is not None) is with_outputs]
        if part:
            ManagedAgentRecord.objects.using(using).bulk_create(
                part,
                update_conflicts=True,
                update_fields=[*update, "flow_outputs"] if with_outputs else update,
                **target,
            )


def archive_terminal(run: Run, flow_outputs: dict[str, Any] | None = None) -> ManagedAgentRecord:
    """Write (or refresh) the terminal archive of one finished run (from its row)."""
    runs.archive([run.pk], flow_outputs={run.pk: flow_outputs})
    return ManagedAgentRecord.objects.get(run_id=run.pk)


# Membership in this group revokes a user's permission to read run results (archived or
# not). Operators add a user to it in the admin; removing them restores access.
READ_REVOKED_GROUP = "sage-read-revoked"


def check_read_permission(user) -> None:
    """Raise ``run.read_forbidden`` (403) unless ``user`` may currently read results.

    Checked on every read, archived results included: a permission revoked after the run
    finished still denies. A user may read while active and not in ``READ_REVOKED_GROUP``.
    """
    if not user.is_active or user.groups.filter(name=READ_REVOKED_GROUP).exists():
        raise SageError(
            "run.read_forbidden",
            "your permission to read run results has been revoked",
            category=ErrorCategory.AUTHORIZATION,
        )


def archive_read(*, user, run_id: Any) -> ManagedAgentRecord:
    """An archived result, checked against ownership first (another user's → 404), then
    the caller's current read permission (revoked → 403)."""
    query = ManagedAgentRecord.objects.select_related("run")
    if not user.is_staff:
        query = query.filter(owner=user)
    record = query.filter(run_id=run_id).first()
    if record is None:
        raise NotFoundError("archive.not_found", "no archived result for that run")
    check_read_permission(user)
    return record


def scoped(queryset, user, field: str = "owner"):
    """Objects the user may see: their own, or everything for staff."""
    if user.is_staff:
        return queryset
    return queryset.filter(**{field: user})
