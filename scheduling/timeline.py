"""A session's or a run's events as a timeline for people (the admin's run and session
pages, ``templates/admin/scheduling/timeline.html``).

``entries(events)`` turns durable events into display entries, in order: user and
assistant messages, one entry per tool call holding its arguments and its result (the
``tool.call.started`` and the ``succeeded``/``failed`` event with the same id), interactions
and replies, errors with their code and category, flow and job steps, and each execution
attempt of a run (``run.started``; an attempt that ended with no event of its own ended
with its worker). Values are kept as text for the template, which escapes them: nothing
here is marked safe. Long values are flagged ``long`` so the page collapses them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from sageproject.admin_display import duration

# A value longer than this, or with more lines, is collapsed behind its first line
# (a message's text only when much longer: it is what people come to read).
LONG_CHARS = 600
LONG_LINES = 12
MESSAGE_LONG_CHARS = 4000
MESSAGE_LONG_LINES = 60
PREVIEW_CHARS = 140

TERMINAL = {
    "run.completed": ("Completed", "ok"),
    "run.failed": ("Failed", "error"),
    "run.cancelled": ("Cancelled", "muted"),
    "run.interrupted": ("Interrupted", "muted"),
}


def value(
    raw: Any, *, long_chars: int = LONG_CHARS, long_lines: int = LONG_LINES, collapse: bool = False
) -> dict[str, Any]:
    """A value to show: ``text`` (a string as it is, anything else as indented JSON),
    ``json`` (whether it is JSON), ``long`` (collapsed: longer than ``long_chars`` or
    ``long_lines``, or ``collapse``) and a one-line ``preview`` for a collapsed one."""
    if isinstance(raw, str):
        text, is_json = raw, False
    else:
        text = json.dumps(raw, indent=2, ensure_ascii=False, default=str)
        is_json = True
    first = text.strip().split("\n", 1)[0] if text.strip() else ""
    long = collapse or len(text) > long_chars or text.count("\n") >= long_lines
    if is_json and long:
        first = json.dumps(raw, ensure_ascii=False, default=str)
    preview = first if len(first) <= PREVIEW_CHARS else first[: PREVIEW_CHARS - 1] + "…"
    return {
        "text": text,
        "json": is_json,
        "long": long,
        "preview": preview,
        "size": len(text),
        "lines": text.count("\n") + 1,
    }


def error_view(raw: Any) -> dict[str, Any]:
    """An error record (``{"code", "category", "message", "retryable", "resumable"}``)."""
    error = raw if isinstance(raw, Mapping) else {"message": str(raw)}
    return {
        "code": str(error.get("code") or "error"),
        "category": str(error.get("category") or ""),
        "message": str(error.get("message") or ""),
        "retryable": error.get("retryable"),
        "resumable": error.get("resumable"),
    }


def entries(events: Iterable[Any], *, runs: Mapping[Any, Any] | None = None) -> list[dict]:
    """Display entries for ``events`` (objects with ``seq``, ``type``, ``payload``,
    ``created_at`` and ``run_id``), in their order. With ``runs`` (run id → Run), an entry
    of kind ``run`` opens each run's part of the timeline (a session's page)."""
    out: list[dict] = []
    tools: dict[tuple[Any, Any], dict] = {}
    interactions: dict[tuple[Any, Any], dict] = {}
    attempts: dict[Any, int] = {}
    # What the last event of each run said about its attempt: an attempt started after one
    # that neither suspended nor ended means the earlier attempt's worker stopped or died.
    open_attempt: dict[Any, bool] = {}
    resumed: dict[Any, bool] = {}
    start: datetime | None = None
    current_run: Any = object()
    for event in events:
        payload = event.payload if isinstance(event.payload, Mapping) else {"value": event.payload}
        etype = event.type
        run_id = event.run_id
        start = start or event.created_at
        if runs is not None and run_id != current_run:
            current_run = run_id
            if run_id is not None:
                out.append({"kind": "run", "run": runs.get(run_id), "run_id": run_id})
        entry: dict[str, Any] = {
            "seq": event.seq,
            "type": etype,
            "time": event.created_at,
            "offset": duration(start, event.created_at),
            "run_id": run_id,
        }
        if etype == "message.completed":
            role = str(payload.get("role") or "message")
            calls = payload.get("tool_calls") or []
            entry.update(
                kind=role if role in ("user", "assistant") else "message",
                role=role,
                content=value(
                    payload.get("content") or "",
                    long_chars=MESSAGE_LONG_CHARS,
                    long_lines=MESSAGE_LONG_LINES,
                ),
                calls=[str(c.get("name")) for c in calls if isinstance(c, Mapping)],
                step=payload.get("step"),
            )
        elif etype == "tool.call.started":
            entry.update(
                kind="tool",
                call_id=str(payload.get("id") or ""),
                name=str(payload.get("name") or "?"),
                arguments=value(payload.get("arguments") or {}),
                status="running",
                result=None,
                error=None,
            )
            tools[(run_id, payload.get("id"))] = entry
        elif etype in ("tool.call.succeeded", "tool.call.failed"):
            ok = etype == "tool.call.succeeded"
            found = tools.pop((run_id, payload.get("id")), None)
            outcome = payload.get("output", payload.get("result")) if ok else None
            if found is None:  # a result without its start: shown on its own
                entry.update(
                    kind="tool",
                    call_id=str(payload.get("id") or ""),
                    name=str(payload.get("name") or "?"),
                    arguments=None,
                )
                found = entry
                out.append(entry)
            found.update(
                status="succeeded" if ok else "failed",
                result=value(outcome if outcome is not None else "") if ok else None,
                error=value(payload.get("error") or "") if not ok else None,
                result_seq=event.seq,
                duration=duration(found["time"], event.created_at),
            )
            continue
        elif etype == "run.started":
            attempts[run_id] = attempts.get(run_id, 0) + 1
            number = attempts[run_id]
            if resumed.pop(run_id, False):
                note = "resumed after a reply"
            elif open_attempt.get(run_id):
                note = "the previous attempt's worker stopped or died before it ended"
            elif number == 1:
                note = "first attempt"
            else:
                note = ""
            open_attempt[run_id] = True
            entry.update(kind="marker", tone="info", title=f"Attempt {number} started", note=note)
        elif etype == "run.suspended":
            open_attempt[run_id] = False
            entry.update(
                kind="marker", tone="warn", title="Suspended", note=str(payload.get("code") or "")
            )
        elif etype == "interaction.requested":
            decisions = payload.get("allowed_decisions") or []
            entry.update(
                kind="interaction",
                interaction_type=str(payload.get("type") or "interaction"),
                error=error_view(payload) if payload.get("code") else None,
                decisions=[str(d) for d in decisions] if isinstance(decisions, list) else [],
                retry_after=payload.get("retry_after"),
                interaction_id=str(payload.get("id") or ""),
                answer=None,
            )
            interactions[(run_id, payload.get("id"))] = entry
        elif etype == "interaction.resolved":
            decision = payload.get("decision")
            asked = interactions.get((run_id, payload.get("interaction_id")))
            if asked is not None:
                asked["answer"] = str(decision)
            entry.update(kind="marker", tone="info", title="Reply", note=f"decision: {decision}")
        elif etype == "run.resumed":
            resumed[run_id] = True
            entry.update(kind="marker", tone="info", title="Queued again", note="after the reply")
        elif etype in TERMINAL:
            open_attempt[run_id] = False
            title, tone = TERMINAL[etype]
            result = payload.get("result")
            entry.update(
                kind="end",
                tone=tone,
                title=title,
                error=error_view(payload["error"]) if payload.get("error") else None,
                result=value(result, collapse=True) if result is not None else None,
                summary=result_summary(result),
            )
        elif etype.startswith("flow."):
            entry.update(_flow(etype, payload))
        elif etype.startswith("job."):
            entry.update(_job(etype, payload))
        else:
            entry.update(kind="other", value=value(payload))
        out.append(entry)
    return out


def result_summary(result: Any) -> str:
    """A run result's model calls and tokens (``2 model calls · tokens in 18 / out 6``)."""
    if not isinstance(result, Mapping):
        return ""
    parts = []
    if isinstance(result.get("steps"), int):
        parts.append(f"{result['steps']} model call{'s' if result['steps'] != 1 else ''}")
    usage = result.get("usage")
    if isinstance(usage, Mapping):
        parts.append(
            f"tokens in {usage.get('input_tokens', '?')} / out {usage.get('output_tokens', '?')}"
        )
    return " · ".join(parts)


def _flow(etype: str, payload: Mapping[str, Any]) -> dict[str, Any]:
    flow = payload.get("flow", "")
    node = payload.get("node") or payload.get("path") or ""
    if etype == "flow.failed":
        return {
            "kind": "end",
            "tone": "error",
            "title": f"Flow {flow} failed",
            "error": error_view(payload),
            "result": None,
            "summary": "",
        }
    if etype == "flow.edge.selected":
        when = " (condition)" if payload.get("conditional") else ""
        return {
            "kind": "marker",
            "tone": "flow",
            "title": f"Edge {payload.get('from')} → {payload.get('to')}{when}",
            "note": f"flow {flow}",
        }
    titles = {
        "flow.started": f"Flow {flow} started",
        "flow.completed": f"Flow {flow} completed",
        "flow.node.started": f"Node {node} started ({payload.get('type', '')})",
        "flow.node.completed": f"Node {node} completed",
    }
    output = payload.get("outputs") or payload.get("output")
    return {
        "kind": "flow",
        "title": titles.get(etype, etype),
        "value": value(output) if output not in (None, "") else None,
    }


def _job(etype: str, payload: Mapping[str, Any]) -> dict[str, Any]:
    state = etype.removeprefix("job.")
    job_id = str(payload.get("job_id") or "")
    size = payload.get("output_bytes")
    note = f"{payload.get('kind', '')} · output {size} bytes" if size is not None else ""
    if payload.get("output_truncated"):
        note += " (truncated)"
    return {
        "kind": "job",
        "tone": "error" if state in ("failed", "killed") else "flow",
        "title": f"Job {job_id[:8]} {state}",
        "job_id": job_id,
        "note": note,
        "error": error_view(payload["error"]) if payload.get("error") else None,
    }


def one_line(etype: str, payload: Any) -> str:
    """What an event says, in one line of text (the event list's "what" column)."""
    data = payload if isinstance(payload, Mapping) else {}
    name = data.get("name", "")
    if etype == "message.completed":
        content = data.get("content") or ""
        text = content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)
        calls = [str(c.get("name")) for c in data.get("tool_calls") or [] if isinstance(c, Mapping)]
        asks = f" → asks for {', '.join(calls)}" if calls else ""
        return f"{data.get('role', '')}: {text}{asks}"
    if etype == "tool.call.started":
        return f"{name} {json.dumps(data.get('arguments') or {}, ensure_ascii=False)}"
    if etype == "tool.call.succeeded":
        return f"{name} → {data.get('output', data.get('result', ''))}"
    if etype == "tool.call.failed":
        return f"{name} failed: {data.get('error', '')}"
    if etype == "run.started":
        return "first attempt" if data.get("first_attempt") else "a later attempt"
    if etype in ("run.resumed", "interaction.resolved"):
        return f"decision: {data.get('decision')}"
    if etype == "run.completed":
        result = data.get("result")
        text = result.get("text") if isinstance(result, Mapping) else None
        return str(text) if text else result_summary(result) or "completed"
    if etype.startswith("job."):
        job = _job(etype, data)
        return f"{job['title']} — {job['note']}" if job["note"] else job["title"]
    if etype.startswith("flow."):
        return str(_flow(etype, data)["title"])
    return json.dumps(payload, ensure_ascii=False, default=str)
