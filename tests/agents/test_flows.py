from __future__ import annotations

import asyncio
from typing import Any

import pytest

from agents.flows import (
    MAX_FLOW_STEPS,
    FlowResult,
    RunAgent,
    models_to_initialise,
    reachable_agents,
    reachable_nodes,
    run_flow,
)
from agents.manifest import Manifest, parse_manifest
from sageproject.errors import NotFoundError, SageError, ValidationError
from tests.conftest import flow_manifest


def main_flow(start: str, nodes: dict[str, Any], edges: list[Any] | None = None) -> dict[str, Any]:
    """Flows of one flow, ``main``: the ``nodes`` run from ``start`` along the ``edges`` (a
    flow without ``edges`` has no such key)."""
    flow: dict[str, Any] = {"start": start, "nodes": nodes}
    return {"main": flow if edges is None else {**flow, "edges": edges}}


def node_ids(flows: dict[str, Any], entrypoint: str) -> list[tuple[str, str]]:
    return [(flow_id, node_id) for flow_id, node_id, _ in reachable_nodes(flows, entrypoint)]


# --- reachability -------------------------------------------------------------------------


def test_it_follows_plain_edges_in_visit_order() -> None:
    flows = main_flow(
        "a",
        {"a": {"type": "agent", "agent": "x"}, "b": {"type": "end"}},
        [{"from": "a", "to": "b"}],
    )
    assert node_ids(flows, "main") == [("main", "a"), ("main", "b")]


def test_it_returns_the_node_definitions_with_the_ids() -> None:
    flows = {"main": {"start": "a", "nodes": {"a": {"type": "agent", "agent": "x"}}}}
    assert reachable_nodes(flows, "main") == (("main", "a", {"type": "agent", "agent": "x"}),)


def test_it_follows_every_conditional_edge() -> None:
    flows = main_flow(
        "a",
        {
            "a": {"type": "agent", "agent": "x"},
            "yes": {"type": "agent", "agent": "y"},
            "no": {"type": "agent", "agent": "z"},
        },
        [
            {"from": "a", "to": "yes", "when": {"contains": "yes"}},
            {"from": "a", "to": "no", "when": {"contains": "no"}},
        ],
    )
    assert node_ids(flows, "main") == [("main", "a"), ("main", "yes"), ("main", "no")]


def test_it_follows_parallel_branches() -> None:
    flows = main_flow(
        "fan",
        {
            "fan": {"type": "parallel", "branches": ["l", "r"]},
            "l": {"type": "agent", "agent": "x"},
            "r": {"type": "agent", "agent": "y"},
        },
        [],
    )
    assert node_ids(flows, "main") == [("main", "fan"), ("main", "l"), ("main", "r")]


def test_it_enters_a_subflow_from_its_start() -> None:
    flows = {
        "main": {
            "start": "s",
            "nodes": {"s": {"type": "subflow", "flow": "inner"}, "e": {"type": "end"}},
            "edges": [{"from": "s", "to": "e"}],
        },
        "inner": {
            "start": "i1",
            "nodes": {
                "i0": {"type": "agent", "agent": "no"},
                "i1": {"type": "agent", "agent": "x"},
            },
        },
    }
    assert node_ids(flows, "main") == [("main", "s"), ("inner", "i1"), ("main", "e")]


def test_it_does_not_follow_edges_out_of_an_end_node() -> None:
    flows = main_flow(
        "e",
        {"e": {"type": "end"}, "after": {"type": "agent", "agent": "x"}},
        [{"from": "e", "to": "after"}],
    )
    assert node_ids(flows, "main") == [("main", "e")]


def test_it_ends_cycles_with_a_visited_set() -> None:
    flows = main_flow(
        "a",
        {
            "a": {"type": "agent", "agent": "x"},
            "b": {"type": "subflow", "flow": "main"},
        },
        [{"from": "a", "to": "b"}, {"from": "b", "to": "a"}],
    )
    assert node_ids(flows, "main") == [("main", "a"), ("main", "b")]


def test_it_skips_unreachable_nodes() -> None:
    flows = main_flow("a", {"a": {"type": "end"}, "unused": {"type": "agent", "agent": "x"}})
    assert node_ids(flows, "main") == [("main", "a")]


def test_it_reaches_no_nodes_from_an_agent_entrypoint() -> None:
    assert reachable_nodes({"main": {"start": "a", "nodes": {}}}, "assistant") == ()


AGENTS = {
    "assistant": {"subagents": []},
    "unused": {"subagents": []},
    "worker": {"subagents": ["researcher"]},
    "researcher": {"subagents": ["worker"]},
    "writer": {"subagents": []},
}


def test_it_collects_agents_with_their_subagents_in_manifest_order() -> None:
    nodes = (
        ("main", "n1", {"type": "agent", "agent": "writer"}),
        ("main", "n2", {"type": "agent", "agent": "worker"}),
    )
    assert reachable_agents(AGENTS, nodes, None) == ["worker", "researcher", "writer"]


def test_it_leaves_out_the_selected_agent() -> None:
    nodes = (("main", "n", {"type": "agent", "agent": "worker"}),)
    assert reachable_agents(AGENTS, nodes, "worker") == ["researcher"]


def test_it_ignores_non_agent_nodes() -> None:
    nodes = (("main", "t", {"type": "tool", "tool": "clock"}), ("main", "e", {"type": "end"}))
    assert reachable_agents(AGENTS, nodes, None) == []


def package(**overrides: Any) -> Manifest:
    data = flow_manifest(
        {
            "assistant": {"model": "m"},
            "unused": {"model": "m"},
            "worker": {"model": "m", "subagents": ["helper"]},
            "helper": {"model": "m"},
            "lonely": {"model": "m", "subagents": ["assistant"]},
        },
        start="a",
        nodes={
            "a": {"type": "agent", "agent": "assistant"},
            "w": {"type": "agent", "agent": "worker"},
            "u": {"type": "agent", "agent": "unused"},
            "e": {"type": "end"},
        },
        edges=[
            {"from": "a", "to": "w", "when": {"contains": "delegate"}},
            {"from": "a", "to": "e"},
            {"from": "w", "to": "e"},
        ],
    )
    data.update(overrides)
    return parse_manifest(data)


def test_it_initialises_only_agents_reachable_from_a_flow_entrypoint() -> None:
    assert models_to_initialise(package()) == ["assistant", "worker", "helper"]


def test_it_puts_the_selected_agent_first_with_its_subagents() -> None:
    assert models_to_initialise(package(), "lonely") == ["lonely", "assistant", "worker", "helper"]


def test_it_initialises_an_agent_entrypoint_and_its_subagents_only() -> None:
    manifest = package(entrypoint="worker")
    assert models_to_initialise(manifest) == ["worker", "helper"]


def test_it_refuses_to_initialise_an_unknown_agent() -> None:
    with pytest.raises(NotFoundError):
        models_to_initialise(package(), "ghost")


# --- execution ----------------------------------------------------------------------------


class Recorder:
    """Fake engine edges: agents answer from a table, tools echo, events are recorded."""

    def __init__(self, answers: dict[str, str] | None = None) -> None:
        self.answers = answers or {}
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.agent_calls: list[tuple[str, str]] = []
        self.tool_calls: list[tuple[str, dict[str, Any]]] = []

    async def run_agent(self, agent_id: str, text: str) -> str:
        self.agent_calls.append((agent_id, text))
        return self.answers.get(agent_id, f"{agent_id}({text})")

    async def run_tool(self, tool: str, args: dict[str, Any]) -> str:
        self.tool_calls.append((tool, args))
        return f"{tool}:{sorted(args.items())}"

    async def on_event(self, event_type: str, payload: dict[str, Any]) -> None:
        self.events.append((event_type, payload))

    def types(self) -> list[str]:
        return [event_type for event_type, _ in self.events]

    async def run(
        self,
        manifest: Manifest,
        flow: str,
        text: str,
        *,
        run_agent: RunAgent | None = None,
        max_steps: int = MAX_FLOW_STEPS,
    ) -> FlowResult:
        """Run ``flow`` with this recorder's edges; ``run_agent`` replaces its agents."""
        return await run_flow(
            manifest,
            flow,
            text,
            run_agent=run_agent or self.run_agent,
            run_tool=self.run_tool,
            on_event=self.on_event,
            max_steps=max_steps,
        )


def flow_package(flows: dict[str, Any]) -> Manifest:
    return parse_manifest(
        {
            "name": "p",
            "version": "1.0.0",
            "entrypoint": next(iter(flows)),
            "agents": {name: {"model": "m"} for name in ("a", "b", "c", "d")},
            "flows": flows,
        }
    )


LINEAR = main_flow(
    "one",
    {
        "one": {"type": "agent", "agent": "a"},
        "two": {"type": "tool", "tool": "clock", "input": {"tz": "UTC"}},
        "three": {"type": "agent", "agent": "b"},
        "done": {"type": "end"},
    },
    [
        {"from": "one", "to": "two"},
        {"from": "two", "to": "three"},
        {"from": "three", "to": "done"},
    ],
)


async def test_it_runs_nodes_along_edges_passing_each_output_on() -> None:
    engine = Recorder()
    result = await engine.run(flow_package(LINEAR), "main", "hi")
    assert engine.agent_calls == [("a", "hi"), ("b", "clock:[('tz', 'UTC')]")]
    assert engine.tool_calls == [("clock", {"tz": "UTC"})]
    assert result.output == "b(clock:[('tz', 'UTC')])"


async def test_it_records_every_node_output() -> None:
    result = await Recorder().run(flow_package(LINEAR), "main", "hi")
    assert result.outputs == {
        "one": "a(hi)",
        "two": "clock:[('tz', 'UTC')]",
        "three": "b(clock:[('tz', 'UTC')])",
        "done": "b(clock:[('tz', 'UTC')])",
    }
    assert result.steps == 4


async def test_it_emits_flow_events_in_order() -> None:
    engine = Recorder()
    await engine.run(flow_package(LINEAR), "main", "hi")
    assert engine.types() == [
        "flow.started",
        "flow.node.started",
        "flow.node.completed",
        "flow.edge.selected",
        "flow.node.started",
        "flow.node.completed",
        "flow.edge.selected",
        "flow.node.started",
        "flow.node.completed",
        "flow.edge.selected",
        "flow.node.started",
        "flow.node.completed",
        "flow.completed",
    ]


async def test_it_puts_the_outputs_in_the_flow_completed_event() -> None:
    engine = Recorder()
    result = await engine.run(flow_package(LINEAR), "main", "hi")
    event_type, payload = engine.events[-1]
    assert event_type == "flow.completed"
    assert payload["outputs"] == result.outputs
    assert payload["output"] == result.output


async def test_it_stops_when_a_node_has_no_outgoing_edge() -> None:
    flows = {"main": {"start": "one", "nodes": {"one": {"type": "agent", "agent": "a"}}}}
    result = await Recorder().run(flow_package(flows), "main", "x")
    assert (result.output, result.steps) == ("a(x)", 1)


BRANCHING = main_flow(
    "route",
    {
        "route": {"type": "agent", "agent": "a"},
        "refund": {"type": "agent", "agent": "b"},
        "billing": {"type": "agent", "agent": "c"},
        "general": {"type": "agent", "agent": "d"},
    },
    [
        {"from": "route", "to": "general"},
        {"from": "route", "to": "refund", "when": {"contains": "REFUND"}},
        {"from": "route", "to": "billing", "when": {"contains": "BILL"}},
    ],
)


async def test_it_chooses_the_conditional_edge_matching_the_previous_output() -> None:
    engine = Recorder({"a": "route to BILL"})
    result = await engine.run(flow_package(BRANCHING), "main", "x")
    assert [agent for agent, _ in engine.agent_calls] == ["a", "c"]
    assert result.output == "c(route to BILL)"


async def test_it_chooses_the_first_matching_conditional_edge() -> None:
    engine = Recorder({"a": "BILL and REFUND"})
    await engine.run(flow_package(BRANCHING), "main", "x")
    assert [agent for agent, _ in engine.agent_calls] == ["a", "b"]


async def test_it_falls_back_to_the_plain_edge_when_no_condition_matches() -> None:
    engine = Recorder({"a": "nothing special"})
    await engine.run(flow_package(BRANCHING), "main", "x")
    assert [agent for agent, _ in engine.agent_calls] == ["a", "d"]


async def test_it_reports_whether_the_selected_edge_was_conditional() -> None:
    engine = Recorder({"a": "REFUND"})
    await engine.run(flow_package(BRANCHING), "main", "x")
    edge = next(payload for kind, payload in engine.events if kind == "flow.edge.selected")
    assert (edge["from"], edge["to"], edge["conditional"]) == ("route", "refund", True)


async def test_it_stops_when_no_condition_matches_and_there_is_no_plain_edge() -> None:
    flows = main_flow(
        "route",
        {
            "route": {"type": "agent", "agent": "a"},
            "x": {"type": "agent", "agent": "b"},
        },
        [{"from": "route", "to": "x", "when": {"contains": "GO"}}],
    )
    result = await Recorder({"a": "stay"}).run(flow_package(flows), "main", "x")
    assert result.output == "stay"
    assert list(result.outputs) == ["route"]


PARALLEL = main_flow(
    "fan",
    {
        "fan": {"type": "parallel", "branches": ["left", "right"]},
        "left": {"type": "agent", "agent": "a"},
        "right": {"type": "agent", "agent": "b"},
        "after": {"type": "agent", "agent": "c"},
        "never": {"type": "agent", "agent": "d"},
    },
    [
        {"from": "fan", "to": "after"},
        # A branch is a single node: its own outgoing edge is not followed inside it.
        {"from": "left", "to": "never"},
    ],
)


async def test_it_runs_parallel_branches_concurrently() -> None:
    arrived: set[str] = set()
    both_arrived = asyncio.Event()

    async def run_agent(agent_id: str, text: str) -> str:
        if agent_id in ("a", "b"):
            arrived.add(agent_id)
            if arrived == {"a", "b"}:
                both_arrived.set()
            # Each branch waits for the other: run one after the other, this never returns.
            await asyncio.wait_for(both_arrived.wait(), timeout=5)
        return f"{agent_id}({text})"

    engine = Recorder()
    result = await engine.run(flow_package(PARALLEL), "main", "go", run_agent=run_agent)
    assert arrived == {"a", "b"}
    assert result.output == "c(a(go)\nb(go))"


async def test_it_joins_branch_outputs_by_newline_in_branch_order() -> None:
    release_left = asyncio.Event()

    async def run_agent(agent_id: str, text: str) -> str:
        if agent_id == "a":
            # The left branch finishes last; the join must still put it first.
            await asyncio.wait_for(release_left.wait(), timeout=5)
        if agent_id == "b":
            release_left.set()
        return agent_id.upper()

    engine = Recorder()
    result = await engine.run(flow_package(PARALLEL), "main", "go", run_agent=run_agent)
    assert result.outputs["fan"] == "A\nB"


async def test_it_does_not_follow_a_branch_nodes_own_edges() -> None:
    engine = Recorder()
    result = await engine.run(flow_package(PARALLEL), "main", "go")
    assert "never" not in result.outputs
    assert sorted(agent for agent, _ in engine.agent_calls) == ["a", "b", "c"]


async def test_it_surfaces_a_failing_branch_as_the_error_itself() -> None:
    async def run_agent(agent_id: str, text: str) -> str:
        if agent_id == "b":
            raise SageError("model.queue_full", "full")
        return "ok"

    engine = Recorder()
    with pytest.raises(SageError) as caught:
        await engine.run(flow_package(PARALLEL), "main", "go", run_agent=run_agent)
    assert caught.value.code == "model.queue_full"


SUBFLOW = {
    "main": {
        "start": "first",
        "nodes": {
            "first": {"type": "agent", "agent": "a"},
            "inner": {"type": "subflow", "flow": "sub"},
            "last": {"type": "agent", "agent": "d"},
        },
        "edges": [{"from": "first", "to": "inner"}, {"from": "inner", "to": "last"}],
    },
    "sub": {
        "start": "s1",
        "nodes": {"s1": {"type": "agent", "agent": "b"}, "s2": {"type": "agent", "agent": "c"}},
        "edges": [{"from": "s1", "to": "s2"}],
    },
}


async def test_it_runs_a_subflow_to_completion_and_continues_with_its_output() -> None:
    engine = Recorder()
    result = await engine.run(flow_package(SUBFLOW), "main", "x")
    assert [agent for agent, _ in engine.agent_calls] == ["a", "b", "c", "d"]
    assert result.output == "d(c(b(a(x))))"


async def test_it_records_subflow_outputs_under_the_subflow_node() -> None:
    result = await Recorder().run(flow_package(SUBFLOW), "main", "x")
    assert list(result.outputs) == ["first", "inner/s1", "inner/s2", "inner", "last"]


async def test_it_stops_at_an_end_node_even_if_an_edge_leaves_it() -> None:
    data = flow_package(LINEAR).data
    # Validation refuses edges out of an end node; build the value directly to prove the
    # executor would not follow one anyway.
    data["flows"]["main"]["edges"].append({"from": "done", "to": "one"})
    engine = Recorder()
    result = await engine.run(Manifest(ref="unvalidated", _data=data), "main", "x")
    assert [agent for agent, _ in engine.agent_calls] == ["a", "b"]
    assert result.steps == 4
    assert engine.types()[-2:] == ["flow.node.completed", "flow.completed"]


CYCLE = main_flow(
    "ping",
    {"ping": {"type": "agent", "agent": "a"}, "pong": {"type": "agent", "agent": "b"}},
    [{"from": "ping", "to": "pong"}, {"from": "pong", "to": "ping"}],
)


async def test_it_stops_a_runaway_cycle_with_flow_step_limit() -> None:
    engine = Recorder({"a": "p", "b": "q"})
    with pytest.raises(ValidationError) as caught:
        await engine.run(flow_package(CYCLE), "main", "x", max_steps=10)
    assert caught.value.code == "flow.step_limit"
    assert len(engine.agent_calls) == 10


async def test_it_caps_steps_at_1000_by_default() -> None:
    engine = Recorder({"a": "p", "b": "q"})
    with pytest.raises(ValidationError):
        await engine.run(flow_package(CYCLE), "main", "x")
    assert len(engine.agent_calls) == MAX_FLOW_STEPS == 1000


async def test_it_leaves_a_cycle_through_a_conditional_edge() -> None:
    counter = iter(range(100))
    engine = Recorder()

    async def run_agent(agent_id: str, text: str) -> str:
        n = next(counter)
        return "DONE" if n == 5 else f"again {n}"

    flows = main_flow(
        "work",
        {"work": {"type": "agent", "agent": "a"}, "stop": {"type": "end"}},
        [
            {"from": "work", "to": "stop", "when": {"contains": "DONE"}},
            {"from": "work", "to": "work"},
        ],
    )
    result = await engine.run(flow_package(flows), "main", "x", run_agent=run_agent)
    assert (result.output, result.steps) == ("DONE", 7)


async def test_it_stops_a_subflow_that_calls_itself_forever() -> None:
    flows = {"main": {"start": "me", "nodes": {"me": {"type": "subflow", "flow": "main"}}}}
    with pytest.raises(ValidationError) as caught:
        await Recorder().run(flow_package(flows), "main", "x")
    assert caught.value.code == "flow.depth_limit"


async def test_it_emits_flow_failed_and_reraises_when_a_node_fails() -> None:
    async def run_agent(agent_id: str, text: str) -> str:
        raise SageError("model.queue_timeout", "too slow")

    engine = Recorder()
    with pytest.raises(SageError):
        await engine.run(flow_package(LINEAR), "main", "x", run_agent=run_agent)
    event_type, payload = engine.events[-1]
    assert event_type == "flow.failed"
    assert payload["code"] == "model.queue_timeout"


async def test_it_rejects_an_unknown_flow() -> None:
    with pytest.raises(NotFoundError) as caught:
        await Recorder().run(flow_package(LINEAR), "ghost", "x")
    assert caught.value.code == "package.flow_not_found"
