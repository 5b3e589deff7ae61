"""Log records as JSON lines, with the run, session and worker they belong to.

``SAGE_LOG_FORMAT=json`` (``sageproject.config``; the default is ``plain``) makes every
process write one JSON object per line on standard error::

    {"time": "2025-01-02T03:04:05.678Z", "level": "WARNING", "logger": "sage.upstream",
     "message": "...", "run_id": "…", "session_id": "…", "worker_id": "host:123:ab"}

``exception`` holds the formatted traceback when the record has one. The ids come from
`bind` (context variables: a run's execution task sets them once, and everything it logs,
in its task and the threads its database calls run in, carries them) or from a record's
own ``extra={"run_id": ...}``; a key is left out when unknown. Django-free.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any

import orjson

IDS = ("run_id", "session_id", "worker_id")
_VARS: dict[str, ContextVar[str | None]] = {
    name: ContextVar(f"sage_log_{name}", default=None) for name in IDS
}


def bind(**ids: Any) -> None:
    """Set ``run_id`` / ``session_id`` / ``worker_id`` for the rest of the current context
    (an asyncio task's own copy: a run's execution task binds its ids once). ``None``
    leaves a name as it is."""
    for name, value in ids.items():
        if value is not None:
            _VARS[name].set(str(value))


@contextlib.contextmanager
def log_context(**ids: Any) -> Iterator[None]:
    """`bind` ``ids`` inside the block only."""
    tokens = [(_VARS[name], _VARS[name].set(str(value))) for name, value in ids.items()]
    try:
        yield
    finally:
        for var, token in reversed(tokens):
            var.reset(token)


def current() -> dict[str, str]:
    """The ids known in this context."""
    return {name: value for name, var in _VARS.items() if (value := var.get()) is not None}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (UTC, ISO 8601, milliseconds), level, logger,
    message, ``exception`` / ``stack`` when present, and the known ids."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC)
            .isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        line.update(current())
        for name in IDS:
            value = getattr(record, name, None)
            if value is not None:
                line[name] = str(value)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exception"] = record.exc_text
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return orjson.dumps(line, default=str).decode()


PLAIN_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def formatter_config(log_format: str) -> dict[str, Any]:
    """The ``LOGGING["formatters"]`` entry of ``SAGE_LOG_FORMAT`` (``plain`` or ``json``)."""
    if log_format == "json":
        return {"()": "sageproject.logs.JsonFormatter"}
    return {"format": PLAIN_FORMAT}
