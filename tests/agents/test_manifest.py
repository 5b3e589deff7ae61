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


REMOVED = object()


def changed(path: str, *, to: Any) -> dict[str, Any]:
    """``base()`` with one change at the dotted ``path`` (digits index a list): the item
    there set ``to`` a value, or removed when ``to`` is ``REMOVED``; an index one past the end
    of a list appends to it."""
    data = base()
    *parents, last = [int(key) if key.isdigit() else key for key in path.split(".")]
    container: Any = data
    for key in parents:
        container = container[key]
    if to is REMOVED:
        del container[last]
    elif isinstance(container, list) and last == len(container):
        container.append(to)
    else:
        container[last] = to
    return data


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


TOP_LEVEL_PROBLEMS = [
    # (changed path, new value or REMOVED, where below the path the problem is)
    ("entrypoint", "ghost", ""),
    # an id shared by an agent and a flow
    ("flows.helper", {"start": "e", "nodes": {"e": {"type": "end"}}}, ""),
]


def test_it_requires_at_least_one_agent() -> None:
    data = base()
    data["agents"] = {}
    data["flows"] = {}
    data["entrypoint"] = "x"
    assert "agents" in fields(invalid(data))


# --- unknown keys -------------------------------------------------------------------------


UNKNOWN_KEYS = [
    ("plugins", [], ""),
    ("agents.helper.temperature", 0.1, ""),
    ("flows.triage.retries", 3, ""),
    ("flows.triage.nodes.done.agent", "helper", ""),
    ("flows.triage.edges.1.weight", 2, ""),
    ("flows.triage.edges.0.when", {"contains": ""}, ".contains"),
    ("agents.assistant.instructions.encoding", "utf-8", ""),
]


def test_it_rejects_a_condition_other_than_contains() -> None:
    data = base()
    data["flows"]["triage"]["edges"][0]["when"] = {"matches": "t.*"}
    assert "flows.triage.edges.0.when.matches" in fields(invalid(data))


# --- agents -------------------------------------------------------------------------------


AGENT_PROBLEMS = [
    ("agents.helper.model", REMOVED, ""),
    ("agents.assistant.instructions", {"path": "prompts/missing.md"}, ".path"),
    ("agents.helper.instructions", ["Help."], ""),
    ("agents.assistant.subagents", ["ghost"], ".0"),
    ("agents.helper.subagents", ["helper"], ".0"),
    ("agents.assistant.tools", ["clock", "clock"], ".1"),
    ("agents.assistant.tools", "clock", ""),
    # an id with a slash
    ("agents.a/b", {"model": "scripted"}, ""),
    # text with a lone surrogate
    ("agents.helper.instructions", "bad \ud800", ""),
]


@pytest.mark.parametrize("steps", [0, 10_001, True, "8", 2.5])
def test_it_rejects_max_steps_outside_1_to_10000(steps: object) -> None:
    data = base()
    data["agents"]["helper"]["max_steps"] = steps
    assert fields(invalid(data)) == ["agents.helper.max_steps"]


def test_it_accepts_max_steps_at_the_cap() -> None:
    data = base()
    data["agents"]["helper"]["max_steps"] = 10_000
    assert parse_manifest(data).agent("helper")["max_steps"] == 10_000


def test_it_allows_subagent_cycles_between_agents() -> None:
    data = base()
    data["agents"]["helper"]["subagents"] = ["assistant"]
    assert parse_manifest(data).agent("helper")["subagents"] == ["assistant"]


# --- flows --------------------------------------------------------------------------------


FLOW_PROBLEMS = [
    ("flows.triage.start", "nowhere", ""),
    ("flows.triage.nodes.done", {"type": "loop"}, ".type"),
    ("flows.triage.nodes.first.agent", "ghost", ""),
    ("flows.triage.nodes.lookup.tool", REMOVED, ""),
    ("flows.triage.nodes.lookup.input", "now", ""),
    ("flows.triage.nodes.sub", {"type": "subflow", "flow": "ghost"}, ".flow"),
    ("flows.triage.nodes.fan", {"type": "parallel", "branches": ["lookup", "x"]}, ".branches.1"),
    ("flows.triage.nodes.fan", {"type": "parallel", "branches": []}, ".branches"),
    ("flows.triage.edges.3", {"from": "lookup", "to": "ghost"}, ".to"),
    ("flows.triage.edges.3", {"from": "ghost", "to": "done"}, ".from"),
    # an end node has no outgoing edges
    ("flows.triage.edges.3", {"from": "done", "to": "first"}, ".from"),
]


def test_it_accepts_a_subflow_defined_after_its_caller() -> None:
    data = base()
    data["flows"]["triage"]["nodes"]["sub"] = {"type": "subflow", "flow": "later"}
    data["flows"]["later"] = {"start": "e", "nodes": {"e": {"type": "end"}}}
    assert parse_manifest(data).flows["triage"]["nodes"]["sub"]["flow"] == "later"


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


@pytest.mark.parametrize(
    ("path", "value", "below"), TOP_LEVEL_PROBLEMS + UNKNOWN_KEYS + AGENT_PROBLEMS + FLOW_PROBLEMS
)
def test_it_reports_a_bad_change_at_the_changed_field(path: str, value: Any, below: str) -> None:
    """Each change breaks one rule: the one problem is at the changed field or ``below`` it."""
    assert fields(invalid(changed(path, to=value))) == [path + below]


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
