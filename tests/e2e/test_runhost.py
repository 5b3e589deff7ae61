"""``manage.py runhost`` (``make run``): SIGTERM stops the web process and the worker with it,
as Ctrl-C does — a ``kill`` of the command must not leave them serving."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from django.conf import settings

from tests.pgcluster import free_port


def _children(parent: int) -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(stat[1]) == parent:
                found.add(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as answer:
            return answer.status == 200
    except OSError:
        return False


def test_sigterm_stops_the_web_process_and_the_worker_too(tmp_path) -> None:
    port = free_port()
    # Its own embedded database, whatever the suite runs on.
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in {"DATABASE_URL", "SAGE_TEST_DB_NAME", "REDIS_URL"}
    }
    env.update(SAGE_LOCAL_DIR=str(tmp_path), SAGE_SHUTDOWN_GRACE_SECONDS="5")
    host = subprocess.Popen(
        [sys.executable, "manage.py", "runhost", "--port", str(port)],
        cwd=settings.BASE_DIR,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    children: set[int] = set()
    try:
        deadline = time.monotonic() + 120
        while not (_healthy(port) and len(children := _children(host.pid)) == 2):
            assert host.poll() is None, host.stdout.read()
            assert time.monotonic() < deadline, "runhost did not start its two processes"
            time.sleep(0.2)
        host.send_signal(signal.SIGTERM)
        assert host.wait(60) == 0
        assert not [pid for pid in children if _alive(pid)], "a child outlived runhost"
        assert not _healthy(port)
        output = host.stdout.read()
        assert "Sage Host is running." in output
        assert "Stopping (the worker finishes or requeues running runs)" in output
    finally:
        if host.poll() is None:
            host.kill()
            host.wait()
        for pid in children:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
