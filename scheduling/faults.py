"""Crash points for fault-injection tests: a process that reaches a named point dies there.

``SAGE_CRASH_AT=<point>[:<n>]`` makes the process SIGKILL itself the ``n``-th time (default:
the first) it reaches ``<point>``; ``SAGE_STOP_AT=<point>[:<n>]`` makes it SIGSTOP itself
there instead (a frozen process: the test sends SIGCONT). Unset (always, in production) a
crash point costs one comparison. Points sit right before and right after each commit of a
run's life:

- ``claim.before_commit`` / ``claim.after_commit``
- ``append.before_commit`` / ``append.after_commit`` (event batches during a run)
- ``start.before_commit`` / ``start.after_commit`` (an execution's first batch)
- ``suspend.before_commit`` / ``suspend.after_commit``
- ``finish.before_commit`` / ``finish.after_commit``
- ``tool.started`` (a tool call's start is durable; its result is not yet)
- ``mcp.call.sent`` (an MCP server answered a tool call; the answer is not durable yet)

Django-free, so the engine can use it too.
"""

from __future__ import annotations

import os
import signal
import threading

_lock = threading.Lock()
_hits: dict[str, int] = {}


def _parse(value: str) -> tuple[str, int] | None:
    if not value:
        return None
    point, _, count = value.partition(":")
    return point, int(count or 1)


_targets = {
    signal.SIGKILL: _parse(os.environ.get("SAGE_CRASH_AT", "")),
    signal.SIGSTOP: _parse(os.environ.get("SAGE_STOP_AT", "")),
}
_armed = frozenset(target[0] for target in _targets.values() if target is not None)


def is_armed(name: str) -> bool:
    """Whether a crash or stop point named ``name`` is set for this process."""
    return name in _armed


def crash_point(name: str) -> None:
    """SIGKILL (``SAGE_CRASH_AT``) or SIGSTOP (``SAGE_STOP_AT``) this process when the
    variable names ``name`` and its count is reached."""
    if name not in _armed:
        return
    for sig, target in _targets.items():
        if target is None or target[0] != name:
            continue
        with _lock:
            _hits[name] = hits = _hits.get(name, 0) + 1
        if hits == target[1]:
            # To this very thread: delivered before it can take another step (a signal sent
            # to the process may be handled by another thread while this one carries on
            # and commits).
            signal.pthread_kill(threading.get_ident(), sig)
