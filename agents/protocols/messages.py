"""A session's durable events in LangGraph's shapes (Django-free): LangChain messages, the
thread's state and its checkpoints, and one run's Server-Sent Events. The views are in
``agents/protocols/langgraph/``.

**State.** A thread's state is ``{"messages": [...]}``, LangChain messages as LangGraph
serializes them: ``human`` (a user message), ``ai`` (an assistant message, its
``tool_calls`` as ``{"name", "args", "id", "type": "tool_call"}``) and ``tool`` (a call's
result, ``status`` ``error`` when it failed). Ids are stable: ``<run>:human``,
``<run>:ai:<n>`` (the run's n-th assistant message), ``<run>:tool:<call id>``, and
``event:<seq>`` for messages of no run (imported history).

**Checkpoints.** Every event that changes the state — a message, a tool result, an
interaction requested — is a checkpoint, numbered by its seq (the id is the seq as a
UUID, `checkpoint_id`). A suspended run's interaction is the thread's interrupt: a task
``tools`` with ``{"value", "id"}`` (``id`` the interaction's id) until it is answered or
the run ends; an approval's value is agent-chat-ui's ``action_requests`` /
``review_configs``.

**A run's stream** (`RunStream`): for each durable event of the run the parts the
requested ``stream_mode``\\s ask for — ``values`` (the state), ``updates`` (``{node:
{"messages": [new]}}``, nodes ``model`` and ``tools``, or ``__interrupt__``),
``messages`` (``messages-tuple``: ``[message chunk, metadata]``), ``events`` (LangChain
``on_chat_model_stream`` / ``_end``, ``on_tool_start`` / ``_end``) — then ``end`` when the
run completes, is cancelled or interrupted, or waits for its interaction, and ``error``
when it fails. Every part has an id that says where a reconnect resumes:
``<seq>-<k>`` (part k of the durable event ``seq``: k is fixed per kind of part, so it
means the same on every stream), ``<seq>-m`` (the first event, ``metadata``, sent before
event ``seq + 1``), and, for a live token chunk,
``<seq>-d<n>``: ``n`` characters of the run's next assistant message were delivered
(``<seq>-d<n>t``: and pieces of its tool calls). Live chunks are never stored; a resumed
stream therefore sends, when that message is durable, the text the client has not seen
(from character ``n``), so the chunks of every message add up to its text exactly once.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

MESSAGE = "message.completed"
TOOL_STARTED = "tool.call.started"
TOOL_RESULTS = frozenset({"tool.call.succeeded", "tool.call.failed"})
INTERACTION = "interaction.requested"
RESOLVED = "interaction.resolved"
# A run's last event, and what its stream ends with.
ENDINGS = {
    "run.completed": "end",
    "run.cancelled": "end",
    "run.interrupted": "end",
    "run.failed": "error",
}
# The graph's nodes as events name them.
MODEL_NODE = "model"
TOOLS_NODE = "tools"


def checkpoint_id(seq: int) -> str:
    """The checkpoint id of the state after durable event ``seq``."""
    return str(uuid.UUID(int=seq))


def checkpoint_seq(value: Any) -> int | None:
    """The seq a checkpoint id (or a checkpoint object) names; None when it names none."""
    if isinstance(value, Mapping):
        value = value.get("checkpoint_id")
    if not isinstance(value, str) or not value:
        return None
    try:
        seq = uuid.UUID(value).int
    except ValueError:
        return None
    return seq if 0 < seq < 2**31 else None


def _base(kind: str, content: Any, message_id: str) -> dict[str, Any]:
    return {
        "content": content,
        "additional_kwargs": {},
        "response_metadata": {},
        "type": kind,
        "name": None,
        "id": message_id,
    }


def tool_call(call: Mapping[str, Any]) -> dict[str, Any]:
    """One of our tool calls (``{"id", "name", "arguments"}``) as LangChain's."""
    return {
        "name": call.get("name", ""),
        "args": dict(call.get("arguments") or {}),
        "id": call.get("id", ""),
        "type": "tool_call",
    }


def ai_message(payload: Mapping[str, Any], message_id: str) -> dict[str, Any]:
    return {
        **_base("ai", payload.get("content", ""), message_id),
        "tool_calls": [tool_call(c) for c in payload.get("tool_calls") or ()],
        "invalid_tool_calls": [],
        "usage_metadata": None,
    }


def chunk(message_id: str, text: str, calls: Iterable[dict[str, Any]] = ()) -> dict[str, Any]:
    """An ``AIMessageChunk``: ``text`` and pieces of tool calls
    (``{"name", "args" (text), "id", "index"}``)."""
    pieces = [{**c, "type": "tool_call_chunk"} for c in calls]
    return {
        **_base("AIMessageChunk", text, message_id),
        "tool_calls": [],
        "invalid_tool_calls": [],
        "usage_metadata": None,
        "tool_call_chunks": pieces,
    }


def interrupt_value(interaction: Mapping[str, Any]) -> dict[str, Any]:
    """What a client is shown of a suspended run's interaction: an approval as
    agent-chat-ui's human-in-the-loop request, any other as it is (without its id)."""
    if interaction.get("type") == "approval":
        waiting = set(interaction.get("waiting") or ())
        calls = [c for c in interaction.get("tool_calls") or () if c.get("id") in waiting]
        decisions = list(interaction.get("allowed_decisions") or ())
        return {
            "type": "approval",
            "action_requests": [
                {
                    "name": c.get("name", ""),
                    "args": dict(c.get("arguments") or {}),
                    "description": f"The agent calls the tool {c.get('name', '')!r}.",
                }
                for c in calls
            ],
            "review_configs": [
                {"action_name": name, "allowed_decisions": decisions}
                for name in dict.fromkeys(c.get("name", "") for c in calls)
            ],
        }
    return {k: v for k, v in interaction.items() if k not in ("id", "resolution")}


def edits(resume: Any, interaction: Mapping[str, Any]) -> dict[str, Any]:
    """The edited arguments a ``Command(resume=...)`` value gives an approval's waiting
    calls, by call id: agent-chat-ui's ``{"decisions": [...]}`` in the order of the
    interrupt's ``action_requests``, each ``{"type": "edit", "edited_action": {"name",
    "args"}}`` (or the older ``{"type": "edit", "args": {"action", "args"}}``)."""
    if isinstance(resume, Mapping) and interaction.get("id") in resume:
        resume = resume[interaction["id"]]
    if isinstance(resume, Mapping) and isinstance(resume.get("decisions"), list):
        answers = list(resume["decisions"])
    elif isinstance(resume, list):
        answers = resume
    else:
        answers = [resume]
    waiting = set(interaction.get("waiting") or ())
    asked = [c for c in interaction.get("tool_calls") or () if c.get("id") in waiting]
    found: dict[str, Any] = {}
    for call, answer in zip(asked, answers, strict=False):
        if not isinstance(answer, Mapping) or answer.get("type") != "edit":
            continue
        action = answer.get("edited_action") or answer.get("args") or {}
        if isinstance(action, Mapping):
            found[str(call["id"])] = action.get("args")
    return found


def decision(resume: Any, interaction: Mapping[str, Any]) -> Any:
    """The decision a ``Command(resume=...)`` value gives an interaction: a decision's
    name (``"approve"``), ``{"type": ...}`` or ``{"decision": ...}``, agent-chat-ui's
    ``{"decisions": [{"type": ...}]}`` (the first, or ``edit`` if one edits), a map of
    interrupt id to any of these, or ``true`` / ``false`` (the first allowed decision /
    ``reject`` or ``cancel``). The caller checks it is allowed."""
    allowed = list(interaction.get("allowed_decisions") or ())
    if isinstance(resume, Mapping) and interaction.get("id") in resume:
        resume = resume[interaction["id"]]
    if isinstance(resume, Mapping) and isinstance(resume.get("decisions"), list):
        resume = resume["decisions"]
    if isinstance(resume, list):
        # One answer per call: an edit approves them all, the edited ones as edited (an
        # edit beside a reject is no one decision).
        types = [a.get("type") if isinstance(a, Mapping) else a for a in resume]
        if "edit" in types:
            resume = None if "reject" in types else "edit"
        else:
            resume = types[0] if types else None
    if isinstance(resume, Mapping):
        resume = resume.get("type", resume.get("decision"))
    if isinstance(resume, bool):
        refusals = [d for d in ("reject", "cancel") if d in allowed]
        return allowed[0] if resume and allowed else (refusals[0] if refusals else None)
    return resume


@dataclass(slots=True)
class Checkpoint:
    """The state after one durable event: how many messages it holds and what comes next."""

    seq: int
    count: int
    source: str
    run: str | None
    next: tuple[str, ...]
    created_at: Any
    interrupt: dict[str, Any] | None = None


@dataclass(slots=True)
class Thread:
    """A thread's state built from its durable events in seq order (`apply`)."""

    thread_id: str
    meta: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: list[Checkpoint] = field(default_factory=list)
    # Assistant messages so far per run (their ids count them).
    ai_count: dict[str, int] = field(default_factory=dict)
    # The pending interaction: (its interrupt, the run it suspends).
    pending: tuple[dict[str, Any], str | None] | None = None
    last_seq: int = 0

    def apply(self, seq: int, etype: str, run: str | None, payload: Any, created_at: Any) -> list:
        """Take one durable event; returns the messages it added (possibly none)."""
        self.last_seq = seq
        added: list[dict[str, Any]] = []
        source, next_nodes = "loop", ()
        if etype == MESSAGE and isinstance(payload, Mapping):
            if payload.get("role") == "user":
                mid = f"{run}:human" if run else f"event:{seq}"
                added.append(_base("human", payload.get("content", ""), mid))
                source, next_nodes = "input", (MODEL_NODE,)
            else:
                if run:
                    self.ai_count[run] = self.ai_count.get(run, 0) + 1
                    mid = f"{run}:ai:{self.ai_count[run]}"
                else:
                    mid = f"event:{seq}"
                message = ai_message(payload, mid)
                added.append(message)
                next_nodes = (TOOLS_NODE,) if message["tool_calls"] else ()
        elif etype in TOOL_RESULTS and isinstance(payload, Mapping):
            ok = etype == "tool.call.succeeded"
            call_id = str(payload.get("id", ""))
            content = payload.get("output") if ok else f"error: {payload.get('error', '')}"
            added.append(
                {
                    **_base("tool", str(content), f"{run}:tool:{call_id}"),
                    "tool_call_id": call_id,
                    "name": payload.get("name", ""),
                    "artifact": None,
                    "status": "success" if ok else "error",
                }
            )
            next_nodes = (MODEL_NODE,)
        elif etype == INTERACTION and isinstance(payload, Mapping):
            interrupt = {"value": interrupt_value(payload), "id": str(payload.get("id", ""))}
            self.pending = (interrupt, run)
            self.checkpoints.append(
                Checkpoint(
                    seq, len(self.messages), "loop", run, (TOOLS_NODE,), created_at, interrupt
                )
            )
            return added
        else:
            if etype == RESOLVED or (
                etype in ENDINGS and self.pending is not None and self.pending[1] == run
            ):
                self.pending = None
            return added
        self.messages.extend(added)
        self.checkpoints.append(
            Checkpoint(seq, len(self.messages), source, run, next_nodes, created_at)
        )
        return added

    @property
    def values(self) -> dict[str, Any]:
        return {"messages": list(self.messages)} if self.checkpoints else {}

    @property
    def interrupts(self) -> list[dict[str, Any]]:
        """The pending interrupt (at most one: a session runs one run at a time)."""
        return [self.pending[0]] if self.pending is not None else []

    def task_id(self, run: str | None) -> str:
        return str(uuid.uuid5(uuid.NAMESPACE_URL, f"sage-task:{run}"))

    def _checkpoint_ref(self, seq: int | None) -> dict[str, Any] | None:
        if seq is None:
            return None
        return {
            "thread_id": self.thread_id,
            "checkpoint_ns": "",
            "checkpoint_id": checkpoint_id(seq),
            "checkpoint_map": None,
        }

    def state(self, index: int = -1) -> dict[str, Any]:
        """The thread state at checkpoint ``index`` (the head by default), as
        ``threads.get_state`` answers it."""
        if not self.checkpoints:
            return {
                "values": {},
                "next": [],
                "tasks": [],
                "metadata": {},
                "created_at": None,
                "checkpoint": {
                    "thread_id": self.thread_id,
                    "checkpoint_ns": "",
                    "checkpoint_id": None,
                    "checkpoint_map": None,
                },
                "parent_checkpoint": None,
                "interrupts": [],
                "checkpoint_id": None,
                "parent_checkpoint_id": None,
            }
        index = index % len(self.checkpoints)
        point = self.checkpoints[index]
        parent = self.checkpoints[index - 1].seq if index > 0 else None
        head = index == len(self.checkpoints) - 1
        # A past interrupt stays in its checkpoint; the head's only while it is pending.
        interrupts = [point.interrupt] if point.interrupt is not None else []
        if head and self.pending is None:
            interrupts = []
        tasks = []
        if point.next:
            tasks.append(
                {
                    "id": self.task_id(point.run),
                    "name": point.next[0],
                    "path": ["__pregel_pull", point.next[0]],
                    "error": None,
                    "interrupts": interrupts,
                    "checkpoint": None,
                    "state": None,
                    "result": None,
                }
            )
        return {
            "values": {"messages": self.messages[: point.count]},
            "next": list(point.next),
            "tasks": tasks,
            "metadata": {
                **self.meta,
                "source": point.source,
                "step": index,
                "run_id": point.run,
                "thread_id": self.thread_id,
                "parents": {},
            },
            "created_at": _iso(point.created_at),
            "checkpoint": self._checkpoint_ref(point.seq),
            "parent_checkpoint": self._checkpoint_ref(parent),
            "interrupts": interrupts,
            "checkpoint_id": checkpoint_id(point.seq),
            "parent_checkpoint_id": checkpoint_id(parent) if parent is not None else None,
        }

    def history(
        self,
        *,
        limit: int,
        before: int | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> list[dict[str, Any]]:
        """States newest first, at most ``limit``, older than checkpoint seq ``before``,
        whose metadata holds every item of ``metadata``."""
        found: list[dict[str, Any]] = []
        for index in range(len(self.checkpoints) - 1, -1, -1):
            if len(found) >= limit:
                break
            if before is not None and self.checkpoints[index].seq >= before:
                continue
            state = self.state(index)
            if metadata and any(state["metadata"].get(k) != v for k, v in metadata.items()):
                continue
            found.append(state)
        return found

    def index_of(self, seq: int) -> int | None:
        for index, point in enumerate(self.checkpoints):
            if point.seq == seq:
                return index
        return None


def _iso(value: Any) -> Any:
    return value.isoformat() if isinstance(value, datetime) else value


# ------------------------------------------------------------------------ a run's stream


@dataclass(frozen=True, slots=True)
class Part:
    """One Server-Sent Event: its id, event name and JSON data."""

    id: str
    event: str
    data: Any

    def encode(self) -> bytes:
        body = json.dumps(self.data, separators=(",", ":"), ensure_ascii=False, default=str)
        return f"id: {self.id}\nevent: {self.event}\ndata: {body}\n\n".encode()


@dataclass(frozen=True, slots=True)
class Resume:
    """Where a stream resumes (`parse_event_id`): after durable event ``seq``, skipping the
    parts up to ``part`` of event ``seq + 1``; ``chars`` of the run's next assistant message
    were delivered when a live chunk was the last event the client got."""

    seq: int
    part: int = -1
    chars: int | None = None
    # Pieces of the message's tool calls were delivered too (``d<n>t``).
    calls: bool = False


def parse_event_id(value: str | None) -> Resume | None:
    """A ``Last-Event-ID`` this layer sent (see the module text); None for any other."""
    if not value:
        return None
    seq_text, _, rest = value.partition("-")
    if not seq_text.isdigit() or len(seq_text) > 10:
        return None
    seq = int(seq_text)
    if rest == "m":
        return Resume(seq)
    calls = rest.endswith("t")
    count = rest[1 : len(rest) - calls]
    if rest.startswith("d") and count.isdigit():
        return Resume(seq, chars=int(count), calls=calls)
    if rest.isdigit() and seq > 0:
        return Resume(seq - 1, int(rest))
    return None


class RunStream:
    """One run's stream parts from the session's events (`durable`) and the run's live
    deltas (`delta`), after the thread state up to where it starts (``thread``).

    ``resume`` is where the stream starts (None: from ``thread.last_seq``, its first
    event ``metadata``). ``live`` says the run had not started its current message
    before this stream subscribed (a run just queued or resumed): its chunks are sent
    from the first; otherwise the message in progress is sent whole when it is durable.
    """

    def __init__(
        self,
        thread: Thread,
        run_id: str,
        modes: Iterable[str],
        meta: Mapping[str, Any],
        *,
        resume: Resume | None = None,
        live: bool = True,
    ) -> None:
        self.thread = thread
        self.run = str(run_id)
        modes = set(modes) or {"values"}
        if "messages-tuple" in modes or "messages" in modes:
            modes.add("messages")
        self.modes = modes
        self.meta = dict(meta)
        self.resume = resume
        # The run's next assistant message: its number; whether its chunks are sent as they
        # come (armed: the stream saw it from its start) or its text from character
        # ``offset`` when it is durable; the text and tool call pieces sent of it.
        self.next_ai = thread.ai_count.get(self.run, 0) + 1
        partial = resume is not None and resume.chars is not None
        self.armed = live and not partial
        self.offset = resume.chars if partial else 0
        # The client had pieces of the message's tool calls: they are not sent again.
        self.calls_delivered = partial and resume.calls
        self.sent_text: list[str] = []
        self.sent_calls: set[int] = set()
        self.broken = False

    def opening(self) -> list[Part]:
        """``metadata``, unless the client had it."""
        if self.resume is not None:
            return []
        metadata = {"run_id": self.run, "attempt": 1}
        return [Part(f"{self.thread.last_seq}-m", "metadata", metadata)]

    def _message_meta(self, node: str) -> dict[str, Any]:
        return {
            **self.meta,
            "run_id": self.run,
            "langgraph_node": node,
            "langgraph_step": len(self.thread.checkpoints),
            "langgraph_triggers": [f"branch:to:{node}"],
        }

    def _event(self, name: str, data: Mapping[str, Any], node: str) -> dict[str, Any]:
        return {
            "event": name,
            "name": node,
            "run_id": self.run,
            "tags": [],
            "metadata": self._message_meta(node),
            "data": dict(data),
            "parent_ids": [],
        }

    def durable(self, event: Any) -> list[Part]:
        """Apply one durable event (``seq``, ``type``, ``run_id``, ``payload``,
        ``created_at``) and return the run's parts for it (``end``/``error`` excepted:
        `closing`)."""
        run = str(event.run_id) if event.run_id is not None else None
        payload = event.payload
        # Each kind of part has its slot (its number within the event), whatever else this
        # stream sends of the event: a part resumed from means the same on every stream.
        pieces: list[tuple[int, str, Any]] = []
        if run == self.run and event.type == MESSAGE and payload.get("role") != "user":
            pieces += self._completion(payload)
        added = self.thread.apply(event.seq, event.type, run, payload, event.created_at)
        if run != self.run:
            return []
        if "events" in self.modes and event.type == TOOL_STARTED:
            data = {"input": dict(payload.get("arguments") or {})}
            pieces.append((1, "events", self._event("on_tool_start", data, TOOLS_NODE)))
        for message in added:
            kind = message["type"]
            node = MODEL_NODE if kind == "ai" else TOOLS_NODE
            if kind == "tool" and "messages" in self.modes:
                pieces.append((2, "messages", [message, self._message_meta(TOOLS_NODE)]))
            if "events" in self.modes and kind != "human":
                name = "on_chat_model_end" if kind == "ai" else "on_tool_end"
                pieces.append((3, "events", self._event(name, {"output": message}, node)))
            if "updates" in self.modes and kind != "human":
                pieces.append((4, "updates", {node: {"messages": [message]}}))
        if event.type == INTERACTION and self.thread.pending is not None:
            interrupt = self.thread.pending[0]
            if "updates" in self.modes:
                pieces.append((4, "updates", {"__interrupt__": [interrupt]}))
            if "values" in self.modes:
                values = {**self.thread.values, "__interrupt__": [interrupt]}
                pieces.append((5, "values", values))
        elif added and "values" in self.modes:
            pieces.append((5, "values", self.thread.values))
        return self._number(event.seq, pieces)

    def closing(self, event: Any) -> Part | None:
        """The run's last part after durable event ``event``: ``end`` (completed,
        cancelled, interrupted, or waiting for its interaction — the caller knows which
        interaction is current) or ``error``; None for any other event."""
        if str(event.run_id) != self.run:
            return None
        name = "end" if event.type == INTERACTION else ENDINGS.get(event.type)
        if name is None:
            return None
        data = None
        if name == "error":
            error = (event.payload or {}).get("error") or {}
            data = {"error": error.get("code", "error"), "message": error.get("message", "")}
        parts = self._number(event.seq, [(15, name, data)])
        return parts[0] if parts else None

    def _number(self, seq: int, pieces: list[tuple[int, str, Any]]) -> list[Part]:
        skip = self.resume.part if self.resume and seq == self.resume.seq + 1 else -1
        return [Part(f"{seq}-{slot}", name, data) for slot, name, data in pieces if slot > skip]

    def _completion(self, payload: Mapping[str, Any]) -> list[tuple[int, str, Any]]:
        """The rest of an assistant message the client has not had as chunks."""
        message_id = f"{self.run}:ai:{self.next_ai}"
        full = str(payload.get("content", ""))
        calls = list(payload.get("tool_calls") or ())
        pieces: list[tuple[int, str, Any]] = []
        if "messages" in self.modes:
            sent = "".join(self.sent_text) if self.armed else None
            if sent is None:
                rest = full[self.offset :]
            elif not self.broken and full.startswith(sent):
                rest = full[len(sent) :]
            else:
                rest = ""
            missing = [
                {
                    "name": c.get("name", ""),
                    "args": json.dumps(c.get("arguments") or {}),
                    "id": c.get("id", ""),
                    "index": index,
                }
                for index, c in enumerate(calls)
                if not (self.armed and index in self.sent_calls) and not self.calls_delivered
            ]
            if rest or missing:
                piece = [chunk(message_id, rest, missing), self._message_meta(MODEL_NODE)]
                pieces.append((0, "messages", piece))
        self.next_ai += 1
        self.offset = 0
        self.calls_delivered = False
        self.sent_text = []
        self.sent_calls = set()
        self.armed = True
        self.broken = False
        return pieces

    def delta(self, kind: str, payload: Mapping[str, Any]) -> list[Part]:
        """A live delta of the run (``message.delta`` / ``tool_call.delta``); other live
        messages (``tool.progress``) are not part of LangGraph's message streams."""
        if not self.armed or self.broken or kind not in ("message.delta", "tool_call.delta"):
            return []
        message_id = f"{self.run}:ai:{self.next_ai}"
        if kind == "message.delta":
            text = str(payload.get("text", ""))
            self.sent_text.append(text)
            piece = chunk(message_id, text)
        else:
            index = int(payload.get("index", 0) or 0)
            self.sent_calls.add(index)
            piece = chunk(
                message_id,
                "",
                [
                    {
                        "name": payload.get("name"),
                        "args": str(payload.get("arguments", "")),
                        "id": payload.get("id"),
                        "index": index,
                    }
                ],
            )
        sent = sum(len(t) for t in self.sent_text)
        part_id = f"{self.thread.last_seq}-d{sent}{'t' if self.sent_calls else ''}"
        parts = []
        if "messages" in self.modes:
            parts.append(Part(part_id, "messages", [piece, self._message_meta(MODEL_NODE)]))
        if "events" in self.modes:
            event = self._event("on_chat_model_stream", {"chunk": piece}, MODEL_NODE)
            parts.append(Part(part_id, "events", event))
        return parts

    def dropped(self) -> None:
        """Deltas were lost: the message in progress is completed from its durable text."""
        self.broken = True
