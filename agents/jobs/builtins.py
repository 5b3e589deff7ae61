"""Built-in job kinds.

``echo`` and ``sleep`` are **built-in diagnostics**: trivial kinds that let operators and
tests check that a runtime (and, for Celery, a worker) accepts, runs, streams and cancels
jobs. ``python_script`` (see ``python_script.py``) is a *code kind*: it is registered
only where the code tools are enabled (``SAGE_CODE_TOOLS``), by whoever builds the runtime.

- ``echo``: payload ``{"chunks": [str], "repeat": 1, "stream": "stdout", "exit_code": 0,
  "fail": str | None}``; emits every chunk ``repeat`` times, then raises ``RuntimeError(fail)``
  if ``fail`` is set, else returns ``exit_code``.
- ``sleep``: payload ``{"seconds": float, "chunks": [str]}``; emits ``chunks`` first, then
  waits until cancelled or ``seconds`` (default 3600) pass, then returns 0.
"""

from __future__ import annotations

import asyncio
import contextlib

from agents.jobs.base import Emit, JobCompletion, JobSpec, Runner, invalid_argument

# The kinds that run code the model wrote: accepted only with the code tools enabled.
CODE_KINDS = ("python_script",)


async def echo_runner(spec: JobSpec, emit: Emit, cancel_event: asyncio.Event) -> JobCompletion:
    """Emit the payload's chunks; returns its ``exit_code`` or raises its ``fail`` message."""
    chunks = spec.payload.get("chunks", [])
    if not isinstance(chunks, list):
        raise invalid_argument("payload.chunks must be a list of strings")
    repeat = int(spec.payload.get("repeat", 1))
    stream = str(spec.payload.get("stream", "stdout"))
    for _ in range(repeat):
        for chunk in chunks:
            await emit(stream, chunk)
    fail = spec.payload.get("fail")
    if fail:
        raise RuntimeError(str(fail))
    return JobCompletion(exit_code=int(spec.payload.get("exit_code", 0)))


async def sleep_runner(spec: JobSpec, emit: Emit, cancel_event: asyncio.Event) -> JobCompletion:
    """Emit ``chunks``, then wait for cancellation or ``seconds``; returns exit code 0."""
    for chunk in spec.payload.get("chunks", []):
        await emit("stdout", chunk)
    seconds = float(spec.payload.get("seconds", 3600))
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await cancel_event.wait()
    return JobCompletion(exit_code=0)


def builtin_runners() -> dict[str, Runner]:
    """The built-in diagnostics, ``echo`` and ``sleep``."""
    return {"echo": echo_runner, "sleep": sleep_runner}


def code_runners() -> dict[str, Runner]:
    """The runners of ``CODE_KINDS``, for a process whose code tools are enabled."""
    from agents.jobs.python_script import python_script_runner

    return {"python_script": python_script_runner}
