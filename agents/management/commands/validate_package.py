"""``manage.py validate_package PATH [--readiness] [--strict] [--json] [--owner USER] [--save]``.

PATH is a JSON or YAML manifest file, or a directory holding ``sage.yaml``/``sage.yml``/
``sage.json`` plus the files it bundles (every other file below the directory, by its
relative path). The checks are the ones the API runs (``agents.packages``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand

from agents.management.commands._output import emit_json, fail
from agents.manifest import MAX_FILES, parse_manifest
from agents.services import packages
from sageproject.errors import NotFoundError, SageError, ValidationError

MANIFEST_NAMES = ("sage.yaml", "sage.yml", "sage.json")


def load_package(path: Path) -> dict[str, Any] | str:
    """The manifest at ``path`` (text for a file; a mapping with bundled files for a
    directory). Raises ``package.invalid`` when nothing readable is there."""
    if path.is_dir():
        manifest_file = next((path / n for n in MANIFEST_NAMES if (path / n).is_file()), None)
        if manifest_file is None:
            raise ValidationError(
                "package.invalid",
                f"{path} holds no {', '.join(MANIFEST_NAMES)}",
                details={"field": ""},
            )
        import yaml

        data = yaml.safe_load(manifest_file.read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise ValidationError(
                "package.invalid", "manifest must be a mapping", details={"field": ""}
            )
        files = dict(data.get("files") or {})
        bundled = sorted(p for p in path.rglob("*") if p.is_file() and p != manifest_file)
        if len(bundled) > MAX_FILES:
            raise ValidationError(
                "package.invalid",
                f"package exceeds {MAX_FILES} files",
                details={"field": "files"},
            )
        for file in bundled:
            relative = file.relative_to(path).as_posix()
            if relative.split("/", 1)[0].startswith("."):
                continue  # .git, editor droppings
            try:
                files[relative] = file.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                raise ValidationError(
                    "package.invalid",
                    f"bundled file {relative} is not UTF-8 text",
                    details={"field": f"files.{relative}"},
                ) from None
        return {**data, "files": files}
    if not path.is_file():
        raise NotFoundError("package.not_found", f"no such file or directory: {path}")
    return path.read_text(encoding="utf-8")


class Command(BaseCommand):
    help = "Validate a package manifest (file or directory); optionally check readiness or save."

    def add_arguments(self, parser) -> None:
        parser.add_argument("path")
        parser.add_argument("--readiness", action="store_true", help="check tools/skills/models")
        parser.add_argument(
            "--strict", action="store_true", help="fail (package.not_ready) when not ready"
        )
        parser.add_argument("--json", action="store_true", help="print JSON")
        parser.add_argument("--owner", help="check model records (and --save) as this user")
        parser.add_argument("--save", action="store_true", help="save the version for --owner")

    def handle(self, *args: Any, **options: Any) -> None:
        as_json = options["json"]
        try:
            body = self._run(options)
        except SageError as exc:
            fail(self, exc, as_json=as_json)
            return
        if as_json:
            emit_json(self, body)
            return
        self._print(body)

    def _run(self, options: dict[str, Any]) -> dict[str, Any]:
        owner = None
        if options["owner"]:
            owner = get_user_model().objects.filter(username=options["owner"]).first()
            if owner is None:
                raise NotFoundError("user.not_found", f"no user {options['owner']!r}")
        if options["save"] and owner is None:
            raise ValidationError(
                "command.invalid", "--save needs --owner USER", details={"field": "owner"}
            )
        data = load_package(Path(options["path"]))
        if options["save"]:
            result = packages.package_save(owner=owner, manifest=data, yaml_ok=True)
            package = result.pop("package")
            return {**result, "package_id": package.pk, "active": package.active}
        parse_manifest(data, yaml_ok=True)  # package.invalid before anything else
        return packages.package_validate(
            owner=owner,
            manifest=data,
            readiness=options["readiness"] or options["strict"],
            strict=options["strict"],
            yaml_ok=True,
        )

    def _print(self, body: dict[str, Any]) -> None:
        self.stdout.write(f"valid: {body['name']}@{body['version']} ref {body['ref']}")
        if "reused" in body:
            self.stdout.write(
                "saved (reused: an identical version existed)"
                if body["reused"]
                else "saved as a new version"
            )
        readiness = body.get("readiness")
        if readiness is None:
            return
        self.stdout.write(f"ready: {'yes' if readiness['ready'] else 'no'}")
        for agent_id, report in readiness["agents"].items():
            state = "ready" if report["ready"] else "NOT READY"
            self.stdout.write(f"  {agent_id}: {state}")
            for label, key in (
                ("missing tools", "missing_tools"),
                ("missing skills", "missing_skills"),
                ("unverified", "unverified"),
            ):
                if report[key]:
                    self.stdout.write(f"    {label}: {', '.join(report[key])}")
            if report.get("missing_model"):
                self.stdout.write(f"    missing model record: {report['missing_model']}")
