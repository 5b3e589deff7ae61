"""The method every target is measured with, this host's and each peer's alike: a `Target`
submits a `Batch` with its ordinary in-process call; `measure_throughput` and
`measure_latency` time the submissions against the starts each target records."""

from __future__ import annotations

import gc
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from benchmarks.e2e.harness import distribution


@dataclass
class Batch:
    """One path's submissions: per index, what to submit and (afterwards) what it made."""

    label: str
    key: str
    handles: list[Any]
    results: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.results = [None] * len(self.handles)


class Target:
    """What the throughput and latency functions drive: this host or a peer."""

    name = ""

    def prepare(self, count: int, label: str) -> Batch:  # untimed
        raise NotImplementedError

    def submit(self, batch: Batch, index: int) -> None:  # the ordinary in-process call
        raise NotImplementedError

    def starts(self, batch: Batch, timeout: float) -> list[float]:
        """Wait until every submission started; each one's start (epoch seconds)."""
        raise NotImplementedError

    def settle(self, batch: Batch, timeout: float) -> dict[str, Any]:
        """Wait until the batch is finished; figures about how it ended."""
        return {}

    def end_thread(self) -> None:
        """Called at the end of each submitting thread."""


def submit_all(target: Target, batch: Batch, threads: int) -> None:
    count = len(batch.handles)
    if threads <= 1:
        for index in range(count):
            target.submit(batch, index)
        return
    errors: list[BaseException] = []

    def share(first: int) -> None:
        try:
            for index in range(first, count, threads):
                target.submit(batch, index)
        except BaseException as exc:
            errors.append(exc)
        finally:
            target.end_thread()

    pool = [threading.Thread(target=share, args=(t,), daemon=True) for t in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    if errors:
        raise errors[0]


def warm_up(target: Target, count: int, timeout: float) -> None:
    batch = target.prepare(count, "warmup")
    submit_all(target, batch, 1)
    target.starts(batch, timeout)
    target.settle(batch, timeout)


def measure_throughput(target: Target, n: int, threads: int, timeout: float) -> dict[str, Any]:
    """N submissions as fast as possible; N / (first submit → start of the last one)."""
    batch = target.prepare(n, "throughput")
    first = time.time()
    submit_all(target, batch, threads)
    submitted = time.time()
    starts = target.starts(batch, timeout)
    last = max(starts)
    ended = target.settle(batch, timeout)
    return {
        "n": n,
        "submit_threads": threads,
        "submit_s": round(submitted - first, 3),
        "submits_per_s": round(n / (submitted - first), 1),
        "first_submit_to_last_start_s": round(last - first, 3),
        "started_per_s": round(n / (last - first), 1),
        **ended,
    }


def settle_collector() -> None:
    """Before a timed path: what this process built so far (sessions, handles, the earlier
    paths' samples) out of the garbage collector's sight. A full collection of the load
    generator's heap is a pause of the client, not of what is measured — it showed as
    20 to 30 ms stalls between the web process and the stream client."""
    gc.collect()
    gc.freeze()


def measure_latency(target: Target, n: int, rate: float, timeout: float) -> dict[str, Any]:
    """N submissions at a steady ``rate``; start minus the time just before each submit call."""
    batch = target.prepare(n, "latency")
    settle_collector()
    stamps = [0.0] * n
    returned = [0.0] * n
    interval = 1.0 / rate
    late = 0
    began = time.perf_counter()
    for index in range(n):
        delay = began + index * interval - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        elif delay < -interval:
            late += 1
        stamps[index] = time.time()
        target.submit(batch, index)
        returned[index] = time.time()
    elapsed = time.perf_counter() - began
    starts = target.starts(batch, timeout)
    ended = target.settle(batch, timeout)
    latencies = [start - stamp for start, stamp in zip(starts, stamps, strict=True)]
    # The submit call alone (its commit included): the rest of the latency is the wake-up
    # and the claim.
    calls = [back - stamp for back, stamp in zip(returned, stamps, strict=True)]
    return {
        "n": n,
        "rate_per_s": rate,
        "achieved_rate_per_s": round(n / elapsed, 1) if elapsed > 0 else None,
        "late_submits": late,
        **distribution(latencies),
        "min_ms": round(min(latencies) * 1000, 3),
        **distribution(calls, "submit_call_"),
        **ended,
    }
