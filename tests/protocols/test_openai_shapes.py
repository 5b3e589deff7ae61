"""How a run's text becomes OpenAI stream events (`agents.protocols.openai_shapes`): the
same pieces and sequence numbers live and replayed, whatever the live deltas' order."""

from __future__ import annotations

import asyncio

from django.http import JsonResponse

from agents.protocols.common import DeferredResponse
from agents.protocols.openai_shapes import ResponseEvents, RunText, pieces


def said(role: str, content: str) -> tuple[str, dict]:
    return ("message.completed", {"role": role, "content": content})


def numbered(text: RunText, steps) -> list[tuple]:
    """(type, number, delta) of the events ``steps`` produce: ``("delta", kind, payload)``
    or ``("event", kind, payload, seq)``."""
    events = ResponseEvents("resp_x")
    out = events.start({})
    for step in steps:
        ops = text.delta(step[1], step[2]) if step[0] == "delta" else text.event(*step[1:])
        out += events.ops(ops)
    return [(e["type"], e["sequence_number"], e.get("delta")) for e in out]


def replayed(events) -> list[tuple]:
    return numbered(RunText(), [("event", kind, payload, None) for kind, payload in events])


def delta(text: str, **extra) -> tuple:
    return ("delta", "message.delta", {"text": text, **extra})


def test_pieces_of_a_prefix_are_the_pieces_of_the_text():
    text = "  Hello,   world! " + "x" * 70 + " tail"
    assert "".join(pieces(text)) == text
    assert max(len(p.rstrip()) for p in pieces(text)) == 32
    for end in range(1, len(text) + 1):
        assert pieces(text[:end])[:-1] == pieces(text)[: len(pieces(text[:end])) - 1]


def test_live_deltas_number_the_events_as_a_replay_does():
    answer = "The result is twenty, as computed."
    durable = [said("assistant", ""), said("assistant", answer), ("run.completed", {})]
    live = [
        ("delta", "tool_call.delta", {"arguments": "{}"}),
        ("event", *durable[0], 3),
        delta("The res"),
        delta("ult is twen"),
        delta("ty, as computed."),
        ("event", *durable[1], 5),
        ("event", *durable[2], 6),
    ]
    assert numbered(RunText(), live) == replayed(durable)


def test_text_after_a_tool_call_waits_for_that_steps_message():
    first, second = "Let me check.", "It is 20."
    live = [
        delta("Let me "),
        delta("check."),
        ("delta", "tool_call.delta", {"arguments": "{}"}),
        delta("It is "),  # the next step streams before the durable message is read
        ("event", *said("assistant", first), 3),
        delta("20."),
        ("event", *said("assistant", second), 5),
        ("event", "run.completed", {}, 6),
    ]
    text = RunText()
    got = numbered(text, live)
    assert text.texts == [first, second]
    assert got == replayed(
        [said("assistant", first), said("assistant", second), ("run.completed", {})]
    )


def test_text_a_durable_message_delivered_first_is_not_sent_twice():
    live = [
        delta("Hello "),
        ("event", *said("assistant", "Hello there"), 3),
        delta("there"),  # late: the message was already read
        ("event", "run.completed", {}, 4),
    ]
    text = RunText()
    got = numbered(text, live)
    assert text.texts == ["Hello there"]
    assert [d for _, _, d in got if d] == ["Hello ", "there"]


def test_a_follower_that_joined_late_uses_live_text_from_the_next_message_on():
    live = [
        delta("middle of "),  # the first message was under way when the follower joined
        delta("it "),
        ("event", *said("assistant", "Start, middle of it"), 8),
        delta("Next "),
        delta("one"),
        ("event", *said("assistant", "Next one"), 9),
    ]
    text = RunText(live_after=7)
    got = numbered(text, live)
    assert text.texts == ["Start, middle of it", "Next one"]
    deltas = [d for _, _, d in got if d]
    assert deltas == ["Start, ", "middle ", "of ", "it", "Next ", "one"]
    # Replayed messages at or before the join point do not make it live.
    early = RunText(live_after=7)
    early.event(*said("assistant", "old"), 7)
    assert early.delta("message.delta", {"text": "x "}) == []


def test_delta_offsets_mark_a_new_model_call_and_a_gap():
    text = RunText(live_after=0)
    assert text.delta("message.delta", {"text": "lost ", "offset": 4}) == []  # joined late
    ops = text.delta("message.delta", {"text": "New ", "offset": 0})
    assert [op[0] for op in ops] == ["open"]
    ops = text.delta("message.delta", {"text": "call ", "offset": 4})
    assert [op[0] for op in ops] == ["piece"]
    assert text.delta("message.delta", {"text": "gap ", "offset": 99}) == []
    ops = text.event(*said("assistant", "New call with a gap"), 5)
    assert [op[2] for op in ops if op[0] == "piece"] == ["call ", "with ", "a ", "gap"]


def test_a_flow_answers_with_its_output():
    text = RunText(flow=True)
    assert text.delta("message.delta", {"text": "inner "}) == []
    text.event(*said("assistant", "an inner agent's message"), 3)
    text.event("run.completed", {"result": {"text": "the flow's output"}}, 4)
    assert text.texts == ["the flow's output"]


def test_events_up_to_the_cursor_are_left_out():
    events = ResponseEvents("resp_x", starting_after=1)
    assert events.start({}) == []
    assert [e["sequence_number"] for e in events.end({"status": "completed"})] == [2]


def test_a_deferred_answer_takes_the_status_and_headers_it_computes():
    async def compute():
        answer = JsonResponse({"error": {"code": "x"}}, status=429)
        answer["Retry-After"] = "3"
        return answer

    async def main():
        response = DeferredResponse(compute)
        await response.settle()  # what the web process's handler awaits before the status
        body = b"".join([part async for part in response])
        return response, body

    response, body = asyncio.run(main())
    assert (response.status_code, response["Retry-After"]) == (429, "3")
    assert body == b'{"error": {"code": "x"}}'
