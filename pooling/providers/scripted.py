"""The keyless built-in ``scripted`` model: deterministic, streamed word by word, no network.

It exists so the embedded default works without any credential and so tests and demos can
drive the agent engine through tool loops and upstream failures on demand. Behaviour is
chosen by the request's options (the model record's options JSON):

- ``script``: ``[{"text": "...", "tool_calls": [{"name": ..., "arguments": {...}}]}, ...]``;
  step *i* is the number of assistant messages after the last user message, so a tool loop
  advances through the steps; past the end the default reply applies.
- ``token_delay_ms``: sleep this long between tokens (the first token comes at once) and
  between the pieces of a tool call's arguments (streamed in ``ARGUMENT_PIECE``-character
  ``ToolCallDelta``s before the complete call).
- ``error``: ``{"status": 502, "body": "...", "retry_after": 3}`` raises the mapped upstream
  error (through ``transform_error``) before any token, or after ``error_after_tokens``
  tokens when that is given. ``"status": null`` simulates a connection failure.

Default reply: a calculation request with a ``calculator`` tool offered calls it; a question
about the time with a ``clock`` tool offered calls it; a tool result is answered ("The
result is 4."); anything else is echoed ("You said: ...").
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sageproject.errors import ValidationError

from .base import ModelRequest, StreamEnd, StreamItem, TextDelta, ToolCall, ToolCallDelta
from .errors import connection_error, parse_error_body, upstream_error

CALCULATE = re.compile(r"(?i)\b(?:calculate|compute|what is)\s+([0-9\s\.\+\-\*/\(\)\^%]+)")
TIME = re.compile(r"(?i)\btime\b")
# Word tokens that keep their trailing whitespace, so joining the tokens gives the text back.
TOKEN = re.compile(r"\S+\s*|\s+")
# Characters of a tool call's arguments text per ToolCallDelta.
ARGUMENT_PIECE = 8


@dataclass(slots=True, kw_only=True)
class ScriptedClient:
    """The scripted "SDK client": nothing to connect, but it honours close like a real one."""

    record_id: Any = None
    model: str = ""
    closed: bool = False

    async def close(self) -> None:
        """Mark the client closed; streaming on a closed client is a bug in the caller."""
        self.closed = True


@dataclass(frozen=True, slots=True, kw_only=True)
class _Step:
    text: str
    tool_calls: tuple[ToolCall, ...]


def tokenize(text: str) -> list[str]:
    """``text`` split into word tokens keeping whitespace; ``"".join(tokens) == text``."""
    return TOKEN.findall(text)


def _words(text: Any) -> int:
    return len(text.split()) if isinstance(text, str) else 0


def _invalid(message: str) -> ValidationError:
    return ValidationError("model.options_invalid", f"scripted model options: {message}")


class ScriptedAdapter:
    """Adapter for the ``scripted`` protocol (see the module docstring for the options)."""

    protocol = "scripted"

    async def create_client(self, record: Any) -> ScriptedClient:
        """A ``ScriptedClient`` for ``record``; never raises and opens no connection."""
        return ScriptedClient(
            record_id=getattr(record, "id", None), model=str(getattr(record, "model", "") or "")
        )

    async def close_client(self, client: Any) -> None:
        """Close ``client`` (idempotent)."""
        await client.close()

    def transform_error(self, status: int, body: bytes | str) -> str | None:
        """A short reason for an injected error body (shared envelope parsing), else ``None``."""
        return parse_error_body(body)

    async def stream(self, client: Any, request: ModelRequest) -> AsyncIterator[StreamItem]:
        """Stream the scripted reply for ``request``: text deltas, tool calls, ``StreamEnd``.

        Raises ``UpstreamError`` when the options inject an error, ``ValidationError``
        (``model.options_invalid``) for malformed options, and ``RuntimeError`` on a closed
        client.
        """
        if getattr(client, "closed", False):
            raise RuntimeError("scripted client is closed")
        options: Mapping[str, Any] = request.options or {}
        delay = _delay_seconds(options.get("token_delay_ms", 0))
        error = options.get("error")
        if error is not None and not isinstance(error, Mapping):
            raise _invalid("'error' must be an object")
        error_after = options.get("error_after_tokens") if error else None
        if error_after is not None and (not isinstance(error_after, int) or error_after < 0):
            raise _invalid("'error_after_tokens' must be a non-negative integer")
        if error and error_after is None:
            raise self._injected(error)

        step = _choose_step(request, options)
        emitted = 0
        for token in tokenize(step.text):
            if error and emitted >= error_after:
                raise self._injected(error)
            if delay and emitted:
                await asyncio.sleep(delay)
            else:
                # Yield to the loop per token, as a real stream would, so a cancellation or a
                # competing run gets a chance between tokens.
                await asyncio.sleep(0)
            yield TextDelta(text=token)
            emitted += 1
        if error:
            # Fewer tokens than error_after_tokens: the stream still fails, at its end.
            raise self._injected(error)
        for index, call in enumerate(step.tool_calls):
            # The arguments stream in pieces, as a vendor's do, then the complete call.
            text = json.dumps(call.arguments)
            for start in range(0, len(text), ARGUMENT_PIECE):
                await asyncio.sleep(delay)
                yield ToolCallDelta(
                    index=index,
                    id=call.id,
                    name=call.name,
                    arguments=text[start : start + ARGUMENT_PIECE],
                )
        for call in step.tool_calls:
            yield call
        usage = {
            "input_tokens": _words(request.system)
            + sum(_words(m.get("content")) for m in request.messages),
            "output_tokens": _words(step.text),
        }
        yield StreamEnd(stop_reason="tool_use" if step.tool_calls else "end_turn", usage=usage)

    def _injected(self, error: Mapping[str, Any]) -> Exception:
        status = error.get("status")
        if status is None:
            return connection_error("connection failed (scripted)")
        if not isinstance(status, int):
            return _invalid("'error.status' must be an integer or null")
        retry_after = error.get("retry_after")
        return upstream_error(
            status,
            error.get("body", "") or "",
            adapter=self,
            retry_after=float(retry_after) if retry_after is not None else None,
        )


def _delay_seconds(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise _invalid("'token_delay_ms' must be a non-negative number")
    return float(value) / 1000.0


def _last_user_index(messages: Sequence[dict]) -> int:
    for index in range(len(messages) - 1, -1, -1):
        if messages[index].get("role") == "user":
            return index
    return -1


def _choose_step(request: ModelRequest, options: Mapping[str, Any]) -> _Step:
    messages = request.messages
    last_user = _last_user_index(messages)
    after = messages[last_user + 1 :]
    step_index = sum(1 for m in after if m.get("role") == "assistant")
    script = options.get("script")
    if script is not None:
        if not isinstance(script, list):
            raise _invalid("'script' must be a list of steps")
        if step_index < len(script):
            return _scripted_step(script[step_index], step_index)
    return _default_step(request, last_user, after, step_index)


def _scripted_step(raw: Any, step_index: int) -> _Step:
    if isinstance(raw, str):
        raw = {"text": raw}
    if not isinstance(raw, Mapping):
        raise _invalid(f"step {step_index} must be an object")
    text = raw.get("text", "")
    calls = raw.get("tool_calls") or []
    if not isinstance(text, str) or not isinstance(calls, list):
        raise _invalid(f"step {step_index} needs a string 'text' and a list 'tool_calls'")
    tool_calls = []
    for index, call in enumerate(calls):
        if not isinstance(call, Mapping) or not isinstance(call.get("name"), str):
            raise _invalid(f"step {step_index} tool call {index} needs a 'name'")
        arguments = call.get("arguments") or {}
        if not isinstance(arguments, Mapping):
            raise _invalid(f"step {step_index} tool call {index} 'arguments' must be an object")
        tool_calls.append(
            ToolCall(
                id=str(call.get("id") or f"call_{step_index}_{index}"),
                name=call["name"],
                arguments=dict(arguments),
            )
        )
    return _Step(text=text, tool_calls=tuple(tool_calls))


def _default_step(
    request: ModelRequest, last_user: int, after: Sequence[dict], step_index: int
) -> _Step:
    messages = request.messages
    offered = {tool.name for tool in request.tools}
    last = messages[-1] if messages else None
    if last is not None and last.get("role") == "tool":
        content = str(last.get("content", ""))
        if last.get("name") == "clock":
            return _Step(text=f"It is {content}.", tool_calls=())
        return _Step(text=f"The result is {content}.", tool_calls=())

    user_text = str(messages[last_user].get("content", "")) if last_user >= 0 else ""
    answered = any(m.get("role") == "tool" for m in after)
    if not answered:
        match = CALCULATE.search(user_text)
        if match and match.group(1).strip() and "calculator" in offered:
            call = ToolCall(
                id=f"call_{step_index}_0",
                name="calculator",
                arguments={"expression": match.group(1).strip()},
            )
            return _Step(text="", tool_calls=(call,))
        if TIME.search(user_text) and "clock" in offered:
            call = ToolCall(id=f"call_{step_index}_0", name="clock", arguments={})
            return _Step(text="", tool_calls=(call,))
    return _Step(text=f"You said: {user_text}", tool_calls=())
