"""Skills: folders of instructions an agent may load on demand.

Each configured directory holds one folder per skill; the folder's ``SKILL.md`` starts
with a small front matter naming the skill::

    ---
    name: refunds
    description: How to handle a refund request.
    ---
    (body: loaded only when an agent asks for it)

Discovery reads only the front matter, never the body: readiness must be able to say a
skill exists without materialising it, and a large skill costs nothing
until it is used.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from sageproject.errors import NotFoundError, ValidationError

SKILL_FILE = "SKILL.md"
# The front matter is a few lines; a file whose header runs longer is broken, and reading
# further would mean reading the body discovery promises not to touch.
MAX_HEADER_LINES = 64
MAX_HEADER_BYTES = 16 * 1024
_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}$")


@dataclass(frozen=True, slots=True, kw_only=True)
class SkillInfo:
    """A discovered skill's metadata; ``path`` is its ``SKILL.md``."""

    name: str
    description: str
    path: Path


class SkillHeaderError(ValueError):
    """A ``SKILL.md`` front matter that cannot be read."""


def read_header(path: Path) -> dict[str, str]:
    """Return the front matter fields of the ``SKILL.md`` at ``path``.

    Reads line by line and stops at the closing ``---``, so the body is never read.
    Raises ``SkillHeaderError`` for a missing or malformed header and ``OSError`` when the
    file cannot be read.
    """
    fields: dict[str, str] = {}
    last_key: str | None = None
    consumed = 0
    # Binary lines, decoded one at a time: a text-mode reader decodes ahead in large
    # chunks, which would touch (and could fail on) the body we promise not to read.
    with path.open("rb") as handle:
        first = handle.readline(MAX_HEADER_BYTES)
        consumed += len(first)
        if first.decode("utf-8").strip() != "---":
            raise SkillHeaderError("SKILL.md must start with a '---' front matter line")
        for _ in range(MAX_HEADER_LINES):
            raw = handle.readline(MAX_HEADER_BYTES)
            consumed += len(raw)
            if not raw or consumed > MAX_HEADER_BYTES:
                break
            line = raw.decode("utf-8")
            stripped = line.strip()
            if stripped == "---":
                return fields
            if not stripped or stripped.startswith("#"):
                continue
            if line[:1] in (" ", "\t") and last_key is not None:
                # An indented line continues the previous value (YAML-style folding).
                fields[last_key] = f"{fields[last_key]} {stripped}".strip()
                continue
            key, sep, value = stripped.partition(":")
            if not sep or not key.strip():
                raise SkillHeaderError(f"front matter line is not 'key: value': {stripped!r}")
            last_key = key.strip()
            fields[last_key] = _unquote(value.strip())
    raise SkillHeaderError(f"front matter is not closed by '---' within {MAX_HEADER_LINES} lines")


def _unquote(value: str) -> str:
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1]
    if value in ("|", ">", "|-", ">-"):
        return ""  # a block scalar: its text comes on the indented lines that follow
    return value


class SkillRegistry:
    """Skills discovered in configured directories, by name.

    ``discovery_errors`` maps a path to why it was skipped (a folder without
    ``SKILL.md``, a broken header, a duplicate name, an unreadable directory).
    """

    def __init__(self, skills: Iterable[SkillInfo] = ()) -> None:
        self._skills: dict[str, SkillInfo] = {}
        self.discovery_errors: dict[str, str] = {}
        for skill in skills:
            if skill.name in self._skills:
                raise ValidationError("skill.duplicate", f"skill {skill.name!r} is given twice")
            self._skills[skill.name] = skill

    @classmethod
    def from_dirs(cls, dirs: Iterable[str | os.PathLike[str]]) -> SkillRegistry:
        """Discover the skills of every directory in ``dirs``; never raises.

        Problems are recorded in ``discovery_errors``; the first directory wins when two
        define the same skill name.
        """
        registry = cls()
        for directory in dirs:
            registry._scan(Path(directory))
        return registry

    def _scan(self, directory: Path) -> None:
        try:
            entries = sorted(directory.iterdir(), key=lambda entry: entry.name)
        except OSError as exc:
            self.discovery_errors[str(directory)] = f"unreadable directory: {exc}"
            return
        for entry in entries:
            try:
                if entry.name.startswith(".") or not entry.is_dir():
                    continue
                skill_file = entry / SKILL_FILE
                if not skill_file.is_file():
                    self.discovery_errors[str(entry)] = f"no {SKILL_FILE}"
                    continue
                header = read_header(skill_file)
            except (OSError, UnicodeDecodeError, SkillHeaderError) as exc:
                self.discovery_errors[str(entry)] = f"{type(exc).__name__}: {exc}"
                continue
            name = header.get("name", "")
            description = header.get("description", "")
            if not _NAME_RE.match(name):
                self.discovery_errors[str(entry)] = (
                    f"{SKILL_FILE} needs a 'name' of letters, digits, '_', '.' or '-'"
                )
                continue
            if not description:
                self.discovery_errors[str(entry)] = f"{SKILL_FILE} needs a 'description'"
                continue
            if name in self._skills:
                self.discovery_errors[str(entry)] = (
                    f"skill {name!r} already defined by {self._skills[name].path.parent}"
                )
                continue
            self._skills[name] = SkillInfo(name=name, description=description, path=skill_file)

    def names(self) -> list[str]:
        """Sorted names of the discovered skills."""
        return sorted(self._skills)

    def __contains__(self, name: object) -> bool:
        return name in self._skills

    def __len__(self) -> int:
        return len(self._skills)

    def get(self, name: str) -> SkillInfo | None:
        """Return a skill's metadata, or ``None``; the body is not read."""
        return self._skills.get(name)

    def load_body(self, name: str) -> str:
        """Read and return the body of skill ``name`` (the text after its front matter).

        Raises ``NotFoundError("skill.not_found")`` for an unknown skill and ``OSError``
        when its file can no longer be read.
        """
        skill = self._skills.get(name)
        if skill is None:
            raise NotFoundError("skill.not_found", f"skill {name!r} does not exist")
        text = skill.path.read_text(encoding="utf-8")
        lines = text.splitlines(keepends=True)
        # Skip the opening '---' and everything up to the closing one.
        for index, line in enumerate(lines[1:], start=1):
            if line.strip() == "---":
                return "".join(lines[index + 1 :]).lstrip("\n")
        return ""
