"""Agent tools for background jobs: ``run_job``, ``job_status``, ``job_output``, ``job_cancel``.

The runtime comes from ``ctx.extras["jobs"]`` (the worker's one runtime). A job is visible to
a tool call only when it was started for the same owner and the same session (any run of
it: a job started in one turn is checked on in the next); anything else answers
``job.not_found``, exactly like a job that never existed, so ids never leak across users.

Every tool answers JSON text. ``run_job`` returns right after admission: the job runs on
while the agent keeps talking, and its lifecycle lands in the session as ``job.*`` events.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

from agents.jobs.base import (
    JobCursor,
    JobOutputChunk,
    JobPauseBehavior,
    JobSnapshot,
    JobSpec,
    JobStream,
    job_not_found,
)
from agents.jobs.records import LABEL_OWNER, LABEL_SESSION
from agents.tools import Tool, ToolContext, ToolError, ToolHandler
from sageproject.errors import SageError

# Output per job_output call. The engine cuts tool answers at 16 000 characters; JSON
# escaping can double text, so one read stays well below half of that.
DEFAULT_OUTPUT_BYTES = 4096
MAX_OUTPUT_BYTES = 6000
# How long job_cancel waits for the job to stop before answering "stopping".
CANCEL_WAIT_SECONDS = 5.0
MAX_JOB_ID_CHARS = 100
MAX_KEY_CHARS = 200
_PAUSE_CHOICES = [str(JobPauseBehavior.DETACH), str(JobPauseBehavior.CONTINUE), "cancel"]


def _runtime(ctx: ToolContext) -> Any:
    runtime = ctx.extras.get("jobs")
    if runtime is None:
        raise ToolError("background jobs are not available on this host")
    return runtime


def _dump(value: dict[str, Any]) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str)


def _owns(snapshot: JobSnapshot, ctx: ToolContext) -> bool:
    if ctx.owner_id is None or snapshot.labels.get(LABEL_OWNER) != str(ctx.owner_id):
        return False
    if ctx.run_id is not None and snapshot.owner_run_id == str(ctx.run_id):
        return True
    session = snapshot.labels.get(LABEL_SESSION)
    return ctx.session_id is not None and session == str(ctx.session_id)


def _job_id(args: dict[str, Any]) -> str:
    job_id = args.get("job_id")
    if not isinstance(job_id, str) or not job_id or len(job_id) > MAX_JOB_ID_CHARS:
        raise ToolError("argument 'job_id' must be a job id returned by run_job")
    return job_id


async def _visible(runtime: Any, job_id: str, ctx: ToolContext) -> JobSnapshot:
    """The job's snapshot if the caller may see it; else ``job.not_found``."""
    try:
        snapshot = await runtime.inspect(job_id)
    except SageError as exc:
        if exc.code == "job.not_found":
            raise job_not_found(job_id) from None
        raise
    if not _owns(snapshot, ctx):
        # Same answer as an unknown id: another user's job must not be detectable.
        raise job_not_found(job_id)
    return snapshot


def _status(snapshot: JobSnapshot) -> dict[str, Any]:
    status: dict[str, Any] = {
        "job_id": snapshot.job_id,
        "kind": snapshot.kind,
        "state": str(snapshot.state),
        "output_bytes": snapshot.output_bytes,
        "output_truncated": snapshot.output_truncated,
        "exit_code": snapshot.exit_code,
    }
    if snapshot.error:
        status["error"] = {
            "code": snapshot.error.get("code"),
            "message": snapshot.error.get("message"),
        }
    return status


def _optional_positive_int(args: dict[str, Any], name: str) -> int | None:
    value = args.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ToolError(f"argument {name!r} must be a positive integer")
    return value


# --- run_job ---------------------------------------------------------------------------


async def run_job(args: dict[str, Any], ctx: ToolContext) -> str:
    """Admit a job for this run; returns ``{"job_id", "kind", "state"}`` as JSON.

    Raises ``ToolError`` for bad arguments or a call outside a run, and the runtime's
    errors (``job.kind_unsupported``, ``job.queue_full``, ``job.runtime_closed``...).
    """
    runtime = _runtime(ctx)
    if ctx.run_id is None or ctx.session_id is None or ctx.owner_id is None:
        raise ToolError("run_job is only available inside a run")
    kind = args.get("kind")
    if not isinstance(kind, str) or not kind.strip():
        raise ToolError("argument 'kind' must be a non-empty string")
    payload = args.get("input", {})
    if payload is None:
        payload = {}
    if not isinstance(payload, dict):
        raise ToolError("argument 'input' must be an object")
    key = args.get("idempotency_key")
    if key is not None and (not isinstance(key, str) or not key or len(key) > MAX_KEY_CHARS):
        raise ToolError(f"argument 'idempotency_key' must be 1..{MAX_KEY_CHARS} characters")
    pause = args.get("pause_behavior", str(JobPauseBehavior.DETACH))
    if pause not in _PAUSE_CHOICES:
        raise ToolError(f"argument 'pause_behavior' must be one of {', '.join(_PAUSE_CHOICES)}")
    spec = JobSpec(
        owner_run_id=str(ctx.run_id),
        kind=kind.strip(),
        payload=payload,
        pause_behavior=JobPauseBehavior(pause),
        idempotency_key=key,
        max_output_bytes=_optional_positive_int(args, "max_output_bytes"),
        max_output_chunks=_optional_positive_int(args, "max_output_chunks"),
        # Set here from the run, never from the model: the recorder writes where they say.
        labels={LABEL_SESSION: str(ctx.session_id), LABEL_OWNER: str(ctx.owner_id)},
    )
    handle = await runtime.submit(spec)
    return _dump({"job_id": handle.job_id, "kind": handle.kind, "state": str(handle.state)})


# --- job_status ------------------------------------------------------------------------


async def job_status(args: dict[str, Any], ctx: ToolContext) -> str:
    """The job's state, output size, truncation, exit code and error as JSON.

    Raises ``job.not_found`` for unknown jobs and jobs of other users or sessions.
    """
    runtime = _runtime(ctx)
    return _dump(_status(await _visible(runtime, _job_id(args), ctx)))


# --- job_output ------------------------------------------------------------------------


def _decode(
    chunks: tuple[JobOutputChunk, ...], *, budget_hit: bool, start: int
) -> tuple[str, int | None]:
    """Text of stdout/stderr chunks and, when the last one ends inside a character, the
    offset to resume from (so the next read starts at that character, not in its middle)."""
    parts: list[str] = []
    resume: int | None = None
    for index, chunk in enumerate(chunks):
        if chunk.stream is JobStream.PROGRESS:
            continue
        data = chunk.data
        if budget_hit and index == len(chunks) - 1:
            try:
                data.decode("utf-8")
            except UnicodeDecodeError as exc:
                if (
                    exc.reason == "unexpected end of data"
                    and exc.start >= len(data) - 3
                    # Trim only when something is left: the cursor must always advance.
                    and chunk.offset + exc.start > start
                ):
                    data = data[: exc.start]
                    resume = chunk.offset + exc.start
        parts.append(data.decode("utf-8", errors="replace"))
    return "".join(parts), resume


async def job_output(args: dict[str, Any], ctx: ToolContext) -> str:
    """Output from ``cursor`` (a byte offset, default 0) as JSON ``{"text", "next_cursor",
    "done", "state", "output_truncated"}``; at most ``max_bytes`` bytes per call.

    ``done`` is true when the job has ended and everything was read. Progress output is
    skipped (it still advances the cursor). Raises ``job.not_found`` as ``job_status``.
    """
    runtime = _runtime(ctx)
    job_id = _job_id(args)
    cursor = args.get("cursor", 0)
    if cursor is None:
        cursor = 0
    if not isinstance(cursor, int) or isinstance(cursor, bool) or cursor < 0:
        raise ToolError("argument 'cursor' must be a non-negative integer")
    max_bytes = _optional_positive_int(args, "max_bytes") or DEFAULT_OUTPUT_BYTES
    max_bytes = min(max_bytes, MAX_OUTPUT_BYTES)
    snapshot = await _visible(runtime, job_id, ctx)
    chunks = await runtime.read_output(JobCursor(job_id=job_id, offset=cursor), max_bytes=max_bytes)
    read = sum(len(chunk.data) for chunk in chunks)
    text, resume = _decode(chunks, budget_hit=read >= max_bytes, start=cursor)
    next_cursor = chunks[-1].next_offset if chunks else cursor
    if resume is not None:
        next_cursor = resume
    # The snapshot was taken before the read: a job that ended in between reports done on
    # the next call, never too early.
    done = snapshot.terminal and next_cursor >= snapshot.output_bytes
    return _dump(
        {
            "job_id": job_id,
            "text": text,
            "next_cursor": next_cursor,
            "done": done,
            "state": str(snapshot.state),
            "output_truncated": snapshot.output_truncated,
        }
    )


# --- job_cancel ------------------------------------------------------------------------


async def job_cancel(args: dict[str, Any], ctx: ToolContext) -> str:
    """Cancel the job; returns its status JSON (``killed``, or ``stopping`` if it has not
    stopped within a few seconds; it is still being stopped then). Idempotent: an ended
    job answers its final status. Raises ``job.not_found`` as ``job_status``.
    """
    runtime = _runtime(ctx)
    job_id = _job_id(args)
    await _visible(runtime, job_id, ctx)
    # Its own task, shielded: an agent that stops waiting must not abandon the kill.
    task = asyncio.ensure_future(runtime.cancel(job_id, reason="cancelled by the agent"))
    task.add_done_callback(_consume_result)
    try:
        snapshot = await asyncio.wait_for(asyncio.shield(task), timeout=CANCEL_WAIT_SECONDS)
    except TimeoutError:
        snapshot = await runtime.inspect(job_id)
    return _dump(_status(snapshot))


def _consume_result(task: asyncio.Future[Any]) -> None:
    # Retrieve the outcome so a late failure is not reported as "never retrieved".
    if not task.cancelled():
        with contextlib.suppress(Exception):
            task.exception()


def _job_tool(name: str, description: str, handler: ToolHandler, **properties: Any) -> Tool:
    """A tool that acts on one job: ``job_id`` (required) plus ``properties``."""
    return Tool(
        name=name,
        description=description,
        parameters={
            "type": "object",
            "properties": {
                "job_id": {"type": "string", "description": "A job id returned by run_job."},
                **properties,
            },
            "required": ["job_id"],
            "additionalProperties": False,
        },
        handler=handler,
    )


JOB_TOOLS: list[Tool] = [
    Tool(
        name="run_job",
        description=(
            "Start a background job and return at once with its id; keep working and check "
            "on it with job_status / job_output. 'kind' names the job type (for example "
            '\'python_script\' when enabled, with input {"script": "..."}).'
        ),
        parameters={
            "type": "object",
            "properties": {
                "kind": {"type": "string"},
                "input": {"type": "object", "description": "The job's input."},
                "idempotency_key": {
                    "type": "string",
                    "description": "Repeat a start safely: same key, same job.",
                },
                "max_output_bytes": {"type": "integer", "minimum": 1},
                "max_output_chunks": {"type": "integer", "minimum": 1},
                "pause_behavior": {"type": "string", "enum": _PAUSE_CHOICES},
            },
            "required": ["kind"],
            "additionalProperties": False,
        },
        handler=run_job,
    ),
    _job_tool(
        "job_status",
        "State, output size, truncation and exit code of a background job.",
        job_status,
    ),
    _job_tool(
        "job_output",
        "Read a background job's output from 'cursor' (start at 0, then pass back "
        "'next_cursor'); 'done' is true once the job ended and all output was read.",
        job_output,
        cursor={"type": "integer", "minimum": 0},
        max_bytes={"type": "integer", "minimum": 1, "maximum": MAX_OUTPUT_BYTES},
    ),
    _job_tool(
        "job_cancel",
        "Cancel a background job; answers its status afterwards.",
        job_cancel,
    ),
]

# ``settings.SAGE_TOOL_MODULES`` loads ``TOOLS`` from each named module.
TOOLS = JOB_TOOLS
