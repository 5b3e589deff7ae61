"""Configuration read from the environment and validated once.

Django-free on purpose: ``manage.py`` and the ASGI entry point validate before Django
starts, so that a bad value stops start-up with one clear line instead of a traceback, and
the system checks report the same problems under ``manage.py check``. Each rule has its own
check id (``sageproject.E0xx``), written next to the rule and never renumbered: a new rule
takes a new id. Processes that load no Django settings (Celery job workers) call ``load``
themselves.
"""

from __future__ import annotations

import ipaddress
import os
import re
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import SplitResult, parse_qs, unquote, urlsplit


@dataclass(frozen=True, slots=True, kw_only=True)
class Limit:
    """One integer ``SAGE_*`` setting: its default, the values allowed and its check id."""

    name: str
    check_id: str
    default: int | None
    minimum: int
    maximum: int | None = None
    # Settings that accept the word ``none`` to switch a mechanism off.
    allow_none: bool = False
    meaning: str = ""

    @property
    def rule(self) -> str:
        """The values allowed, as error messages and docs/SETTINGS.md say them."""
        rule = f"an integer ≥ {self.minimum}"
        if self.maximum is not None:
            rule = f"an integer from {self.minimum} to {self.maximum}"
        if self.allow_none:
            rule += " or 'none'"
        return rule


LIMITS: tuple[Limit, ...] = (
    Limit(
        name="SAGE_SERVER_MAX_MODEL_CLIENTS",
        check_id="sageproject.E001",
        default=64,
        minimum=1,
        meaning="model SDK client instances in the pool",
    ),
    Limit(
        name="SAGE_SERVER_MAX_CONCURRENT_RUNS",
        check_id="sageproject.E002",
        default=8,
        minimum=1,
        meaning="executing root runs, all users",
    ),
    Limit(
        name="SAGE_SERVER_MAX_CONCURRENT_RUNS_PER_USER",
        check_id="sageproject.E003",
        default=2,
        minimum=1,
        meaning="executing root runs per user",
    ),
    Limit(
        name="SAGE_SERVER_MAX_PENDING_RUNS",
        check_id="sageproject.E004",
        default=1024,
        minimum=1,
        meaning="queued runs, all users; beyond: 429 `scheduler.queue_full`",
    ),
    Limit(
        name="SAGE_SERVER_MAX_PENDING_RUNS_PER_USER",
        check_id="sageproject.E005",
        default=256,
        minimum=1,
        meaning="queued runs of one user (429 `scheduler.queue_full` with "
        "`details.max_pending_per_user`): one user cannot lock everyone else out of admission",
    ),
    Limit(
        name="SAGE_SERVER_MAX_MANAGED_APPLICATIONS",
        check_id="sageproject.E006",
        default=32,
        minimum=1,
        meaning="resident Applications",
    ),
    Limit(
        name="SAGE_MAX_CONCURRENT_MODEL_CALLS",
        check_id="sageproject.E007",
        default=8,
        minimum=1,
        meaning="model calls running at once (the budget's limit)",
    ),
    Limit(
        name="SAGE_MAX_WAITING_MODEL_CALLS",
        check_id="sageproject.E008",
        default=128,
        minimum=0,
        meaning="model calls waiting for a slot (the budget's max_waiting)",
    ),
    Limit(
        name="SAGE_MODEL_QUEUE_TIMEOUT_SECONDS",
        check_id="sageproject.E009",
        default=60,
        minimum=1,
        meaning="seconds a model call may wait for a slot",
    ),
    Limit(
        name="SAGE_AUTO_RELEASE_IDLE_SECONDS",
        check_id="sageproject.E010",
        default=300,
        minimum=0,
        allow_none=True,
        meaning="idle seconds before a resident Application is released automatically; "
        "`none` disables, 0 releases at once",
    ),
    Limit(
        name="SAGE_LEASE_SECONDS",
        check_id="sageproject.E011",
        default=30,
        minimum=2,
        meaning="run lease length",
    ),
    Limit(
        name="SAGE_HEARTBEAT_SECONDS",
        check_id="sageproject.E012",
        default=10,
        minimum=1,
        meaning="run lease renewal period (at most half the lease)",
    ),
    Limit(
        name="SAGE_MAX_RUN_ATTEMPTS",
        check_id="sageproject.E013",
        default=3,
        minimum=1,
        meaning="crashes (executions whose worker died) of one run before "
        "`execution.worker_restarted`; suspensions and graceful restarts do not count",
    ),
    Limit(
        name="SAGE_SHUTDOWN_GRACE_SECONDS",
        check_id="sageproject.E014",
        default=10,
        minimum=0,
        meaning="seconds running runs get on SIGTERM before they are requeued",
    ),
    Limit(
        name="SAGE_STORE_WRITERS",
        check_id="sageproject.E015",
        default=1,
        minimum=1,
        maximum=64,
        meaning="writer connections of the session store (event group commits)",
    ),
    Limit(
        name="SAGE_MAX_REQUEST_BYTES",
        check_id="sageproject.E016",
        default=1_048_576,
        minimum=1024,
        meaning="largest accepted request body",
    ),
    Limit(
        name="SAGE_WORKER_CONCURRENT_RUNS",
        check_id="sageproject.E017",
        default=None,
        minimum=1,
        meaning="runs one worker process executes at once (its slots; `runworker "
        "--max-concurrent` overrides it); unset: `SAGE_SERVER_MAX_CONCURRENT_RUNS`, the "
        "global limit shared among the live workers",
    ),
    Limit(
        name="SAGE_JOB_LOST_SECONDS",
        check_id="sageproject.E018",
        default=30,
        minimum=3,
        meaning="on Celery job workers: a running job reports its worker alive every third "
        "of this; one silent that long is failed with `job.worker_lost`",
    ),
    Limit(
        name="SAGE_LANGGRAPH_STREAM_SECONDS",
        check_id="sageproject.E090",
        default=300,
        minimum=1,
        maximum=3600,
        meaning="seconds a `/lg/` run stream stays open; the SDK then reconnects with "
        "`Last-Event-ID` and loses nothing",
    ),
    Limit(
        name="SAGE_MCP_MAX_SESSIONS",
        check_id="sageproject.E081",
        default=64,
        minimum=1,
        meaning="open MCP client sessions per worker, one per (user, server, credentials); "
        "the least recently used idle one is closed for a new one, and when all are in "
        "use a run suspends with `mcp.session_pool_full`",
    ),
    Limit(
        name="SAGE_MCP_MAX_CALLS_PER_USER",
        check_id="sageproject.E082",
        default=4,
        minimum=1,
        meaning="MCP tool calls of one user running at once per worker; a call waits for a "
        "slot up to its server's `timeout_seconds`",
    ),
    Limit(
        name="SAGE_MCP_MAX_OUTPUT_BYTES",
        check_id="sageproject.E083",
        default=65536,
        minimum=1024,
        meaning="an MCP tool result's UTF-8 bytes the model sees; beyond, it is cut with a "
        "marker saying so",
    ),
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Boolean:
    """One on/off setting (1/0, true/false, yes/no, on/off): its default and its check id."""

    name: str
    check_id: str
    default: bool = False
    meaning: str = ""


BOOLEANS: tuple[Boolean, ...] = (
    Boolean(
        name="SAGE_REQUIRE_READINESS",
        check_id="sageproject.E020",
        meaning="strict readiness for saves and new runs",
    ),
    Boolean(
        name="SAGE_CODE_TOOLS",
        check_id="sageproject.E021",
        meaning="enables the code tools (`python`, `python_session`) and the `python_script` "
        "job kind (a Celery job worker reads its own)",
    ),
    Boolean(name="DEBUG", check_id="sageproject.E022", meaning="Django's debug mode"),
    Boolean(
        name="SAGE_OTEL_CAPTURE_CONTENT",
        check_id="sageproject.E023",
        meaning="records message content (instructions, messages, tool arguments and "
        "results) on the OpenTelemetry spans (`agents/tracing.py`)",
    ),
    Boolean(
        name="SAGE_PG_HELD_PIPELINE",
        check_id="sageproject.E024",
        default=True,
        meaning="PostgreSQL: a pipelined transaction's statements are held and sent in one "
        "write (`sageproject.db.pipelined`, which overrides psycopg 3.3.9's private pipeline "
        "methods); off: psycopg's own pipeline, the same statements and results in more "
        "writes",
    ),
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Described:
    """A setting with a rule of its own (below), or read outside this module (``read_by``):
    what docs/SETTINGS.md says of it. ``check_ids`` are its rules' ids; ``default`` is as
    the table shows it."""

    name: str
    default: str
    rule: str
    meaning: str
    check_ids: tuple[str, ...] = ()
    read_by: str = ""


# The rules that are not one integer's or one boolean's own, each with its id for good.
CHECK_HEARTBEAT_WITHIN_LEASE = "sageproject.E030"
CHECK_PER_USER_RUNS_WITHIN_ALL = "sageproject.E031"
CHECK_DATABASE_URL = "sageproject.E040"
CHECK_REDIS_URL = "sageproject.E041"
CHECK_JOB_RUNTIME = "sageproject.E050"
CHECK_JOB_RUNTIME_BROKER = "sageproject.E051"
CHECK_JOB_RUNNER_MODULES = "sageproject.E052"
CHECK_JOBS_REDIS_URL = "sageproject.E053"
CHECK_LOG_FORMAT = "sageproject.E060"
CHECK_METRICS_TOKEN = "sageproject.E070"
CHECK_METRICS_DIR = "sageproject.E071"
CHECK_MCP_ALLOWED_HOSTS = "sageproject.E080"
CHECK_LANGGRAPH_CORS_ORIGINS = "sageproject.E091"
# The rules between two integers, shown on the first one's row of docs/SETTINGS.md.
CROSS_RULES: dict[str, tuple[str, str]] = {
    "SAGE_HEARTBEAT_SECONDS": (CHECK_HEARTBEAT_WITHIN_LEASE, "at most half of SAGE_LEASE_SECONDS"),
    "SAGE_SERVER_MAX_CONCURRENT_RUNS_PER_USER": (
        CHECK_PER_USER_RUNS_WITHIN_ALL,
        "at most SAGE_SERVER_MAX_CONCURRENT_RUNS",
    ),
}

# Every other setting, for docs/SETTINGS.md (`settings_table`): those this module reads
# by rules of their own, then those read elsewhere (Django's settings, the fault points).
DESCRIBED: tuple[Described, ...] = (
    Described(
        name="DATABASE_URL",
        default="`sqlite:///db.sqlite3`",
        rule="starts with `sqlite://`, `postgres://` or `mysql://`",
        check_ids=(CHECK_DATABASE_URL,),
        meaning="the database; on PostgreSQL `?pool=0` disables Django's psycopg pool, "
        "`?pool_max=N` sizes it, `?prepared=0` turns prepared statements off (a pooler "
        "that cannot keep them); other query parameters are libpq's",
    ),
    Described(
        name="REDIS_URL",
        default="unset",
        rule="starts with `redis://`, `rediss://` or `unix://`",
        check_ids=(CHECK_REDIS_URL,),
        meaning="enables wake-ups and live fan-out over Redis (other databases than "
        "PostgreSQL), and is the Celery broker",
    ),
    Described(
        name="SAGE_JOB_RUNTIME",
        default="auto",
        rule="`memory` or `celery`; `celery` needs `REDIS_URL`",
        check_ids=(CHECK_JOB_RUNTIME, CHECK_JOB_RUNTIME_BROKER),
        meaning="the background job runtime (default: Celery when `REDIS_URL` is set)",
    ),
    Described(
        name="SAGE_JOB_RUNNER_MODULES",
        default="unset",
        rule="Python module names, comma-separated",
        check_ids=(CHECK_JOB_RUNNER_MODULES,),
        meaning="modules a Celery job worker imports at start; they register their runners "
        "(`agents.jobs.tasks.register_runner`)",
    ),
    Described(
        name="SAGE_JOBS_REDIS_URL",
        default="unset",
        rule="starts with `redis://`, `rediss://` or `unix://`",
        check_ids=(CHECK_JOBS_REDIS_URL,),
        meaning="Redis of job state and output when it is not the broker's (`REDIS_URL`); "
        "set alike on job workers and the worker that submits",
    ),
    Described(
        name="SAGE_LOG_FORMAT",
        default="plain",
        rule="`plain` or `json`",
        check_ids=(CHECK_LOG_FORMAT,),
        meaning="`json`: one JSON object per log line with `run_id`/`session_id`/`worker_id` "
        "where known (`sageproject.logs`)",
    ),
    Described(
        name="SAGE_METRICS_TOKEN",
        default="unset",
        rule="at least 16 printable characters without spaces (never echoed)",
        check_ids=(CHECK_METRICS_TOKEN,),
        meaning="bearer token of `GET /metrics`; unset: staff API tokens only",
    ),
    Described(
        name="SAGE_METRICS_DIR",
        default="`.local/metrics`",
        rule="an absolute path",
        check_ids=(CHECK_METRICS_DIR,),
        meaning="directory of the web processes' counter files (one per host)",
    ),
    Described(
        name="SAGE_LANGGRAPH_CORS_ORIGINS",
        default="unset",
        rule="origins (`https://ui.example.com`: scheme, host and port only), "
        "comma-separated, or `*`",
        check_ids=(CHECK_LANGGRAPH_CORS_ORIGINS,),
        meaning="origins whose browser pages may call `/lg/` (agent-chat-ui on another "
        "origin); preflights answered, `Content-Location`/`Location` exposed",
    ),
    Described(
        name="SAGE_MCP_ALLOWED_HOSTS",
        default="unset",
        rule="host names or IP addresses, each with an optional `:port` (`[::1]:8080` for "
        "IPv6), comma-separated",
        check_ids=(CHECK_MCP_ALLOWED_HOSTS,),
        meaning="the hosts a remote MCP server's URL may reach over plain `http` or at a "
        "loopback, link-local or private address (`sageproject.outbound`); a host without a "
        "port is allowed on every port; unset: `https` to public addresses only",
    ),
    Described(
        name="SAGE_LOCAL_DIR",
        default="`.local`",
        rule="a directory",
        meaning="the host's own files: the generated secret key, the wake-up and live "
        "sockets of the embedded default (the web and worker processes of a host must "
        "share it), the metrics files; a relative path is taken from the project directory",
    ),
    Described(
        name="SAGE_TOOL_MODULES",
        default="unset",
        rule="module names, comma-separated",
        read_by="sageproject/settings.py",
        meaning="modules exposing `TOOLS: list[Tool]`",
    ),
    Described(
        name="SAGE_SKILL_DIRS",
        default="unset",
        rule="directories, path-separator separated",
        read_by="sageproject/settings.py",
        meaning="skill directories",
    ),
    Described(
        name="SAGE_MCP_OAUTH_REDIRECT_URL",
        default="`http://localhost:8000/mcp/oauth/callback`",
        rule="this host's public URL of `/mcp/oauth/callback`",
        read_by="sageproject/settings.py",
        meaning="the redirect URI registered with MCP servers' OAuth authorization servers: "
        "where the user's browser comes back after approving",
    ),
    Described(
        name="SECRET_KEY",
        default="generated",
        rule="any string",
        read_by="sageproject/settings.py",
        meaning="Django's; unset, one is generated once into `.local/secret_key`; model "
        "credentials are encrypted with a key derived from it",
    ),
    Described(
        name="ALLOWED_HOSTS",
        default="`127.0.0.1,localhost,[::1]`",
        rule="host names, comma-separated",
        read_by="sageproject/settings.py",
        meaning="Django's",
    ),
    Described(
        name="CSRF_TRUSTED_ORIGINS",
        default="unset",
        rule="origins, comma-separated",
        read_by="sageproject/settings.py",
        meaning="Django's",
    ),
    Described(
        name="LOG_LEVEL",
        default="INFO",
        rule="a logging level",
        read_by="sageproject/settings.py",
        meaning="the root logger's level",
    ),
    Described(
        name="HOST / PORT",
        default="127.0.0.1 / 8000",
        rule="an address / a port",
        read_by="`manage.py runweb`, `runhost`",
        meaning="where the web server listens (`--host`, `--port` override them)",
    ),
    Described(
        name="SAGE_CRASH_AT",
        default="unset",
        rule="`<point>[:<n>]`",
        read_by="scheduling/faults.py",
        meaning="tests only: the process SIGKILLs itself the n-th time it reaches the "
        "fault point (`claim.*`, `start.*`, `append.*`, `suspend.*`, `finish.*`, "
        "`tool.started`); never set it in production",
    ),
    Described(
        name="SAGE_STOP_AT",
        default="unset",
        rule="`<point>[:<n>]`",
        read_by="scheduling/faults.py",
        meaning="tests only: as `SAGE_CRASH_AT`, but the process SIGSTOPs itself",
    ),
)

JOB_RUNTIMES = ("memory", "celery")
# libpq's network timeouts on PostgreSQL (DATABASE_URL query parameters override them).
PG_NETWORK_DEFAULTS = {
    "connect_timeout": 5,
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "tcp_user_timeout": 10000,
}
# psycopg prepares a statement after this many executions: never by count, only the
# statements executed with ``prepare=True`` (see ``prepared`` in `parse_database_url`).
PREPARE_EXPLICIT_ONLY = 2**31 - 1
LOG_FORMATS = ("plain", "json")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}
_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
# A DNS name: dot-separated labels of letters, digits and inner hyphens (IDNA's ``xn--``).
_HOST_NAME = re.compile(r"(?!-)[a-z0-9-]{1,63}(?<!-)(\.(?!-)[a-z0-9-]{1,63}(?<!-))*")


@dataclass(frozen=True, slots=True)
class Problem:
    """A value that breaks a rule: the rule's check id and one line naming the variable."""

    check_id: str
    message: str


@dataclass(slots=True)
class Config:
    values: dict[str, Any] = field(default_factory=dict)
    errors: list[Problem] = field(default_factory=list)
    database: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, name: str) -> Any:
        return self.values[name]

    def report(self, check_id: str, message: str) -> None:
        self.errors.append(Problem(check_id, message))


def _parse_limit(limit: Limit, raw: str | None) -> tuple[int | None, str | None]:
    if raw is None or raw.strip() == "":
        return limit.default, None
    text = raw.strip()
    if limit.allow_none and text.lower() == "none":
        return None, None
    rule = limit.rule
    try:
        value = int(text)
    except ValueError:
        return None, f"{limit.name} must be {rule} (got {raw!r})"
    if value < limit.minimum or (limit.maximum is not None and value > limit.maximum):
        return None, f"{limit.name} must be {rule} (got {raw!r})"
    return value, None


def _server_entry(
    parts: SplitResult, backend: str, *, name: str, user: str, host: str, port: str
) -> dict[str, Any]:
    """The connection fields of a database server's URL; the arguments are the defaults."""
    return {
        "ENGINE": f"django.db.backends.{backend}",
        "NAME": unquote(parts.path.lstrip("/")) or name,
        "USER": unquote(parts.username or user),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": parts.hostname or host,
        "PORT": str(parts.port or port),
    }


def parse_database_url(url: str, *, base_dir: str) -> dict[str, Any]:
    """Turn ``DATABASE_URL`` into a Django ``DATABASES['default']`` entry.

    Raises ``ValueError`` with a one-line reason for a URL it cannot use.
    """
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    if scheme == "sqlite":
        path = unquote(url[len("sqlite://") :]).split("?", 1)[0]
        if path.startswith("/") and not path.startswith("//"):
            path = path[1:] or "db.sqlite3"  # sqlite:///db.sqlite3 → relative file
        elif path.startswith("//"):
            path = path[1:]  # sqlite:////abs/path → /abs/path
        if path == ":memory:":
            name = ":memory:"
        else:
            name = path if os.path.isabs(path) else os.path.join(base_dir, path)
        return {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": name,
            "OPTIONS": {
                # WAL lets the web process read while the worker writes; the busy
                # timeout and IMMEDIATE transactions make two writers queue instead of
                # failing with "database is locked" on lock upgrade. synchronous=FULL
                # syncs the WAL at every commit, so an answered write survives a power
                # loss (NORMAL would only survive a process crash).
                "timeout": 30,
                "transaction_mode": "IMMEDIATE",
                "init_command": (
                    "PRAGMA journal_mode=WAL;PRAGMA synchronous=FULL;"
                    "PRAGMA foreign_keys=ON;PRAGMA busy_timeout=30000;"
                ),
            },
            # Tests use a file (not shared-cache memory): the worker's threads then get
            # real WAL concurrency with busy waits instead of table-lock errors.
            # One connection per thread for the process's life: reopening costs the PRAGMAs.
            "CONN_MAX_AGE": None,
            "TEST": {
                "NAME": os.path.join(tempfile.gettempdir(), f"sage-test-{os.getpid()}.sqlite3")
            },
        }
    if scheme in {"postgres", "postgresql", "pgsql"}:
        # A backend idle inside a transaction (its process frozen or wedged) would keep
        # its row locks, and with them every other worker's claims, until it died.
        options: dict[str, Any] = {"options": "-c idle_in_transaction_session_timeout=15000"}
        # Across a network a lost peer must show as an error, not as a hang: a connection
        # attempt gives up after 5 s, data the server has not acknowledged for 10 s drops
        # the connection, and an idle one is probed after 10 s. (A worker cut off from the
        # database then retries, and sees its fenced writes refused once it is back.)
        options.update(PG_NETWORK_DEFAULTS)
        pool = query.pop("pool", "1").lower() in _TRUE
        if pool:
            options["pool"] = {"min_size": 1, "max_size": int(query.pop("pool_max", "20"))}
        # The run path's own statements (admission, claim, group commit) are prepared once
        # per connection and then only bound and run: planning them costs more than running
        # them. Django's queries are never prepared (client-side binding). ``prepared=0``
        # turns them off for a pooler that cannot keep prepared statements.
        prepared = query.pop("prepared", "1").lower() in _TRUE
        options["prepare_threshold"] = PREPARE_EXPLICIT_ONLY if prepared else None
        if prepared:
            # ... and always run on the plan made once (a generic plan). Left to choose,
            # PostgreSQL compared each execution's estimated cost with the generic plan's.
            # For the claim it went on planning every call once its statistics saw many
            # queued runs, and planning cost more than running. The generic plans run no
            # slower (docs/PERFORMANCE.md). Django's
            # queries are never prepared (nothing changes for them); the foreign-key
            # checks' cached plans are key lookups, generic either way.
            options["options"] += " -c plan_cache_mode=force_generic_plan"
        options.update(query)
        return {
            **_server_entry(parts, "postgresql", name="postgres", user="", host="", port=""),
            "OPTIONS": options,
            "CONN_MAX_AGE": 0,
            # The pool checks a connection before handing it out: after a database restart
            # no caller gets a dead one.
            "CONN_HEALTH_CHECKS": True,
        }
    if scheme in {"mysql", "mariadb"}:
        return {
            **_server_entry(
                parts, "mysql", name="test", user="root", host="127.0.0.1", port="3306"
            ),
            "OPTIONS": {"charset": "utf8mb4", "isolation_level": "read committed", **query},
            "TEST": {"CHARSET": "utf8mb4", "COLLATION": "utf8mb4_unicode_ci"},
            "CONN_MAX_AGE": 60,
            "CONN_HEALTH_CHECKS": True,
        }
    raise ValueError(
        f"DATABASE_URL must start with sqlite://, postgres:// or mysql:// (got {scheme or url!r}://)"
    )


def load(environ: Mapping[str, str] | None = None, *, base_dir: str = ".") -> Config:
    """Read and check every setting; problems are collected in ``Config.errors``.

    A value that breaks its rule is reported and replaced by its default.
    """
    env = os.environ if environ is None else environ
    config = Config()
    _read_limits(env, config)
    _read_booleans(env, config)
    _check_run_limits(config)
    _read_database(env, config, base_dir=base_dir)
    config.values["REDIS_URL"] = _read_redis_url(env, config, "REDIS_URL", CHECK_REDIS_URL)
    _read_jobs(env, config)
    config.values["SAGE_LOG_FORMAT"] = _log_format(env, config)
    _read_metrics(env, config)
    config.values["SAGE_LANGGRAPH_CORS_ORIGINS"] = _cors_origins(env, config)
    config.values["SAGE_MCP_ALLOWED_HOSTS"] = _host_list(
        env, config, "SAGE_MCP_ALLOWED_HOSTS", CHECK_MCP_ALLOWED_HOSTS
    )
    # The host's own files: the generated secret key, the local sockets of wake-ups and
    # live deltas (a host's web and worker processes must share it), metrics files.
    local = env.get("SAGE_LOCAL_DIR", "").strip() or ".local"
    config.values["SAGE_LOCAL_DIR"] = os.path.join(base_dir, local)  # relative: to the project
    return config


def _read_limits(env: Mapping[str, str], config: Config) -> None:
    for limit in LIMITS:
        value, error = _parse_limit(limit, env.get(limit.name))
        config.values[limit.name] = value if error is None else limit.default
        if error:
            config.report(limit.check_id, error)


def _read_booleans(env: Mapping[str, str], config: Config) -> None:
    for boolean in BOOLEANS:
        value, error = _parse_boolean(boolean, env.get(boolean.name))
        config.values[boolean.name] = value
        if error:
            config.report(boolean.check_id, error)


def _parse_boolean(boolean: Boolean, raw: str | None) -> tuple[bool, str | None]:
    if raw is None:
        return boolean.default, None
    text = raw.strip().lower()
    if text in _TRUE:
        return True, None
    if text in _FALSE:
        return False, None
    return (
        boolean.default,
        f"{boolean.name} must be 1/0, true/false, yes/no or on/off (got {raw!r})",
    )


def _check_run_limits(config: Config) -> None:
    heartbeat = config.values["SAGE_HEARTBEAT_SECONDS"]
    lease = config.values["SAGE_LEASE_SECONDS"]
    if heartbeat and lease and heartbeat * 2 > lease:
        config.report(
            CHECK_HEARTBEAT_WITHIN_LEASE,
            f"SAGE_HEARTBEAT_SECONDS ({heartbeat}) must be at most half of "
            f"SAGE_LEASE_SECONDS ({lease})",
        )
    if (
        config.values["SAGE_SERVER_MAX_CONCURRENT_RUNS_PER_USER"]
        > config.values["SAGE_SERVER_MAX_CONCURRENT_RUNS"]
    ):
        config.report(
            CHECK_PER_USER_RUNS_WITHIN_ALL,
            "SAGE_SERVER_MAX_CONCURRENT_RUNS_PER_USER must not exceed "
            "SAGE_SERVER_MAX_CONCURRENT_RUNS",
        )


def _read_database(env: Mapping[str, str], config: Config, *, base_dir: str) -> None:
    url = env.get("DATABASE_URL", "").strip() or "sqlite:///db.sqlite3"
    try:
        config.database = parse_database_url(url, base_dir=base_dir)
    except ValueError as exc:
        config.report(CHECK_DATABASE_URL, str(exc))
        config.database = parse_database_url("sqlite:///db.sqlite3", base_dir=base_dir)


def _read_redis_url(env: Mapping[str, str], config: Config, name: str, check_id: str) -> str | None:
    """A Redis URL setting, ``None`` when unset (or invalid, which is reported)."""
    url = env.get(name, "").strip() or None
    if url and not url.startswith(_REDIS_SCHEMES):
        config.report(
            check_id, f"{name} must start with redis://, rediss:// or unix:// (got {url!r})"
        )
        return None
    return url


def _read_jobs(env: Mapping[str, str], config: Config) -> None:
    """The background job settings: the runtime, the runner modules, the jobs' Redis."""
    config.values["SAGE_JOB_RUNTIME"] = _job_runtime(env, config)
    config.values["SAGE_JOB_RUNNER_MODULES"] = _module_names(
        env, config, "SAGE_JOB_RUNNER_MODULES", CHECK_JOB_RUNNER_MODULES
    )
    config.values["SAGE_JOBS_REDIS_URL"] = _read_redis_url(
        env, config, "SAGE_JOBS_REDIS_URL", CHECK_JOBS_REDIS_URL
    )


def _job_runtime(env: Mapping[str, str], config: Config) -> str:
    """``memory`` or ``celery``: as ``SAGE_JOB_RUNTIME`` says, else Celery when Redis is set."""
    redis_url = config.values["REDIS_URL"]
    automatic = "celery" if redis_url else "memory"
    choice = env.get("SAGE_JOB_RUNTIME", "").strip().lower()
    if not choice:
        return automatic
    if choice not in JOB_RUNTIMES:
        config.report(
            CHECK_JOB_RUNTIME,
            f"SAGE_JOB_RUNTIME must be one of {', '.join(JOB_RUNTIMES)} (got {choice!r})",
        )
        return automatic
    if choice == "celery" and not redis_url:
        config.report(
            CHECK_JOB_RUNTIME_BROKER, "SAGE_JOB_RUNTIME=celery needs REDIS_URL (the Celery broker)"
        )
        return automatic
    return choice


def _log_format(env: Mapping[str, str], config: Config) -> str:
    """``plain`` (the default) or ``json``: one JSON object per log line (sageproject.logs)."""
    choice = env.get("SAGE_LOG_FORMAT", "").strip().lower() or "plain"
    if choice not in LOG_FORMATS:
        config.report(
            CHECK_LOG_FORMAT,
            f"SAGE_LOG_FORMAT must be one of {', '.join(LOG_FORMATS)} (got {choice!r})",
        )
        return "plain"
    return choice


def _read_metrics(env: Mapping[str, str], config: Config) -> None:
    """``SAGE_METRICS_TOKEN`` (the bearer token of ``GET /metrics``; unset: staff API tokens
    only) and ``SAGE_METRICS_DIR`` (the web processes' counter files; unset: ``.local/metrics``).
    A refused token is never echoed."""
    token = env.get("SAGE_METRICS_TOKEN", "").strip() or None
    if token is not None and (len(token) < 16 or not token.isprintable() or " " in token):
        config.report(
            CHECK_METRICS_TOKEN,
            "SAGE_METRICS_TOKEN must be at least 16 printable characters without spaces",
        )
        token = None
    config.values["SAGE_METRICS_TOKEN"] = token
    directory = env.get("SAGE_METRICS_DIR", "").strip() or None
    if directory is not None and not os.path.isabs(directory):
        config.report(
            CHECK_METRICS_DIR, f"SAGE_METRICS_DIR must be an absolute path (got {directory!r})"
        )
        directory = None
    config.values["SAGE_METRICS_DIR"] = directory


def _cors_origins(env: Mapping[str, str], config: Config) -> tuple[str, ...]:
    """``SAGE_LANGGRAPH_CORS_ORIGINS``: the browser origins (``https://ui.example.com``,
    comma-separated; ``*`` for any) whose pages may call the LangGraph API under ``/lg/``.
    Empty by default: no cross-origin access."""
    raw = env.get("SAGE_LANGGRAPH_CORS_ORIGINS", "")
    origins = tuple(o.strip().rstrip("/") for o in raw.split(",") if o.strip())
    for origin in origins:
        parts = urlsplit(origin)
        if origin != "*" and (
            parts.scheme not in ("http", "https")
            or not parts.hostname
            or parts.path
            or parts.query
            or parts.fragment
            or parts.username is not None
        ):
            config.report(
                CHECK_LANGGRAPH_CORS_ORIGINS,
                "SAGE_LANGGRAPH_CORS_ORIGINS must list origins like https://ui.example.com "
                f"(scheme, host and port only), comma-separated, or * (got {origin!r})",
            )
            return ()
    return origins


def parse_host(entry: str) -> tuple[str, int | None]:
    """One entry of an allowed-hosts setting: ``host``, ``host:port`` or ``[v6]:port``.

    Returns the host in canonical form (lower case, no trailing dot, an IP address as
    ``ipaddress`` writes it) and the port, or None for every port. Raises ``ValueError``
    with a one-line reason.
    """
    text = entry.strip().lower()
    if any(c in text for c in "/@?#"):
        raise ValueError(f"{entry!r} is not a host (write no scheme, user or path)")
    host, port = text, None
    if text.startswith("["):
        host, bracket, rest = text[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            raise ValueError(f"{entry!r} is not a host")
        port = rest[1:] if rest else None
    elif text.count(":") == 1:
        host, port = text.split(":")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        host = host.rstrip(".")
        if not _HOST_NAME.fullmatch(host):
            raise ValueError(f"{entry!r} is not a host name or an IP address") from None
    else:
        host = str(address)
    if port is None:
        return host, None
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{entry!r} has no valid port")
    return host, int(port)


def _host_list(env: Mapping[str, str], config: Config, name: str, check_id: str) -> tuple[str, ...]:
    """An allowed-hosts setting (``SAGE_MCP_ALLOWED_HOSTS``): comma-separated entries for
    ``parse_host``, empty when unset. One bad entry empties the list: a typo must not
    leave a half-list that the operator believes whole."""
    raw = env.get(name, "")
    entries = [e.strip() for e in raw.split(",") if e.strip()]
    for entry in entries:
        try:
            parse_host(entry)
        except ValueError as exc:
            config.report(
                check_id,
                f"{name} must list host names or IP addresses, each with an optional :port, "
                f"comma-separated ({exc})",
            )
            return ()
    return tuple(entries)


def _module_names(
    env: Mapping[str, str], config: Config, name: str, check_id: str
) -> tuple[str, ...]:
    """A comma-separated list of dotted Python module names (empty when unset)."""
    raw = env.get(name, "")
    modules = tuple(m.strip() for m in raw.split(",") if m.strip())
    if not all(part.isidentifier() for module in modules for part in module.split(".")):
        config.report(check_id, f"{name} must be comma-separated Python module names (got {raw!r})")
        return ()
    return modules


def exit_on_errors(config: Config, *, program: str = "sage") -> None:
    """Print one line per problem to stderr and exit 2 when there is any."""
    if config.errors:
        for error in config.errors:
            print(f"{program}: configuration error: {error.message}", file=sys.stderr)
        raise SystemExit(2)


# ------------------------------------------------------------------ docs/SETTINGS.md

SETTINGS_DOC_HEADER = (
    "# Settings\n\n"
    "<!-- Generated from sageproject/config.py: do not edit. Regenerate with\n"
    "     python -m sageproject.config --markdown > docs/SETTINGS.md -->\n\n"
    "Every setting Sage Host reads from the environment. An invalid value stops start-up "
    "with one line\nnaming the variable and the rule; `manage.py check` reports the same "
    "under the rule's check id.\n\n"
)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def settings_table() -> str:
    """docs/SETTINGS.md: one Markdown row per setting (variable, default, rule and its
    check ids, meaning), rendered from the declarations above."""
    rows = ["| variable | default | rule (check id) | meaning |", "| --- | --- | --- | --- |"]

    def row(name: str, default: str, rule: str, ids: list[str], meaning: str) -> None:
        checks = ", ".join(f"`{i}`" for i in ids)
        rule_cell = f"{rule} ({checks})" if checks else rule
        rows.append(f"| `{name}` | {_cell(default)} | {_cell(rule_cell)} | {_cell(meaning)} |")

    for limit in LIMITS:
        rule, ids = limit.rule, [limit.check_id]
        if limit.name in CROSS_RULES:
            cross_id, cross = CROSS_RULES[limit.name]
            rule, ids = f"{rule}; {cross}", [limit.check_id, cross_id]
        default = "unset" if limit.default is None else str(limit.default)
        row(limit.name, default, rule, ids, limit.meaning)
    for boolean in BOOLEANS:
        default = "on" if boolean.default else "off"
        row(
            boolean.name,
            default,
            "1/0, true/false, yes/no or on/off",
            [boolean.check_id],
            boolean.meaning,
        )
    for described in DESCRIBED:
        meaning = described.meaning
        if described.read_by:
            meaning += f" (read by {described.read_by})"
        row(described.name, described.default, described.rule, list(described.check_ids), meaning)
    return SETTINGS_DOC_HEADER + "\n".join(rows) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] != ["--markdown"]:
        raise SystemExit("usage: python -m sageproject.config --markdown > docs/SETTINGS.md")
    sys.stdout.write(settings_table())
