"""Several web processes on one port, each with a listening socket of its own
(``SO_REUSEPORT``): ``manage.py runweb``.

``uvicorn --workers N`` shares one listening socket among its processes, and whichever
process is idle in ``accept`` first takes the next connection: clients on keep-alive
connections (SDKs, a load balancer's upstream pool) end up unevenly spread — 40 of 50 on
one of two processes was seen — and the busiest process sets everybody's latency while the
other idles. With a socket per process bound with ``SO_REUSEPORT``, the kernel spreads new
connections over the processes by a hash of their addresses.

The supervisor starts the processes, restarts one that exits (a process that exits within
`EARLY_EXIT` seconds of its start stops everything: a bad setting or a port taken would
only repeat), and on SIGTERM or SIGINT stops them: uvicorn's graceful shutdown, which
finishes the requests in flight and ends event streams still open after
`GRACEFUL_SHUTDOWN` seconds (their clients resume with ``Last-Event-ID``), then SIGKILL
after `STOP_GRACE` seconds. A process whose supervisor is gone (killed outright) stops
itself the same way, so it never keeps the port. Django-free; each process loads
``sagehost.asgi``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

EARLY_EXIT = 5.0
GRACEFUL_SHUTDOWN = 10.0
STOP_GRACE = 15.0
# How often a web process looks whether its supervisor is still there.
ORPHAN_CHECK_SECONDS = 1.0


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port with ``SO_REUSEPORT``, listening."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(address)
    sock.listen(2048)
    return sock


def serve_one(host: str, port: int, log_level: str = "info") -> None:
    """One web process: uvicorn serving ``sagehost.asgi`` on its own socket."""
    import uvicorn

    sock = listening_socket(host, port)
    config = uvicorn.Config(
        "sagehost.asgi:application",
        lifespan="off",
        access_log=False,
        log_level=log_level,
        timeout_graceful_shutdown=int(GRACEFUL_SHUTDOWN),
    )
    threading.Thread(
        target=_stop_when_orphaned, args=(os.getppid(),), name="orphan-watch", daemon=True
    ).start()
    uvicorn.Server(config).run(sockets=[sock])


def _stop_when_orphaned(parent: int) -> None:
    """SIGTERM this process (a graceful stop) once its supervisor ``parent`` is gone."""
    while os.getppid() == parent:
        time.sleep(ORPHAN_CHECK_SECONDS)
    os.kill(os.getpid(), signal.SIGTERM)


class Supervisor:
    """``workers`` processes of `serve_one` on host:port (see the module text)."""

    def __init__(
        self, host: str, port: int, workers: int, log: Callable[[str], None], log_level: str
    ) -> None:
        self.host, self.port, self.workers, self.log = host, port, workers, log
        self.log_level = log_level
        self.children: list[tuple[subprocess.Popen, float]] = []
        self.stopping = False

    def _start(self) -> tuple[subprocess.Popen, float]:
        argv = [
            sys.executable,
            "-m",
            "sagehost.webserver",
            self.host,
            str(self.port),
            self.log_level,
        ]
        return subprocess.Popen(argv), time.monotonic()

    def run(self) -> int:
        """Serve until SIGTERM or SIGINT (0), or until a process exits early (1)."""
        listening_socket(self.host, self.port).close()  # the port is free (or ours): say so now
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._stop)
        self.children = [self._start() for _ in range(self.workers)]
        self.log(f"web: {self.workers} processes on {self.host}:{self.port} (SO_REUSEPORT)")
        code = 0
        while not self.stopping:
            time.sleep(0.2)
            for index, (child, started) in enumerate(self.children):
                status = child.poll()
                if status is None or self.stopping:
                    continue
                if time.monotonic() - started < EARLY_EXIT:
                    self.log(f"web: process {child.pid} exited with {status} at start; stopping")
                    self.stopping, code = True, 1
                    break
                self.log(f"web: process {child.pid} exited with {status}; starting another")
                self.children[index] = self._start()
        self._stop_children()
        return code

    def _stop(self, signum: int, frame: object) -> None:
        self.stopping = True

    def _stop_children(self) -> None:
        for child, _ in self.children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE
        for child, _ in self.children:
            try:
                child.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


if __name__ == "__main__":
    serve_one(sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "info")
