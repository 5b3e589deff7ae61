"""An in-process worker running in its own thread and event loop, for end-to-end tests."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator

import pytest

from scheduling.models import TERMINAL_STATUSES, Run
from scheduling.worker import Worker
from tests.waiting import wait_until


async def _close_executor_connections(loop: asyncio.AbstractEventLoop) -> None:
    """``connections.close_all()`` in every thread of ``loop``'s default executor: one call
    per thread, each held at a barrier until all threads have one."""
    from django.db import connections

    executor = getattr(loop, "_default_executor", None)
    threads = len(getattr(executor, "_threads", ()))
    if not threads:
        return
    barrier = threading.Barrier(threads, timeout=5)

    def close() -> None:
        connections.close_all()
        with contextlib.suppress(threading.BrokenBarrierError):
            barrier.wait()

    await asyncio.gather(*(loop.run_in_executor(None, close) for _ in range(threads)))


class WorkerThread:
    def __init__(self, **options) -> None:
        self.options = options
        self.loop = asyncio.new_event_loop()
        self.worker: Worker | None = None
        self.error: BaseException | None = None
        self._ready = threading.Event()
        self.thread = threading.Thread(target=self._main, name="test-worker", daemon=True)

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def main() -> None:
            options = dict(self.options)
            if "executor" not in options:
                from agents.executor import RunExecutor

                options["executor"] = RunExecutor()
            self.worker = Worker(**options)
            self._ready.set()
            await self.worker.run()

        try:
            self.loop.run_until_complete(main())
        except BaseException as exc:  # surfaced by stop()
            self.error = exc
            self._ready.set()
        finally:
            from django.db import connections

            connections.close_all()
            # The worker's database calls ran on the loop's default executor, each thread
            # keeping its connection (MySQL: CONN_MAX_AGE 60). Close them in those threads,
            # then end the threads: a suite of worker tests would otherwise hold a
            # connection per thread per test until the server refuses more.
            self.loop.run_until_complete(_close_executor_connections(self.loop))
            self.loop.run_until_complete(self.loop.shutdown_default_executor())
            self.loop.close()

    def start(self) -> WorkerThread:
        self.thread.start()
        assert self._ready.wait(10), "worker did not start"
        return self

    def stop(self, timeout: float = 30.0) -> None:
        if self.worker is not None and self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.worker.request_stop)
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "worker did not stop"
        if self.error:
            raise self.error


def wait_for(
    predicate: Callable[[], bool], *, timeout: float = 30.0, message: str = "condition"
) -> None:
    """Poll the database until ``predicate`` holds; fail with ``message`` at the deadline."""
    wait_until(predicate, timeout=timeout, message=message)


def all_terminal(run_ids) -> bool:
    return Run.objects.filter(pk__in=run_ids).exclude(status__in=TERMINAL_STATUSES).count() == 0


@pytest.fixture
def start_worker() -> Iterator[Callable[..., WorkerThread]]:
    started: list[WorkerThread] = []

    def start(**options) -> WorkerThread:
        options.setdefault("lease_seconds", 6)
        options.setdefault("heartbeat_seconds", 1)
        options.setdefault("grace_seconds", 5)
        # Cancellation requests are noticed by polling; a short period keeps tests quick.
        options.setdefault("cancel_poll_seconds", 0.2)
        worker = WorkerThread(**options).start()
        started.append(worker)
        return worker

    yield start
    for worker in started:
        if worker.thread.is_alive():
            worker.stop()
