"""Readiness: can the tools, skills and model records a package declares be found now?

A package can be *valid* (its manifest is well formed and self-consistent) and still not
*ready*: a skill was removed from disk, a tool plugin failed to import, a model record was
renamed. Readiness answers that question per agent, for every agent of the package,
without calling a model, executing a tool or loading a skill's content:
discovery only. What discovery cannot settle is reported as ``unverified`` rather than
guessed, and strict mode (``SAGE_REQUIRE_READINESS``) treats it like a missing resource.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from agents.manifest import Manifest
from agents.mcp.discovery import Discovery
from agents.mcp.naming import tool_name
from agents.skills import SkillRegistry
from agents.tools import ToolRegistry
from sageproject.errors import ValidationError

SCOPE = "resource discovery only; no credential, model generation or skill materialization test"
# Offered by the engine to every agent that has skills, so it is never a registry tool.
LOAD_SKILL_TOOL = "load_skill"


@dataclass(frozen=True, slots=True, kw_only=True)
class ReadinessResult:
    """Readiness of one package version.

    ``agents`` maps every agent id to ``{"missing_tools", "missing_skills", "unverified",
    "missing_model", "ready"}``. ``valid`` is about the manifest (always true once it
    parsed); ``ready`` is true only when no agent misses or leaves unverified anything.
    """

    ref: str
    valid: bool
    ready: bool
    strict: bool
    agents: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Tool nodes of flows, by flow id: {"missing_tools", "unverified"} (only flows with tools).
    flows: dict[str, dict[str, list[str]]] = field(default_factory=dict)

    def not_ready_agents(self) -> dict[str, dict[str, Any]]:
        """The per-agent reports of the agents that are not ready."""
        return {agent_id: report for agent_id, report in self.agents.items() if not report["ready"]}

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready form, as stored in ``ReadinessReport`` and returned by the API:
        every field (the reports copied), then ``scope``."""
        return {**asdict(self), "scope": SCOPE}


# (a manifest's MCP server entry) → what it lists for the checking user.
McpCheck = Callable[[Mapping[str, Any]], Discovery]


def _discovery_note(kind: str, errors: dict[str, str]) -> str:
    sources = ", ".join(f"{source} ({reason})" for source, reason in sorted(errors.items()))
    return f"{kind} discovery failed: {sources}"


def check_agent(
    agent: dict[str, Any],
    *,
    tools: ToolRegistry,
    skills: SkillRegistry | None,
    model_names: set[str] | None,
    mcp: McpCheck | None = None,
) -> dict[str, Any]:
    """Return one agent's readiness report (see ``ReadinessResult.agents``); never raises.

    An agent with ``mcp_servers`` also gets ``mcp_servers`` (server name → the tools it
    lists); a server that cannot be asked (not connected by the checking user,
    unreachable, refusing the credentials; or ``mcp`` not given) is unverified, and an
    ``allowed_tools`` entry the server does not list is a missing tool
    (``mcp__<server>__<tool>``)."""
    missing_tools: list[str] = []
    missing_skills: list[str] = []
    unverified: list[str] = []
    missing_model: str | None = None

    declared_tools = list(agent.get("tools") or ())
    if agent.get("skills") and skills is not None:
        declared_tools = [name for name in declared_tools if name != LOAD_SKILL_TOOL]
    for name in sorted(set(declared_tools)):
        if name in tools:
            continue
        # A tool absent while some tool module failed to import may live in that module:
        # only a working import (or a real run) can tell, so it is unverified, not missing.
        if tools.discovery_errors:
            unverified.append(f"tool {name!r}: " + _discovery_note("tool", tools.discovery_errors))
        else:
            missing_tools.append(name)

    for name in sorted(set(agent.get("skills") or ())):
        if skills is None:
            missing_skills.append(name)
        elif name in skills:
            continue
        elif skills.discovery_errors:
            unverified.append(
                f"skill {name!r}: " + _discovery_note("skill", skills.discovery_errors)
            )
        else:
            missing_skills.append(name)

    servers: dict[str, list[str]] = {}
    for server in agent.get("mcp_servers") or ():
        found = (
            mcp(server) if mcp is not None else Discovery(problem="MCP servers were not checked")
        )
        if found.problem is not None:
            unverified.append(f"MCP server {server['name']!r}: {found.problem}")
            continue
        servers[server["name"]] = list(found.tools)
        for name in server.get("allowed_tools") or ():
            if name not in found.tools:
                missing_tools.append(tool_name(server["name"], name))

    model = agent.get("model")
    if model_names is None:
        unverified.append(f"model record {model!r}: model records were not checked")
    elif model not in model_names:
        missing_model = model

    report = {
        "missing_tools": missing_tools,
        "missing_skills": missing_skills,
        "unverified": unverified,
        "missing_model": missing_model,
        "ready": not (missing_tools or missing_skills or unverified or missing_model),
    }
    if agent.get("mcp_servers"):
        report["mcp_servers"] = servers
    return report


def check_readiness(
    manifest: Manifest,
    *,
    tools: ToolRegistry,
    skills: SkillRegistry | None,
    model_names: set[str] | None,
    strict: bool,
    mcp: McpCheck | None = None,
) -> ReadinessResult:
    """Check every agent of ``manifest`` against the registries; return a ``ReadinessResult``.

    ``model_names`` is the set of model record names visible to the package's owner, or
    ``None`` when they were not looked up (each agent's model is then unverified).
    ``skills=None`` means no skill provider: every declared skill is missing. Never calls
    a model, runs a tool or reads a skill body; tool nodes of flows are checked too (in
    ``flows``). Never raises: strict callers pass the
    result to ``raise_if_not_ready``.
    """
    data = manifest.data
    agents = {
        agent_id: check_agent(agent, tools=tools, skills=skills, model_names=model_names, mcp=mcp)
        for agent_id, agent in data["agents"].items()
    }
    flows: dict[str, dict[str, list[str]]] = {}
    for flow_id, flow in data["flows"].items():
        names = sorted({node["tool"] for node in flow["nodes"].values() if node["type"] == "tool"})
        if not names:
            continue
        missing = [name for name in names if name not in tools]
        if tools.discovery_errors:
            note = _discovery_note("tool", tools.discovery_errors)
            flows[flow_id] = {
                "missing_tools": [],
                "unverified": [f"tool {name!r}: {note}" for name in missing],
            }
        else:
            flows[flow_id] = {"missing_tools": missing, "unverified": []}
    ready = all(report["ready"] for report in agents.values()) and not any(
        report["missing_tools"] or report["unverified"] for report in flows.values()
    )
    return ReadinessResult(
        ref=manifest.ref, valid=True, ready=ready, strict=strict, agents=agents, flows=flows
    )


def raise_if_not_ready(result: ReadinessResult) -> None:
    """Raise when a strict check found anything missing or unverified; else return.

    A non-strict result never raises (it is reported, not enforced). Raises
    ``ValidationError("package.not_ready")`` with ``details = {"ref", "agents": {agent_id:
    report}, "flows": {flow_id: report}}`` for the agents and flows that are not ready.
    """
    if result.ready or not result.strict:
        return
    not_ready = result.not_ready_agents()
    parts: list[str] = []
    for agent_id, report in not_ready.items():
        what = []
        if report["missing_tools"]:
            what.append("missing tools " + ", ".join(report["missing_tools"]))
        if report["missing_skills"]:
            what.append("missing skills " + ", ".join(report["missing_skills"]))
        if report["missing_model"]:
            what.append(f"missing model record {report['missing_model']}")
        if report["unverified"]:
            what.append(f"{len(report['unverified'])} unverified bindings")
        parts.append(f"{agent_id}: {'; '.join(what)}")
    flows = {
        flow_id: report
        for flow_id, report in result.flows.items()
        if report["missing_tools"] or report["unverified"]
    }
    for flow_id, report in flows.items():
        what = []
        if report["missing_tools"]:
            what.append("missing tools " + ", ".join(report["missing_tools"]))
        if report["unverified"]:
            what.append(f"{len(report['unverified'])} unverified bindings")
        parts.append(f"flow {flow_id}: {'; '.join(what)}")
    raise ValidationError(
        "package.not_ready",
        "package resources are not ready: " + " | ".join(parts),
        details={"ref": result.ref, "agents": not_ready, "flows": flows},
    )
