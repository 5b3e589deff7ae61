"""``/readyz`` follows the workers for real: 503 when the worker stops, 200 again when one
starts — an in-process worker, and ``runworker`` behind a live ``uvicorn``."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from io import StringIO

import pytest
from django.core.management import call_command
from rest_framework.test import APIClient

from tests.e2e.conftest import wait_for
from tests.scheduling.processes import live_web_server, worker_env, worker_processes_fixture

pytestmark = [pytest.mark.storage, pytest.mark.django_db(transaction=True)]

worker_processes = worker_processes_fixture


def probe(client: APIClient) -> tuple[int, list[str]]:
    response = client.get("/readyz")
    return response.status_code, response.json()["failed"]


def test_readyz_turns_503_when_the_worker_stops_and_200_when_it_starts(start_worker):
    client = APIClient()
    assert probe(client) == (503, ["workers"])
    worker = start_worker()
    wait_for(lambda: probe(client)[0] == 200, message="/readyz 200 with a worker running")
    assert probe(client) == (200, [])

    worker.stop()
    assert probe(client) == (503, ["workers"])  # its snapshot says stopped: at once
    out = StringIO()
    with pytest.raises(SystemExit) as stopped:
        call_command("doctor", "--json", stdout=out)
    assert stopped.value.code == 1
    checks = {c["name"]: c for c in json.loads(out.getvalue())["checks"]}
    assert checks["workers"]["status"] == "fail"

    start_worker()
    wait_for(lambda: probe(client)[0] == 200, message="/readyz 200 with a new worker")


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_the_live_host_is_ready_only_while_runworker_runs(tmp_path, worker_processes):
    with live_web_server(tmp_path / "web.log", worker_env()) as base:

        def start_and_wait_ready(name: str):
            worker = worker_processes.start(name)
            worker_processes.wait_for(
                lambda: _get(f"{base}/readyz")[0] == 200,
                timeout=60,
                message=f"/readyz 200 once runworker {name} publishes its heartbeat",
                running=[worker],
            )
            return worker

        assert _get(f"{base}/healthz") == (200, {"status": "ok"})
        status, body = _get(f"{base}/readyz")
        assert (status, body["failed"]) == (503, ["workers"])

        worker = start_and_wait_ready("first")
        assert worker.terminate() == 0  # SIGTERM: drains, marks its snapshot stopped
        status, body = _get(f"{base}/readyz")
        assert (status, body["failed"]) == (503, ["workers"])
        assert _get(f"{base}/healthz")[0] == 200  # the web process itself is still up

        start_and_wait_ready("again")
