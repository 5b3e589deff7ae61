"""Runs from the user's side: submit (admission), cancel, reply, roll back the turns after
a point of a session, and the permission to read what runs produced.

The Run's status changes only in ``scheduling.runs`` (the state machine); these functions
check what the caller may do and call it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agents.models import AgentPackage
from agents.services.packages import package_validate, strict_mode
from sageproject.errors import (
    ConflictError,
    ErrorCategory,
    NotFoundError,
    SageError,
    ValidationError,
)
from scheduling import runs
from scheduling.models import UNFINISHED_STATUSES, Event, Run, RunStatus, Session


def run_submit(*, owner, session_id: Any, priority: int = 0, **admission: Any) -> tuple[Run, bool]:
    """Admit a run (queued) into the owner's session; returns (run, created).

    ``admission`` is the rest of what `scheduling.runs.admit` takes — ``input`` (required),
    ``idempotency_key``, ``queue`` (``chat``), ``multitask`` (``enqueue``) — passed on
    after this door's own checks.

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
        package = AgentPackage.objects.usable_by(owner.pk).filter(ref=session.package_ref).first()
        if package is None:
            raise NotFoundError("package.not_found", "the session's package version is gone")
        package_validate(owner=owner, package=package, strict=True)
    return runs.admit(owner=owner, session_id=session_id, priority=priority, **admission)


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


def run_cancel(*, run: Run, rollback: bool = False) -> Run:
    """Cancel a run: a queued or suspended one at once (its ``run.cancelled`` event and
    archive with it), a running one through its worker at its next step (or the reaper, if
    its worker died). Idempotent: a terminal run is answered unchanged. ``rollback`` ends
    it ``interrupted`` with its events removed from the session (as multitask rollback)."""
    return runs.cancel(run.pk, rollback=rollback)


def run_reply(
    *,
    run: Run,
    decision: str,
    interaction_id: str | None = None,
    edits: Mapping[str, Any] | None = None,
) -> Run:
    """Answer a suspended run's interaction: ``retry`` queues it again, ``cancel`` ends it.

    An approval's ``edit`` approves its calls with ``edits`` (call id to new arguments)
    in place of the model's arguments; the edits are kept in the resolution.
    Raises ``run.not_suspended`` (409) when there is nothing to answer, and
    ``run.decision_invalid`` (400) for a decision the interaction does not allow or
    edits that are not of its waiting calls.
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
    checked = _checked_edits(interaction, decision, edits)
    if decision == "cancel":
        return run_cancel(run=run)
    resolution: dict[str, Any] = {"interaction_id": interaction.get("id"), "decision": decision}
    if checked:
        resolution["edits"] = checked
    if not runs.resume(run.pk, resolution):
        raise ConflictError("run.not_suspended", "the run changed state; read it again")
    return Run.objects.get(pk=run.pk)


def _checked_edits(
    interaction: Mapping[str, Any], decision: str, edits: Mapping[str, Any] | None
) -> dict[str, dict[str, Any]]:
    """``edits`` when they fit: only an ``edit`` has them (and needs one), each of a
    waiting call, each a JSON object. Raises ``run.decision_invalid`` (400)."""
    if decision != "edit":
        if edits:
            raise _invalid_edits("only the decision edit has edits")
        return {}
    if not isinstance(edits, Mapping) or not edits:
        raise _invalid_edits("an edit needs the new arguments of at least one call")
    waiting = set(interaction.get("waiting") or ())
    for call_id, arguments in edits.items():
        if call_id not in waiting:
            raise _invalid_edits(f"{call_id!r} is not a call waiting for approval")
        if not isinstance(arguments, Mapping):
            raise _invalid_edits(f"the arguments of {call_id!r} must be a JSON object")
    return {str(k): dict(v) for k, v in edits.items()}


def _invalid_edits(message: str) -> ValidationError:
    return ValidationError(
        "run.decision_invalid", message, details={"fields": {"edits": [message]}}
    )


def check_rollback(*, session: Session, after_seq: int) -> list[Any]:
    """The runs whose events follow seq ``after_seq`` in ``session``, in order, when they
    may be rolled back (``session_rollback``).

    Raises ``checkpoint.not_replaceable`` (409) when an event after it belongs to no run
    (imported history), and ``session.busy`` (409) when one of those runs is unfinished.
    """
    later = Event.objects.filter(session=session, seq__gt=after_seq)
    if later.filter(run__isnull=True).exists():
        raise ConflictError(
            "checkpoint.not_replaceable", "the turns after this checkpoint were imported"
        )
    replaced = list(dict.fromkeys(later.order_by("seq").values_list("run_id", flat=True)))
    if Run.objects.filter(pk__in=replaced, status__in=list(UNFINISHED_STATUSES)).exists():
        raise ConflictError("session.busy", "the thread has an unfinished run")
    return replaced


def session_rollback(*, session: Session, after_seq: int) -> list[Any]:
    """Roll back the finished turns after seq ``after_seq``: every later run's events are
    removed from the session (as multitask rollback does). Returns those runs' ids.

    A session is linear, so the removed turns do not stay as a branch. Raises as
    ``check_rollback``; the runs themselves keep their (terminal) status.
    """
    replaced = check_rollback(session=session, after_seq=after_seq)
    for run_id in replaced:
        runs.remove_run_events(session.pk, run_id)
    return replaced


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
