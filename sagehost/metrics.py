"""``GET /metrics``: the host's figures in the Prometheus text format.

Answered only with ``Authorization: Bearer <SAGE_METRICS_TOKEN>`` (when that setting is
set; compared in constant time) or a staff user's API token (``Authorization: Token …``);
otherwise 401/403 in the error envelope. Not part of ``/api/v1/`` nor of its schema.

Every scrape reads three sources, so the figures are right with any number of web
processes, workers and hosts:

- **The database** (a few aggregate queries, ages on the database's clock): runs by status
  and queue, runs submitted / started / finished by outcome, queue depth and the age of the
  oldest run waiting for a worker per queue. One grouped pass over the run table, plus an
  index range over the ready queued runs (``run_fair_claim_ready``).
- **The workers' snapshots** (``WorkerSnapshot``, published every 3 s and when a worker
  stops): each worker's counters and histograms (`scheduling.figures`) and its capacity
  figures (model calls, model clients, Applications, jobs, code-tool sessions), with a
  ``worker`` label. A snapshot is shown while its heartbeat is at most
  `WORKER_RETENTION_SECONDS` old, whether the worker runs or stopped, so a stopped worker's
  counters do not vanish before the next scrapes see their last values.
- **The web processes' own counters** (429 answers of the API by code,
  `sageproject.counters`): each process adds to its own file in ``SAGE_METRICS_DIR``
  (default ``.local/metrics``) and a scrape sums them all.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db.models import Count, Min
from django.http import HttpRequest, HttpResponse, JsonResponse
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString
from rest_framework import exceptions as drf_exceptions

from sageproject import counters
from sageproject.errors import ErrorCategory, envelope
from scheduling import figures

# A worker's snapshot is exposed while its heartbeat is at most this old (running or not).
WORKER_RETENTION_SECONDS = 900

# ---------------------------------------------------------------- the database's figures


def _run_families(now: datetime) -> list[Metric]:
    from scheduling.models import TERMINAL_STATUSES, Run, RunQueue, RunStatus

    queues = [q.value for q in RunQueue]
    counts = {(s.value, q): (0, 0) for s in RunStatus for q in queues}
    rows = (
        Run.objects.values_list("status", "queue")
        .annotate(n=Count("*"), started=Count("started_at"))
        .order_by()
    )
    for status, queue, n, started in rows:
        counts[(status, queue)] = (n, started)
    oldest = dict(
        Run.objects.filter(status=RunStatus.QUEUED, ready=True)
        .values_list("queue")
        .annotate(oldest=Min("available_at"))
        .order_by()
    )
    by_status = GaugeMetricFamily(
        "sage_runs", "Runs in the database by status and queue.", labels=["status", "queue"]
    )
    submitted = CounterMetricFamily(
        "sage_runs_submitted", "Runs admitted (every run in the database).", labels=["queue"]
    )
    started = CounterMetricFamily(
        "sage_runs_started", "Runs a worker has started (started_at set).", labels=["queue"]
    )
    finished = CounterMetricFamily(
        "sage_runs_finished",
        "Runs that ended, by outcome (terminal status).",
        labels=["queue", "outcome"],
    )
    depth = GaugeMetricFamily("sage_queue_depth", "Queued runs.", labels=["queue"])
    age = GaugeMetricFamily(
        "sage_queue_oldest_age_seconds",
        "Seconds the oldest run waiting for a worker has been available (queued, its "
        "session's turn; 0 when none), on the database's clock.",
        labels=["queue"],
    )
    for queue in queues:
        for status in RunStatus:
            n = counts[(status.value, queue)][0]
            by_status.add_metric([status.value, queue], n)
            if status in TERMINAL_STATUSES:
                finished.add_metric([queue, status.value], n)
        submitted.add_metric([queue], sum(counts[(s.value, queue)][0] for s in RunStatus))
        started.add_metric([queue], sum(counts[(s.value, queue)][1] for s in RunStatus))
        depth.add_metric([queue], counts[(RunStatus.QUEUED.value, queue)][0])
        since = oldest.get(queue)
        age.add_metric([queue], max((now - since).total_seconds(), 0.0) if since else 0.0)
    return [by_status, submitted, started, finished, depth, age]


# ---------------------------------------------------------------- the workers' snapshots

# Capacity figures of a snapshot: family, type, where in ``WorkerSnapshot.capacity``, help.
SNAPSHOT_FIGURES: tuple[tuple[str, str, str, str], ...] = (
    ("sage_worker_runs_executing", "gauge", "runs.active", "Runs the worker is executing."),
    (
        "sage_model_calls_active",
        "gauge",
        "executor.model_calls.active",
        "Model calls holding a slot.",
    ),
    (
        "sage_model_calls_waiting",
        "gauge",
        "executor.model_calls.waiting",
        "Model calls waiting for a slot.",
    ),
    ("sage_model_calls_limit", "gauge", "executor.model_calls.limit", "Model-call slots."),
    (
        "sage_store_transactions",
        "counter",
        "store.transactions",
        "Transactions of the worker's session store (each a group commit of one or more commits).",
    ),
    (
        "sage_store_commits",
        "counter",
        "store.commits",
        "Commits (a run's events with its state change) the session store made durable.",
    ),
    (
        "sage_store_commits_rejected",
        "counter",
        "store.rejected",
        "Commits the session store refused: a stale lease, a session moved on elsewhere, "
        "a failed write.",
    ),
    (
        "sage_store_batches_redone",
        "counter",
        "store.redone",
        "Group commits redone commit by commit after a check of the pipelined form failed.",
    ),
    (
        "sage_model_calls_rejected",
        "counter",
        "executor.model_calls.rejected",
        "Model calls refused (model.queue_full).",
    ),
    (
        "sage_model_calls_timed_out",
        "counter",
        "executor.model_calls.timed_out",
        "Model calls that waited in vain (model.queue_timeout).",
    ),
    ("sage_model_clients", "gauge", "executor.model_clients.clients", "Pooled model clients."),
    (
        "sage_model_clients_closing",
        "gauge",
        "executor.model_clients.closing_clients",
        "Model clients closing after their last lease.",
    ),
    (
        "sage_model_client_leases",
        "gauge",
        "executor.model_clients.active_leases",
        "Model client leases held.",
    ),
    (
        "sage_model_clients_max",
        "gauge",
        "executor.model_clients.max_clients",
        "Most model clients the pool keeps.",
    ),
    (
        "sage_model_client_constructions",
        "counter",
        "executor.model_clients.constructions",
        "Model clients constructed.",
    ),
    (
        "sage_applications_resident",
        "gauge",
        "executor.management.applications",
        "Resident Applications.",
    ),
    (
        "sage_applications_limit",
        "gauge",
        "executor.management.limit",
        "Most resident Applications.",
    ),
    (
        "sage_jobs_active",
        "gauge",
        "executor.jobs.admitted",
        "Background jobs admitted and not ended.",
    ),
    ("sage_jobs_running", "gauge", "executor.jobs.running", "Background jobs running."),
    (
        "sage_jobs_retained",
        "gauge",
        "executor.jobs.retained_terminal",
        "Ended background jobs still kept.",
    ),
    (
        "sage_jobs_output_buffered_bytes",
        "gauge",
        "executor.jobs.buffered_output_bytes",
        "Background job output held.",
    ),
    (
        "sage_code_sessions_live",
        "gauge",
        "executor.code_tools.sessions.live",
        "Live python_session kernels.",
    ),
    (
        "sage_code_sessions_rss_bytes",
        "gauge",
        "executor.code_tools.sessions.rss",
        "Memory of the live python_session kernels.",
    ),
    (
        "sage_code_session_evictions",
        "counter",
        "executor.code_tools.sessions.evictions",
        "python_session kernels closed for idleness or memory.",
    ),
)
# The workers' own counters and histograms (`scheduling.figures`): family, help, labels.
FIGURE_COUNTERS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    figures.LEASE_RECLAIMS: (
        "sage_lease_reclaims",
        "Dead leases the worker ended (the run requeued as a crash, or ended).",
        (),
    ),
    figures.FENCE_REJECTIONS: (
        "sage_fence_rejections",
        "Writes of the worker refused by lease fencing (renew, events, outcome).",
        ("write",),
    ),
    figures.SUSPENSIONS: ("sage_run_suspensions", "Runs the worker suspended, by code.", ("code",)),
    figures.RATE_LIMITED: (
        "sage_worker_rate_limited",
        "Executions ended by a rate limit (the provider's 429 or a bound of the host), by code.",
        ("code",),
    ),
    figures.MODEL_TOKENS: (
        "sage_model_tokens",
        "Tokens the provider reported, by model and type (input, output).",
        ("model", "type"),
    ),
    figures.MCP_CALLS: (
        "sage_mcp_calls",
        "MCP tool calls, by server and outcome (ok, tool_error, timeout, unreachable, …).",
        ("server", "outcome"),
    ),
}
FIGURE_HISTOGRAMS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    figures.START_WAIT: (
        "sage_run_start_wait_seconds",
        "Seconds from a run becoming available (admitted, resumed, requeued) to its claim.",
        ("queue",),
    ),
    figures.EXECUTION: (
        "sage_run_execution_seconds",
        "Seconds from claim to committed outcome, per execution, by outcome.",
        ("outcome",),
    ),
    figures.FIRST_TOKEN: (
        "sage_model_first_token_seconds",
        "Seconds from a model request to its first streamed item.",
        ("model",),
    ),
    figures.MCP_CALL_SECONDS: (
        "sage_mcp_call_seconds",
        "Seconds an MCP tool call took (its wait for a call slot included), by server.",
        ("server",),
    ),
}


def _dig(data: Any, path: list[str]) -> float | None:
    for key in path:
        if not isinstance(data, dict):
            return None
        data = data.get(key)
    return float(data) if isinstance(data, int | float) and not isinstance(data, bool) else None


def _worker_families(now: datetime) -> list[Metric]:
    from scheduling.models import SNAPSHOT_STALE_AFTER, WorkerSnapshot

    stale_after = SNAPSHOT_STALE_AFTER.total_seconds()

    snapshots = list(
        WorkerSnapshot.objects.filter(
            heartbeat_at__gte=now - timedelta(seconds=WORKER_RETENTION_SECONDS)
        )
        .order_by("worker_id")
        .values_list("worker_id", "heartbeat_at", "stopped_at", "capacity")
    )
    live = GaugeMetricFamily(
        "sage_workers_live",
        f"Running workers whose heartbeat is at most {stale_after:g} s old.",
    )
    up = GaugeMetricFamily(
        "sage_worker_up", "1 while the worker runs, 0 once it stopped.", labels=["worker"]
    )
    heartbeat = GaugeMetricFamily(
        "sage_worker_heartbeat_age_seconds",
        "Seconds since the worker's last snapshot, on the database's clock.",
        labels=["worker"],
    )
    kinds = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily}
    capacity_families = [
        (kinds[kind](name, text, labels=["worker"]), path.split("."))
        for name, kind, path, text in SNAPSHOT_FIGURES
    ]
    own = {
        key: CounterMetricFamily(n, h, labels=["worker", *labels])
        for key, (n, h, labels) in FIGURE_COUNTERS.items()
    }
    histograms = {
        key: HistogramMetricFamily(n, h, labels=["worker", *labels])
        for key, (n, h, labels) in FIGURE_HISTOGRAMS.items()
    }
    running = 0
    for worker, beat, stopped, capacity in snapshots:
        age = max((now - beat).total_seconds(), 0.0)
        running += stopped is None and age <= stale_after
        up.add_metric([worker], 0 if stopped else 1)
        heartbeat.add_metric([worker], age)
        for family, path in capacity_families:
            value = _dig(capacity, path)
            if value is not None:
                family.add_metric([worker], value)
        published = (capacity or {}).get("metrics") or {}
        _add_counters(own, worker, published.get("counters") or {})
        _add_histograms(histograms, worker, published.get("histograms") or {})
    live.add_metric([], running)
    families = [family for family, _ in capacity_families]
    return [live, up, heartbeat, *families, *own.values(), *histograms.values()]


def _add_counters(families: dict[str, Metric], worker: str, published: dict[str, Any]) -> None:
    for key, family in families.items():
        labels = FIGURE_COUNTERS[key][2]
        series = published.get(key) or []
        if not labels and not series:
            family.add_metric([worker], 0)  # a plain counter is shown from the start
        for values, value in series:
            family.add_metric([worker, *(str(values.get(n, "")) for n in labels)], value)


def _add_histograms(families: dict[str, Metric], worker: str, published: dict[str, Any]) -> None:
    for key, family in families.items():
        labels = FIGURE_HISTOGRAMS[key][2]
        entry = published.get(key) or {}
        bounds = entry.get("bounds") or []
        for values, data in entry.get("series") or []:
            buckets = [
                (floatToGoString(bound), count)
                for bound, count in zip(bounds, data["buckets"], strict=True)
            ]
            buckets.append(("+Inf", data["count"]))
            family.add_metric(
                [worker, *(str(values.get(n, "")) for n in labels)], buckets, data["sum"]
            )


# ---------------------------------------------------------------- the scrape and the view


class _Scrape:
    """One scrape's collector (``generate_latest`` calls ``collect``)."""

    def collect(self) -> Iterator[Metric]:
        from scheduling.runs import db_now

        now = db_now()
        yield from _run_families(now)
        yield from _worker_families(now)
        yield from counters.families()


def exposition() -> bytes:
    """Every family, in the Prometheus text format (version 0.0.4)."""
    return generate_latest(_Scrape())  # type: ignore[arg-type]


def _refusal(status: int, code: str, message: str, category: ErrorCategory) -> JsonResponse:
    response = JsonResponse(envelope(code, message, category=category), status=status)
    if status == 401:
        response["WWW-Authenticate"] = 'Bearer realm="metrics"'
    return response


def _refused(request: HttpRequest) -> JsonResponse | None:
    """None when the request may read the metrics, else the answer (401 or 403)."""
    scheme, _, credential = request.META.get("HTTP_AUTHORIZATION", "").partition(" ")
    if scheme.lower() == "bearer":
        expected = settings.SAGE.get("SAGE_METRICS_TOKEN") or ""
        given = credential.strip().encode()
        if expected and hmac.compare_digest(given, expected.encode()):
            return None
        return _refusal(401, "auth.required", "invalid metrics token", ErrorCategory.AUTHENTICATION)
    if scheme.lower() == "token":
        from sageproject.authentication import TokenAuthentication

        try:
            authenticated = TokenAuthentication().authenticate(request)
        except drf_exceptions.AuthenticationFailed as exc:
            return _refusal(401, "auth.required", str(exc.detail), ErrorCategory.AUTHENTICATION)
        if authenticated is not None:
            if authenticated[0].is_staff:
                return None
            return _refusal(
                403, "auth.forbidden", "metrics are for staff", ErrorCategory.AUTHORIZATION
            )
    return _refusal(
        401,
        "auth.required",
        "send Authorization: Bearer <SAGE_METRICS_TOKEN> or a staff user's Token",
        ErrorCategory.AUTHENTICATION,
    )


def metrics_view(request: HttpRequest) -> HttpResponse:
    """``GET /metrics`` (see the module text)."""
    if request.method != "GET":
        response = JsonResponse(
            envelope(
                "request.method_not_allowed",
                f'Method "{request.method}" not allowed.',
                category=ErrorCategory.VALIDATION,
            ),
            status=405,
        )
        response["Allow"] = "GET"
        return response
    refused = _refused(request)
    if refused is not None:
        return refused
    return HttpResponse(exposition(), content_type=CONTENT_TYPE_PLAIN_0_0_4)
