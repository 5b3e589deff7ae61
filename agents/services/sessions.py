"""Sessions: open a conversation with one agent (or flow) of a package version.

A LangGraph *thread* is a session too (``agents.protocols.langgraph``). It may start
bound to nothing, keeps a client's metadata in `agents.models.ThreadMetadata`, and is
deleted with its runs; its ``thread_*`` functions are here.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping
from typing import Any

from django.db import IntegrityError, transaction
from django.utils import timezone

from agents.models import AgentPackage, ThreadMetadata
from agents.services.packages import package_resolve
from agents.services.runs import run_cancel
from sageproject.errors import ConflictError, ValidationError
from scheduling import runs
from scheduling.models import UNFINISHED_STATUSES, Run, RunStatus, Session, SessionKind

# How a thread names the agent it runs: ``<package>/<agent>``.
SEPARATOR = "/"


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


def session_import(
    *,
    owner,
    package: str,
    agent: str,
    history: Iterable[tuple[str, str]] = (),
    kind: str = SessionKind.BRANCH,
) -> Session:
    """A new session on ``package``'s ``agent`` whose earlier turns are ``history``.

    ``history`` holds ``(role, text)`` pairs, ``user`` or ``assistant``. They become
    durable ``message.completed`` events of no run (``imported: true``), in one
    transaction with the session. A client that sends a whole conversation (the OpenAI
    layer) gets exactly that history for its agent.
    """
    with transaction.atomic():
        session = session_create(owner=owner, package=package, agent=agent, kind=kind)
        for role, text in history:
            runs.append_event(
                session.pk,
                None,
                "message.completed",
                {"role": role, "content": text, "imported": True},
            )
    return session


def thread_create(
    *,
    owner,
    thread_id: uuid.UUID | None = None,
    package: AgentPackage | None = None,
    agent: str = "",
    metadata: Mapping[str, Any] | None = None,
) -> Session:
    """Open a thread: a session on ``package``'s ``agent``, or bound to nothing (its
    first run binds it) without a package. ``metadata`` is stored with it, in one
    transaction. Raises ``thread.exists`` (409) when ``thread_id`` is taken."""
    try:
        with transaction.atomic():
            session = Session.objects.create(
                id=thread_id or uuid.uuid4(),
                owner=owner,
                package_ref=package.ref if package else "",
                package_name=package.name if package else "",
                agent_id=agent if package else "",
                kind=SessionKind.MASTER,
            )
            if metadata:
                ThreadMetadata.objects.create(session=session, metadata=dict(metadata))
    except IntegrityError:
        raise ConflictError("thread.exists", f"thread {thread_id} already exists") from None
    return session


def thread_bind(*, session: Session, package: AgentPackage, agent: str) -> Session:
    """Bind an unbound thread to ``package``'s ``agent`` and return it, refreshed.

    Only a thread bound to nothing changes (a conditional update: two first runs bind it
    once). Raises ``thread.assistant_conflict`` (409) when it runs another agent.
    """
    if not session.package_ref:
        Session.objects.filter(pk=session.pk, package_ref="").update(
            package_ref=package.ref, package_name=package.name, agent_id=agent
        )
        session.refresh_from_db(fields=["package_ref", "package_name", "agent_id"])
    if (session.package_name, session.agent_id) != (package.name, agent):
        bound = None
        if session.package_ref:
            bound = f"{session.package_name}{SEPARATOR}{session.agent_id}"
        raise ConflictError(
            "thread.assistant_conflict",
            f"thread {session.pk} runs {bound}, not {package.name}{SEPARATOR}{agent}",
        )
    return session


def thread_metadata_update(*, session: Session, metadata: Mapping[str, Any]) -> dict[str, Any]:
    """Merge ``metadata`` into the thread's stored metadata; returns the merged whole.

    The row is locked while merging, so two updates never lose each other's keys.
    """
    with transaction.atomic():
        row, _ = ThreadMetadata.objects.select_for_update().get_or_create(session=session)
        row.metadata = {**row.metadata, **metadata}
        row.save(update_fields=["metadata"])
    Session.objects.filter(pk=session.pk).update(updated_at=timezone.now())
    return row.metadata


def thread_delete(*, session: Session) -> None:
    """Cancel the thread's unfinished runs, then delete the session with its runs,
    events and archives.

    Raises ``session.busy`` (409) while a running run is still stopping: its worker must
    not lose the row under it. Deleting again a moment later succeeds.
    """
    for run in Run.objects.filter(session=session, status__in=list(UNFINISHED_STATUSES)):
        run_cancel(run=run)
    with transaction.atomic():
        if Run.objects.filter(session=session, status=RunStatus.RUNNING).exists():
            raise ConflictError(
                "session.busy", "the thread's run is stopping; delete the thread again soon"
            )
        session.delete()
