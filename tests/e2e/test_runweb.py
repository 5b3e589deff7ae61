"""``manage.py runweb``: several web processes on one port, each with its own listening
socket (``SO_REUSEPORT``); one that dies is started again; SIGTERM stops them all. And
``manage.py runhost`` (``make run``): SIGTERM stops its web process and worker with it, as
Ctrl-C does — a ``kill`` of the command must not leave them serving."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from django.conf import settings

from sagehost import webserver
from tests.pgcluster import free_port
from tests.waiting import wait_until


def _children(parent: int, marker: bytes | None = b"sagehost.webserver") -> set[int]:
    """The processes ``parent`` started (those whose command line holds ``marker``)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat[1]) == parent and (marker is None or marker in cmdline):
            found.add(int(entry.name))
    return found


def _wait(condition, seconds: float, what: str):
    return wait_until(condition, timeout=seconds, interval=0.1, message=what)


def _port_sockets(pid: int, port: int, state: str) -> set[int]:
    """Inodes of the process's IPv4 TCP sockets with local ``port`` in ``state`` (``0A``
    listening, ``01`` established), from /proc."""
    owned = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            owned.add(int(target[8:-1]))
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].split(":")[1], 16) == port and fields[3] == state:
            if int(fields[9]) in owned:
                found.add(int(fields[9]))
    return found


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as answer:
            return answer.status == 200
    except OSError:
        return False


def test_several_processes_serve_one_port_and_one_that_dies_is_replaced() -> None:
    port = free_port()
    argv = [sys.executable, "manage.py", "runweb", "--workers", "2", "--port", str(port)]
    web = subprocess.Popen(
        [*argv, "--log-level", "warning"],
        cwd=settings.BASE_DIR,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        first = _wait(
            lambda: len(now := _children(web.pid)) == 2 and now, 30, "the 2 web processes"
        )
        # Each process listens on the port with a socket of its own.
        listening = _wait(
            lambda: (
                all(len(_port_sockets(p, port, "0A")) == 1 for p in first)
                and [_port_sockets(p, port, "0A") for p in first]
            ),
            60,
            "both processes to listen",
        )
        assert listening[0] != listening[1]
        _wait(lambda: _healthy(port), 60, "the web processes to answer")
        # Connections are spread over both processes: 20 keep-alive clients all on one of
        # two would happen by chance once in half a million.
        clients = [socket.create_connection(("127.0.0.1", port), 5) for _ in range(20)]
        try:
            for client in clients:
                client.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            for client in clients:
                assert client.recv(4096).startswith(b"HTTP/1.1 200")
            served = {p: len(_port_sockets(p, port, "01")) for p in first}
        finally:
            for client in clients:
                client.close()
        assert sum(served.values()) == 20 and min(served.values()) >= 1, served
        # One killed after its start-up is replaced; the port keeps answering.
        time.sleep(max(0.0, webserver.EARLY_EXIT + 0.5))
        victim = sorted(first)[0]
        os.kill(victim, signal.SIGKILL)
        replaced = _wait(
            lambda: len(now := _children(web.pid)) == 2 and victim not in now and now,
            30,
            "a replacement process",
        )
        assert len(replaced & first) == 1
        _wait(lambda: _healthy(port), 60, "the replacement to answer")
        web.send_signal(signal.SIGTERM)
        assert web.wait(60) == 0
        assert _children(web.pid) == set()
        output = web.stdout.read()
        assert f"web: 2 processes on 127.0.0.1:{port}" in output
        assert f"process {victim} exited with -9; starting another" in output
    finally:
        if web.poll() is None:
            web.kill()
            web.wait()


def test_a_process_that_cannot_start_stops_the_command() -> None:
    port = free_port()
    taken = socket.socket()
    taken.bind(("127.0.0.1", port))  # no SO_REUSEPORT: nobody may join the port
    taken.listen(1)
    try:
        result = subprocess.run(
            [sys.executable, "manage.py", "runweb", "--workers", "2", "--port", str(port)],
            cwd=settings.BASE_DIR,
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        taken.close()
    assert result.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr


def test_the_web_processes_stop_when_their_supervisor_is_killed() -> None:
    port = free_port()
    web = subprocess.Popen(
        [sys.executable, "manage.py", "runweb", "--workers", "2", "--port", str(port)],
        cwd=settings.BASE_DIR,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    children = _wait(lambda: len(now := _children(web.pid)) == 2 and now, 30, "the 2 web processes")
    _wait(lambda: _healthy(port), 60, "the web processes to answer")
    web.kill()
    web.wait()

    def gone() -> bool:
        return not any(Path(f"/proc/{pid}").exists() for pid in children)

    _wait(gone, webserver.ORPHAN_CHECK_SECONDS + webserver.GRACEFUL_SHUTDOWN + 5, "orphans to stop")
    assert not _healthy(port)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


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
    lines: list[str] = []

    def read() -> None:
        for line in host.stdout:
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    children: set[int] = set()
    try:
        # Up once it says so (its banner comes after the web process answers).
        wait_until(
            lambda: any("Press Ctrl-C to stop." in line for line in lines),
            timeout=120,
            interval=0.2,
            message="runhost to start",
            abort=lambda: None if host.poll() is None else "runhost exited:\n" + "".join(lines),
        )
        children = _children(host.pid, None)
        assert len(children) == 2, children
        assert _healthy(port)
        host.send_signal(signal.SIGTERM)
        assert host.wait(60) == 0
        assert not [pid for pid in children if _alive(pid)], "a child outlived runhost"
        assert not _healthy(port)
        reader.join(10)
        assert "Stopping (the worker finishes or requeues running runs)" in "".join(lines)
    finally:
        if host.poll() is None:
            host.kill()
            host.wait()
        for pid in children:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
