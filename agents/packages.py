"""Package versions: save (validated, content-addressed, immutable), resolve."""

from __future__ import annotations

from typing import Any

from django.db import IntegrityError, transaction

from agents.manifest import Manifest, parse_manifest
from agents.models import AgentPackage
from sageproject.errors import ConflictError, NotFoundError


def _split(manifest: Manifest) -> tuple[dict[str, Any], dict[str, str]]:
    data = manifest.data
    files = data.pop("files", {})
    return data, files


def package_create(
    *, owner, manifest: dict[str, Any] | str | bytes, activate: bool = True, yaml_ok: bool = False
) -> tuple[AgentPackage, bool]:
    """Save a package version; returns (package, created).

    The same version with the same content answers the existing row (``created`` False);
    the same version with other content raises ``package.version_conflict`` (409).
    Raises ``package.invalid`` (400) for a manifest that does not validate.
    """
    parsed = parse_manifest(manifest, yaml_ok=yaml_ok)
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
        return existing, False
    try:
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
                and not AgentPackage.objects.filter(
                    owner=owner, name=parsed.name, active=True
                ).exists()
            ):
                AgentPackage.objects.filter(pk=package.pk).update(active=True)
                package.active = True
    except IntegrityError:
        # A concurrent save of the same version won the race: answer as a repeat.
        return package_create(owner=owner, manifest=manifest, activate=activate, yaml_ok=yaml_ok)
    return package, True


def package_resolve(*, owner, name_or_ref: str) -> AgentPackage:
    """The owner's active version of a package name, or the version with that ref."""
    packages = AgentPackage.objects.filter(owner=owner)
    package = (
        packages.filter(ref=name_or_ref).first()
        or packages.filter(name=name_or_ref, active=True).first()
        or packages.filter(name=name_or_ref).order_by("-created_at").first()
    )
    if package is None:
        raise NotFoundError("package.not_found", f"no package {name_or_ref!r}")
    return package
