"""The admin site: Django's, plus the capacity page operators watch (``/admin/capacity/``).

The capacity page groups the figures into cards — runs, model calls, model clients,
Applications, jobs, code tools, workers — summed over the live workers' last snapshots
(``WorkerSnapshot.objects.live()``, see ``scheduling.worker.Worker.capacity`` and
``agents.executor.RunExecutor.capacity`` for the keys) and the database's counts, and
charts queue depth and active runs over the last hour from the capacity history
(``scheduling.samples``), drawn as inline SVG on the server (``sageproject.charts``).
Each worker's every figure stays one click away ("All figures").
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.contrib import admin
from django.contrib.auth import get_user_model
from django.db.models import Count
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import path

from sageproject.admin_display import duration
from sageproject.charts import PALETTE, line_chart

# The charts' window.
CHART_SECONDS = 3600


def _rows(value: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """Flatten nested capacity JSON into (dotted name, scalar) rows for a table."""
    rows: list[tuple[str, Any]] = []
    if isinstance(value, dict):
        for key, item in value.items():
            if key in ("history", "resident"):
                continue  # drawn as a chart / its own table, not listed
            rows += _rows(item, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        for index, item in enumerate(value):
            rows += _rows(item, f"{prefix}[{index}]")
    else:
        rows.append((prefix, value))
    return rows


def _get(data: Any, *keys: str, default: Any = None) -> Any:
    """``data[k1][k2]...``, or ``default`` where a level is missing or not a dict."""
    for key in keys:
        if not isinstance(data, dict) or key not in data:
            return default
        data = data[key]
    return data


def _num(value: Any) -> float:
    return value if isinstance(value, int | float) and not isinstance(value, bool) else 0


class _Fleet:
    """The live workers' capacity snapshots, read as one: totals, the newest's values."""

    def __init__(self, capacities: list[dict]) -> None:
        self.caps = capacities
        self.newest = capacities[0] if capacities else {}

    def total(self, *keys: str) -> int:
        return int(sum(_num(_get(c, *keys)) for c in self.caps))

    def latest(self, *keys: str, default: Any = None) -> Any:
        return _get(self.newest, *keys, default=default)

    def labels(self, *keys: str) -> str:
        """The distinct values of a key across the workers, or a dash."""
        found = {str(v) for c in self.caps if (v := _get(c, *keys)) not in (None, "")}
        return ", ".join(sorted(found)) or "—"


def _meter(used: float, limit: float) -> dict[str, Any] | None:
    """A filled bar: ``percent`` of ``limit`` used, and ``level`` (``high`` ≥ 75 %, ``full``)."""
    if not limit:
        return None
    percent = max(0.0, min(100.0, used / limit * 100))
    return {
        "percent": round(percent, 1),
        "level": "full" if used >= limit else "high" if percent >= 75 else "",
    }


def _figure(label: str, value: Any, of: Any = None) -> dict[str, Any]:
    return {"label": label, "value": value, "of": of}


def _resident(capacity: Any) -> list[dict[str, Any]]:
    """The management service's resident Applications of a worker snapshot."""
    rows = _get(capacity, "executor", "management", "resident", default=[])
    return [row for row in rows if isinstance(row, dict)] if isinstance(rows, list) else []


def _usernames(ids: set[Any]) -> dict[Any, Any]:
    """User ids (ints, or digits as JSON keys) → usernames; other keys map to themselves."""
    numeric = {int(i) for i in ids if str(i).isdigit()}
    names = dict(get_user_model().objects.filter(pk__in=numeric).values_list("pk", "username"))
    return {i: names.get(int(i), i) if str(i).isdigit() else i for i in ids}


def _pool_charts(workers: list[dict]) -> list[dict[str, Any]]:
    """Each code-tool pool's ``history`` (``[[t, created, in_use], ...]``, the pool's own
    clock) as a chart of its last hour, per worker."""
    charts = []
    for worker in workers:
        pools = _get(worker["capacity"], "executor", "code_tools", "pools", default={})
        for name, pool in (pools or {}).items():
            history = _get(pool, "history", default=[])
            if not isinstance(history, list) or not history:
                continue
            last = history[-1][0]
            chart = line_chart(
                [
                    {"name": "created", "points": [(s[0] - last, s[1]) for s in history]},
                    {
                        "name": "in use",
                        "points": [(s[0] - last, s[2]) for s in history],
                        "fill": True,
                    },
                ],
                span=CHART_SECONDS,
                gap=CHART_SECONDS,  # the pool records changes, not a steady rate
                limit=_num(pool.get("max")) or None,
                limit_label="max",
            )
            charts.append(
                {
                    "title": f"Code tools: {name} interpreters",
                    "worker": worker["snapshot"].worker_id,
                    "chart": chart,
                }
            )
    return charts


def _history_charts(samples: list, now, max_concurrent: int) -> list[dict[str, Any]]:
    """Queue depth and active runs over the last hour, from the capacity samples: the
    total (filled) and, when there is more than one queue, a line per queue (the same
    colour in both charts)."""
    from scheduling.samples import SAMPLE_SECONDS

    queues = sorted({q for s in samples for q in (s.per_queue or {})})

    def series(total: str, figure: str, color: str) -> list[dict[str, Any]]:
        """``total`` (a sample's field) and each queue's ``figure`` (its per-queue key)."""
        lines = [
            {
                "name": f"{total}, all",
                "fill": True,
                "color": color,
                "points": [((s.time - now).total_seconds(), getattr(s, total)) for s in samples],
            }
        ]
        for index, queue in enumerate(queues if len(queues) > 1 else []):
            lines.append(
                {
                    "name": queue,
                    "color": PALETTE[2 + index % (len(PALETTE) - 2)],
                    "points": [
                        (
                            (s.time - now).total_seconds(),
                            _num(_get(s.per_queue, queue, figure, default=0)),
                        )
                        for s in samples
                    ],
                }
            )
        return lines

    gap = SAMPLE_SECONDS * 3
    return [
        {
            "title": "Queue depth",
            "subtitle": "queued root runs, last hour",
            "chart": line_chart(
                series("queued", "pending", PALETTE[0]), span=CHART_SECONDS, gap=gap
            ),
        },
        {
            "title": "Active runs",
            "subtitle": "executing root runs, last hour",
            "chart": line_chart(
                series("active", "active", PALETTE[1]),
                span=CHART_SECONDS,
                gap=gap,
                limit=max_concurrent,
            ),
        },
    ]


def _card(key: str, title: str, figures: list, rows: list, **extra: Any) -> dict[str, Any]:
    return {"key": key, "title": title, "figures": figures, "rows": rows, **extra}


def _runs_card(fleet: _Fleet, counts: dict[str, int]) -> dict[str, Any]:
    sage = settings.SAGE
    limit = sage["SAGE_SERVER_MAX_CONCURRENT_RUNS"]
    per_queue = fleet.latest("runs", "per_queue", default={}) or {}
    per_user = fleet.latest("runs", "per_user", default={}) or {}
    names = _usernames(set(per_user))
    busiest = sorted(
        per_user.items(),
        key=lambda kv: (-_num(_get(kv[1], "active")), -_num(_get(kv[1], "pending"))),
    )[:5]
    rows = [(f"queue {name}", v) for name, v in sorted(per_queue.items())]
    rows += [(f"user {names.get(user, user)}", v) for user, v in busiest]
    return _card(
        "runs",
        "Runs",
        [
            _figure("running", counts["running"], limit),
            _figure("queued", counts["queued"], sage["SAGE_SERVER_MAX_PENDING_RUNS"]),
            _figure("suspended", counts["suspended"]),
        ],
        [
            ("per user at most", sage["SAGE_SERVER_MAX_CONCURRENT_RUNS_PER_USER"]),
            ("completed by live workers", fleet.total("runs", "completed")),
        ],
        meter=_meter(counts["running"], limit),
        table={
            "head": ["queue / user", "active", "queued"],
            "rows": [
                (name, _get(v, "active", default=0), _get(v, "pending", default=0))
                for name, v in rows
            ],
        }
        if rows
        else None,
    )


def _model_cards(fleet: _Fleet) -> list[dict[str, Any]]:
    calls = ("executor", "model_calls")
    clients = ("executor", "model_clients")
    timeout = fleet.latest(*calls, "wait_timeout_seconds", default="—")
    return [
        _card(
            "model-calls",
            "Model calls",
            [
                _figure("active", fleet.total(*calls, "active"), fleet.total(*calls, "limit")),
                _figure(
                    "waiting", fleet.total(*calls, "waiting"), fleet.total(*calls, "max_waiting")
                ),
            ],
            [
                ("rejected (queue full)", fleet.total(*calls, "rejected")),
                ("timed out waiting", fleet.total(*calls, "timed_out")),
                ("wait timeout", f"{timeout} s"),
            ],
            meter=_meter(fleet.total(*calls, "active"), fleet.total(*calls, "limit")),
        ),
        _card(
            "model-clients",
            "Model clients",
            [
                _figure(
                    "pooled", fleet.total(*clients, "clients"), fleet.total(*clients, "max_clients")
                ),
                _figure("leased", fleet.total(*clients, "active_leases")),
            ],
            [
                ("closing", fleet.total(*clients, "closing_clients")),
                ("constructed since start", fleet.total(*clients, "constructions")),
            ],
            meter=_meter(fleet.total(*clients, "clients"), fleet.total(*clients, "max_clients")),
        ),
    ]


def _applications_card(fleet: _Fleet) -> dict[str, Any]:
    apps = ("executor", "management")
    idle_age = fleet.latest(*apps, "automatic_idle_age")
    return _card(
        "applications",
        "Applications",
        [
            _figure("resident", fleet.total(*apps, "applications"), fleet.total(*apps, "limit")),
            _figure("in use", fleet.total(*apps, "leased_applications")),
            _figure("building", fleet.total(*apps, "building")),
        ],
        [
            ("draining", fleet.total(*apps, "draining")),
            ("built since start", fleet.total(*apps, "builds_started")),
            ("released since start", fleet.total(*apps, "releases")),
            ("released when idle for", "never" if idle_age is None else f"{idle_age} s"),
        ],
        meter=_meter(fleet.total(*apps, "applications"), fleet.total(*apps, "limit")),
        link=("release idle (safe)…", "admin:agents_reclamationrequest_release_idle"),
    )


def _jobs_card(fleet: _Fleet, jobs: dict[str, int]) -> dict[str, Any]:
    return _card(
        "jobs",
        "Jobs",
        [
            _figure("running", jobs.get("running", 0)),
            _figure("waiting", jobs.get("created", 0)),
            _figure("stopping", jobs.get("stopping", 0)),
        ],
        [
            ("runtime", fleet.labels("executor", "jobs", "runtime")),
            ("cancels pending", jobs.get("cancel_requested", 0)),
        ],
        link=("job list", "admin:agents_jobrecord_changelist"),
    )


def _code_tools_card(fleet: _Fleet) -> dict[str, Any]:
    tools = ("executor", "code_tools")
    columns = ("in_use", "created", "max", "waiting", "spares")
    pools: dict[str, dict[str, int]] = {}
    for cap in fleet.caps:
        for name, pool in (_get(cap, *tools, "pools", default={}) or {}).items():
            total = pools.setdefault(name, dict.fromkeys(columns, 0))
            for column in columns:
                total[column] += int(_num(_get(pool, column)))
    enabled = any(_get(c, *tools, "enabled") for c in fleet.caps)
    kernels = fleet.total(*tools, "sessions", "live")
    max_kernels = fleet.total(*tools, "sessions", "max_live")
    return _card(
        "code-tools",
        "Code tools",
        [
            _figure(
                "interpreters in use",
                sum(p["in_use"] for p in pools.values()),
                sum(p["created"] for p in pools.values()),
            ),
            _figure("session kernels", kernels, max_kernels),
        ],
        [
            ("enabled", "yes" if enabled else "no (SAGE_CODE_TOOLS=0)"),
            ("kernels evicted", fleet.total(*tools, "sessions", "evictions")),
        ],
        meter=_meter(kernels, max_kernels) if enabled else None,
        table={
            "head": ["pool", "in use", "created", "max", "waiting", "spares"],
            "rows": [(name, *(p[c] for c in columns)) for name, p in sorted(pools.items())],
        }
        if pools
        else None,
    )


def _workers_card(fleet: _Fleet, workers: list[dict]) -> dict[str, Any]:
    stale = sum(1 for w in workers if w["stale"])
    return _card(
        "workers",
        "Workers",
        [
            _figure("live", len(workers) - stale),
            _figure("silent", stale),
            _figure("executing", fleet.total("runs", "active")),
        ],
        [
            ("claims since start", fleet.total("scheduler", "claims")),
            ("claim errors", fleet.total("scheduler", "claim_errors")),
            (
                "event commits / transactions",
                f"{fleet.total('store', 'commits')} / {fleet.total('store', 'transactions')}",
            ),
            ("event commits refused", fleet.total("store", "rejected")),
            ("leases lost", fleet.total("scheduler", "leases_lost")),
            ("wake-up channel", fleet.labels("scheduler", "wakeups", "channel")),
            (
                "live deltas sent / dropped",
                f"{fleet.total('scheduler', 'live', 'sent')}"
                f" / {fleet.total('scheduler', 'live', 'dropped')}",
            ),
            (
                "web processes stuck (live socket full)",
                fleet.total("scheduler", "live", "congested"),
            ),
        ],
        workers=True,
    )


def _cards(workers: list[dict], counts: dict[str, int], jobs: dict[str, int]) -> list[dict]:
    """The capacity cards, each ``{"key", "title", "figures", "rows"}`` and optionally
    ``meter``, ``table``, ``link``, ``workers`` (the workers' table)."""
    fleet = _Fleet([w["capacity"] for w in workers])
    return [
        _runs_card(fleet, counts),
        *_model_cards(fleet),
        _applications_card(fleet),
        _jobs_card(fleet, jobs),
        _code_tools_card(fleet),
        _workers_card(fleet, workers),
    ]


class SageAdminSite(admin.AdminSite):
    site_header = "Sage Host administration"
    site_title = "Sage Host"
    index_title = "Operations"
    # Lists get the whole width (readable at 1400 px); the breadcrumbs and the index lead
    # everywhere the sidebar did.
    enable_nav_sidebar = False

    def get_urls(self):
        return [
            path("capacity/", self.admin_view(self.capacity_view), name="capacity"),
            path("mcp/", self.admin_view(self.mcp_view), name="mcp"),
            *super().get_urls(),
        ]

    def mcp_view(self, request: HttpRequest) -> HttpResponse:
        """Remote MCP servers: which active package versions use which (and how many users
        connected each: never a secret), and the live workers' recent calls."""
        from agents.mcp.transport import normalize_server_url
        from agents.models import AgentPackage, McpConnection
        from scheduling.models import WorkerSnapshot

        connected = dict(
            McpConnection.objects.live()
            .values_list("server_url")
            .annotate(n=Count("pk"))
            .order_by()
        )
        servers = []
        for package in AgentPackage.objects.filter(active=True).select_related("owner"):
            for agent_id, agent in (package.manifest.get("agents") or {}).items():
                for server in agent.get("mcp_servers") or ():
                    try:
                        url = normalize_server_url(server["url"])
                    except Exception:  # a manifest saved before a rule changed
                        url = str(server.get("url"))
                    servers.append(
                        {
                            "package": package,
                            "agent": agent_id,
                            "name": server.get("name"),
                            "url": url,
                            "allowed": ", ".join(server.get("allowed_tools") or ()) or "all",
                            "approval": server.get("approval", "never"),
                            "connections": connected.get(url, 0),
                        }
                    )
        calls = []
        for snapshot in WorkerSnapshot.objects.live():
            capacity = snapshot.capacity if isinstance(snapshot.capacity, dict) else {}
            for call in _get(capacity, "executor", "mcp_sessions", "recent", default=[]) or ():
                if isinstance(call, dict):
                    calls.append({**call, "worker": snapshot.worker_id})
        calls.sort(key=lambda c: str(c.get("at", "")), reverse=True)
        calls = calls[:100]
        names = _usernames({c.get("owner") for c in calls})
        for call in calls:
            call["owner_name"] = names.get(call.get("owner"), call.get("owner"))
        context = {
            **self.each_context(request),
            "title": "MCP servers",
            "servers": servers,
            "calls": calls,
            "connections": sum(connected.values()),
        }
        return TemplateResponse(request, "admin/mcp.html", context)

    def capacity_view(self, request: HttpRequest) -> HttpResponse:
        from agents.jobs.records import unfinished
        from agents.models import JobRecord
        from scheduling import samples
        from scheduling.models import SNAPSHOT_STALE_AFTER, Run, RunStatus, WorkerSnapshot
        from scheduling.runs import db_now

        # Heartbeats are written with the database's clock: ages are read on it too.
        now = db_now()
        workers = []
        for snapshot in WorkerSnapshot.objects.live():
            capacity = snapshot.capacity if isinstance(snapshot.capacity, dict) else {}
            workers.append(
                {
                    "snapshot": snapshot,
                    "capacity": capacity,
                    "stale": now - snapshot.heartbeat_at > SNAPSHOT_STALE_AFTER,
                    "up": duration(snapshot.started_at, now),
                    "heartbeat_age": duration(snapshot.heartbeat_at, now),
                    "rows": _rows(capacity),
                    "resident": _resident(capacity),
                    "active": _get(capacity, "runs", "active", default=0),
                    "claims": _get(capacity, "scheduler", "claims", default=0),
                    "claim_errors": _get(capacity, "scheduler", "claim_errors", default=0),
                    "error": _get(capacity, "scheduler", "permanent_error")
                    or _get(capacity, "scheduler", "last_claim_error"),
                }
            )
        # Snapshots carry owner ids; show operators the usernames.
        names = _usernames({app.get("owner") for w in workers for app in w["resident"]})
        for worker in workers:
            for app in worker["resident"]:
                app["owner_name"] = names.get(app.get("owner"), app.get("owner"))
        counts = {
            status: Run.objects.filter(status=status).count()
            for status in (RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.SUSPENDED)
        }
        unfinished_jobs = unfinished(JobRecord.objects.all())
        jobs = dict(unfinished_jobs.values_list("state").annotate(n=Count("pk")).order_by())
        jobs["cancel_requested"] = unfinished_jobs.filter(cancel_requested=True).count()
        history = samples.history(CHART_SECONDS, now=now)
        context = {
            **self.each_context(request),
            "title": "Capacity",
            "workers": workers,
            "counts": counts,
            "cards": _cards(workers, counts, jobs),
            "charts": _history_charts(
                history, now, settings.SAGE["SAGE_SERVER_MAX_CONCURRENT_RUNS"]
            ),
            "pool_charts": _pool_charts(workers),
            "samples": len(history),
            "sample_seconds": samples.SAMPLE_SECONDS,
        }
        return TemplateResponse(request, "admin/capacity.html", context)
