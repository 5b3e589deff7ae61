"""The agent loop: instructions + history → model stream → tool calls → repeat.

Django-free. The caller supplies ``call_model`` (which leases a client and a budget slot)
and ``emit`` (which commits durable events); the loop itself holds no resources.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agents.tools import Tool, ToolContext, ToolSuspends
from agents.tracing import DISABLED, Tracing
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
    # Tools whose calls wait for the user's approval (the manifest agent's ``approval``).
    approval: frozenset[str] = frozenset()


# The result recorded for a call the user rejected (an approval interaction's "reject").
REJECTED_TOOL_ERROR = "the user rejected this call"


class ApprovalRequired(Exception):
    """The model called a tool of ``AgentTurn.approval``: the step's message is emitted,
    none of its calls acts, and the run suspends for the user's decision. ``calls`` is
    every call of the step (``{"id", "name", "arguments"}``, in order), ``waiting`` the ids
    of those that need approval; resumed, ``run_turn(approval=ApprovalReply(...))`` runs
    the step's calls, the rejected ones answered with `REJECTED_TOOL_ERROR`."""

    def __init__(self, calls: list[dict[str, Any]], waiting: list[str]) -> None:
        names = sorted({c["name"] for c in calls if c["id"] in waiting})
        super().__init__(f"tool calls wait for approval: {', '.join(names)}")
        self.calls = calls
        self.waiting = waiting


@dataclass(frozen=True, slots=True, kw_only=True)
class ApprovalReply:
    """A suspended step's calls and which of them the user rejected (ids)."""

    calls: tuple[ToolCall, ...]
    rejected: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True, kw_only=True)
class TurnOutcome:
    text: str
    steps: int
    usage: dict[str, int]


# The result recorded for a tool call whose worker died before it answered.
INTERRUPTED_TOOL_ERROR = "interrupted by a worker restart; the tool's effect is unknown"
# What the model is told of a call that waited for an approval the run ended without.
NOT_APPROVED_TOOL_ERROR = "not run: the run ended before the user approved this call"
# What the model is told of the calls a suspending tool (`ToolSuspends`) stopped.
SUSPENDED_TOOL_ERROR = "not run: the run waited for the user ({reason}); call it again"


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


def history_from_events(
    events: Iterable[tuple[str, Mapping[str, Any]]], *, open_calls: Iterable[str] = ()
) -> list[dict[str, Any]]:
    """Normalized messages from durable events (oldest first).

    Every assistant tool call is answered: a call whose worker died before its result
    (no succeeded/failed event) gets a tool message saying so — or, for a call that
    waited for an approval never given, that it was not run — placed before the next
    non-tool message, so the history is always one a provider accepts. The last step's
    calls named in ``open_calls`` (an approval being answered) are left unanswered.
    """
    messages: list[dict[str, Any]] = []
    pending: dict[str, str] = {}
    unapproved: set[str] = set()
    left_open = set(open_calls)
    # The assistant's calls by id, their arguments made those a call was started with.
    asked_calls: dict[str, dict[str, Any]] = {}

    def answer_pending(final: bool = False) -> None:
        for call_id, name in pending.items():
            if final and call_id in left_open:
                continue
            error = NOT_APPROVED_TOOL_ERROR if call_id in unapproved else INTERRUPTED_TOOL_ERROR
            answer = {"role": "tool", "tool_call_id": call_id, "name": name}
            messages.append({**answer, "content": f"error: {error}"})
        pending.clear()

    for etype, payload in events:
        if etype == "interaction.requested" and payload.get("type") == "approval":
            unapproved.update(str(c.get("id", "")) for c in payload.get("tool_calls") or ())
        elif etype == MESSAGE_COMPLETED:
            answer_pending()
            message = {
                "role": payload.get("role", "assistant"),
                "content": payload.get("content", ""),
            }
            if payload.get("tool_calls"):
                message["tool_calls"] = [dict(c) for c in payload["tool_calls"]]
                asked_calls.update((str(c.get("id", "")), c) for c in message["tool_calls"])
                for call in payload["tool_calls"]:
                    pending[str(call.get("id", ""))] = str(call.get("name", ""))
            messages.append(message)
        elif etype == TOOL_STARTED:
            # A call the user edited before approving was sent with other arguments.
            asked = asked_calls.get(str(payload.get("id", "")))
            if asked is not None and isinstance(payload.get("arguments"), Mapping):
                asked["arguments"] = dict(payload["arguments"])
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
    answer_pending(final=True)
    return messages


async def _call_tool(
    tool: Tool | None, call: ToolCall, ctx: ToolContext, tracing: Tracing = DISABLED
) -> tuple[bool, str]:
    """Run one tool call in its ``execute_tool`` span (agents/tracing.py)."""
    with tracing.tool_call(
        name=call.name,
        call_id=call.id,
        arguments=call.arguments,
        description=tool.description if tool is not None else None,
        conversation_id=ctx.session_id,
        run_id=ctx.run_id,
        server=tool.server if tool is not None else None,
    ) as span:
        if tool is None:
            span.failed("tool.not_found")
            return False, f"unknown tool {call.name!r}"
        try:
            output = await tool.handler(
                dict(call.arguments), dataclasses.replace(ctx, call_id=call.id)
            )
        except ToolSuspends as exc:  # the run waits for the user: not a tool result
            span.failed(exc.code)
            raise
        except SageError as exc:  # ToolError (tool.failed) and the host's own errors
            span.failed(exc.code)
            return False, exc.message
        if not isinstance(output, str):
            output = json.dumps(output, default=str)
        if not tool.capped:
            output = output[:MAX_TOOL_OUTPUT_CHARS]
        span.succeeded(output)
        return True, output


def _sent_as(history: list[dict[str, Any]], calls: Sequence[ToolCall]) -> None:
    """Give the assistant tool calls in ``history`` the arguments ``calls`` are sent with."""
    sent = {c.id: dict(c.arguments) for c in calls}
    asked = next((m for m in reversed(history) if m.get("tool_calls")), None)
    for call in (asked or {}).get("tool_calls") or ():
        if call.get("id") in sent:
            call["arguments"] = sent[call["id"]]


def _started(calls: Sequence[ToolCall], rejected: frozenset[str] = frozenset()) -> EventBatch:
    return [
        (TOOL_STARTED, {"id": c.id, "name": c.name, "arguments": dict(c.arguments)})
        for c in calls
        if c.id not in rejected
    ]


async def run_turn(
    turn: AgentTurn,
    history: list[dict[str, Any]],
    *,
    call_model: CallModel,
    emit: Emit,
    ctx: ToolContext,
    tracing: Tracing = DISABLED,
    approval: ApprovalReply | None = None,
    resend: Sequence[ToolCall] = (),
) -> TurnOutcome:
    """Run model calls and tools until the model answers without tool calls.

    ``history`` already ends with the user's message and is extended in place. Returns the
    final text. Raises ``MaxStepsExceeded`` or whatever ``call_model`` raises (upstream,
    budget and pool errors), after every event of the finished steps has been emitted.
    Each tool call runs in an ``execute_tool`` span of ``tracing`` (agents/tracing.py).

    A step that calls a tool of ``turn.approval`` raises `ApprovalRequired` after its
    message is emitted, before any of its calls acts. ``approval`` resumes such a step:
    ``history`` then ends with its message, and its calls run (the rejected ones are
    answered with `REJECTED_TOOL_ERROR`) before the next model call.

    ``resend``: calls a crashed attempt sent without recording their result, of tools
    declared idempotent: they are sent again (same idempotency key) before the model is
    called. Each call's result is emitted (durable) before the next call acts: a resumed
    run never sends a call whose result was recorded. A `ToolSuspends` from a tool
    answers its call and the step's later ones as not run, then propagates.
    """
    tools_by_name = {tool.name: tool for tool in turn.tools}
    specs = tuple(
        ToolSpec(name=t.name, description=t.description, parameters=t.parameters)
        for t in turn.tools
    )
    usage = {"input_tokens": 0, "output_tokens": 0}

    async def act(calls: Sequence[ToolCall], rejected: frozenset[str] = frozenset()) -> None:
        """Run a step's calls (their start already emitted) and emit their results."""
        crash_point("tool.started")
        for index, call in enumerate(calls):
            if call.id in rejected:
                ok, output = False, REJECTED_TOOL_ERROR
            else:
                try:
                    ok, output = await _call_tool(tools_by_name.get(call.name), call, ctx, tracing)
                except ToolSuspends as exc:
                    error = SUSPENDED_TOOL_ERROR.format(reason=exc.code)
                    await emit([_result(c, False, error) for c in calls[index:]])
                    raise
            # The journal: this result is durable before the next call acts.
            await emit([_result(call, ok, output)])

    def _result(call: ToolCall, ok: bool, output: str) -> tuple[str, dict[str, Any]]:
        content = output if ok else f"error: {output}"
        history.append(
            {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": content}
        )
        if ok:
            return (TOOL_SUCCEEDED, {"id": call.id, "name": call.name, "output": output})
        return (TOOL_FAILED, {"id": call.id, "name": call.name, "error": output})

    if resend:
        await emit(_started(resend))
        await act(resend)
    if approval is not None:
        # An edited call is sent as edited: the model later sees what was sent.
        _sent_as(history, approval.calls)
        started = _started(approval.calls, approval.rejected)
        if started:
            await emit(started)
        await act(approval.calls, approval.rejected)
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
        waiting = [c.id for c in calls if c.name in turn.approval]
        if waiting:
            await emit(batch)
            raise ApprovalRequired(message["tool_calls"], waiting)
        await emit(batch + _started(calls))
        if not calls:
            return TurnOutcome(text=text, steps=step, usage=usage)
        await act(calls)
    raise MaxStepsExceeded(turn.max_steps)
