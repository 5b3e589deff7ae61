"""A run's events as the admin's timeline (``scheduling.timeline``): tool calls paired with
their results, attempts and what ended them, interactions and their answers, long values
collapsed, one line per event for the event list."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

from scheduling import timeline

T0 = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)


def _events(*rows, run="r1"):
    return [
        SimpleNamespace(
            seq=i + 1,
            type=etype,
            payload=payload,
            run_id=run,
            created_at=T0 + timedelta(milliseconds=250 * i),
        )
        for i, (etype, payload) in enumerate(rows)
    ]


def test_a_tool_call_is_one_entry_with_its_arguments_and_result():
    entries = timeline.entries(
        _events(
            ("tool.call.started", {"id": "a", "name": "calculator", "arguments": {"x": "1+1"}}),
            ("tool.call.started", {"id": "b", "name": "clock", "arguments": {}}),
            ("tool.call.failed", {"id": "b", "name": "clock", "error": "no such zone"}),
            ("tool.call.succeeded", {"id": "a", "name": "calculator", "output": "2"}),
            ("tool.call.succeeded", {"id": "z", "name": "lost", "output": "?"}),  # no start
        )
    )
    assert [(e["name"], e["status"], e["seq"], e.get("result_seq")) for e in entries] == [
        ("calculator", "succeeded", 1, 4),
        ("clock", "failed", 2, 3),
        ("lost", "succeeded", 5, 5),
    ]
    assert entries[0]["arguments"]["text"] == '{\n  "x": "1+1"\n}'
    assert (entries[0]["result"]["text"], entries[0]["duration"]) == ("2", "750 ms")
    assert entries[1]["error"]["text"] == "no such zone" and entries[1]["result"] is None
    assert entries[2]["arguments"] is None


def test_attempts_say_how_the_previous_one_ended():
    entries = timeline.entries(
        _events(
            ("run.started", {"first_attempt": True}),
            ("run.started", {"first_attempt": False}),  # the first attempt's worker died
            ("run.suspended", {"code": "model.queue_full"}),
            (
                "interaction.requested",
                {
                    "id": "i1",
                    "type": "retry",
                    "code": "model.queue_full",
                    "category": "RATE_LIMITED",
                    "message": "full",
                    "allowed_decisions": ["retry", "cancel"],
                },
            ),
            ("interaction.resolved", {"interaction_id": "i1", "decision": "retry"}),
            ("run.resumed", {"decision": "retry"}),
            ("run.started", {"first_attempt": False}),
            (
                "run.failed",
                {
                    "error": {
                        "code": "upstream.error",
                        "category": "UPSTREAM",
                        "message": "the provider failed",
                        "retryable": True,
                    }
                },
            ),
        )
    )
    attempts = [(e["title"], e["note"]) for e in entries if e["type"] == "run.started"]
    assert attempts == [
        ("Attempt 1 started", "first attempt"),
        ("Attempt 2 started", "the previous attempt's worker stopped or died before it ended"),
        ("Attempt 3 started", "resumed after a reply"),
    ]
    asked = next(e for e in entries if e["kind"] == "interaction")
    assert (asked["answer"], asked["decisions"], asked["error"]["code"]) == (
        "retry",
        ["retry", "cancel"],
        "model.queue_full",
    )
    end = entries[-1]
    assert (end["kind"], end["tone"], end["error"]["code"], end["error"]["category"]) == (
        "end",
        "error",
        "upstream.error",
        "UPSTREAM",
    )


def test_a_session_timeline_opens_each_run():
    events = _events(("run.started", {}), run="r1") + _events(("run.started", {}), run="r2")
    runs = {"r1": "run one", "r2": "run two"}
    kinds = [(e["kind"], e.get("run")) for e in timeline.entries(events, runs=runs)]
    assert kinds == [("run", "run one"), ("marker", None), ("run", "run two"), ("marker", None)]


def test_long_values_are_collapsed_and_messages_only_when_very_long():
    assert timeline.value({"a": 1})["long"] is False
    wide = timeline.value({"chunks": ["x" * 700]})
    assert wide["long"] is True and wide["preview"].endswith("…") and len(wide["preview"]) == 140
    assert timeline.value("line\n" * 12)["long"] is True
    message = timeline.entries(
        _events(("message.completed", {"role": "assistant", "content": "y" * 2000}))
    )[0]
    assert (message["kind"], message["content"]["long"]) == ("assistant", False)
    completed = timeline.entries(
        _events(("run.completed", {"result": {"text": "ok", "steps": 1, "usage": {}}}))
    )[0]
    assert completed["result"]["long"] is True  # the final message already says it
    assert completed["summary"].startswith("1 model call")


def test_each_event_reads_as_one_line():
    assert timeline.one_line("tool.call.started", {"name": "calc", "arguments": {"x": 1}}) == (
        'calc {"x": 1}'
    )
    assert timeline.one_line("tool.call.succeeded", {"name": "calc", "output": "2"}) == "calc → 2"
    assert (
        timeline.one_line(
            "message.completed",
            {"role": "assistant", "content": "", "tool_calls": [{"name": "calc"}]},
        )
        == "assistant:  → asks for calc"
    )
    assert timeline.one_line("run.started", {"first_attempt": True}) == "first attempt"
    assert timeline.one_line(
        "job.completed", {"job_id": "abcdef123", "kind": "echo", "output_bytes": 3}
    ) == ("Job abcdef12 completed — echo · output 3 bytes")
    assert timeline.one_line("custom.thing", {"k": "v"}) == '{"k": "v"}'
