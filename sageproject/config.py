"""Configuration read from the environment and validated once.

Django-free on purpose: ``manage.py`` and the ASGI entry point validate before Django
starts, so that a bad value stops start-up with one clear line instead of a traceback, and
the system check ``sageproject.E001`` reports the same problems under ``manage.py check``.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit


@dataclass(frozen=True, slots=True, kw_only=True)
class Limit:
    """One integer ``SAGE_*`` setting: its default and the smallest value allowed."""

    name: str
    default: int | None
    minimum: int
    maximum: int | None = None
    # Settings that accept the word ``none`` to switch a mechanism off.
    allow_none: bool = False
    meaning: str = ""


LIMITS: tuple[Limit, ...] = (
    Limit(
        name="SAGE_SERVER_MAX_MODEL_CLIENTS",
        default=64,
        minimum=1,
        meaning="model SDK client instances in the pool",
    ),
    Limit(
        name="SAGE_SERVER_MAX_CONCURRENT_RUNS",
        default=8,
        minimum=1,
        meaning="executing root runs, all users",
    ),
    Limit(
        name="SAGE_SERVER_MAX_CONCURRENT_RUNS_PER_USER",
        default=2,
        minimum=1,
        meaning="executing root runs per user",
    ),
    Limit(
        name="SAGE_SERVER_MAX_PENDING_RUNS",
        default=1024,
        minimum=1,
        meaning="queued runs, all users",
    ),
    Limit(
        name="SAGE_SERVER_MAX_PENDING_RUNS_PER_USER",
        default=256,
        minimum=1,
        meaning="queued runs of one user, so one user cannot fill the host's queue",
    ),
    Limit(
        name="SAGE_SERVER_MAX_MANAGED_APPLICATIONS",
        default=32,
        minimum=1,
        meaning="resident Applications",
    ),
    Limit(
        name="SAGE_MAX_CONCURRENT_MODEL_CALLS",
        default=8,
        minimum=1,
        meaning="model calls running at once",
    ),
    Limit(
        name="SAGE_MAX_WAITING_MODEL_CALLS",
        default=128,
        minimum=0,
        meaning="model calls waiting for a slot",
    ),
    Limit(
        name="SAGE_MODEL_QUEUE_TIMEOUT_SECONDS",
        default=60,
        minimum=1,
        meaning="seconds a model call may wait for a slot",
    ),
    Limit(
        name="SAGE_AUTO_RELEASE_IDLE_SECONDS",
        default=300,
        minimum=0,
        allow_none=True,
        meaning="idle seconds before an Application may be released automatically",
    ),
    Limit(name="SAGE_LEASE_SECONDS", default=30, minimum=2, meaning="run lease length"),
    Limit(name="SAGE_HEARTBEAT_SECONDS", default=10, minimum=1, meaning="run lease renewal period"),
    Limit(
        name="SAGE_MAX_RUN_ATTEMPTS",
        default=3,
        minimum=1,
        meaning="executions of one run before it is failed",
    ),
    Limit(
        name="SAGE_SHUTDOWN_GRACE_SECONDS",
        default=10,
        minimum=0,
        meaning="seconds running runs get to finish on shutdown",
    ),
    Limit(
        name="SAGE_STORE_WRITERS",
        default=1,
        minimum=1,
        maximum=64,
        meaning="database writer connections for event commits",
    ),
    Limit(
        name="SAGE_MAX_REQUEST_BYTES",
        default=1_048_576,
        minimum=1024,
        meaning="largest accepted request body",
    ),
)

BOOLEANS: dict[str, bool] = {
    "SAGE_REQUIRE_READINESS": False,
    "SAGE_CODE_TOOLS": False,
    "DEBUG": False,
}

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


@dataclass(slots=True)
class Config:
    values: dict[str, Any] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    database: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, name: str) -> Any:
        return self.values[name]


def _parse_limit(limit: Limit, raw: str | None) -> tuple[int | None, str | None]:
    if raw is None or raw.strip() == "":
        return limit.default, None
    text = raw.strip()
    if limit.allow_none and text.lower() == "none":
        return None, None
    rule = f"an integer ≥ {limit.minimum}"
    if limit.maximum is not None:
        rule = f"an integer from {limit.minimum} to {limit.maximum}"
    if limit.allow_none:
        rule += " or 'none'"
    try:
        value = int(text)
    except ValueError:
        return None, f"{limit.name} must be {rule} (got {raw!r})"
    if value < limit.minimum or (limit.maximum is not None and value > limit.maximum):
        return None, f"{limit.name} must be {rule} (got {raw!r})"
    return value, None


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
        pool = query.pop("pool", "1").lower() in _TRUE
        if pool:
            options["pool"] = {"min_size": 1, "max_size": int(query.pop("pool_max", "20"))}
        options.update(query)
        return {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": unquote(parts.path.lstrip("/")) or "postgres",
            "USER": unquote(parts.username or ""),
            "PASSWORD": unquote(parts.password or ""),
            "HOST": parts.hostname or "",
            "PORT": str(parts.port or ""),
            "OPTIONS": options,
            "CONN_MAX_AGE": 0,
            # The pool checks a connection before handing it out: after a database restart
            # no caller gets a dead one.
            "CONN_HEALTH_CHECKS": True,
        }
    if scheme in {"mysql", "mariadb"}:
        return {
            "ENGINE": "django.db.backends.mysql",
            "NAME": unquote(parts.path.lstrip("/")) or "test",
            "USER": unquote(parts.username or "root"),
            "PASSWORD": unquote(parts.password or ""),
            "HOST": parts.hostname or "127.0.0.1",
            "PORT": str(parts.port or "3306"),
            "OPTIONS": {"charset": "utf8mb4", "isolation_level": "read committed", **query},
            "TEST": {"CHARSET": "utf8mb4", "COLLATION": "utf8mb4_unicode_ci"},
            "CONN_MAX_AGE": 60,
            "CONN_HEALTH_CHECKS": True,
        }
    raise ValueError(
        f"DATABASE_URL must start with sqlite://, postgres:// or mysql:// (got {scheme or url!r}://)"
    )


def load(environ: Mapping[str, str] | None = None, *, base_dir: str = ".") -> Config:
    """Read and check every setting; problems are collected in ``Config.errors``."""
    env = os.environ if environ is None else environ
    config = Config()
    for limit in LIMITS:
        value, error = _parse_limit(limit, env.get(limit.name))
        config.values[limit.name] = value if error is None else limit.default
        if error:
            config.errors.append(error)
    for name, default in BOOLEANS.items():
        raw = env.get(name)
        if raw is None:
            config.values[name] = default
        elif raw.strip().lower() in _TRUE:
            config.values[name] = True
        elif raw.strip().lower() in _FALSE:
            config.values[name] = False
        else:
            config.values[name] = default
            config.errors.append(f"{name} must be 1/0, true/false, yes/no or on/off (got {raw!r})")
    heartbeat = config.values["SAGE_HEARTBEAT_SECONDS"]
    lease = config.values["SAGE_LEASE_SECONDS"]
    if heartbeat and lease and heartbeat * 2 > lease:
        config.errors.append(
            f"SAGE_HEARTBEAT_SECONDS ({heartbeat}) must be at most half of "
            f"SAGE_LEASE_SECONDS ({lease})"
        )
    if (
        config.values["SAGE_SERVER_MAX_CONCURRENT_RUNS_PER_USER"]
        > config.values["SAGE_SERVER_MAX_CONCURRENT_RUNS"]
    ):
        config.errors.append(
            "SAGE_SERVER_MAX_CONCURRENT_RUNS_PER_USER must not exceed "
            "SAGE_SERVER_MAX_CONCURRENT_RUNS"
        )
    url = env.get("DATABASE_URL", "").strip() or "sqlite:///db.sqlite3"
    try:
        config.database = parse_database_url(url, base_dir=base_dir)
    except ValueError as exc:
        config.errors.append(str(exc))
        config.database = parse_database_url("sqlite:///db.sqlite3", base_dir=base_dir)
    redis_url = env.get("REDIS_URL", "").strip() or None
    if redis_url and not redis_url.startswith(("redis://", "rediss://", "unix://")):
        config.errors.append(
            f"REDIS_URL must start with redis://, rediss:// or unix:// (got {redis_url!r})"
        )
        redis_url = None
    config.values["REDIS_URL"] = redis_url
    return config


def exit_on_errors(config: Config, *, program: str = "sage") -> None:
    """Print one line per problem to stderr and exit 2 when there is any."""
    if config.errors:
        for error in config.errors:
            print(f"{program}: configuration error: {error}", file=sys.stderr)
        raise SystemExit(2)
