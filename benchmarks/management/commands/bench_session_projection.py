"""``manage.py bench_session_projection``: the cost of serializing a commit's events.

Coordinator serialization only: a synthetic history of N copies of one
typical event; ``full`` serializes the whole history (the truncation / full-export path),
``append`` only the event after a persisted prefix of N-1 (the ordinary commit). No SQL,
no model I/O: the figures cannot be turned into QPS.
"""

from __future__ import annotations

import statistics
import time
from datetime import UTC, datetime
from typing import Any

import orjson
from django.core.management.base import BaseCommand, CommandError

from sageproject.progress import note
from scheduling.serialization import SessionEvent, serializer_calls
from scheduling.store import dump_events

TYPICAL_PAYLOAD: dict[str, Any] = {
    "role": "assistant",
    "content": "Here is the summary you asked for: the refund was approved and will arrive "
    "within five business days. Anything else I can help with?",
    "tool_calls": [{"id": "call_1", "name": "lookup_order", "arguments": {"order": "A-1042"}}],
    "usage": {"input_tokens": 812, "output_tokens": 64},
    "model": "scripted",
}


def build_history(events: int) -> list[SessionEvent]:
    now = datetime.now(UTC)
    return [
        SessionEvent(seq=i, type="message", run_id=None, created_at=now, payload=TYPICAL_PAYLOAD)
        for i in range(1, events + 1)
    ]


def measure(history: list[SessionEvent], offset: int | None, repeats: int) -> dict[str, Any]:
    """Median wall time of ``dump_events(history, offset)`` with cold encodings."""
    timings: list[float] = []
    serialized = 0
    start_index = 0 if offset is None else offset
    for _ in range(repeats):
        # Outside the timed section: forget the encodings the timed call must produce.
        for event in history[start_index:]:
            event.forget_encoding()
        before = serializer_calls.value
        started = time.perf_counter()
        dump_events(history, offset)
        timings.append(time.perf_counter() - started)
        serialized = serializer_calls.value - before
    return {
        "median_ms": round(statistics.median(timings) * 1000, 4),
        "serialized_events": serialized,
    }


class Command(BaseCommand):
    help = "Time full vs append-only serialization of a long session's events."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--events", type=int, default=10_000)
        parser.add_argument("--repeats", type=int, default=10)

    def handle(self, *args: Any, **options: Any) -> None:
        events, repeats = options["events"], options["repeats"]
        if events < 1 or repeats < 1:
            raise CommandError("events and repeats must be positive")
        note(f"building {events} events", stream=self.stderr, prefix="bench_session_projection")
        history = build_history(events)  # construction is outside the timed sections
        full = measure(history, None, repeats)
        append = measure(history, events - 1, repeats)
        ratio = full["median_ms"] / append["median_ms"] if append["median_ms"] else None
        line = {
            "events": events,
            "repeats": repeats,
            "scope": "coordinator serialization only; synthetic ledger; no SQL/model I/O",
            "full": full,
            "append": append,
            "full_over_append": round(ratio, 1) if ratio else None,
        }
        self.stdout.write(orjson.dumps(line).decode())
