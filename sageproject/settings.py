"""Django settings, read from the environment (see docs/DESIGN.md §7 and docs/SETTINGS.md)."""

from __future__ import annotations

import os
import secrets
import warnings
from pathlib import Path

from sageproject import config as sage_config
from sageproject import logs as sage_logs
from sageproject import pgpool

BASE_DIR = Path(__file__).resolve().parent.parent
SAGE_CONFIG = sage_config.load(base_dir=str(BASE_DIR))
SAGE = SAGE_CONFIG.values
LOCAL_DIR = Path(SAGE["SAGE_LOCAL_DIR"])


def _secret_key() -> str:
    """The key from SECRET_KEY, else one generated on first run into a git-ignored file."""
    if os.environ.get("SECRET_KEY"):
        return os.environ["SECRET_KEY"]
    path = LOCAL_DIR / "secret_key"
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        LOCAL_DIR.mkdir(parents=True, exist_ok=True)
        key = secrets.token_urlsafe(50)
        # O_EXCL: two processes starting together must not write two different keys.
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return path.read_text().strip()
        with os.fdopen(fd, "w") as handle:
            handle.write(key)
        return key


SECRET_KEY = _secret_key()
DEBUG = SAGE["DEBUG"]
ALLOWED_HOSTS = [
    h.strip()
    for h in os.environ.get("ALLOWED_HOSTS", "127.0.0.1,localhost,[::1]").split(",")
    if h.strip()
]
CSRF_TRUSTED_ORIGINS = [
    o.strip() for o in os.environ.get("CSRF_TRUSTED_ORIGINS", "").split(",") if o.strip()
]

INSTALLED_APPS = [
    # The admin's site is the host's (sagehost.admin: the capacity page).
    "sagehost.apps.SageAdminConfig",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "rest_framework.authtoken",
    "drf_spectacular",
    "sageproject.apps.SageProjectConfig",
    "pooling",
    "scheduling",
    "agents",
    # The layers above the apps: the host (URLs, web process, admin site, health,
    # metrics, runhost/runweb/doctor) and the benchmarks (manage.py bench_*).
    "sagehost.apps.SageHostConfig",
    "benchmarks",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "sagehost.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]
WSGI_APPLICATION = "sagehost.wsgi.application"
ASGI_APPLICATION = "sagehost.asgi.application"

DATABASES = {"default": SAGE_CONFIG.database}
if os.environ.get("SAGE_TEST_DB_NAME") and "sqlite" not in DATABASES["default"]["ENGINE"]:
    # The test runner names its databases so that parallel runs on one server don't collide
    # (SQLite's test database is a file the configuration names in the temporary directory;
    # the runner's name would put it in the working directory).
    DATABASES["default"].setdefault("TEST", {})["NAME"] = os.environ["SAGE_TEST_DB_NAME"]
if isinstance(_pool := DATABASES["default"].get("OPTIONS", {}).get("pool"), dict):
    # The pool's health check without a round trip per checkout (sageproject.pgpool).
    _pool.setdefault("check", pgpool.check)
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = BASE_DIR / "staticfiles"
# Without collectstatic there is no STATIC_ROOT; the finders serve the files instead.
warnings.filterwarnings("ignore", message="No directory at")
# Serve the admin's CSS straight from the installed apps: `make run` needs no collectstatic.
WHITENOISE_USE_FINDERS = True
WHITENOISE_AUTOREFRESH = DEBUG

DATA_UPLOAD_MAX_MEMORY_SIZE = SAGE["SAGE_MAX_REQUEST_BYTES"]

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "sageproject.authentication.TokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_PAGINATION_CLASS": "sageproject.api.Pagination",
    "PAGE_SIZE": 50,
    "EXCEPTION_HANDLER": "sageproject.api.exception_handler",
    "DEFAULT_SCHEMA_CLASS": "sageproject.schema.AutoSchema",
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"]
    + (["rest_framework.renderers.BrowsableAPIRenderer"] if DEBUG else []),
    # The one validation layer for JSON bodies (NUL, lone surrogates, depth: sageproject.parsers).
    "DEFAULT_PARSER_CLASSES": ["sageproject.parsers.JSONParser"],
    "UNAUTHENTICATED_USER": "django.contrib.auth.models.AnonymousUser",
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Sage Host API",
    "DESCRIPTION": "Run AI-agent Runs on a shared host: sessions, runs, events, archives.",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    # Request bodies as their own components: only writable fields, minLength 1 where blanks
    # are refused, additionalProperties false where unknown fields are (sageproject.schema).
    "COMPONENT_SPLIT_REQUEST": True,
}

SAGE_TOOL_MODULES = [
    m.strip() for m in os.environ.get("SAGE_TOOL_MODULES", "").split(",") if m.strip()
]
SAGE_SKILL_DIRS = [
    d.strip() for d in os.environ.get("SAGE_SKILL_DIRS", "").split(os.pathsep) if d.strip()
]
# Where MCP servers' authorization servers send the browser back: this host's public
# /mcp/oauth/callback (registered with each authorization server as our redirect URI).
SAGE_MCP_OAUTH_REDIRECT_URL = os.environ.get(
    "SAGE_MCP_OAUTH_REDIRECT_URL", "http://localhost:8000/mcp/oauth/callback"
).strip()

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    # SAGE_LOG_FORMAT: plain lines, or one JSON object per line (sageproject.logs).
    "formatters": {"sage": sage_logs.formatter_config(SAGE["SAGE_LOG_FORMAT"])},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "sage"}},
    "root": {"handlers": ["console"], "level": os.environ.get("LOG_LEVEL", "INFO")},
    "loggers": {"django.server": {"level": "WARNING"}},
}
