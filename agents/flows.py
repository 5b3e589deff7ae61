"""Flow reachability and an engine-agnostic flow executor.

Reachability (docs/DESIGN.md §4) decides which agents of a package need a model
when a session starts: only the entrypoint and the members reachable from it, never the
whole package (explicit validation is what checks every agent).

The executor walks a flow along its edges. It knows nothing about models or tools: the
caller passes ``run_agent``, ``run_tool`` and ``on_event`` coroutines, so the same code runs
under the real engine, the scripted model and the tests.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agents.manifest import Manifest
from sageproject.errors import NotFoundError, SageError, ValidationError

logger = logging.getLogger(__name__)

# A runaway cycle (a → b → a with no exit) must end with an error, not run forever.
MAX_FLOW_STEPS = 1000
# A subflow that calls itself nests one coroutine per level; this keeps the nesting far
# below Python's recursion limit while allowing any sensible composition.
MAX_SUBFLOW_DEPTH = 32

NodeTriple = tuple[str, str, Mapping[str, Any]]
RunAgent = Callable[[str, str], Awaitable[str]]
RunTool = Callable[[str, dict[str, Any]], Awaitable[str]]
OnEvent = Callable[[str, dict[str, Any]], Awaitable[None]]


def reachable_nodes(flows: Mapping[str, Any], entrypoint: str) -> tuple[NodeTriple, ...]:
    """Return the ``(flow_id, node_id, node)`` triples reachable from ``entrypoint``.

    Depth-first from ``flows[entrypoint]["start"]``, in visit order. Every edge out of a
    node is followed (conditional edges too) except out of an ``end`` node; a ``subflow``
    node also leads to its flow's start and a ``parallel`` node to its branches. A visited
    set of ``(flow_id, node_id)`` ends cycles. An entrypoint that is not a flow (an agent)
    reaches no nodes; dangling references are skipped rather than raised, so this also
    works on unvalidated data.
    """
    entry = flows.get(entrypoint)
    if not isinstance(entry, Mapping):
        return ()
    visited: set[tuple[str, str]] = set()
    order: list[NodeTriple] = []
    stack: list[tuple[str, Any]] = [(entrypoint, entry.get("start"))]
    while stack:
        flow_id, node_id = stack.pop()
        if (flow_id, node_id) in visited:
            continue
        flow = flows.get(flow_id)
        nodes = flow.get("nodes") if isinstance(flow, Mapping) else None
        node = nodes.get(node_id) if isinstance(nodes, Mapping) else None
        if not isinstance(node, Mapping):
            continue
        visited.add((flow_id, node_id))
        order.append((flow_id, node_id, node))
        children: list[tuple[str, Any]] = []
        node_type = node.get("type")
        if node_type == "subflow":
            sub = flows.get(node.get("flow"))
            if isinstance(sub, Mapping):
                children.append((node["flow"], sub.get("start")))
        elif node_type == "parallel":
            children.extend((flow_id, branch) for branch in node.get("branches") or ())
        if node_type != "end":
            children.extend(
                (flow_id, edge.get("to"))
                for edge in flow.get("edges") or ()
                if isinstance(edge, Mapping) and edge.get("from") == node_id
            )
        # Reversed so the first child is visited first: visit order follows the manifest.
        stack.extend(reversed(children))
    return tuple(order)


def reachable_agents(
    agents: Mapping[str, Any], nodes: Sequence[NodeTriple], selected_agent: str | None
) -> list[str]:
    """Return the agent ids of reachable ``agent`` nodes plus, transitively, their subagents.

    In the manifest's agent order, without ``selected_agent``; unknown ids are ignored.
    """
    found: set[str] = set()
    pending = [node.get("agent") for _, _, node in nodes if node.get("type") == "agent"]
    while pending:
        agent_id = pending.pop()
        if agent_id in found or agent_id not in agents:
            continue
        found.add(agent_id)
        pending.extend(agents[agent_id].get("subagents") or ())
    return [agent_id for agent_id in agents if agent_id in found and agent_id != selected_agent]


def models_to_initialise(manifest: Manifest, selected: str | None = None) -> list[str]:
    """Return the ids of the agents that need a model for a session on ``selected``.

    ``selected`` (default: the entrypoint when it is an agent) comes first, followed in
    manifest order by its transitive subagents and, when the entrypoint is a flow, the
    agents reachable from that flow and their subagents. Raises
    ``NotFoundError("package.agent_not_found")`` for an unknown ``selected``.
    """
    data = manifest.data
    agents = data["agents"]
    if selected is None:
        selected = manifest.entrypoint if manifest.entrypoint in agents else None
    elif selected not in agents:
        raise NotFoundError(
            "package.agent_not_found",
            f"agent {selected!r} does not exist in this package version",
            details={"agent": selected},
        )
    nodes: list[NodeTriple] = list(reachable_nodes(data["flows"], manifest.entrypoint))
    if selected is not None:
        # The selected agent behaves like one more reachable node, so its subagents join.
        nodes.append(("", "", {"type": "agent", "agent": selected}))
    members = reachable_agents(agents, nodes, selected)
    return ([selected] if selected is not None else []) + members


@dataclass(frozen=True, slots=True, kw_only=True)
class FlowResult:
    """The outcome of one flow run.

    ``output`` is the final text; ``outputs`` maps each executed node's path to its last
    output (top-level nodes by id, subflow nodes as ``"<subflow node>/<node>"``).
    """

    flow: str
    output: str
    outputs: dict[str, str]
    steps: int


class _Execution:
    """State of one ``run_flow`` call: the step counter and the recorded outputs."""

    def __init__(
        self,
        flows: Mapping[str, Any],
        run_agent: RunAgent,
        run_tool: RunTool,
        on_event: OnEvent,
        max_steps: int,
    ) -> None:
        self.flows = flows
        self.run_agent = run_agent
        self.run_tool = run_tool
        self.on_event = on_event
        self.max_steps = max_steps
        self.steps = 0
        self.outputs: dict[str, str] = {}

    async def flow(self, flow_id: str, text: str, prefix: str, depth: int) -> str:
        flow = self.flows[flow_id]
        await self.on_event("flow.started", {"flow": flow_id, "path": prefix})
        node_id: str = flow["start"]
        current = text
        while True:
            node = flow["nodes"][node_id]
            current = await self.node(flow_id, node_id, node, current, prefix, depth)
            if node["type"] == "end":
                break
            edge = _select_edge(flow.get("edges") or (), node_id, current)
            if edge is None:
                break
            await self.on_event(
                "flow.edge.selected",
                {
                    "flow": flow_id,
                    "path": prefix,
                    "from": node_id,
                    "to": edge["to"],
                    "conditional": "when" in edge,
                },
            )
            node_id = edge["to"]
        if prefix:
            await self.on_event(
                "flow.completed", {"flow": flow_id, "path": prefix, "output": current}
            )
        return current

    async def node(
        self,
        flow_id: str,
        node_id: str,
        node: Mapping[str, Any],
        text: str,
        prefix: str,
        depth: int,
    ) -> str:
        self.steps += 1
        if self.steps > self.max_steps:
            raise ValidationError(
                "flow.step_limit",
                f"flow executed more than {self.max_steps} nodes; does it loop without an exit?",
                details={"flow": flow_id, "node": node_id, "max_steps": self.max_steps},
            )
        path = f"{prefix}{node_id}"
        node_type = node["type"]
        base = {"flow": flow_id, "node": node_id, "path": path, "type": node_type}
        await self.on_event("flow.node.started", dict(base))
        if node_type == "agent":
            output = _text(await self.run_agent(node["agent"], text), path)
        elif node_type == "tool":
            output = _text(await self.run_tool(node["tool"], dict(node.get("input") or {})), path)
        elif node_type == "subflow":
            if depth >= MAX_SUBFLOW_DEPTH:
                raise ValidationError(
                    "flow.depth_limit",
                    f"subflows nested deeper than {MAX_SUBFLOW_DEPTH} levels",
                    details={"flow": flow_id, "node": node_id},
                )
            output = await self.flow(node["flow"], text, f"{path}/", depth + 1)
        elif node_type == "parallel":
            output = await self.parallel(flow_id, node["branches"], text, prefix, depth)
        else:  # end passes its input through: it is where the flow's answer is read
            output = text
        self.outputs[path] = output
        await self.on_event("flow.node.completed", {**base, "output": output})
        return output

    async def parallel(
        self, flow_id: str, branches: Sequence[str], text: str, prefix: str, depth: int
    ) -> str:
        nodes = self.flows[flow_id]["nodes"]
        results = [""] * len(branches)

        async def branch(index: int, node_id: str) -> None:
            # A branch is one node: its own edges belong to the flow, not to the branch.
            results[index] = await self.node(flow_id, node_id, nodes[node_id], text, prefix, depth)

        try:
            async with asyncio.TaskGroup() as group:
                for index, node_id in enumerate(branches):
                    group.create_task(branch(index, node_id))
        except BaseExceptionGroup as failures:
            # Callers handle SageErrors, not groups: surface the first real failure.
            first = next(
                (e for e in failures.exceptions if not isinstance(e, asyncio.CancelledError)),
                failures.exceptions[0],
            )
            raise first from None
        return "\n".join(results)


def _select_edge(
    edges: Sequence[Mapping[str, Any]], node_id: str, output: str
) -> Mapping[str, Any] | None:
    """First conditional edge whose text occurs in ``output``, else first plain edge."""
    outgoing = [edge for edge in edges if edge.get("from") == node_id]
    for edge in outgoing:
        when = edge.get("when")
        if when is not None and when["contains"] in output:
            return edge
    for edge in outgoing:
        if "when" not in edge:
            return edge
    return None


def _text(value: object, path: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"flow node {path!r} produced {type(value).__name__}, expected str")
    return value


async def run_flow(
    manifest: Manifest,
    flow_id: str,
    input_text: str,
    *,
    run_agent: RunAgent,
    run_tool: RunTool,
    on_event: OnEvent,
    max_steps: int = MAX_FLOW_STEPS,
) -> FlowResult:
    """Run ``flow_id`` of ``manifest`` on ``input_text`` and return its ``FlowResult``.

    Nodes run along edges; an agent node receives the previous node's output; a tool node
    is called with its configured ``input``; a conditional edge (``when.contains``) is
    chosen by the previous output (first match, else the first plain edge, else the flow
    stops); parallel branches run concurrently and their outputs join with newlines in
    branch order; a subflow runs to completion and its output continues; ``end`` stops.

    Events: ``flow.started``, ``flow.node.started``, ``flow.node.completed``,
    ``flow.edge.selected``, ``flow.completed`` (the top-level one carries ``outputs``) or
    ``flow.failed``. Raises ``NotFoundError("package.flow_not_found")``,
    ``ValidationError("flow.step_limit")`` after ``max_steps`` node executions,
    ``ValidationError("flow.depth_limit")``, or whatever ``run_agent``/``run_tool`` raise.
    """
    flows = manifest.flows
    if flow_id not in flows:
        raise NotFoundError(
            "package.flow_not_found",
            f"flow {flow_id!r} does not exist in this package version",
            details={"flow": flow_id},
        )
    if max_steps < 1:
        raise ValueError("max_steps must be at least 1")
    execution = _Execution(flows, run_agent, run_tool, on_event, max_steps)
    try:
        output = await execution.flow(flow_id, input_text, "", 0)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        code = exc.code if isinstance(exc, SageError) else "flow.node_failed"
        try:
            await on_event(
                "flow.failed",
                {"flow": flow_id, "code": code, "message": str(exc), "steps": execution.steps},
            )
        except Exception:
            # The original failure is what the caller must see; the event is best effort.
            logger.exception("could not record flow.failed for flow %r", flow_id)
        raise
    outputs = dict(execution.outputs)
    await on_event(
        "flow.completed",
        {"flow": flow_id, "path": "", "output": output, "outputs": outputs},
    )
    return FlowResult(flow=flow_id, output=output, outputs=outputs, steps=execution.steps)
