"""Sessions: open a conversation with one agent (or flow) of a package version."""

from __future__ import annotations

from agents.services.packages import package_resolve
from sageproject.errors import ValidationError
from scheduling.models import Session, SessionKind


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
