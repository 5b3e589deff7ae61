"""Agent package manifests: parsing, validation, normalisation and the content ref.

A manifest (DESIGN §4) names agents, flows and bundled files. ``parse_manifest`` checks
all of it in one pass and reports *every* problem it finds as one
``ValidationError("package.invalid")`` whose details carry the dotted field of each
problem, so an author fixes a package in one round trip instead of one error at a time.

The ref of a package is the SHA-256 of the canonical JSON of the normalized manifest
(defaults filled in, files included). Two manifests that differ only in key order or in
spelling out a default therefore share a ref, and any change of content gives a new one;
that is what makes a saved version immutable and comparable by ref alone.

This module is free of Django imports: the worker, the management commands and the tests
all use it directly.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from agents.mcp.naming import SERVER_NAME_RE
from sageproject.errors import NotFoundError, ValidationError

MAX_FILES = 256
# Total UTF-8 size of the bundled files, paths and contents together.
MAX_FILES_BYTES = 4 * 1024 * 1024
MAX_STEPS_LIMIT = 10_000
DEFAULT_MAX_STEPS = 8
MAX_PATH_CHARS = 1024
MAX_SEGMENT_CHARS = 255

NODE_TYPES = ("agent", "tool", "subflow", "parallel", "end")

# Ids (agents, flows, nodes, tools, skills) are plain words: they appear in URLs, admin
# pages and event payloads, and the flow executor uses "/" to qualify subflow node ids.
_ID_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}$")
# The package name and version rules, stated once: the API's serializers and the OpenAPI
# schema use these patterns too (``\A``/``\Z``: the whole string, no trailing newline;
# ASCII digits only). A version fits the column (50 characters).
NAME_PATTERN = r"\A[A-Za-z0-9][A-Za-z0-9_.-]{0,99}\Z"
VERSION_PATTERN = r"\A[0-9]{1,9}\.[0-9]{1,9}\.[0-9]{1,9}(?:-[0-9A-Za-z.-]+)?(?:\+[0-9A-Za-z.-]+)?\Z"
MAX_VERSION_CHARS = 50
_NAME_RE = re.compile(NAME_PATTERN)
_VERSION_RE = re.compile(VERSION_PATTERN)
_DRIVE_RE = re.compile(r"^[A-Za-z]:")
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")

# Names that must never be a bundled path segment: ``.git`` would let a package smuggle
# repository metadata into a checkout, and the Windows device names cannot be created
# (or are silently redirected) on a Windows host that unpacks the bundle.
_DEVICE_NAMES = frozenset(
    {"con", "prn", "aux", "nul"}
    | {f"com{i}" for i in range(1, 10)}
    | {f"lpt{i}" for i in range(1, 10)}
)
# The manifest's own file names in a package directory: a bundled file must not shadow it.
_RESERVED_ROOT_FILES = frozenset({"sage.yaml", "sage.yml", "sage.json"})

_TOP_KEYS = frozenset({"name", "version", "entrypoint", "agents", "flows", "files"})
_AGENT_KEYS = frozenset(
    {
        "model",
        "instructions",
        "tools",
        "skills",
        "subagents",
        "max_steps",
        "approval",
        "mcp_servers",
    }
)
_MCP_KEYS = frozenset({"name", "url", "allowed_tools", "approval", "timeout_seconds", "idempotent"})
MCP_DEFAULT_TIMEOUT_SECONDS = 30
MCP_MAX_TIMEOUT_SECONDS = 300
MCP_MAX_URL_CHARS = 2000
# An MCP tool's own name (what the server lists): printable, no spaces, bounded.
_MCP_TOOL_RE = re.compile(r"^[^\s\x00-\x1f\x7f]{1,128}$")
_FLOW_KEYS = frozenset({"start", "nodes", "edges"})
_EDGE_KEYS = frozenset({"from", "to", "when"})
_NODE_KEYS: dict[str, frozenset[str]] = {
    "agent": frozenset({"type", "agent"}),
    "tool": frozenset({"type", "tool", "input"}),
    "subflow": frozenset({"type", "flow"}),
    "parallel": frozenset({"type", "branches"}),
    "end": frozenset({"type"}),
}


def canonical_json(obj: Any) -> bytes:
    """Return the canonical UTF-8 JSON encoding of ``obj``: sorted keys, no whitespace.

    Raises ``TypeError``/``ValueError`` for values JSON cannot encode and
    ``UnicodeEncodeError`` for strings holding lone surrogates.
    """
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def file_path_problem(path: object) -> str | None:
    """Return why ``path`` may not name a bundled file, or ``None`` when it may.

    The rules keep a bundle safe to unpack anywhere: relative, no traversal, no empty or
    reserved segment, forward slashes only.
    """
    if not isinstance(path, str):
        return "file path must be a string"
    if not path:
        return "file path must not be empty"
    if len(path) > MAX_PATH_CHARS:
        return f"file path longer than {MAX_PATH_CHARS} characters"
    if "\\" in path:
        return "file path must not contain a backslash"
    if _CONTROL_RE.search(path):
        return "file path must not contain control characters"
    if path.startswith("/") or _DRIVE_RE.match(path):
        return "file path must be relative"
    for segment in path.split("/"):
        if segment == "":
            return "file path must not contain an empty segment"
        if segment in (".", ".."):
            return f"file path must not contain a {segment!r} segment"
        if len(segment) > MAX_SEGMENT_CHARS:
            return f"file path segment longer than {MAX_SEGMENT_CHARS} characters"
        lowered = segment.lower()
        # Windows resolves "nul.txt" to the device too, so the stem is what counts.
        if lowered == ".git" or lowered.split(".", 1)[0] in _DEVICE_NAMES:
            return f"file path uses the reserved name {segment!r}"
        if segment.endswith((".", " ")):
            return "file path segment must not end with a dot or a space"
    if path.lower() in _RESERVED_ROOT_FILES:
        return f"file path {path!r} is reserved for the manifest itself"
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class Manifest:
    """A validated, normalized package manifest and its content ref.

    Equality is by ref. ``data`` returns a copy so that no caller can change the content
    behind a ref.
    """

    ref: str
    _data: dict[str, Any] = field(repr=False, compare=False)

    @property
    def data(self) -> dict[str, Any]:
        """The normalized manifest (files included), as a fresh copy."""
        return copy.deepcopy(self._data)

    @property
    def name(self) -> str:
        return self._data["name"]

    @property
    def version(self) -> str:
        return self._data["version"]

    @property
    def entrypoint(self) -> str:
        return self._data["entrypoint"]

    @property
    def entrypoint_is_flow(self) -> bool:
        """True when the entrypoint names a flow rather than an agent."""
        return self._data["entrypoint"] in self._data["flows"]

    @property
    def agent_ids(self) -> list[str]:
        """Agent ids in manifest order."""
        return list(self._data["agents"])

    @property
    def flows(self) -> dict[str, Any]:
        """The flows mapping, as a fresh copy."""
        return copy.deepcopy(self._data["flows"])

    @property
    def files(self) -> dict[str, str]:
        """The bundled files (path → text), as a fresh copy."""
        return dict(self._data["files"])

    def agent(self, agent_id: str) -> dict[str, Any]:
        """Return a copy of one agent's normalized definition.

        Raises ``NotFoundError("package.agent_not_found")`` for an unknown id.
        """
        try:
            return copy.deepcopy(self._data["agents"][agent_id])
        except KeyError:
            raise NotFoundError(
                "package.agent_not_found",
                f"agent {agent_id!r} does not exist in this package version",
                details={"agent": agent_id},
            ) from None

    def instructions(self, agent_id: str) -> str:
        """Return an agent's instructions, reading a ``{"path": ...}`` from the bundle.

        Whitespace is preserved exactly. Raises ``NotFoundError("package.agent_not_found")``
        for an unknown agent; the bundled file always exists (validation checked it).
        """
        instructions = self.agent(agent_id)["instructions"]
        if isinstance(instructions, str):
            return instructions
        return self._data["files"][instructions["path"]]

    def resolved(self) -> dict[str, Any]:
        """Return the manifest without files, with every bundled instruction inlined."""
        data = self.data
        files = data.pop("files")
        for agent in data["agents"].values():
            if isinstance(agent["instructions"], dict):
                agent["instructions"] = files[agent["instructions"]["path"]]
        return data


class _Problems:
    """Collects (field, message) pairs so that validation reports everything at once."""

    def __init__(self) -> None:
        self.items: list[dict[str, str]] = []

    def add(self, field_path: str, message: str) -> None:
        self.items.append({"field": field_path, "message": message})

    def __bool__(self) -> bool:
        return bool(self.items)


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def _check_keys(
    value: Mapping[str, Any], allowed: frozenset[str], where: str, problems: _Problems
) -> None:
    for key in value:
        if not isinstance(key, str):
            problems.add(where, f"keys must be strings, got {key!r}")
        elif key not in allowed:
            problems.add(_join(where, key), f"unknown key {key!r}")


def _check_id(value: object, where: str, problems: _Problems, what: str) -> bool:
    if not isinstance(value, str) or not _ID_RE.match(value):
        problems.add(
            where,
            f"{what} must be 1-100 characters of letters, digits, '_', '.' or '-' (got {value!r})",
        )
        return False
    return True


def _str_list(value: object, where: str, problems: _Problems, what: str) -> list[str]:
    """Validate a list of unique ids; return the valid ones in order."""
    if value is None:
        return []
    if not isinstance(value, list):
        problems.add(where, f"must be a list of {what} names")
        return []
    out: list[str] = []
    for index, item in enumerate(value):
        item_field = f"{where}.{index}"
        if not _check_id(item, item_field, problems, f"a {what} name"):
            continue
        if item in out:
            problems.add(item_field, f"{what} {item!r} is listed twice")
            continue
        out.append(item)
    return out


def _objects(
    value: Mapping[Any, Any], where: str, kind: str, id_label: str, problems: _Problems
) -> Iterator[tuple[str, str, Mapping[str, Any]]]:
    """Yield ``(id, field, spec)`` for each entry of ``value`` with a valid id and an object
    as its spec; report every other entry (a bad id, or a ``kind`` that is not an object)."""
    for entry_id, spec in value.items():
        entry_field = f"{where}.{entry_id}"
        if not _check_id(entry_id, entry_field, problems, id_label):
            continue
        if not isinstance(spec, Mapping):
            problems.add(entry_field, f"{kind} must be an object")
            continue
        yield entry_id, entry_field, spec


def _load(data: dict[str, Any] | str | bytes, yaml_ok: bool) -> Any:
    if isinstance(data, bytes | bytearray):
        try:
            data = bytes(data).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _invalid([{"field": "", "message": f"manifest is not UTF-8: {exc}"}]) from None
    if not isinstance(data, str):
        return data
    try:
        return json.loads(data)
    except json.JSONDecodeError as exc:
        if not yaml_ok:
            raise _invalid(
                [{"field": "", "message": f"manifest is not valid JSON: {exc}"}]
            ) from None
    import yaml  # only the command line accepts YAML, so only it pays for the import

    try:
        return yaml.safe_load(data)
    except yaml.YAMLError as exc:
        raise _invalid(
            [{"field": "", "message": f"manifest is neither JSON nor YAML: {exc}"}]
        ) from None


def _invalid(errors: list[dict[str, str]]) -> ValidationError:
    first = errors[0]
    where = f"{first['field']}: " if first["field"] else ""
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return ValidationError(
        "package.invalid",
        f"invalid package: {where}{first['message']}{more}",
        details={"field": first["field"], "errors": errors},
    )


def parse_manifest(data: dict[str, Any] | str | bytes, *, yaml_ok: bool = False) -> Manifest:
    """Validate and normalize a package manifest; return it as a ``Manifest``.

    ``data`` is a mapping or JSON text (YAML text too when ``yaml_ok``). Defaults are
    filled in (empty tools/skills/subagents/flows/files, ``max_steps`` 8, empty
    instructions and tool input) so equal content always gives an equal ref.

    Raises ``ValidationError("package.invalid")`` listing every problem found, with
    ``details = {"field": <first dotted field>, "errors": [{"field", "message"}, ...]}``.
    """
    raw = _load(data, yaml_ok)
    problems = _Problems()
    if not isinstance(raw, Mapping):
        raise _invalid([{"field": "", "message": "manifest must be a JSON object"}])
    _check_keys(raw, _TOP_KEYS, "", problems)

    name = raw.get("name")
    if not isinstance(name, str) or not _NAME_RE.match(name):
        problems.add(
            "name",
            "name is required: 1-100 characters of letters, digits, '_', '.' or '-', "
            "starting with a letter or digit",
        )
    version = raw.get("version")
    if (
        not isinstance(version, str)
        or not _VERSION_RE.match(version)
        or len(version) > MAX_VERSION_CHARS
    ):
        problems.add(
            "version",
            f"version is required as MAJOR.MINOR.PATCH, e.g. '1.0.0' "
            f"(at most {MAX_VERSION_CHARS} characters)",
        )

    files = _normalize_files(raw.get("files"), problems)
    agents = _normalize_agents(raw.get("agents"), files, problems)
    flows = _normalize_flows(raw.get("flows"), agents, problems)

    for flow_id in flows:
        if flow_id in agents:
            problems.add(
                f"flows.{flow_id}", f"flow id {flow_id!r} is also an agent id; ids must differ"
            )
    entrypoint = raw.get("entrypoint")
    if not isinstance(entrypoint, str) or not entrypoint:
        problems.add("entrypoint", "entrypoint is required: an agent id or a flow id")
    elif entrypoint not in agents and entrypoint not in flows:
        problems.add("entrypoint", f"entrypoint {entrypoint!r} is neither an agent nor a flow")

    normalized = {
        "name": name,
        "version": version,
        "entrypoint": entrypoint,
        "agents": agents,
        "flows": flows,
        "files": files,
    }
    if not problems:
        _check_unicode(normalized, "", problems)
    if problems:
        raise _invalid(problems.items)
    ref = hashlib.sha256(canonical_json(normalized)).hexdigest()
    return Manifest(ref=ref, _data=normalized)


def _check_unicode(value: Any, where: str, problems: _Problems) -> None:
    """Report strings that cannot be encoded as UTF-8 (lone surrogates from JSON escapes)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            problems.add(where, "text is not valid Unicode (lone surrogate)")
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_unicode(key, where, problems)
            _check_unicode(item, _join(where, str(key)), problems)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_unicode(item, _join(where, str(index)), problems)


def _normalize_files(value: object, problems: _Problems) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        problems.add("files", "files must be an object of relative path → text")
        return {}
    if len(value) > MAX_FILES:
        problems.add("files", f"package exceeds {MAX_FILES} files ({len(value)} given)")
    files: dict[str, str] = {}
    total = 0
    for path, text in value.items():
        where = f"files.{path}"
        reason = file_path_problem(path)
        if reason is not None:
            problems.add(where, reason)
            continue
        if not isinstance(text, str):
            problems.add(where, "file content must be text")
            continue
        try:
            total += len(path.encode("utf-8")) + len(text.encode("utf-8"))
        except UnicodeEncodeError:
            problems.add(where, "file is not valid Unicode (lone surrogate)")
            continue
        files[path] = text
    if total > MAX_FILES_BYTES:
        problems.add("files", f"package files exceed 4 MiB ({total} bytes of UTF-8)")
    return files


def _normalize_agents(
    value: object, files: Mapping[str, str], problems: _Problems
) -> dict[str, dict[str, Any]]:
    if not isinstance(value, Mapping) or not value:
        problems.add("agents", "agents is required: an object with at least one agent")
        return {}
    agents: dict[str, dict[str, Any]] = {}
    for agent_id, where, spec in _objects(value, "agents", "agent", "an agent id", problems):
        _check_keys(spec, _AGENT_KEYS, where, problems)
        model = spec.get("model")
        if not isinstance(model, str) or not model.strip():
            problems.add(f"{where}.model", "model is required: the name of a model record")
        instructions: str | dict[str, str] = ""
        raw_instructions = spec.get("instructions", "")
        if isinstance(raw_instructions, str):
            instructions = raw_instructions
        elif isinstance(raw_instructions, Mapping):
            _check_keys(raw_instructions, frozenset({"path"}), f"{where}.instructions", problems)
            path = raw_instructions.get("path")
            if not isinstance(path, str) or not path:
                problems.add(f"{where}.instructions.path", "path of a bundled file is required")
            elif path not in files:
                problems.add(f"{where}.instructions.path", f"bundled file {path!r} does not exist")
            else:
                instructions = {"path": path}
        else:
            problems.add(
                f"{where}.instructions", 'instructions must be text or {"path": "<bundled file>"}'
            )
        max_steps = spec.get("max_steps", DEFAULT_MAX_STEPS)
        if (
            isinstance(max_steps, bool)
            or not isinstance(max_steps, int)
            or not 1 <= max_steps <= MAX_STEPS_LIMIT
        ):
            problems.add(
                f"{where}.max_steps", f"max_steps must be an integer from 1 to {MAX_STEPS_LIMIT}"
            )
            max_steps = DEFAULT_MAX_STEPS
        agents[agent_id] = {
            "model": model,
            "instructions": instructions,
            "tools": _str_list(spec.get("tools"), f"{where}.tools", problems, "tool"),
            "skills": _str_list(spec.get("skills"), f"{where}.skills", problems, "skill"),
            "subagents": _str_list(
                spec.get("subagents"), f"{where}.subagents", problems, "subagent"
            ),
            "max_steps": max_steps,
        }
        # Tools whose calls wait for the user's approval: kept only when some are named, so
        # the refs of manifests without them stay what they were.
        approval = _str_list(spec.get("approval"), f"{where}.approval", problems, "tool")
        for index, tool in enumerate(approval):
            if tool not in agents[agent_id]["tools"]:
                problems.add(
                    f"{where}.approval.{index}", f"{tool!r} is not one of the agent's tools"
                )
        if approval:
            agents[agent_id]["approval"] = approval
        # Remote MCP servers, kept only when some are listed (refs of older manifests stay).
        servers = _normalize_mcp_servers(spec.get("mcp_servers"), f"{where}.mcp_servers", problems)
        if servers:
            agents[agent_id]["mcp_servers"] = servers
    # References are checked once every id is known, so order in the manifest is free.
    for agent_id, agent in agents.items():
        for index, sub in enumerate(agent["subagents"]):
            sub_field = f"agents.{agent_id}.subagents.{index}"
            if sub == agent_id:
                problems.add(sub_field, "an agent cannot be its own subagent")
            elif sub not in value:
                problems.add(sub_field, f"subagent {sub!r} is not an agent of this package")
    return agents


def mcp_url_problem(url: object) -> str | None:
    """Why ``url`` cannot be an MCP server's address, or None. No credentials in it: the
    manifest is shared, and the user's own credentials live in their connections."""
    if not isinstance(url, str) or not url:
        return "url is required: the server's Streamable HTTP endpoint"
    if len(url) > MCP_MAX_URL_CHARS or _CONTROL_RE.search(url) or " " in url:
        return f"url must be at most {MCP_MAX_URL_CHARS} characters without spaces"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port out of range
    except ValueError as exc:
        return f"url is not a valid URL: {exc}"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "url must be an http or https URL with a host"
    if parts.username is not None or parts.password is not None:
        return "url must not carry credentials: users connect with their own"
    if parts.fragment:
        return "url must not have a fragment"
    return None


def _mcp_tool_list(value: object, where: str, problems: _Problems) -> list[str]:
    if not isinstance(value, list):
        problems.add(where, "must be a list of tool names")
        return []
    out: list[str] = []
    for index, item in enumerate(value):
        if not isinstance(item, str) or not _MCP_TOOL_RE.match(item):
            problems.add(f"{where}.{index}", f"not an MCP tool name: {item!r}")
        elif item in out:
            problems.add(f"{where}.{index}", f"tool {item!r} is listed twice")
        else:
            out.append(item)
    return out


def _normalize_mcp_servers(value: object, where: str, problems: _Problems) -> list[dict[str, Any]]:
    """Validate an agent's ``mcp_servers``; return the valid entries with defaults filled
    in (``approval`` "never", ``timeout_seconds`` 30; the optional lists only when given)."""
    if value is None:
        return []
    if not isinstance(value, list):
        problems.add(where, "mcp_servers must be a list of server objects")
        return []
    servers: list[dict[str, Any]] = []
    names: set[str] = set()
    for index, spec in enumerate(value):
        at = f"{where}.{index}"
        if not isinstance(spec, Mapping):
            problems.add(at, "an MCP server must be an object")
            continue
        _check_keys(spec, _MCP_KEYS, at, problems)
        name = spec.get("name")
        if not isinstance(name, str) or not SERVER_NAME_RE.match(name):
            problems.add(f"{at}.name", "name must be 1-32 characters of a-z, 0-9, '_' or '-'")
            continue
        if name in names:
            problems.add(f"{at}.name", f"MCP server {name!r} is listed twice")
            continue
        names.add(name)
        entry: dict[str, Any] = {"name": name, "url": spec.get("url")}
        reason = mcp_url_problem(entry["url"])
        if reason is not None:
            problems.add(f"{at}.url", reason)
        timeout = spec.get("timeout_seconds", MCP_DEFAULT_TIMEOUT_SECONDS)
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not 1 <= timeout <= MCP_MAX_TIMEOUT_SECONDS
        ):
            problems.add(
                f"{at}.timeout_seconds",
                f"timeout_seconds must be a number from 1 to {MCP_MAX_TIMEOUT_SECONDS}",
            )
            timeout = MCP_DEFAULT_TIMEOUT_SECONDS
        entry["timeout_seconds"] = timeout
        entry["approval"] = _mcp_approval(spec.get("approval", "never"), f"{at}.approval", problems)
        for key in ("allowed_tools", "idempotent"):
            if key in spec:
                entry[key] = _mcp_tool_list(spec[key], f"{at}.{key}", problems)
        servers.append(entry)
    return servers


def _mcp_approval(value: object, where: str, problems: _Problems) -> str | dict[str, list[str]]:
    if value in ("never", "always"):
        return value  # type: ignore[return-value]
    if isinstance(value, Mapping) and set(value) == {"always"}:
        return {"always": _mcp_tool_list(value["always"], f"{where}.always", problems)}
    problems.add(where, 'approval must be "never", "always" or {"always": [tool, ...]}')
    return "never"


def _normalize_flows(
    value: object, agents: Mapping[str, Any], problems: _Problems
) -> dict[str, dict[str, Any]]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        problems.add("flows", "flows must be an object of flow id → flow")
        return {}
    flow_ids = {fid for fid in value if isinstance(fid, str)}
    flows: dict[str, dict[str, Any]] = {}
    for flow_id, where, spec in _objects(value, "flows", "flow", "a flow id", problems):
        _check_keys(spec, _FLOW_KEYS, where, problems)
        nodes = _normalize_nodes(spec.get("nodes"), where, agents, flow_ids, problems)
        start = spec.get("start")
        if not isinstance(start, str) or not start:
            problems.add(f"{where}.start", "start is required: a node id of this flow")
        elif nodes and start not in nodes:
            problems.add(f"{where}.start", f"start node {start!r} does not exist")
        raw_nodes = spec.get("nodes") if isinstance(spec.get("nodes"), Mapping) else {}
        edges = _normalize_edges(spec.get("edges"), where, raw_nodes, nodes, problems)
        flows[flow_id] = {"start": start, "nodes": nodes, "edges": edges}
    return flows


def _normalize_nodes(
    value: object,
    where: str,
    agents: Mapping[str, Any],
    flow_ids: set[str],
    problems: _Problems,
) -> dict[str, dict[str, Any]]:
    if not isinstance(value, Mapping) or not value:
        problems.add(f"{where}.nodes", "nodes is required: an object with at least one node")
        return {}
    nodes: dict[str, dict[str, Any]] = {}
    entries = _objects(value, f"{where}.nodes", "node", "a node id", problems)
    for node_id, node_field, spec in entries:
        node_type = spec.get("type")
        if node_type not in NODE_TYPES:
            problems.add(f"{node_field}.type", f"type must be one of {', '.join(NODE_TYPES)}")
            continue
        for key in spec:
            if key not in _NODE_KEYS[node_type]:
                problems.add(
                    f"{node_field}.{key}", f"key {key!r} is not allowed on a {node_type} node"
                )
        node: dict[str, Any] = {"type": node_type}
        if node_type == "agent":
            agent_id = spec.get("agent")
            if not isinstance(agent_id, str) or agent_id not in agents:
                problems.add(
                    f"{node_field}.agent", f"agent {agent_id!r} is not an agent of this package"
                )
            node["agent"] = agent_id
        elif node_type == "tool":
            tool = spec.get("tool")
            _check_id(tool, f"{node_field}.tool", problems, "a tool name")
            tool_input = spec.get("input", {})
            if not isinstance(tool_input, Mapping):
                problems.add(f"{node_field}.input", "input must be an object")
                tool_input = {}
            node["tool"] = tool
            node["input"] = dict(tool_input)
        elif node_type == "subflow":
            flow = spec.get("flow")
            if not isinstance(flow, str) or flow not in flow_ids:
                problems.add(f"{node_field}.flow", f"flow {flow!r} is not a flow of this package")
            node["flow"] = flow
        elif node_type == "parallel":
            branches = spec.get("branches")
            if not isinstance(branches, list) or not branches:
                problems.add(
                    f"{node_field}.branches", "branches must be a non-empty list of node ids"
                )
                branches = []
            for index, branch in enumerate(branches):
                branch_field = f"{node_field}.branches.{index}"
                if branch == node_id:
                    problems.add(branch_field, "a parallel node cannot be its own branch")
                elif not isinstance(branch, str) or branch not in value:
                    problems.add(branch_field, f"branch {branch!r} is not a node of this flow")
                elif branches.index(branch) != index:
                    problems.add(branch_field, f"branch {branch!r} is listed twice")
            node["branches"] = list(branches)
        nodes[node_id] = node
    return nodes


def _normalize_edges(
    value: object,
    where: str,
    raw_nodes: Mapping[str, Any],
    nodes: Mapping[str, dict[str, Any]],
    problems: _Problems,
) -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, list):
        problems.add(f"{where}.edges", "edges must be a list")
        return []
    edges: list[dict[str, Any]] = []
    for index, spec in enumerate(value):
        edge_field = f"{where}.edges.{index}"
        if not isinstance(spec, Mapping):
            problems.add(edge_field, "edge must be an object")
            continue
        _check_keys(spec, _EDGE_KEYS, edge_field, problems)
        source, target = spec.get("from"), spec.get("to")
        for key, node_id in (("from", source), ("to", target)):
            if not isinstance(node_id, str) or node_id not in raw_nodes:
                problems.add(f"{edge_field}.{key}", f"node {node_id!r} is not a node of this flow")
        if isinstance(source, str) and nodes.get(source, {}).get("type") == "end":
            problems.add(f"{edge_field}.from", "an end node has no outgoing edges")
        edge: dict[str, Any] = {"from": source, "to": target}
        if "when" in spec:
            when = spec["when"]
            if not isinstance(when, Mapping):
                problems.add(f"{edge_field}.when", 'when must be {"contains": "<text>"}')
            else:
                _check_keys(when, frozenset({"contains"}), f"{edge_field}.when", problems)
                contains = when.get("contains")
                if not isinstance(contains, str) or not contains:
                    problems.add(
                        f"{edge_field}.when.contains", "contains must be a non-empty string"
                    )
                else:
                    edge["when"] = {"contains": contains}
        edges.append(edge)
    return edges
