"""The OpenAI shapes of a run (Django-free): Response objects and their streamed events,
chat completions and their chunks, and the error object. The views are in
``agents/protocols/openai.py``.

A run's answer is its assistant messages (`RunText`): for an agent, every
``message.completed`` of the assistant with text, in order (a tool-calling step's text too;
the tool calls themselves stay inside the host); for a flow, the flow's output when the run
completes. Live ``message.delta``\\s stream into the current message.

**Replayable numbering.** A streamed response must number its events the same way whether
it is followed live or replayed later from durable events (``GET /v1/responses/{id}?stream=
true&starting_after=N``), but live deltas are never stored and arrive in the model's own
pieces. So text is sent in canonical pieces — `pieces` (a word with the spaces after it,
at most 32 characters without a space) — which depend on the text alone: live, a piece is
sent once the text after it has begun (the last piece of a message with the message's
durable event); replayed, the durable text is cut the same way. Each piece is one
``response.output_text.delta`` and takes one sequence number, so ``starting_after`` means
the same event on every replay.

Live deltas are attributed to messages by the stream's order, with two guards: after a
``tool_call.delta`` (the step calls a tool, so its text has ended) text waits until that
step's durable message has closed it; and text a message's durable event already
delivered (deltas that arrive after it) is not sent twice. The durable text is the truth:
a message's ``done`` events carry it, whatever the live pieces were.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

PIECE = re.compile(r"\S{1,32}\s*|\s+")
# Run status → Response status (a suspended run waits for a reply no OpenAI client can
# give: the layer reports it failed, rate limited, and a waiting request cancels it).
RESPONSE_STATUS = {
    "queued": "queued",
    "running": "in_progress",
    "suspended": "failed",
    "completed": "completed",
    "failed": "failed",
    "cancelled": "cancelled",
    "interrupted": "cancelled",
}
# Our error categories → the OpenAI error ``type``.
ERROR_TYPE = {
    "VALIDATION": "invalid_request_error",
    "NOT_FOUND": "invalid_request_error",
    "CONFLICT": "invalid_request_error",
    "AUTHENTICATION": "authentication_error",
    "AUTHORIZATION": "permission_error",
    "RATE_LIMITED": "rate_limit_error",
    "CANCELLED": "invalid_request_error",
    "RESOURCE_LOST": "server_error",
    "UPSTREAM": "server_error",
    "UNAVAILABLE": "server_error",
    "INTERNAL": "server_error",
}
# The durable events that end a run (scheduling.runs.TERMINAL_EVENTS).
TERMINAL_KINDS = frozenset({"run.completed", "run.failed", "run.cancelled", "run.interrupted"})
# Messages of one chat completion are joined with this (also between streamed messages).
CHAT_JOIN = "\n\n"


def pieces(text: str) -> list[str]:
    """``text`` in canonical pieces; ``"".join(pieces(t)) == t``, and the pieces of a
    prefix are those of the whole text except (perhaps) the last."""
    return PIECE.findall(text)


def error_object(error: Mapping[str, Any]) -> dict[str, Any]:
    """The OpenAI error object for one of our errors (the envelope's fields): ``type`` from
    its category, ``code`` our stable code, ``param`` the first field it names."""
    fields = (error.get("details") or {}).get("fields")
    param = next(iter(fields), None) if isinstance(fields, Mapping) else None
    return {
        "message": str(error.get("message", "")),
        "type": ERROR_TYPE.get(str(error.get("category")), "server_error"),
        "param": param,
        "code": error.get("code"),
    }


# ------------------------------------------------------------------------------ text


@dataclass(slots=True)
class Message:
    """One output message of a run."""

    index: int
    live: str = ""  # the text received live so far
    sent: str = ""  # the part of it sent, in whole pieces
    text: str | None = None  # the durable text, once the message is closed


class RunText:
    """A run's output messages as operations — ``("open", m)``, ``("piece", m, text)``,
    ``("close", m)`` — from its durable events (`event`) and live deltas (`delta`); see
    the module text. ``flow``: the answer is the flow's output, live deltas are ignored.
    ``live_after``: the follower joined the run late, when the session's durable prefix
    was this seq — live text is not used until the model call in progress then is over
    (a durable assistant message after that seq, or a delta at offset 0)."""

    def __init__(self, *, flow: bool = False, live_after: int | None = None) -> None:
        self.flow = flow
        self.live_after = live_after
        self.live = live_after is None
        self.closed: list[Message] = []
        self.open: Message | None = None
        self.barrier = False
        self.held: list[str] = []
        self.owed = ""

    @property
    def texts(self) -> list[str]:
        return [m.text or "" for m in self.closed]

    def delta(self, kind: str, payload: Mapping[str, Any]) -> list[tuple[Any, ...]]:
        if self.flow:
            return []
        if kind == "tool_call.delta":
            self.barrier = True  # the step calls a tool: its text has ended
            return []
        text = payload.get("text")
        if kind != "message.delta" or not isinstance(text, str) or not text:
            return []
        offset = payload.get("offset")
        if isinstance(offset, int) and not isinstance(offset, bool):
            if offset == 0:
                # A new model call, seen from its start; an open message's call is over.
                self.live, self.owed = True, ""
                if self.open is not None and self.open.live and not self.barrier:
                    self.barrier = True
            elif offset != self._expected():
                self.live, self.held = False, []  # a gap: this call's text comes durable
        if not self.live:
            return []
        return self._text(text)

    def _expected(self) -> int:
        """Where the next live text of the current model call starts."""
        if self.barrier:
            return sum(len(t) for t in self.held)
        return len(self.open.live) if self.open is not None else 0

    def _text(self, text: str) -> list[tuple[Any, ...]]:
        if self.owed:
            if self.owed.startswith(text):
                self.owed = self.owed[len(text) :]
                return []
            self.owed = ""
        if self.barrier:
            self.held.append(text)
            return []
        ops: list[tuple[Any, ...]] = []
        message = self._open(ops)
        message.live += text
        for piece in pieces(message.live[len(message.sent) :])[:-1]:
            message.sent += piece
            ops.append(("piece", message, piece))
        return ops

    def _open(self, ops: list[tuple[Any, ...]]) -> Message:
        if self.open is None:
            self.open = Message(len(self.closed))
            ops.append(("open", self.open))
        return self.open

    def event(
        self, kind: str, payload: Mapping[str, Any], seq: int | None = None
    ) -> list[tuple[Any, ...]]:
        """Operations for one durable event of the run (``seq``: its seq)."""
        if kind == "message.completed" and not self.flow and payload.get("role") == "assistant":
            ops = self._message(str(payload.get("content") or ""))
            if not self.live and seq is not None and seq > (self.live_after or 0):
                self.live = True  # the call in progress when the follower joined is over
            return ops
        if kind == "run.completed" and self.flow:
            result = payload.get("result")
            text = result.get("text") if isinstance(result, Mapping) else None
            return self._message(str(text or ""))
        if kind in TERMINAL_KINDS:
            return self._close(self.open.live) if self.open is not None else []
        return []

    def _message(self, content: str) -> list[tuple[Any, ...]]:
        held, self.held, self.barrier = self.held, [], False
        ops: list[tuple[Any, ...]] = []
        if content:
            message = self._open(ops)
            if content.startswith(message.sent):
                for piece in pieces(content[len(message.sent) :]):
                    message.sent += piece
                    ops.append(("piece", message, piece))
            live = message.live
            ops += self._close(content)
            self.owed = content[len(live) :] if content.startswith(live) else ""
        for text in held:
            ops += self._text(text)
        return ops

    def _close(self, text: str) -> list[tuple[Any, ...]]:
        message = self.open
        if message is None:
            return []
        message.text = text
        self.closed.append(message)
        self.open = None
        return [("close", message)]

    def replay(self, events: Iterable[tuple[str, Mapping[str, Any]]]) -> list[str]:
        """The texts of the messages that ``events`` (durable, in order) close."""
        for kind, payload in events:
            self.event(kind, payload)
        return self.texts


# ------------------------------------------------------------------------------ responses


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(response_id: str, index: int, text: str | None) -> dict[str, Any]:
    """An output message item; ``text`` None while it is in progress."""
    return {
        "id": f"msg_{response_id.removeprefix('resp_')}_{index}",
        "type": "message",
        "role": "assistant",
        "status": "in_progress" if text is None else "completed",
        "content": [] if text is None else [output_text(text)],
    }


def _counted(usage: Mapping[str, Any] | None, shape: Any) -> dict[str, Any] | None:
    """``shape(input_tokens, output_tokens)`` of a run's usage; None without one."""
    if not usage:
        return None
    return shape(int(usage.get("input_tokens", 0) or 0), int(usage.get("output_tokens", 0) or 0))


def usage_object(usage: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A Response's ``usage``."""
    return _counted(
        usage,
        lambda tokens_in, tokens_out: {
            "input_tokens": tokens_in,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": tokens_out,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": tokens_in + tokens_out,
        },
    )


def response_error(error: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A run's error as a Response's ``error`` (``code`` is OpenAI's; ours ends the
    message)."""
    if not error:
        return None
    code = "rate_limit_exceeded" if error.get("category") == "RATE_LIMITED" else "server_error"
    return {"code": code, "message": f"{error.get('message', '')} ({error.get('code')})"}


def response_body(
    *,
    response_id: str,
    created_at: float,
    status: str,
    model: str,
    texts: list[str],
    error: Mapping[str, Any] | None = None,
    usage: Mapping[str, Any] | None = None,
    background: bool = False,
    previous_response_id: str | None = None,
    completed_at: float | None = None,
) -> dict[str, Any]:
    """A Response object (``object: "response"``)."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(created_at),
        "status": status,
        "background": background,
        "completed_at": int(completed_at) if completed_at is not None else None,
        "error": response_error(error),
        "incomplete_details": None,
        "instructions": None,
        "max_output_tokens": None,
        "metadata": {},
        "model": model,
        "output": [message_item(response_id, i, text) for i, text in enumerate(texts)],
        "parallel_tool_calls": False,
        "previous_response_id": previous_response_id,
        "store": True,
        "temperature": None,
        "text": {"format": {"type": "text"}},
        "tool_choice": "auto",
        "tools": [],
        "top_p": None,
        "truncation": "disabled",
        "usage": usage_object(usage),
    }


# The stream event that ends a response of each final status.
TERMINAL_TYPE = {
    "completed": "response.completed",
    "failed": "response.failed",
    "cancelled": "response.incomplete",
}


class ResponseEvents:
    """A Response's streamed events with their sequence numbers (0, 1, …), leaving out
    those numbered ``starting_after`` or lower (-1: none)."""

    def __init__(self, response_id: str, starting_after: int = -1) -> None:
        self.response_id = response_id
        self.after = starting_after
        self.number = -1

    def _event(self, kind: str, **fields: Any) -> list[dict[str, Any]]:
        self.number += 1
        if self.number <= self.after:
            return []
        return [{"type": kind, "sequence_number": self.number, **fields}]

    def start(self, response: dict[str, Any]) -> list[dict[str, Any]]:
        return self._event("response.created", response=response) + self._event(
            "response.in_progress", response=response
        )

    def ops(self, ops: Iterable[tuple[Any, ...]]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for op in ops:
            message: Message = op[1]
            where = {
                "item_id": message_item(self.response_id, message.index, None)["id"],
                "output_index": message.index,
            }
            if op[0] == "open":
                out += self._event(
                    "response.output_item.added",
                    output_index=message.index,
                    item=message_item(self.response_id, message.index, None),
                )
                out += self._event(
                    "response.content_part.added", **where, content_index=0, part=output_text("")
                )
            elif op[0] == "piece":
                out += self._event(
                    "response.output_text.delta", **where, content_index=0, delta=op[2], logprobs=[]
                )
            else:
                text = message.text or ""
                out += self._event(
                    "response.output_text.done", **where, content_index=0, text=text, logprobs=[]
                )
                out += self._event(
                    "response.content_part.done", **where, content_index=0, part=output_text(text)
                )
                out += self._event(
                    "response.output_item.done",
                    output_index=message.index,
                    item=message_item(self.response_id, message.index, text),
                )
        return out

    def end(self, response: dict[str, Any]) -> list[dict[str, Any]]:
        kind = TERMINAL_TYPE.get(response["status"], "response.failed")
        return self._event(kind, response=response)

    def error(self, error: Mapping[str, Any]) -> list[dict[str, Any]]:
        """An ``error`` event (an OpenAI error object's code, message and param)."""
        return self._event(
            "error", code=error.get("code"), message=error.get("message"), param=error.get("param")
        )


# ------------------------------------------------------------------------------ chat


def chat_usage(usage: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A chat completion's ``usage``."""
    return _counted(
        usage,
        lambda prompt, completion: {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        },
    )


def chat_completion(
    *, completion_id: str, created: float, model: str, texts: list[str], usage: Any
) -> dict[str, Any]:
    """A chat completion (``object: "chat.completion"``), one choice: the run's messages
    joined with `CHAT_JOIN`."""
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(created),
        "model": model,
        "system_fingerprint": None,
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": CHAT_JOIN.join(texts),
                    "refusal": None,
                    "annotations": [],
                },
                "finish_reason": "stop",
                "logprobs": None,
            }
        ],
        "usage": chat_usage(usage),
    }


class ChatChunks:
    """The chunks of a streamed chat completion (``object: "chat.completion.chunk"``)."""

    def __init__(self, completion_id: str, created: float, model: str) -> None:
        self.base = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": int(created),
            "model": model,
            "system_fingerprint": None,
        }

    def chunk(self, delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        return {
            **self.base,
            "choices": [
                {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
            ],
        }

    def start(self) -> list[dict[str, Any]]:
        return [self.chunk({"role": "assistant", "content": ""})]

    def ops(self, ops: Iterable[tuple[Any, ...]]) -> list[dict[str, Any]]:
        out = []
        for op in ops:
            if op[0] == "open" and op[1].index > 0:
                out.append(self.chunk({"content": CHAT_JOIN}))
            elif op[0] == "piece":
                out.append(self.chunk({"content": op[2]}))
        return out

    def end(self, usage: Any, *, include_usage: bool) -> list[dict[str, Any]]:
        out = [self.chunk({}, "stop")]
        if include_usage:
            out.append({**self.base, "choices": [], "usage": chat_usage(usage)})
        return out
