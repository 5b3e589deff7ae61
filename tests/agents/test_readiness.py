"""Skills discovery and package readiness (discovery only: no model, tool or skill body)."""

from __future__ import annotations

import os
import sys
import types
from collections.abc import Iterator
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Any

import pytest

from agents.manifest import Manifest, parse_manifest
from agents.readiness import check_readiness, raise_if_not_ready
from agents.skills import SkillRegistry, read_header
from agents.tools import Tool, ToolRegistry, build_registry
from sageproject.errors import NotFoundError, ValidationError
from tests.conftest import flow_manifest


def write_skill(root: Path, folder: str, header: str, body: str = "Body text.\n") -> Path:
    path = root / folder
    path.mkdir(parents=True)
    (path / "SKILL.md").write_text(f"---\n{header}---\n{body}", encoding="utf-8")
    return path / "SKILL.md"


# --- skills discovery ---------------------------------------------------------------------


def test_it_discovers_one_skill_per_folder(tmp_path: Path) -> None:
    write_skill(tmp_path, "refunds", "name: refunds\ndescription: Handle refunds.\n")
    write_skill(tmp_path, "billing", "name: billing\ndescription: Explain invoices.\n")
    registry = SkillRegistry.from_dirs([tmp_path])
    assert registry.names() == ["billing", "refunds"]
    assert registry.discovery_errors == {}


def test_it_returns_metadata_from_the_front_matter(tmp_path: Path) -> None:
    path = write_skill(tmp_path, "r", "name: refunds\ndescription: 'Handle: refunds.'\n")
    skill = SkillRegistry.from_dirs([tmp_path]).get("refunds")
    assert skill is not None
    assert (skill.name, skill.description, skill.path) == ("refunds", "Handle: refunds.", path)


def test_it_folds_an_indented_continuation_into_the_value(tmp_path: Path) -> None:
    write_skill(tmp_path, "r", "name: refunds\ndescription: >\n  Handle\n  refunds.\n")
    skill = SkillRegistry.from_dirs([tmp_path]).get("refunds")
    assert skill is not None and skill.description == "Handle refunds."


def test_it_merges_several_directories(tmp_path: Path) -> None:
    write_skill(tmp_path / "one", "a", "name: a\ndescription: A.\n")
    write_skill(tmp_path / "two", "b", "name: b\ndescription: B.\n")
    assert SkillRegistry.from_dirs([tmp_path / "one", tmp_path / "two"]).names() == ["a", "b"]


def test_it_never_reads_the_body_during_discovery(tmp_path: Path) -> None:
    # Invalid UTF-8 after the header: reading past the front matter would fail discovery.
    path = tmp_path / "r"
    path.mkdir()
    (path / "SKILL.md").write_bytes(b"---\nname: r\ndescription: R.\n---\n\xff\xfe body\n")
    registry = SkillRegistry.from_dirs([tmp_path])
    assert registry.names() == ["r"]
    assert registry.discovery_errors == {}


def test_it_loads_the_body_only_when_asked(tmp_path: Path) -> None:
    write_skill(tmp_path, "r", "name: r\ndescription: R.\n", body="Step 1.\nStep 2.\n")
    assert SkillRegistry.from_dirs([tmp_path]).load_body("r") == "Step 1.\nStep 2.\n"


def test_it_raises_not_found_for_the_body_of_an_unknown_skill(tmp_path: Path) -> None:
    with pytest.raises(NotFoundError) as caught:
        SkillRegistry.from_dirs([tmp_path]).load_body("ghost")
    assert caught.value.code == "skill.not_found"


def test_it_records_a_folder_without_skill_md(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    registry = SkillRegistry.from_dirs([tmp_path])
    assert registry.names() == []
    assert registry.discovery_errors == {str(tmp_path / "empty"): "no SKILL.md"}


def test_it_records_a_skill_md_without_front_matter(tmp_path: Path) -> None:
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "SKILL.md").write_text("# just a title\n", encoding="utf-8")
    registry = SkillRegistry.from_dirs([tmp_path])
    assert "front matter" in registry.discovery_errors[str(tmp_path / "bad")]


def test_it_records_a_front_matter_that_is_never_closed(tmp_path: Path) -> None:
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "SKILL.md").write_text("---\nname: x\ndescription: y\n", encoding="utf-8")
    registry = SkillRegistry.from_dirs([tmp_path])
    assert "not closed" in registry.discovery_errors[str(tmp_path / "bad")]


def test_it_records_a_header_without_a_description(tmp_path: Path) -> None:
    write_skill(tmp_path, "bad", "name: bad\n")
    registry = SkillRegistry.from_dirs([tmp_path])
    assert "description" in registry.discovery_errors[str(tmp_path / "bad")]
    assert "bad" not in registry


def test_it_records_a_header_with_an_invalid_name(tmp_path: Path) -> None:
    write_skill(tmp_path, "bad", "name: two words\ndescription: x\n")
    assert "name" in SkillRegistry.from_dirs([tmp_path]).discovery_errors[str(tmp_path / "bad")]


def test_it_records_a_malformed_header_line(tmp_path: Path) -> None:
    write_skill(tmp_path, "bad", "name: bad\nthis line has no colon\n")
    assert (
        "key: value" in SkillRegistry.from_dirs([tmp_path]).discovery_errors[str(tmp_path / "bad")]
    )


def test_it_keeps_the_first_of_two_skills_with_one_name(tmp_path: Path) -> None:
    first = write_skill(tmp_path, "a", "name: same\ndescription: first\n")
    write_skill(tmp_path, "b", "name: same\ndescription: second\n")
    registry = SkillRegistry.from_dirs([tmp_path])
    skill = registry.get("same")
    assert skill is not None and skill.path == first
    assert "already defined" in registry.discovery_errors[str(tmp_path / "b")]


def test_it_records_a_directory_that_does_not_exist(tmp_path: Path) -> None:
    registry = SkillRegistry.from_dirs([tmp_path / "missing"])
    assert "unreadable directory" in registry.discovery_errors[str(tmp_path / "missing")]


def test_it_records_a_configured_path_that_is_not_a_directory(tmp_path: Path) -> None:
    plain = tmp_path / "skills.txt"
    plain.write_text("not a directory", encoding="utf-8")
    registry = SkillRegistry.from_dirs([plain])
    assert "unreadable directory" in registry.discovery_errors[str(plain)]


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any directory")
def test_it_records_an_unreadable_directory(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0)
    try:
        registry = SkillRegistry.from_dirs([locked])
    finally:
        locked.chmod(0o755)
    assert str(locked) in registry.discovery_errors


def test_it_skips_hidden_folders_and_plain_files(tmp_path: Path) -> None:
    (tmp_path / ".cache").mkdir()
    (tmp_path / "README.md").write_text("hi", encoding="utf-8")
    registry = SkillRegistry.from_dirs([tmp_path])
    assert (registry.names(), registry.discovery_errors) == ([], {})


def test_it_reads_a_header_field_by_field(tmp_path: Path) -> None:
    path = write_skill(tmp_path, "r", '# comment\nname: r\n\ndescription: "R"\n')
    assert read_header(path) == {"name": "r", "description": "R"}


# --- readiness ----------------------------------------------------------------------------


@pytest.fixture
def skills_dir(tmp_path: Path) -> Path:
    write_skill(tmp_path, "refunds", "name: refunds\ndescription: Handle refunds.\n")
    write_skill(tmp_path, "billing", "name: billing\ndescription: Invoices.\n")
    return tmp_path


def manifest(**agents: dict[str, Any]) -> Manifest:
    return parse_manifest(
        {
            "name": "support",
            "version": "1.0.0",
            "entrypoint": next(iter(agents)),
            "agents": agents,
        }
    )


SUPPORT = manifest(
    assistant={"model": "scripted", "tools": ["clock"], "skills": ["refunds"]},
    helper={"model": "scripted", "tools": ["calculator"], "skills": ["billing"]},
)


def check(
    package: Manifest,
    skills_dir: Path | None,
    *,
    tools: ToolRegistry | None = None,
    model_names: AbstractSet[str] | None = frozenset({"scripted"}),
    strict: bool = False,
) -> Any:
    return check_readiness(
        package,
        tools=tools if tools is not None else build_registry(),
        skills=SkillRegistry.from_dirs([skills_dir]) if skills_dir is not None else None,
        model_names=set(model_names) if model_names is not None else None,
        strict=strict,
    )


def test_it_is_ready_when_every_binding_is_found(skills_dir: Path) -> None:
    result = check(SUPPORT, skills_dir)
    assert (result.valid, result.ready) == (True, True)
    assert result.agents["assistant"] == {
        "missing_tools": [],
        "missing_skills": [],
        "unverified": [],
        "missing_model": None,
        "ready": True,
    }


def test_it_lists_a_removed_skill_as_missing_while_staying_valid(skills_dir: Path) -> None:
    for child in (skills_dir / "billing").iterdir():
        child.unlink()
    (skills_dir / "billing").rmdir()
    result = check(SUPPORT, skills_dir)
    assert (result.valid, result.ready) == (True, False)
    assert result.agents["helper"]["missing_skills"] == ["billing"]
    assert result.agents["assistant"]["ready"] is True


def test_it_checks_every_agent_not_only_the_entrypoint(skills_dir: Path) -> None:
    package = manifest(
        assistant={"model": "scripted"},
        unused={"model": "scripted", "tools": ["teleport"]},
    )
    result = check(package, skills_dir)
    assert result.agents["unused"]["missing_tools"] == ["teleport"]
    assert result.ready is False


def test_it_lists_missing_tools_sorted(skills_dir: Path) -> None:
    package = manifest(assistant={"model": "scripted", "tools": ["zeta", "clock", "alpha"]})
    assert check(package, skills_dir).agents["assistant"]["missing_tools"] == ["alpha", "zeta"]


def test_it_shows_code_tools_as_missing_when_they_are_not_registered(skills_dir: Path) -> None:
    package = manifest(assistant={"model": "scripted", "tools": ["python", "python_session"]})
    result = check(package, skills_dir)
    assert result.agents["assistant"]["missing_tools"] == ["python", "python_session"]


def test_it_finds_tools_registered_beyond_the_built_ins(skills_dir: Path) -> None:
    async def handler(args: dict[str, Any], ctx: Any) -> str:
        raise AssertionError("readiness must never execute a tool")

    extra = Tool(name="python", description="code", parameters={}, handler=handler)
    package = manifest(assistant={"model": "scripted", "tools": ["python"]})
    result = check(package, skills_dir, tools=build_registry(extra=[extra]))
    assert result.ready is True


@pytest.fixture
def broken_tool_module() -> Iterator[str]:
    name = "tests_agents_broken_tools"
    module = types.ModuleType(name)  # no TOOLS attribute: loading it fails
    sys.modules[name] = module
    yield name
    del sys.modules[name]


def test_it_marks_absent_tools_unverified_when_a_tool_module_failed(
    skills_dir: Path, broken_tool_module: str
) -> None:
    tools = build_registry([broken_tool_module])
    package = manifest(assistant={"model": "scripted", "tools": ["clock", "plugin_tool"]})
    report = check(package, skills_dir, tools=tools).agents["assistant"]
    assert report["missing_tools"] == []
    assert len(report["unverified"]) == 1
    assert "plugin_tool" in report["unverified"][0]
    assert broken_tool_module in report["unverified"][0]
    assert report["ready"] is False


def test_it_marks_absent_skills_unverified_when_skill_discovery_failed(skills_dir: Path) -> None:
    (skills_dir / "broken").mkdir()
    package = manifest(assistant={"model": "scripted", "skills": ["refunds", "maybe"]})
    report = check(package, skills_dir).agents["assistant"]
    assert report["missing_skills"] == []
    assert report["unverified"] and "maybe" in report["unverified"][0]


def test_it_lists_every_skill_missing_without_a_skill_provider() -> None:
    package = manifest(assistant={"model": "scripted", "skills": ["b", "a"]})
    assert check(package, None).agents["assistant"]["missing_skills"] == ["a", "b"]


def test_it_does_not_require_load_skill_from_the_tool_registry(skills_dir: Path) -> None:
    package = manifest(
        assistant={"model": "scripted", "tools": ["load_skill"], "skills": ["refunds"]}
    )
    assert check(package, skills_dir).ready is True


def test_it_leaves_the_model_unverified_when_model_records_were_not_checked(
    skills_dir: Path,
) -> None:
    report = check(SUPPORT, skills_dir, model_names=None).agents["assistant"]
    assert report["unverified"] == ["model record 'scripted': model records were not checked"]
    assert report["ready"] is False


def test_it_reports_a_model_record_that_does_not_exist(skills_dir: Path) -> None:
    report = check(SUPPORT, skills_dir, model_names={"gpt"}).agents["assistant"]
    assert report["missing_model"] == "scripted"
    assert report["ready"] is False


def test_it_checks_the_tools_of_flow_tool_nodes(skills_dir: Path) -> None:
    package = parse_manifest(
        flow_manifest(
            {"a": {"model": "scripted"}},
            start="t",
            nodes={
                "t": {"type": "tool", "tool": "teleport"},
                "c": {"type": "tool", "tool": "clock"},
            },
        )
    )
    result = check(package, skills_dir)
    assert result.flows == {"main": {"missing_tools": ["teleport"], "unverified": []}}
    assert result.ready is False


def test_it_never_loads_skill_content(skills_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(self: SkillRegistry, name: str) -> str:
        raise AssertionError("readiness must not load a skill body")

    monkeypatch.setattr(SkillRegistry, "load_body", forbidden)
    assert check(SUPPORT, skills_dir).ready is True


def test_it_serializes_to_a_plain_dict(skills_dir: Path) -> None:
    result = check(SUPPORT, skills_dir, strict=True)
    data = result.to_dict()
    assert set(data) == {"ref", "valid", "ready", "strict", "agents", "flows", "scope"}
    assert data["ref"] == SUPPORT.ref
    assert data["strict"] is True
    assert set(data["agents"]) == {"assistant", "helper"}
    # The reports are copies: changing the dict leaves the result as it was.
    assert data["agents"] == result.agents
    data["agents"]["assistant"]["ready"] = "changed"
    assert result.agents["assistant"]["ready"] != "changed"


def test_it_raises_package_not_ready_in_strict_mode_listing_what_is_missing(
    skills_dir: Path,
) -> None:
    package = manifest(assistant={"model": "scripted", "skills": ["refunds", "gone"]})
    result = check(package, skills_dir, strict=True)
    with pytest.raises(ValidationError) as caught:
        raise_if_not_ready(result)
    assert caught.value.code == "package.not_ready"
    assert caught.value.details["agents"]["assistant"]["missing_skills"] == ["gone"]
    assert "gone" in caught.value.message


def test_it_does_not_raise_for_a_non_strict_result(skills_dir: Path) -> None:
    package = manifest(assistant={"model": "scripted", "skills": ["gone"]})
    raise_if_not_ready(check(package, skills_dir, strict=False))


def test_it_does_not_raise_in_strict_mode_when_ready(skills_dir: Path) -> None:
    raise_if_not_ready(check(SUPPORT, skills_dir, strict=True))


def test_it_treats_unverified_bindings_as_not_ready_in_strict_mode(skills_dir: Path) -> None:
    with pytest.raises(ValidationError) as caught:
        raise_if_not_ready(check(SUPPORT, skills_dir, model_names=None, strict=True))
    assert set(caught.value.details["agents"]) == {"assistant", "helper"}
