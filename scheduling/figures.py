"""What a worker counts for ``/metrics``: cumulative counters and fixed-bucket histograms.

One `Figures` per worker process, shared by its parts — the scheduler (lease reclaims, the
wait from admission to claim), the dispatcher (what each execution ended with, fence
rejections) and the executor (time to a model's first streamed item, tokens) — and
published in the worker's snapshot (``WorkerSnapshot.capacity["metrics"]``, every few
seconds and when it stops). The web process turns every recent snapshot into Prometheus
families with a ``worker`` label (`sagehost.metrics`): figures that live in a worker's
memory stay correct with any number of workers and hosts, and the database holds the rest.

Values only ever grow while the process lives (a new process starts from zero, as
Prometheus counters may). Label values are bounded: past `MAX_SERIES` label sets of one
name, a new model name is counted as ``other``, so a stream of distinct model names cannot
grow a snapshot without limit. Django-free; used from the worker's one event loop.
"""

from __future__ import annotations

import bisect
from typing import Any

# Counters (names as published; `sagehost.metrics` gives each its Prometheus family).
LEASE_RECLAIMS = "lease_reclaims"  # dead leases this worker's reaping ended (crashes)
FENCE_REJECTIONS = "fence_rejections"  # {write}: a write of an execution refused by its fence
SUSPENSIONS = "suspensions"  # {code}: runs this worker suspended (committed)
RATE_LIMITED = "rate_limited"  # {code}: executions ended by a RATE_LIMITED error
MODEL_TOKENS = "model_tokens"  # {model, type}: tokens the provider reported, input and output
MCP_CALLS = "mcp_calls"  # {server, outcome}: MCP tool calls (outcome ok, tool_error, timeout, …)

# Histograms and their bucket upper bounds, in seconds.
START_WAIT = "run_start_wait_seconds"  # {queue}: available (admitted, resumed) → claimed
EXECUTION = "run_execution_seconds"  # {outcome}: claim → outcome committed, per execution
FIRST_TOKEN = "model_first_token_seconds"  # {model}: request sent → first streamed item
MCP_CALL_SECONDS = "mcp_call_seconds"  # {server}: an MCP tool call, slot wait included

BUCKETS: dict[str, tuple[float, ...]] = {
    START_WAIT: (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900),
    EXECUTION: (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600),
    FIRST_TOKEN: (0.05, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 20, 30, 60),
    MCP_CALL_SECONDS: (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
}

# Label values the host does not choose (a model record's model name): past `MAX_SERIES`
# label sets of one name, new values are counted as `OTHER`. The other labels take a few
# values each (queues, outcomes, error codes, write kinds).
OPEN_LABELS = frozenset({"model", "server"})
MAX_SERIES = 64
OTHER = "other"


def _key(labels: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((name, str(value)) for name, value in labels.items()))


class _Histogram:
    __slots__ = ("counts", "sum")

    def __init__(self, size: int) -> None:
        self.counts = [0] * (size + 1)  # one per bound, then +Inf (not cumulative)
        self.sum = 0.0


class Figures:
    """Counters (`count`) and histograms (`observe`) by name and labels; `snapshot`."""

    def __init__(self) -> None:
        self._counters: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
        self._histograms: dict[str, dict[tuple[tuple[str, str], ...], _Histogram]] = {}

    @staticmethod
    def _bounded(series: dict[Any, Any], labels: dict[str, Any]) -> tuple[tuple[str, str], ...]:
        key = _key(labels)
        if key in series or len(series) < MAX_SERIES:
            return key
        return tuple((name, OTHER if name in OPEN_LABELS else value) for name, value in key)

    def count(self, name: str, amount: float = 1, **labels: Any) -> None:
        """Add ``amount`` (≥ 0) to the counter ``name`` of ``labels``."""
        if amount <= 0:
            return
        series = self._counters.setdefault(name, {})
        key = self._bounded(series, labels)
        series[key] = series.get(key, 0) + amount

    def observe(self, name: str, value: float, **labels: Any) -> None:
        """Record ``value`` (seconds; a negative one as 0) in the histogram ``name``."""
        bounds = BUCKETS[name]
        series = self._histograms.setdefault(name, {})
        key = self._bounded(series, labels)
        histogram = series.get(key)
        if histogram is None:
            histogram = series[key] = _Histogram(len(bounds))
        value = max(float(value), 0.0)
        histogram.counts[bisect.bisect_left(bounds, value)] += 1
        histogram.sum += value

    def snapshot(self) -> dict[str, Any]:
        """JSON-ready: ``{"counters": {name: [[labels, value], ...]}, "histograms": {name:
        {"bounds": [...], "series": [[labels, {"buckets": [cumulative count per bound],
        "count", "sum"}], ...]}}}``."""
        counters = {
            name: [[dict(key), value] for key, value in series.items()]
            for name, series in self._counters.items()
        }
        histograms = {}
        for name, series in self._histograms.items():
            rows = []
            for key, histogram in series.items():
                cumulative, running = [], 0
                for n in histogram.counts[:-1]:
                    running += n
                    cumulative.append(running)
                rows.append(
                    [
                        dict(key),
                        {
                            "buckets": cumulative,
                            "count": running + histogram.counts[-1],
                            "sum": round(histogram.sum, 6),
                        },
                    ]
                )
            histograms[name] = {"bounds": list(BUCKETS[name]), "series": rows}
        return {"counters": counters, "histograms": histograms}
