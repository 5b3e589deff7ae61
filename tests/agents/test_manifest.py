from __future__ import annotations

import copy
import hashlib
import json
from typing import Any

import pytest

from agents.manifest import (
    MAX_FILES,
    MAX_FILES_BYTES,
    Manifest,
    canonical_json,
    parse_manifest,
)
from sageproject.errors import ErrorCategory, NotFoundError, ValidationError


def base() -> dict[str, Any]:
    return {
        "name": "support",
        "version": "1.0.0",
        "entrypoint": "assistant",
        "agents": {
            "assistant": {
                "model": "scripted",
                "instructions": {"path": "prompts/assistant.md"},
                "tools": ["clock"],
                "skills": ["refunds"],
                "subagents": ["helper"],
            },
            "helper": {"model": "scripted", "instructions": "Help.", "max_steps": 20},
        },
        "flows": {
            "triage": {
                "start": "first",
                "nodes": {
                    "first": {"type": "agent", "agent": "assistant"},
                    "lookup": {"type": "tool", "tool": "clock", "input": {}},
                    "done": {"type": "end"},
                },
                "edges": [
                    {"from": "first", "to": "lookup", "when": {"contains": "time"}},
                    {"from": "first", "to": "done"},
                    {"from": "lookup", "to": "done"},
                ],
            }
        },
        "files": {"prompts/assistant.md": "  You are helpful.\n"},
    }


def invalid(data: Any) -> ValidationError:
    with pytest.raises(ValidationError) as caught:
        parse_manifest(data)
    assert caught.value.code == "package.invalid"
    return caught.value


def fields(error: ValidationError) -> list[str]:
    return [item["field"] for item in error.details["errors"]]


# --- a valid manifest ---------------------------------------------------------------------


def test_it_accepts_a_valid_manifest_and_exposes_its_parts() -> None:
    manifest = parse_manifest(base())
    assert (manifest.name, manifest.version, manifest.entrypoint) == (
        "support",
        "1.0.0",
        "assistant",
    )
    assert manifest.agent_ids == ["assistant", "helper"]


def test_it_fills_in_defaults() -> None:
    agent = parse_manifest(base()).agent("helper")
    assert agent == {
        "model": "scripted",
        "instructions": "Help.",
        "tools": [],
        "skills": [],
        "subagents": [],
        "max_steps": 20,
    }
    assert parse_manifest(base()).agent("assistant")["max_steps"] == 8


def test_it_resolves_bundled_instructions_with_whitespace_preserved() -> None:
    manifest = parse_manifest(base())
    assert manifest.instructions("assistant") == "  You are helpful.\n"
    assert manifest.instructions("helper") == "Help."


def test_it_inlines_instructions_in_the_resolved_manifest() -> None:
    resolved = parse_manifest(base()).resolved()
    assert "files" not in resolved
    assert resolved["agents"]["assistant"]["instructions"] == "  You are helpful.\n"


def test_it_raises_not_found_for_an_unknown_agent() -> None:
    with pytest.raises(NotFoundError) as caught:
        parse_manifest(base()).agent("nobody")
    assert caught.value.code == "package.agent_not_found"


def test_it_hands_out_copies_so_the_content_behind_a_ref_cannot_change() -> None:
    manifest = parse_manifest(base())
    manifest.data["agents"]["helper"]["model"] = "changed"
    manifest.agent("helper")["tools"].append("x")
    assert manifest.agent("helper")["model"] == "scripted"
    assert manifest.agent("helper")["tools"] == []


def test_it_accepts_json_text_and_bytes() -> None:
    text = json.dumps(base())
    assert (
        parse_manifest(text).ref == parse_manifest(text.encode()).ref == parse_manifest(base()).ref
    )


def test_it_accepts_yaml_only_when_allowed() -> None:
    text = "name: y\nversion: 2.0.0\nentrypoint: a\nagents:\n  a:\n    model: scripted\n"
    assert parse_manifest(text, yaml_ok=True).version == "2.0.0"
    assert fields(invalid(text)) == [""]


def test_it_rejects_a_manifest_that_is_not_an_object() -> None:
    assert "JSON object" in invalid("[1, 2]").message


def test_it_accepts_a_flow_as_entrypoint() -> None:
    data = base()
    data["entrypoint"] = "triage"
    manifest = parse_manifest(data)
    assert manifest.entrypoint_is_flow


# --- collected errors ---------------------------------------------------------------------


def test_it_reports_every_problem_at_once() -> None:
    data = base()
    data["version"] = "one"
    data["agents"]["helper"]["max_steps"] = 0
    data["files"]["../escape"] = "x"
    error = invalid(data)
    assert set(fields(error)) == {"version", "agents.helper.max_steps", "files.../escape"}
    assert error.category == ErrorCategory.VALIDATION
    assert error.details["field"] == fields(error)[0]


@pytest.mark.parametrize("missing", ["name", "version", "entrypoint", "agents"])
def test_it_requires_the_top_level_fields(missing: str) -> None:
    data = base()
    del data[missing]
    assert missing in fields(invalid(data))


@pytest.mark.parametrize("version", ["1", "1.0", "v1.0.0", "1.0.0.0", "", 1])
def test_it_rejects_a_version_that_is_not_semver_like(version: object) -> None:
    data = base()
    data["version"] = version
    assert fields(invalid(data)) == ["version"]


@pytest.mark.parametrize("version", ["0.1.0", "10.20.30", "1.0.0-rc.1", "1.0.0+build.5"])
def test_it_accepts_semver_versions(version: str) -> None:
    data = base()
    data["version"] = version
    assert parse_manifest(data).version == version


def test_it_rejects_an_entrypoint_that_names_nothing() -> None:
    data = base()
    data["entrypoint"] = "ghost"
    assert fields(invalid(data)) == ["entrypoint"]


def test_it_requires_at_least_one_agent() -> None:
    data = base()
    data["agents"] = {}
    data["flows"] = {}
    data["entrypoint"] = "x"
    assert "agents" in fields(invalid(data))


def test_it_rejects_an_id_shared_by_an_agent_and_a_flow() -> None:
    data = base()
    data["flows"]["helper"] = {"start": "e", "nodes": {"e": {"type": "end"}}}
    assert fields(invalid(data)) == ["flows.helper"]


# --- unknown keys -------------------------------------------------------------------------


def test_it_rejects_an_unknown_top_level_key() -> None:
    data = base()
    data["plugins"] = []
    assert fields(invalid(data)) == ["plugins"]


def test_it_rejects_an_unknown_agent_key() -> None:
    data = base()
    data["agents"]["helper"]["temperature"] = 0.1
    assert fields(invalid(data)) == ["agents.helper.temperature"]


def test_it_rejects_an_unknown_flow_key() -> None:
    data = base()
    data["flows"]["triage"]["retries"] = 3
    assert fields(invalid(data)) == ["flows.triage.retries"]


def test_it_rejects_a_key_that_belongs_to_another_node_type() -> None:
    data = base()
    data["flows"]["triage"]["nodes"]["done"]["agent"] = "helper"
    assert fields(invalid(data)) == ["flows.triage.nodes.done.agent"]


def test_it_rejects_an_unknown_edge_key() -> None:
    data = base()
    data["flows"]["triage"]["edges"][1]["weight"] = 2
    assert fields(invalid(data)) == ["flows.triage.edges.1.weight"]


def test_it_rejects_a_condition_other_than_contains() -> None:
    data = base()
    data["flows"]["triage"]["edges"][0]["when"] = {"matches": "t.*"}
    assert "flows.triage.edges.0.when.matches" in fields(invalid(data))


def test_it_rejects_an_empty_contains_condition() -> None:
    data = base()
    data["flows"]["triage"]["edges"][0]["when"] = {"contains": ""}
    assert fields(invalid(data)) == ["flows.triage.edges.0.when.contains"]


def test_it_rejects_unknown_keys_in_bundled_instructions() -> None:
    data = base()
    data["agents"]["assistant"]["instructions"]["encoding"] = "utf-8"
    assert fields(invalid(data)) == ["agents.assistant.instructions.encoding"]


# --- agents -------------------------------------------------------------------------------


def test_it_requires_a_model_record_name() -> None:
    data = base()
    del data["agents"]["helper"]["model"]
    assert fields(invalid(data)) == ["agents.helper.model"]


@pytest.mark.parametrize("steps", [0, 10_001, True, "8", 2.5])
def test_it_rejects_max_steps_outside_1_to_10000(steps: object) -> None:
    data = base()
    data["agents"]["helper"]["max_steps"] = steps
    assert fields(invalid(data)) == ["agents.helper.max_steps"]


def test_it_accepts_max_steps_at_the_cap() -> None:
    data = base()
    data["agents"]["helper"]["max_steps"] = 10_000
    assert parse_manifest(data).agent("helper")["max_steps"] == 10_000


def test_it_rejects_instructions_from_a_file_that_is_not_bundled() -> None:
    data = base()
    data["agents"]["assistant"]["instructions"] = {"path": "prompts/missing.md"}
    assert fields(invalid(data)) == ["agents.assistant.instructions.path"]


def test_it_rejects_instructions_of_another_type() -> None:
    data = base()
    data["agents"]["helper"]["instructions"] = ["Help."]
    assert fields(invalid(data)) == ["agents.helper.instructions"]


def test_it_rejects_a_subagent_that_is_not_an_agent() -> None:
    data = base()
    data["agents"]["assistant"]["subagents"] = ["ghost"]
    assert fields(invalid(data)) == ["agents.assistant.subagents.0"]


def test_it_rejects_an_agent_that_is_its_own_subagent() -> None:
    data = base()
    data["agents"]["helper"]["subagents"] = ["helper"]
    assert fields(invalid(data)) == ["agents.helper.subagents.0"]


def test_it_allows_subagent_cycles_between_agents() -> None:
    data = base()
    data["agents"]["helper"]["subagents"] = ["assistant"]
    assert parse_manifest(data).agent("helper")["subagents"] == ["assistant"]


def test_it_rejects_a_tool_listed_twice() -> None:
    data = base()
    data["agents"]["assistant"]["tools"] = ["clock", "clock"]
    assert fields(invalid(data)) == ["agents.assistant.tools.1"]


def test_it_rejects_tools_that_are_not_a_list_of_names() -> None:
    data = base()
    data["agents"]["assistant"]["tools"] = "clock"
    assert fields(invalid(data)) == ["agents.assistant.tools"]


def test_it_rejects_an_agent_id_with_a_slash() -> None:
    data = base()
    data["agents"]["a/b"] = {"model": "scripted"}
    assert fields(invalid(data)) == ["agents.a/b"]


# --- flows --------------------------------------------------------------------------------


def test_it_rejects_a_start_node_that_does_not_exist() -> None:
    data = base()
    data["flows"]["triage"]["start"] = "nowhere"
    assert fields(invalid(data)) == ["flows.triage.start"]


def test_it_rejects_an_unknown_node_type() -> None:
    data = base()
    data["flows"]["triage"]["nodes"]["done"] = {"type": "loop"}
    assert fields(invalid(data)) == ["flows.triage.nodes.done.type"]


def test_it_rejects_an_agent_node_naming_no_agent_of_the_package() -> None:
    data = base()
    data["flows"]["triage"]["nodes"]["first"]["agent"] = "ghost"
    assert fields(invalid(data)) == ["flows.triage.nodes.first.agent"]


def test_it_rejects_a_tool_node_without_a_tool_name() -> None:
    data = base()
    del data["flows"]["triage"]["nodes"]["lookup"]["tool"]
    assert fields(invalid(data)) == ["flows.triage.nodes.lookup.tool"]


def test_it_rejects_a_tool_node_input_that_is_not_an_object() -> None:
    data = base()
    data["flows"]["triage"]["nodes"]["lookup"]["input"] = "now"
    assert fields(invalid(data)) == ["flows.triage.nodes.lookup.input"]


def test_it_rejects_a_subflow_naming_no_flow_of_the_package() -> None:
    data = base()
    data["flows"]["triage"]["nodes"]["sub"] = {"type": "subflow", "flow": "ghost"}
    assert fields(invalid(data)) == ["flows.triage.nodes.sub.flow"]


def test_it_accepts_a_subflow_defined_after_its_caller() -> None:
    data = base()
    data["flows"]["triage"]["nodes"]["sub"] = {"type": "subflow", "flow": "later"}
    data["flows"]["later"] = {"start": "e", "nodes": {"e": {"type": "end"}}}
    assert parse_manifest(data).flows["triage"]["nodes"]["sub"]["flow"] == "later"


def test_it_rejects_a_parallel_branch_that_is_not_a_node() -> None:
    data = base()
    data["flows"]["triage"]["nodes"]["fan"] = {"type": "parallel", "branches": ["lookup", "x"]}
    assert fields(invalid(data)) == ["flows.triage.nodes.fan.branches.1"]


def test_it_rejects_a_parallel_node_without_branches() -> None:
    data = base()
    data["flows"]["triage"]["nodes"]["fan"] = {"type": "parallel", "branches": []}
    assert fields(invalid(data)) == ["flows.triage.nodes.fan.branches"]


def test_it_rejects_an_edge_to_a_node_that_does_not_exist() -> None:
    data = base()
    data["flows"]["triage"]["edges"].append({"from": "lookup", "to": "ghost"})
    assert fields(invalid(data)) == ["flows.triage.edges.3.to"]


def test_it_rejects_an_edge_from_a_node_that_does_not_exist() -> None:
    data = base()
    data["flows"]["triage"]["edges"].append({"from": "ghost", "to": "done"})
    assert fields(invalid(data)) == ["flows.triage.edges.3.from"]


def test_it_rejects_an_edge_out_of_an_end_node() -> None:
    data = base()
    data["flows"]["triage"]["edges"].append({"from": "done", "to": "first"})
    assert fields(invalid(data)) == ["flows.triage.edges.3.from"]


def test_it_allows_cycles_between_flow_nodes() -> None:
    data = base()
    data["flows"]["triage"]["edges"].append({"from": "lookup", "to": "first"})
    assert len(parse_manifest(data).flows["triage"]["edges"]) == 4


# --- bundled file paths -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "reason"),
    [
        ("", "empty"),
        ("/tmp/escape", "relative"),
        ("C:/escape", "relative"),
        ("../escape", "'..'"),
        ("a/../b", "'..'"),
        ("./a", "'.'"),
        ("a//b", "empty segment"),
        ("a/", "empty segment"),
        ("a\\b", "backslash"),
        (".git/config", "reserved"),
        ("docs/.GIT", "reserved"),
        ("CON", "reserved"),
        ("nul.txt", "reserved"),
        ("a/com1.md", "reserved"),
        ("lpt9", "reserved"),
        ("sage.yaml", "manifest"),
        ("a\x00b", "control"),
        ("notes.", "dot or a space"),
    ],
)
def test_it_rejects_a_bundled_file_path(path: str, reason: str) -> None:
    data = base()
    data["files"][path] = "x"
    error = invalid(data)
    assert fields(error) == [f"files.{path}"]
    assert reason in error.details["errors"][0]["message"]


@pytest.mark.parametrize("path", [".gitignore", "docs/console.md", "a/b/c.txt", "nested/sage.yaml"])
def test_it_accepts_ordinary_bundled_file_paths(path: str) -> None:
    data = base()
    data["files"][path] = "x"
    assert path in parse_manifest(data).files


def test_it_rejects_file_content_that_is_not_text() -> None:
    data = base()
    data["files"]["data.bin"] = b"x"
    assert fields(invalid(data)) == ["files.data.bin"]


def test_it_accepts_exactly_256_files() -> None:
    data = base()
    data["files"] = {f"f{i}.txt": "x" for i in range(MAX_FILES - 1)}
    data["files"]["prompts/assistant.md"] = "hi"
    assert len(parse_manifest(data).files) == MAX_FILES


def test_it_rejects_more_than_256_files() -> None:
    data = base()
    data["files"].update({f"f{i}.txt": "x" for i in range(MAX_FILES)})
    error = invalid(data)
    assert fields(error) == ["files"]
    assert "256" in error.message


def test_it_accepts_files_of_exactly_4_mib() -> None:
    data = base()
    path = "prompts/assistant.md"
    data["files"] = {path: "a" * (MAX_FILES_BYTES - len(path))}
    assert parse_manifest(data).ref


def test_it_rejects_files_over_4_mib_counting_utf8_bytes() -> None:
    data = base()
    path = "prompts/assistant.md"
    # 'é' is two bytes in UTF-8: the character count is under the limit, the bytes are not.
    body = "é" * ((MAX_FILES_BYTES - len(path)) // 2) + "a"
    assert len(body) < MAX_FILES_BYTES
    data["files"] = {path: body}
    error = invalid(data)
    assert fields(error) == ["files"]
    assert "4 MiB" in error.message


def test_it_rejects_text_with_a_lone_surrogate() -> None:
    data = base()
    data["agents"]["helper"]["instructions"] = "bad \ud800"
    assert fields(invalid(data)) == ["agents.helper.instructions"]


# --- ref ----------------------------------------------------------------------------------


def test_it_gives_the_same_ref_to_the_same_content() -> None:
    assert parse_manifest(base()).ref == parse_manifest(base()).ref


def test_it_is_a_sha256_of_the_canonical_json_of_the_normalized_manifest() -> None:
    manifest = parse_manifest(base())
    assert manifest.ref == hashlib.sha256(canonical_json(manifest.data)).hexdigest()


def test_it_ignores_key_order_in_the_ref() -> None:
    data = base()
    reordered = {key: data[key] for key in reversed(list(data))}
    reordered["agents"] = {
        agent_id: dict(reversed(list(spec.items()))) for agent_id, spec in data["agents"].items()
    }
    assert parse_manifest(reordered).ref == parse_manifest(base()).ref


def test_it_gives_the_same_ref_when_a_default_is_spelled_out() -> None:
    data = base()
    data["agents"]["assistant"]["max_steps"] = 8
    data["agents"]["helper"]["tools"] = []
    assert parse_manifest(data).ref == parse_manifest(base()).ref


@pytest.mark.parametrize(
    "change",
    [
        lambda d: d.__setitem__("version", "1.0.1"),
        lambda d: d["agents"]["helper"].__setitem__("instructions", "Help!"),
        lambda d: d["files"].__setitem__("prompts/assistant.md", "  You are helpful. \n"),
        lambda d: d["files"].__setitem__("extra.md", ""),
        lambda d: d["flows"]["triage"]["edges"][0]["when"].__setitem__("contains", "Time"),
    ],
)
def test_it_gives_a_different_ref_to_any_change(change: Any) -> None:
    data = copy.deepcopy(base())
    change(data)
    assert parse_manifest(data).ref != parse_manifest(base()).ref


def test_it_compares_manifests_by_ref() -> None:
    assert parse_manifest(base()) == parse_manifest(json.dumps(base()))
    assert isinstance(parse_manifest(base()), Manifest)


def test_it_encodes_canonical_json_with_sorted_keys_and_no_whitespace() -> None:
    assert canonical_json({"b": [1, {"d": 1, "c": "é"}], "a": None}) == (
        '{"a":null,"b":[1,{"c":"é","d":1}]}'.encode()
    )
