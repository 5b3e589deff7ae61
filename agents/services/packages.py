"""Package versions: save (validated, content-addressed, immutable), resolve, validate,
fork, activate — and readiness, the one check both saves and run admission use.

Everything here is synchronous ORM code: the web process calls it directly, the worker
through ``db_call``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction

from agents.manifest import Manifest, parse_manifest
from agents.mcp.discovery import Discovery, discover
from agents.mcp.transport import normalize_server_url
from agents.models import AgentPackage, ReadinessReport, Visibility
from agents.readiness import ReadinessResult, check_readiness, raise_if_not_ready
from agents.services.mcp import mcp_credentials_sync
from agents.skills import SkillRegistry
from agents.tools import ToolRegistry, build_registry
from sageproject.db import named_lock
from sageproject.errors import ConflictError, NotFoundError, ValidationError

VALIDATION_SCOPE = "schema, composition and resource discovery; no quality evaluation"
REUSED_SCOPE = "previously saved immutable version; resources not rechecked"


def _split(manifest: Manifest) -> tuple[dict[str, Any], dict[str, str]]:
    data = manifest.data
    files = data.pop("files", {})
    return data, files


def strict_mode() -> bool:
    """Whether ``SAGE_REQUIRE_READINESS`` is on (read at call time so tests can flip it)."""
    return bool(settings.SAGE.get("SAGE_REQUIRE_READINESS", False))


def package_manifest(package: AgentPackage) -> Manifest:
    """The stored package as a ``Manifest`` (its ref equals ``package.ref``)."""
    return parse_manifest({**package.manifest, "files": package.files or {}})


# --- readiness ---------------------------------------------------------------------------


def registries() -> tuple[ToolRegistry, SkillRegistry]:
    """The tools as the worker registers them (job tools; the code tools when
    ``SAGE_CODE_TOOLS`` is on) and the skills as configured now (re-scanned: one may have
    gone). Readiness only lists them; it never executes one."""
    from agents.code_tools import discovery_tools
    from agents.jobs.tools import JOB_TOOLS

    return (
        build_registry(settings.SAGE_TOOL_MODULES, extra=[*JOB_TOOLS, *discovery_tools()]),
        SkillRegistry.from_dirs(settings.SAGE_SKILL_DIRS),
    )


def model_names(owner_id: int | None) -> set[str]:
    """Model record names an owner's agents may use: their own plus the shared ones
    (``owner_id=None``: the shared ones only)."""
    from pooling.models import ModelRecord

    return set(ModelRecord.objects.usable_by(owner_id).values_list("name", flat=True))


def package_readiness(
    manifest: Manifest,
    *,
    owner_id: int | None,
    strict: bool,
    tools: ToolRegistry | None = None,
    skills: SkillRegistry | None = None,
) -> ReadinessResult:
    """Readiness of every agent of ``manifest`` for ``owner_id``; never raises.

    The one implementation used by saves, validation, run admission and the admin.
    """
    if tools is None or skills is None:
        default_tools, default_skills = registries()
        tools = default_tools if tools is None else tools
        skills = default_skills if skills is None else skills
    return check_readiness(
        manifest,
        tools=tools,
        skills=skills,
        model_names=model_names(owner_id),
        strict=strict,
        mcp=mcp_check(owner_id),
    )


def mcp_check(owner_id: int | None) -> Any:
    """Readiness's MCP discovery as ``owner_id`` (the package's owner or the validating
    user): their own connection's credentials, never another user's."""

    def check(server: Any) -> Discovery:
        url = normalize_server_url(server["url"])
        headers = mcp_credentials_sync(owner_id, url) if owner_id is not None else None
        if headers is None:
            return Discovery(problem="not connected by the checking user")
        return discover(server["name"], url, headers, float(server["timeout_seconds"]))

    return check


def save_report(package: AgentPackage, result: ReadinessResult) -> ReadinessReport:
    """Store a readiness result as a ``ReadinessReport`` row."""
    agents = {agent_id: dict(report) for agent_id, report in result.agents.items()}
    # Tool nodes of flows are listed beside the agents, keyed "flow:<id>".
    for flow_id, report in result.flows.items():
        agents[f"flow:{flow_id}"] = {
            "missing_tools": list(report["missing_tools"]),
            "missing_skills": [],
            "unverified": list(report["unverified"]),
            "ready": not (report["missing_tools"] or report["unverified"]),
        }
    return ReadinessReport.objects.create(
        package=package,
        valid=result.valid,
        ready=result.ready,
        strict=result.strict,
        agents=agents,
    )


def _report_body(manifest: Manifest, result: ReadinessResult | None, scope: str) -> dict[str, Any]:
    return {
        "valid": True,
        "ref": manifest.ref,
        "name": manifest.name,
        "version": manifest.version,
        "agents": manifest.agent_ids,
        "flows": list(manifest.flows),
        "readiness": result.to_dict() if result is not None else None,
        "validation": scope,
    }


def package_validate(
    *,
    owner,
    manifest: dict[str, Any] | str | bytes | None = None,
    package: AgentPackage | None = None,
    readiness: bool = True,
    strict: bool | None = None,
    yaml_ok: bool = False,
    record: bool = True,
) -> dict[str, Any]:
    """Validate a manifest (or a saved package) and, with ``readiness``, its resources.

    ``owner=None`` checks model records against the shared ones only. Returns ``{"valid",
    "ref", "name", "version", "agents", "flows", "readiness", "validation"}``; a saved
    ``package`` gets a ``ReadinessReport`` row (``record``).
    Raises ``package.invalid`` (400) for a bad manifest and, when ``strict`` (default:
    ``SAGE_REQUIRE_READINESS``), ``package.not_ready`` (400) listing what is missing —
    after the report was stored, so operators see why.
    """
    strict = strict_mode() if strict is None else strict
    parsed = (
        package_manifest(package)
        if package is not None
        else parse_manifest(manifest if manifest is not None else {}, yaml_ok=yaml_ok)
    )
    result = None
    if readiness or strict:
        owner_id = owner.pk if owner is not None else None
        result = package_readiness(parsed, owner_id=owner_id, strict=strict)
        if package is not None and record:
            save_report(package, result)
        raise_if_not_ready(result)
    return _report_body(parsed, result, VALIDATION_SCOPE)


# --- saving --------------------------------------------------------------------------------


def package_create(
    *, owner, manifest: dict[str, Any] | str | bytes, activate: bool = True, yaml_ok: bool = False
) -> tuple[AgentPackage, bool]:
    """Save a package version; returns (package, created).

    The same version with the same content answers the existing row (``created`` False);
    the same version with other content raises ``package.version_conflict`` (409).
    Raises ``package.invalid`` (400) for a manifest that does not validate and, in strict
    mode, ``package.not_ready`` (see ``package_save``).
    """
    body = package_save(owner=owner, manifest=manifest, activate=activate, yaml_ok=yaml_ok)
    return body["package"], not body["reused"]


def package_save(
    *, owner, manifest: dict[str, Any] | str | bytes, activate: bool = True, yaml_ok: bool = False
) -> dict[str, Any]:
    """Save a package version; returns the validation body plus ``package`` and ``reused``.

    Immutability is checked before anything else: the same version with other content
    raises ``package.version_conflict`` (409). A repeated save of the same ref answers
    ``reused: True`` — in strict mode after a full revalidation (which may raise
    ``package.not_ready``), otherwise without rechecking. A new version is validated
    (strict: refused with ``package.not_ready`` before it is stored), stored and, when
    ``activate`` and no version is active yet, activated.
    """
    strict = strict_mode()
    parsed = parse_manifest(manifest, yaml_ok=yaml_ok)
    # Saves of one (owner, name, version) are serialized (across processes too), so twelve
    # concurrent identical saves check resources once and store one row.
    lock = hashlib.sha256(f"{owner.pk}:{parsed.name}:{parsed.version}".encode()).hexdigest()
    try:
        with named_lock(f"sage.package.{lock[:40]}"):
            body = _save_locked(owner, parsed, strict=strict, activate=activate)
        # Raised after the commit, so the stored report tells operators why.
        refusal = body.pop("refusal", None)
        if refusal is not None:
            raise_if_not_ready(refusal)
        return body
    except IntegrityError:
        # A concurrent save of the same version won the race: answer as a repeat.
        return package_save(owner=owner, manifest=manifest, activate=activate, yaml_ok=yaml_ok)


def _save_locked(owner, parsed: Manifest, *, strict: bool, activate: bool) -> dict[str, Any]:
    data, files = _split(parsed)
    existing = AgentPackage.objects.filter(
        owner=owner, name=parsed.name, version=parsed.version
    ).first()
    if existing is not None:
        if existing.ref != parsed.ref:
            raise ConflictError(
                "package.version_conflict",
                f"{parsed.name}@{parsed.version} exists with other content; versions are "
                "immutable, publish a new version",
                details={"name": parsed.name, "version": parsed.version, "ref": existing.ref},
            )
        if not strict:
            body = _report_body(parsed, None, REUSED_SCOPE)
            return {**body, "package": existing, "reused": True}
        # Strict: a full revalidation, its report stored, a refusal raised by the caller.
        result = package_readiness(parsed, owner_id=owner.pk, strict=True)
        save_report(existing, result)
        body = _report_body(parsed, result, VALIDATION_SCOPE)
        return {**body, "package": existing, "reused": True, "refusal": result}
    result = package_readiness(parsed, owner_id=owner.pk, strict=strict)
    raise_if_not_ready(result)
    with transaction.atomic():
        package = AgentPackage.objects.create(
            owner=owner,
            name=parsed.name,
            version=parsed.version,
            ref=parsed.ref,
            manifest=data,
            files=files,
            active=False,
        )
        if (
            activate
            and not AgentPackage.objects.filter(owner=owner, name=parsed.name, active=True).exists()
        ):
            AgentPackage.objects.filter(pk=package.pk).update(active=True)
            package.active = True
        save_report(package, result)
    return {**_report_body(parsed, result, VALIDATION_SCOPE), "package": package, "reused": False}


def package_resolve(*, owner, name_or_ref: str) -> AgentPackage:
    """The version a user means by a package name or ref: their own first (the version with
    that ref, else the active version of that name, else its newest), then the same among
    the versions shared with them (``AgentPackage.objects.usable_by``). Another user's
    private package is not found."""
    own = AgentPackage.objects.filter(owner=owner)
    shared = AgentPackage.objects.usable_by(owner.pk).exclude(owner=owner)
    for packages in (own, shared):
        package = (
            packages.filter(ref=name_or_ref).first()
            or packages.filter(name=name_or_ref, active=True).order_by("-created_at").first()
            or packages.filter(name=name_or_ref).order_by("-created_at").first()
        )
        if package is not None:
            return package
    raise NotFoundError("package.not_found", f"no package {name_or_ref!r}")


def package_publish(
    package: AgentPackage, visibility: str, groups: Iterable[Any] = ()
) -> AgentPackage:
    """Set who may use a package version: ``private``, ``everyone``, or ``groups`` (the
    given Django groups). Staff decide this (the admin's publish actions, ``seed_demo``);
    sessions, runs and archives on a shared version stay private to their users."""
    if visibility not in Visibility.values:
        raise ValidationError(
            "package.visibility_invalid",
            f"visibility must be one of {', '.join(Visibility.values)}",
            details={"fields": {"visibility": [f"one of {Visibility.values}"]}},
        )
    with transaction.atomic():
        package.visibility = visibility
        package.save(update_fields=["visibility"])
        package.shared_with.set(list(groups) if visibility == Visibility.GROUPS else [])
    return package


def package_fork(*, owner, package: AgentPackage, version: str) -> dict[str, Any]:
    """Copy ``package`` under a new ``version`` and save it (see ``package_save``)."""
    if package.owner_id != owner.pk:
        raise NotFoundError("package.not_found", "agent package not found in caller scope")
    data = {**package.manifest, "files": package.files or {}, "version": version}
    return package_save(owner=owner, manifest=data, activate=False)


def package_activate(*, owner, package: AgentPackage, expected_ref: str | None) -> dict[str, Any]:
    """Make ``package`` the active version of its name.

    ``expected_ref`` must be the currently active ref (``None`` when none is active), so
    two operators cannot silently overwrite each other's choice: a stale one raises
    ``package.active_conflict`` (409). Re-activating an older version is allowed.
    Returns ``{"ref", "previous_ref", "package"}``.
    """
    if package.owner_id != owner.pk:
        raise NotFoundError("package.not_found", "agent package not found in caller scope")
    with transaction.atomic():
        versions = AgentPackage.objects.select_for_update().filter(owner=owner, name=package.name)
        current = next((p for p in versions if p.active), None)
        previous_ref = current.ref if current is not None else None
        if previous_ref != (expected_ref or None):
            raise ConflictError(
                "package.active_conflict",
                "active version conflict; refresh inventory before retrying",
                details={"active_ref": previous_ref, "expected_ref": expected_ref},
            )
        AgentPackage.objects.filter(owner=owner, name=package.name).exclude(pk=package.pk).update(
            active=False
        )
        AgentPackage.objects.filter(pk=package.pk).update(active=True)
    return {"ref": package.ref, "previous_ref": previous_ref, "package": package.name}
