"""This host over HTTP: the web processes as production starts them (``manage.py
runweb``), the ``http_admission`` windows (a minimal keep-alive client, `KeepAliveClient`),
and the streaming paths ``token_to_sse`` and ``event_to_sse`` (runs of a model served by
``benchmarks.peers.model_server``, read by clients of the session event stream)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson
from django.core.management.base import CommandError
from django.db import connections

from benchmarks.e2e.harness import (
    ROOT,
    Subprocess,
    check_running,
    child_env,
    database_url,
    distribution,
    free_port,
    progress,
    start_child,
    targets,
    tidy_tables,
    wait_until,
)
from benchmarks.e2e.host import HostTarget
from benchmarks.e2e.machine import cpu_by_process, cpu_spent, database_processes, process_tree
from benchmarks.e2e.method import settle_collector

SSE_CONCURRENCY = 10


class KeepAliveClient:
    """A minimal HTTP/1.1 client on one keep-alive connection (asyncio streams): the
    load generator of ``http_admission``. It costs a small part of what a full client
    (httpx) costs per request, so on a machine shared with the server the figure is the
    server's. Understands what this API answers: ``Content-Length`` bodies."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post_json(self, path: str, body: bytes, headers: dict[str, str]) -> int:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
            + "\r\n"
        )
        self.writer.write(head.encode() + body)
        status_line = await self.reader.readline()
        length = None
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        if length is None:
            # Anything else (a chunked body) would leave the next answer misread.
            raise CommandError(f"{status_line.decode().strip()} came without Content-Length")
        await self.reader.readexactly(length)
        return int(status_line.split()[1])

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(OSError):
                await self.writer.wait_closed()


async def http_admission(
    base: str, clients: list[tuple[str, list[str]]], seconds: float
) -> dict[str, Any]:
    from urllib.parse import urlsplit

    address = urlsplit(base)
    latencies: list[float] = []
    statuses: Counter[int] = Counter()
    reused = 0
    connections_ = [KeepAliveClient(address.hostname, address.port) for _ in clients]

    async def post(client: KeepAliveClient, token: str, session: str) -> int:
        body = orjson.dumps({"session": session, "input": "ping"})
        return await client.post_json("/api/v1/runs/", body, {"Authorization": f"Token {token}"})

    try:
        # Warm-up (untimed): one request per client opens its connection.
        await asyncio.gather(
            *(
                post(client, token, sessions[0])
                for client, (token, sessions) in zip(connections_, clients, strict=True)
            )
        )
        deadline = time.perf_counter() + seconds

        async def one(client: KeepAliveClient, token: str, sessions: list[str]) -> None:
            nonlocal reused
            index = 1
            while time.perf_counter() < deadline:
                if index >= len(sessions):
                    reused += 1  # queued behind its session's earlier run
                started = time.perf_counter()
                code = await post(client, token, sessions[index % len(sessions)])
                latencies.append(time.perf_counter() - started)
                statuses[code] += 1
                index += 1

        began = time.perf_counter()
        await asyncio.gather(
            *(
                one(client, token, sessions)
                for client, (token, sessions) in zip(connections_, clients, strict=True)
            )
        )
        elapsed = time.perf_counter() - began
    finally:
        for client in connections_:
            await client.close()
    return {
        "path": "http_admission",
        "clients": len(clients),
        "seconds": round(elapsed, 3),
        "requests": len(latencies),
        "req_per_s": round(len(latencies) / elapsed, 1),
        **distribution(latencies),
        "status": {str(code): n for code, n in sorted(statuses.items())},
        "sessions_reused": reused,
    }


@dataclass
class SseSample:
    tokens: list[float]  # arrival minus the token's send time, per token (s)
    event: float  # run.completed: arrival minus its created_at (s)
    total: float  # run.completed: arrival minus the time just before the submit call (s)
    dropped: int


async def sse_samples(
    base: str, token: str, owner: Any, sessions: list[Any], wait_s: float
) -> list[SseSample]:
    """One run per session, each submitted once its SSE stream is open; what the client saw."""
    import httpx

    from agents.services import run_submit
    from sageproject.db import db_call

    def submit(session_id: Any) -> str:
        run, _ = run_submit(owner=owner, session_id=session_id, input="ping")
        return str(run.pk)

    headers = {"Authorization": f"Token {token}"}
    gate = asyncio.Semaphore(SSE_CONCURRENCY)
    limits = httpx.Limits(max_connections=SSE_CONCURRENCY + 2)

    async def one(client: httpx.AsyncClient, session_id: Any) -> SseSample:
        async with gate:
            url = f"/api/v1/sessions/{session_id}/stream/?after=0&timeout=120"
            async with client.stream("GET", url, headers=headers) as response:
                if response.status_code != 200:
                    raise CommandError(f"GET {url} answered {response.status_code}")
                lines = response.aiter_lines()
                async for line in lines:
                    if line.startswith("retry:"):
                        break  # subscribed (live) and reading the durable events
                submitted = time.time()
                run_id = await db_call(submit, session_id)
                event, tokens, dropped = "", [], 0
                async for line in lines:
                    if line.startswith(": dropped"):
                        dropped = int(line.split()[2])
                    elif line.startswith("event: "):
                        event = line[len("event: ") :]
                    elif line.startswith("data: ") and event in ("message.delta", "run.completed"):
                        received = time.time()
                        data = orjson.loads(line[len("data: ") :])
                        if data.get("run") != run_id:
                            continue
                        if event == "run.completed":
                            created = datetime.fromisoformat(data["created_at"]).timestamp()
                            return SseSample(
                                tokens, received - created, received - submitted, dropped
                            )
                        for word in str((data.get("payload") or {}).get("text", "")).split():
                            with contextlib.suppress(ValueError):
                                tokens.append(received - float(word))
                    elif not line:
                        event = ""
        raise CommandError(f"the stream of session {session_id} ended before run.completed")

    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=wait_s) as client:
        return list(await asyncio.gather(*(one(client, s) for s in sessions)))


def sse_lines(samples: list[SseSample], tokens_per_run: int, gap_ms: float) -> list[dict]:
    tokens = [t for sample in samples for t in sample.tokens]
    token_line: dict[str, Any] = {
        "path": "token_to_sse",
        "runs": len(samples),
        "tokens_per_run": tokens_per_run,
        "token_gap_ms": gap_ms,
        "tokens": len(tokens),
        "tokens_expected": len(samples) * tokens_per_run,
        "dropped": sum(sample.dropped for sample in samples),
        "concurrent_streams": min(SSE_CONCURRENCY, len(samples)),
        "model": "benchmarks.peers.model_server (OpenAI-compatible; each token is its send time)",
    }
    if tokens:
        token_line.update(distribution(tokens))
    else:
        token_line["note"] = "no message.delta event reached the client"
    event_line = {
        "path": "event_to_sse",
        "event": "run.completed",
        "n": len(samples),
        "concurrent_streams": min(SSE_CONCURRENCY, len(samples)),
        **distribution([sample.event for sample in samples]),
        **distribution([sample.total for sample in samples], prefix="submit_to_client_"),
        "note": "durable event: its created_at to its arrival at a connected SSE client",
    }
    return [token_line, event_line]


def http_paths(
    options: dict[str, Any],
    host: HostTarget,
    owners: list[tuple[Any, Any]],
    web: tuple[str, Subprocess],
    worker: Subprocess,
    common: dict[str, Any],
    *,
    emit: Callable[[dict[str, Any]], None],
    stack: contextlib.ExitStack,
) -> None:
    """The HTTP paths, each line given to ``emit``: ``http_admission`` with the worker
    paused and running, then ``token_to_sse`` and ``event_to_sse``. What they start goes
    on ``stack``."""
    from rest_framework.authtoken.models import Token

    base, server = web
    children = [worker, server]
    tokens = [Token.objects.get_or_create(user=user)[0].key for user, _ in owners]
    # Admission alone (the worker paused: on this machine kind executing 500 runs/s
    # takes both CPUs by itself, see the throughput path), then with the worker
    # executing what is admitted as it arrives.
    for paused in (True, False):
        line = admission_window(options, host, owners, tokens, base, children, paused)
        path = "http_admission" if paused else "http_admission_with_worker"
        path_targets = targets("http_admission") if paused else {}
        emit({**line, "path": path, **common, **path_targets})

    user, _ = owners[0]
    live = live_model(options, user, worker.log.parent, stack=stack, children=children)
    progress(f"token_to_sse and event_to_sse: {options['sse_n']} runs")
    # The first round opens each web process's live channel; it is not measured.
    warm = live.prepare(min(SSE_CONCURRENCY, options["sse_n"]), "sse-warmup")
    asyncio.run(sse_samples(base, tokens[0], user, [s for _, s in warm.handles], 120))
    batch = live.prepare(options["sse_n"], "sse")
    tidy_tables()  # as before every path: not the admission windows' dead rows
    settle_collector()
    samples = asyncio.run(
        sse_samples(base, tokens[0], user, [s for _, s in batch.handles], options["timeout"])
    )
    connections.close_all()
    for line in sse_lines(samples, options["sse_tokens"], options["sse_token_gap_ms"]):
        emit({**line, **common})


def admission_window(
    options: dict[str, Any],
    host: HostTarget,
    owners: list[tuple[Any, Any]],
    tokens: list[str],
    base: str,
    children: list[Subprocess],
    paused: bool,
) -> dict[str, Any]:
    """One ``http_admission`` window into fresh sessions, the worker paused (SIGSTOP,
    holding no run) or running; then the admitted runs drained."""
    from scheduling.models import UNFINISHED_STATUSES, Run

    worker, server = children
    clients = options["http_clients"]
    per_client = max(20, int(options["http_seconds"] * 15))
    # Client c posts as owner c mod users, into fresh sessions of that owner.
    batch = host.prepare(clients * per_client, "http")
    by_owner: dict[Any, list[str]] = {}
    for user, session in batch.handles:
        by_owner.setdefault(user.pk, []).append(str(session))
    plan = []
    for c in range(clients):
        owner_index = c % len(owners)
        peers_of_c = list(range(owner_index, clients, len(owners)))
        mine = by_owner[owners[owner_index][0].pk][peers_of_c.index(c) :: len(peers_of_c)]
        plan.append((tokens[owner_index], mine))
    tidy_tables()
    state = "paused" if paused else "running"
    progress(f"http_admission: {clients} clients, {options['http_seconds']} s, worker {state}")
    if paused:
        os.kill(worker.pid, signal.SIGSTOP)
    web, database, client = (
        cpu_by_process(process_tree(server.pid)),
        cpu_by_process(database_processes()),
        time.process_time(),
    )
    try:
        line = asyncio.run(http_admission(base, plan, options["http_seconds"]))
    finally:
        if paused:
            os.kill(worker.pid, signal.SIGCONT)
    per_request = 1000 / max(1, line["requests"])  # ms per request, from seconds
    spent = {
        "web": cpu_spent(web, cpu_by_process(process_tree(server.pid))),
        # None without database processes here: SQLite runs in the web processes
        # (counted there), a server elsewhere is not measured.
        "database": (
            cpu_spent(database, cpu_by_process(database_processes())) if database else None
        ),
        "client": time.process_time() - client,
    }
    line["cpu_ms_per_request"] = {
        name: round(seconds * per_request, 3)
        for name, seconds in spent.items()
        if seconds is not None
    }
    check_running(server)
    progress("waiting for the worker to drain the admitted runs")
    began = time.perf_counter()
    user_ids = [user.pk for user, _ in owners]
    wait_until(
        "the admitted runs to finish",
        lambda: (
            not Run.objects.filter(owner_id__in=user_ids, status__in=UNFINISHED_STATUSES).exists()
        ),
        options["timeout"],
        children,
    )
    line["drain_s"] = round(time.perf_counter() - began, 3)
    line["web_workers"] = options["web_workers"]
    line["worker"] = state
    return line


def live_model(
    options: dict[str, Any],
    user: Any,
    logs: Path,
    *,
    stack: contextlib.ExitStack,
    children: list[Subprocess],
) -> HostTarget:
    """The ``bench-live`` model (benchmarks.peers.model_server) and a package whose agent uses
    it, for ``user``; both go with the user. Returns a target whose sessions use it."""
    from agents.management.commands.seed_demo import DEMO_MANIFEST
    from agents.services import packages
    from pooling.models import ModelRecord, Protocol

    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "benchmarks.peers.model_server",
        "--port",
        str(port),
        "--tokens",
        str(options["sse_tokens"]),
        "--gap-ms",
        str(options["sse_token_gap_ms"]),
    ]
    server = start_child("model-server", argv, child_env(database_url(), 1), logs)
    stack.callback(server.stop)

    def up() -> bool:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            return True
        return False

    wait_until("the model server", up, 30, [server])
    record = ModelRecord(
        owner=user,
        name="bench-live",
        protocol=Protocol.OPENAI,
        base_url=f"http://127.0.0.1:{port}/v1",
        model="bench-live",
        options={"timeout": 60},
    )
    record.api_key = "bench"
    record.save()
    agent = {**DEMO_MANIFEST["agents"]["assistant"], "model": "bench-live", "tools": []}
    manifest = {**DEMO_MANIFEST, "name": "bench-live", "agents": {"assistant": agent}}
    package, _ = packages.package_create(owner=user, manifest=manifest)
    return HostTarget([(user, package)], children)


def start_web(
    options: dict[str, Any],
    env: dict[str, str],
    logs: Path,
    stack: contextlib.ExitStack,
) -> tuple[str, Subprocess]:
    import urllib.request

    port = free_port()
    argv = [
        sys.executable,
        str(ROOT / "manage.py"),
        "runweb",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        str(options["web_workers"]),
        "--log-level",
        "warning",
    ]
    progress(f"starting the web server ({options['web_workers']} workers)")
    server = start_child("web", argv, env, logs)
    stack.callback(server.stop)
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            with urllib.request.urlopen(f"{base}/healthz", timeout=1) as response:
                return response.status == 200
        except OSError:
            return False

    wait_until("the web server", up, 60, [server])
    return base, server
