"""``SAGE_LOG_FORMAT=json``: one JSON object per log line, carrying the run, session and
worker ids where they are known — set once by a run's execution, seen in everything it
logs."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import subprocess
import sys
from datetime import datetime

import pytest
from asgiref.sync import sync_to_async

from agents.tools import Tool
from sageproject import config, logs
from tests.conftest import demo_manifest, scripted_model
from tests.e2e.conftest import all_terminal, start_worker, wait_for

__all__ = ["start_worker"]  # the in-process worker fixture (tests/e2e/conftest.py)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL_LOGGER = "sage.test.log_tool"


async def _log_line(arguments: dict, context) -> str:
    logging.getLogger(TOOL_LOGGER).info("tool %s ran", "log_line")
    return "logged"


# This module doubles as a tool module (SAGE_TOOL_MODULES) for the end-to-end test.
TOOLS = [
    Tool(
        name="log_line",
        description="Write one log line.",
        parameters={"type": "object", "properties": {}},
        handler=_log_line,
    )
]


@pytest.fixture
def captured():
    """Lines the JSON formatter writes for the ``sage.test`` loggers."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logs.JsonFormatter())
    logger = logging.getLogger("sage.test")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield lambda: [json.loads(line) for line in stream.getvalue().splitlines()]
    finally:
        logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)


def test_a_line_is_one_json_object_with_the_ids_of_its_context(captured):
    logger = logging.getLogger("sage.test.unit")
    with logs.log_context(run_id="r-1", session_id="s-1", worker_id="host:1:w"):
        try:
            raise ValueError("broken \n on two lines")
        except ValueError:
            logger.exception("step %d failed", 3)
    logger.warning("after")
    inside, after = captured()
    assert inside["level"] == "ERROR"
    assert inside["logger"] == "sage.test.unit"
    assert inside["message"] == "step 3 failed"
    assert (inside["run_id"], inside["session_id"], inside["worker_id"]) == (
        "r-1",
        "s-1",
        "host:1:w",
    )
    assert inside["exception"].startswith("Traceback")
    assert "ValueError: broken \n on two lines" in inside["exception"]
    assert inside["time"].endswith("Z")
    assert datetime.fromisoformat(inside["time"]).utcoffset().total_seconds() == 0
    assert set(after) == {"time", "level", "logger", "message"}  # ids unknown: left out


def test_a_records_own_ids_win(captured):
    with logs.log_context(run_id="outer"):
        logging.getLogger("sage.test.unit").info("x", extra={"run_id": "own", "session_id": 7})
    (line,) = captured()
    assert (line["run_id"], line["session_id"]) == ("own", "7")


async def test_a_task_binds_its_ids_for_itself_and_its_threads(captured):
    logger = logging.getLogger("sage.test.async")
    bound = asyncio.Event()

    async def run() -> None:
        logs.bind(run_id="run-a", worker_id="w-1")
        bound.set()
        await sync_to_async(logger.info, thread_sensitive=False)("in a thread")
        logs.bind(session_id="sess-a")
        logger.info("later in the task")

    async def neighbour() -> None:
        await bound.wait()
        logger.info("another task")

    await asyncio.gather(run(), neighbour())
    lines = {line["message"]: line for line in captured()}
    assert lines["in a thread"]["run_id"] == "run-a"
    assert "session_id" not in lines["in a thread"]
    assert lines["later in the task"]["session_id"] == "sess-a"
    assert lines["later in the task"]["worker_id"] == "w-1"
    assert "run_id" not in lines["another task"]
    assert logs.current() == {}  # the test's own context is untouched


def test_the_format_setting_is_plain_json_or_refused():
    assert config.load({})["SAGE_LOG_FORMAT"] == "plain"
    assert config.load({"SAGE_LOG_FORMAT": " JSON "})["SAGE_LOG_FORMAT"] == "json"
    refused = config.load({"SAGE_LOG_FORMAT": "xml"})
    assert [(p.check_id, p.message) for p in refused.errors] == [
        ("sageproject.E060", "SAGE_LOG_FORMAT must be one of plain, json (got 'xml')")
    ]
    assert refused["SAGE_LOG_FORMAT"] == "plain"


def _django_log(fmt: str) -> subprocess.CompletedProcess:
    code = (
        "import django, logging; django.setup(); "
        "logging.getLogger('sage.example').warning('hello %s', 'there')"
    )
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "sageproject.settings", "SAGE_LOG_FORMAT": fmt}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )


def test_the_settings_log_json_lines_when_asked():
    result = _django_log("json")
    assert result.returncode == 0, result.stderr
    (line,) = [json.loads(x) for x in result.stderr.splitlines()]
    assert (line["level"], line["logger"], line["message"]) == (
        "WARNING",
        "sage.example",
        "hello there",
    )
    plain = _django_log("plain")
    assert plain.stderr.rstrip().endswith("WARNING sage.example: hello there")
    with pytest.raises(json.JSONDecodeError):
        json.loads(plain.stderr)


@pytest.mark.storage
@pytest.mark.django_db(transaction=True)
def test_what_a_run_logs_carries_its_run_session_and_worker(
    alice, settings, captured, start_worker
):
    from agents import services
    from agents.services import packages
    from scheduling.models import Run, RunStatus

    settings.SAGE_TOOL_MODULES = [__name__]
    scripted_model(
        "logger",
        {"text": "", "tool_calls": [{"name": "log_line", "arguments": {}}]},
        {"text": "done"},
    )
    packages.package_create(
        owner=alice, manifest=demo_manifest(name="logging", model="logger", tools=["log_line"])
    )
    session = services.session_create(owner=alice, package="logging", agent="assistant")
    run, _ = services.run_submit(owner=alice, session_id=session.pk, input="go")
    worker = start_worker()
    wait_for(lambda: all_terminal([run.pk]), message="the run to finish")
    run.refresh_from_db()
    assert run.status == RunStatus.COMPLETED, run.error
    (line,) = [x for x in captured() if x["logger"] == TOOL_LOGGER]
    assert line["message"] == "tool log_line ran"
    assert line["run_id"] == str(run.pk)
    assert line["session_id"] == str(session.pk)
    assert line["worker_id"] == worker.worker.worker_id
    assert Run.objects.filter(pk=run.pk, attempts=1).exists()
