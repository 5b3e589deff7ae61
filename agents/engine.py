"""The agent loop: instructions + history → model stream → tool calls → repeat.

Django-free. The caller supplies ``call_model`` (which leases a client and a budget slot)
and ``emit`` (which commits durable events); the loop itself holds no resources.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agents.tools import Tool, ToolContext, ToolError
from pooling.providers.base import ModelRequest, StreamEnd, TextDelta, ToolCall, ToolSpec
from sageproject.errors import SageError
from scheduling.faults import crash_point

EventBatch = list[tuple[str, dict[str, Any]]]
Emit = Callable[[EventBatch], Awaitable[None]]
CallModel = Callable[[ModelRequest], AsyncIterator[Any]]

# Event types that rebuild a conversation (part of the event contract, docs/DESIGN.md §3).
MESSAGE_COMPLETED = "message.completed"
TOOL_STARTED = "tool.call.started"
TOOL_SUCCEEDED = "tool.call.succeeded"
TOOL_FAILED = "tool.call.failed"
# A tool's output is cut to this many characters before it goes back to the model.
MAX_TOOL_OUTPUT_CHARS = 16_000


class MaxStepsExceeded(SageError):
    def __init__(self, max_steps: int) -> None:
        super().__init__(
            "run.max_steps_exceeded",
            f"the agent did not finish within max_steps={max_steps} model calls",
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentTurn:
    """What one agent needs for a turn."""

    model: str
    instructions: str
    tools: Sequence[Tool] = ()
    max_steps: int = 8
    options: Mapping[str, Any] = field(default_factory=dict)
    max_tokens: int = 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class TurnOutcome:
    text: str
    steps: int
    usage: dict[str, int]


# The result recorded for a tool call whose worker died before it answered.
INTERRUPTED_TOOL_ERROR = "interrupted by a worker restart; the tool's effect is unknown"


def unanswered_tool_calls(
    events: Iterable[tuple[str, Mapping[str, Any]]],
) -> list[dict[str, Any]]:
    """``tool.call.started`` payloads (oldest first) that have no succeeded/failed event."""
    pending: dict[str, dict[str, Any]] = {}
    for etype, payload in events:
        if etype == TOOL_STARTED:
            pending[str(payload.get("id", ""))] = dict(payload)
        elif etype in (TOOL_SUCCEEDED, TOOL_FAILED):
            pending.pop(str(payload.get("id", "")), None)
    return list(pending.values())


def history_from_events(events: Iterable[tuple[str, Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """Normalized messages from durable events (oldest first).

    Every assistant tool call is answered: a call whose worker died before its result
    (no succeeded/failed event) gets a tool message saying so, placed before the next
    non-tool message, so the history is always one a provider accepts.
    """
    messages: list[dict[str, Any]] = []
    pending: dict[str, str] = {}

    def answer_pending() -> None:
        for call_id, name in pending.items():
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": call_id,
                    "name": name,
                    "content": f"error: {INTERRUPTED_TOOL_ERROR}",
                }
            )
        pending.clear()

    for etype, payload in events:
        if etype == MESSAGE_COMPLETED:
            answer_pending()
            message = {
                "role": payload.get("role", "assistant"),
                "content": payload.get("content", ""),
            }
            if payload.get("tool_calls"):
                message["tool_calls"] = list(payload["tool_calls"])
                for call in payload["tool_calls"]:
                    pending[str(call.get("id", ""))] = str(call.get("name", ""))
            messages.append(message)
        elif etype in (TOOL_SUCCEEDED, TOOL_FAILED):
            pending.pop(str(payload.get("id", "")), None)
            content = (
                payload.get("output")
                if etype == TOOL_SUCCEEDED
                else (f"error: {payload.get('error', 'tool failed')}")
            )
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": payload.get("id", ""),
                    "name": payload.get("name", ""),
                    "content": str(content),
                }
            )
    answer_pending()
    return messages


async def _call_tool(tool: Tool | None, call: ToolCall, ctx: ToolContext) -> tuple[bool, str]:
    if tool is None:
        return False, f"unknown tool {call.name!r}"
    try:
        output = await tool.handler(dict(call.arguments), ctx)
    except ToolError as exc:
        return False, exc.message
    except SageError as exc:
        return False, exc.message
    if not isinstance(output, str):
        output = json.dumps(output, default=str)
    return True, output[:MAX_TOOL_OUTPUT_CHARS]


async def run_turn(
    turn: AgentTurn,
    history: list[dict[str, Any]],
    *,
    call_model: CallModel,
    emit: Emit,
    ctx: ToolContext,
) -> TurnOutcome:
    """Run model calls and tools until the model answers without tool calls.

    ``history`` already ends with the user's message and is extended in place. Returns the
    final text. Raises ``MaxStepsExceeded`` or whatever ``call_model`` raises (upstream,
    budget and pool errors), after every event of the finished steps has been emitted.
    """
    tools_by_name = {tool.name: tool for tool in turn.tools}
    specs = tuple(
        ToolSpec(name=t.name, description=t.description, parameters=t.parameters)
        for t in turn.tools
    )
    usage = {"input_tokens": 0, "output_tokens": 0}
    for step in range(1, turn.max_steps + 1):
        request = ModelRequest(
            model=turn.model,
            system=turn.instructions,
            messages=tuple(history),
            tools=specs,
            max_tokens=turn.max_tokens,
            options=turn.options,
        )
        parts: list[str] = []
        calls: list[ToolCall] = []
        async for item in call_model(request):
            if isinstance(item, TextDelta):
                parts.append(item.text)
            elif isinstance(item, ToolCall):
                calls.append(item)
            elif isinstance(item, StreamEnd):
                for key in usage:
                    usage[key] += int(item.usage.get(key, 0) or 0)
        text = "".join(parts)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = [
                {"id": c.id, "name": c.name, "arguments": dict(c.arguments)} for c in calls
            ]
        history.append(message)
        batch: EventBatch = [(MESSAGE_COMPLETED, {**message, "step": step})]
        batch += [
            (TOOL_STARTED, {"id": c.id, "name": c.name, "arguments": dict(c.arguments)})
            for c in calls
        ]
        await emit(batch)
        if not calls:
            return TurnOutcome(text=text, steps=step, usage=usage)
        crash_point("tool.started")
        results: EventBatch = []
        for call in calls:
            ok, output = await _call_tool(tools_by_name.get(call.name), call, ctx)
            if ok:
                results.append(
                    (TOOL_SUCCEEDED, {"id": call.id, "name": call.name, "output": output})
                )
                content = output
            else:
                results.append((TOOL_FAILED, {"id": call.id, "name": call.name, "error": output}))
                content = f"error: {output}"
            history.append(
                {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": content}
            )
        await emit(results)
    raise MaxStepsExceeded(turn.max_steps)
