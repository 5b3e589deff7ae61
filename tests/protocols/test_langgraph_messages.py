"""A run's LangGraph stream from durable events and live deltas (Django-free): where a
reconnect resumes, and chunks that add up to each message once whatever was missed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agents.protocols.messages import Resume, RunStream, Thread, decision, edits, parse_event_id

RUN = "r1"


@dataclass
class Ev:
    seq: int
    type: str
    payload: dict
    run_id: Any = RUN
    created_at: Any = None


EVENTS = [
    Ev(1, "run.started", {}),
    Ev(2, "message.completed", {"role": "user", "content": "hi"}),
    Ev(3, "message.completed", {"role": "assistant", "content": "Hello there, friend."}),
    Ev(4, "run.completed", {}),
]


def _stream(upto: int, **options: Any) -> RunStream:
    thread = Thread("t1")
    for event in EVENTS[:upto]:
        thread.apply(event.seq, event.type, RUN, event.payload, None)
    thread.last_seq = upto
    return RunStream(thread, RUN, ["values", "messages-tuple"], {}, **options)


def _text(parts) -> str:
    return "".join(p.data[0]["content"] for p in parts if p.event == "messages")


def _rest(stream: RunStream, upto: int) -> list:
    parts = []
    for event in EVENTS[upto:]:
        parts += stream.durable(event)
        closing = stream.closing(event)
        if closing is not None:
            parts.append(closing)
    return parts


def test_event_ids_say_where_a_stream_resumes():
    assert parse_event_id("7-m") == Resume(7)
    assert parse_event_id("7-2") == Resume(6, 2)
    assert parse_event_id("7-d12") == Resume(7, chars=12)
    assert parse_event_id("7-d12t") == Resume(7, chars=12, calls=True)
    for other in (None, "", "-1", "0", "abc", "7-x", "7-d", "0-3"):
        assert parse_event_id(other) is None, other


def test_live_chunks_then_nothing_more_when_all_arrived():
    stream = _stream(2)
    assert [p.id for p in stream.opening()] == ["2-m"]
    sent = []
    for piece in ("Hello ", "there, ", "friend."):
        sent += stream.delta("message.delta", {"text": piece})
    assert [p.id for p in sent] == ["2-d6", "2-d13", "2-d20"]
    rest = _rest(stream, 2)
    assert _text(sent + rest) == "Hello there, friend."
    assert [p.event for p in rest] == ["values", "end"]
    assert [p.id for p in rest] == ["3-5", "4-15"]


def test_a_resumed_stream_sends_the_text_the_client_missed():
    # The client had "Hello " (6 characters) when the stream was cut.
    stream = _stream(2, resume=parse_event_id("2-d6"), live=False)
    assert stream.opening() == []
    # Live pieces of that message cannot be placed: they are not sent.
    assert stream.delta("message.delta", {"text": "friend."}) == []
    rest = _rest(stream, 2)
    assert "Hello " + _text(rest) == "Hello there, friend."


def test_a_stream_that_lost_deltas_completes_the_message_from_its_durable_text():
    stream = _stream(2)
    sent = stream.delta("message.delta", {"text": "Hello "})
    stream.dropped()
    assert stream.delta("message.delta", {"text": "friend."}) == []
    rest = _rest(stream, 2)
    assert _text(sent + rest) == "Hello "  # the hole is not filled by guessing…
    assert rest[0].data["messages"][-1]["content"] == "Hello there, friend."  # …values are


def test_a_durable_part_resumes_after_itself():
    # Cut after the completing chunk (part 0) of event 3: its values (part 5) follow.
    stream = _stream(2, resume=parse_event_id("3-0"))
    assert [(p.id, p.event) for p in _rest(stream, 2)] == [("3-5", "values"), ("4-15", "end")]
    # Cut after its values: only the end; after the end, nothing.
    assert [p.id for p in _rest(_stream(2, resume=parse_event_id("3-5")), 2)] == ["4-15"]
    assert _rest(_stream(3, resume=parse_event_id("4-15")), 3) == []


def test_a_resume_value_gives_an_edit_and_its_arguments():
    approval = {
        "id": "i1",
        "allowed_decisions": ["approve", "reject", "edit"],
        "tool_calls": [{"id": "c0", "name": "clock"}, {"id": "c1", "name": "calculator"}],
        "waiting": ["c1"],
    }
    new = {"type": "edit", "edited_action": {"name": "calculator", "args": {"expression": "1"}}}
    assert decision({"decisions": [new]}, approval) == "edit"
    assert edits({"decisions": [new]}, approval) == {"c1": {"expression": "1"}}
    older = {"type": "edit", "args": {"action": "calculator", "args": {"expression": "2"}}}
    assert decision([older], approval) == "edit"
    assert edits([older], approval) == {"c1": {"expression": "2"}}
    # An edit beside a reject is no one decision.
    assert decision({"decisions": [new, {"type": "reject"}]}, approval) is None


def test_a_resume_value_gives_a_decision():
    approval = {"id": "i1", "allowed_decisions": ["approve", "reject"]}
    assert decision("approve", approval) == "approve"
    assert decision({"decisions": [{"type": "reject", "message": "no"}]}, approval) == "reject"
    assert decision({"type": "approve"}, approval) == "approve"
    assert decision({"i1": {"decision": "reject"}}, approval) == "reject"
    assert decision(True, approval) == "approve"
    assert decision(False, approval) == "reject"
    retry = {"id": "i2", "allowed_decisions": ["retry", "cancel"]}
    assert decision(False, retry) == "cancel"
