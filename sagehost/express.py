"""The web process's express lane: the API's busiest request, answered without the
middleware chain and DRF's request cycle — with the answer they would give.

A run submission (``POST /api/v1/runs/``) spends about two thirds of its web-process CPU
in Django's middleware chain and DRF's request cycle (content negotiation, parser choice,
authenticator chain, permission and throttle checks, response finalisation), not in what
it does. A request that qualifies (below) is served here from the same parts: the route's
own function (`agents.api.runs.submit`: the DRF view's `submit_run`), the API's token
authentication, JSON parser, renderer and exception handler (every error the same
envelope), and the response passed through the ``process_response`` of the security and
clickjacking middleware as configured. Anything else goes through the full stack:

- a qualifying request is ``POST`` to a route of `routes`, with an
  ``Authorization: Token <key>`` that authenticates (a missing, unknown or inactive token
  goes the long way, which answers 401 as always), a body of ``Content-Type:
  application/json`` (UTF-8), no query string, an ``Accept`` the JSON renderer satisfies
  plainly (none, ``*/*``, ``application/json``) and a host ``ALLOWED_HOSTS`` allows;
- the lane is off (every request takes the full stack) when ``MIDDLEWARE`` holds anything
  beyond the known list below — a middleware it does not know might change the answer;
  and it does nothing the known ones would do for such a request: no session or message
  is read (the token authenticates), the views are CSRF-exempt, static files are not
  asked for, and a request that `SecurityMiddleware` would redirect, or that
  `CommonMiddleware` would refuse or redirect, goes the long way.

The token is authenticated from the process's cache of token rows
(`TokenAuthentication.authenticate_cached`), and the route hands the request's `Credential`
to the admission, which checks it again in its own transaction. A request is answered here
only once its credential has been checked: by the admission, or — for a request that ended
before (a malformed body, a priority the cached user may not give) — by a query of its own
before its error is answered. A refused credential (a token deleted meanwhile, say) sends
the request the long way, which looks the token up afresh and answers as DRF does.

What it leaves out are the request signals (``request_started``/``request_finished``);
the database connection is given back after each request as those signals would.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.core.exceptions import DisallowedHost, PermissionDenied
from django.db import close_old_connections
from django.http import HttpRequest, HttpResponse, HttpResponseBase
from django.utils.log import log_response
from django.utils.module_loading import import_string
from rest_framework import exceptions
from rest_framework.renderers import JSONRenderer
from rest_framework.response import Response

from sageproject.authentication import TokenAuthentication
from sageproject.credentials import Credential, CredentialRefused, check_credential

logger = logging.getLogger("sage.web")

# The middleware the lane knows, by what it does to a token-authenticated JSON POST to the
# API: looks at it before the view (a redirect or a refusal sends it the long way), adds
# headers to its response (applied here, in MIDDLEWARE order), or nothing at all (see the
# module text). Any other middleware turns the lane off.
REQUEST_CHECKS = {
    "django.middleware.security.SecurityMiddleware",
    "django.middleware.common.CommonMiddleware",
}
RESPONSE_HEADERS = {
    "django.middleware.security.SecurityMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
}
NOTHING_TO_DO = {
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
}
KNOWN_MIDDLEWARE = REQUEST_CHECKS | RESPONSE_HEADERS | NOTHING_TO_DO
ACCEPTS = {b"", b"*/*", b"application/json"}

# A route: the request, its authenticated user and the `Credential` the admission is to
# check in, the answer (a DRF ``Response``, to be rendered as the API renders it) out. It
# may raise whatever the DRF view would.
Route = Callable[[HttpRequest, Any, Credential], Response]


def routes() -> dict[str, tuple[Route, str]]:
    """The express routes: path → (function, the ``Allow`` header DRF answers there)."""
    from agents.api.runs import submit

    return {"/api/v1/runs/": (submit, "GET, POST, HEAD, OPTIONS")}


def _no_view(request: HttpRequest) -> HttpResponse:  # pragma: no cover - never called
    raise AssertionError("middleware used only for its request and response hooks")


class Express:
    """The lane of one web process (see the module text)."""

    def __init__(self) -> None:
        self.routes = routes()
        names = list(settings.MIDDLEWARE)
        self.checks = [import_string(n)(_no_view) for n in names if n in REQUEST_CHECKS]
        self.headers = [
            import_string(n)(_no_view) for n in reversed(names) if n in RESPONSE_HEADERS
        ]
        self.renderer = JSONRenderer()
        self.authenticator = TokenAuthentication()

    @classmethod
    def configured(cls) -> Express | None:
        """The lane, or None when ``MIDDLEWARE`` holds one it does not know."""
        unknown = [name for name in settings.MIDDLEWARE if name not in KNOWN_MIDDLEWARE]
        if unknown:
            logger.info("express lane off: unknown middleware %s", ", ".join(unknown))
            return None
        return cls()

    def route(self, scope: dict[str, Any]) -> tuple[Route, str] | None:
        """The route for this request, when its method, path and headers qualify."""
        if scope["method"] != "POST" or scope.get("query_string") or scope.get("root_path"):
            return None
        route = self.routes.get(scope["path"])
        if route is None:
            return None
        authorization = content_type = None
        accept = b""
        for name, value in scope["headers"]:
            name = name.lower()
            if name == b"authorization":
                authorization = value
            elif name == b"content-type":
                content_type = value.replace(b" ", b"").lower()
            elif name == b"accept":
                accept = value.strip()
        if content_type not in (b"application/json", b"application/json;charset=utf-8"):
            return None
        if accept not in ACCEPTS or authorization is None:
            return None
        # Only a glance (the body is not read for other credentials); the header's rules
        # are DRF's, applied by the authenticator.
        if not authorization.lower().startswith(b"token "):
            return None
        return route

    def _holds(self, credential: Credential, key: str) -> bool:
        """Whether a request that ended in an error may have it answered here: its
        admission checked the credential, or the credential holds now (the error came
        first: a malformed body, say)."""
        if credential.checked:
            return True
        try:
            check_credential(credential)
        except CredentialRefused:
            self.authenticator.forget(key)
            return False
        except Exception:  # the database is down, say: the long way answers as DRF does
            return False
        return True

    def answer(self, route: tuple[Route, str], request: HttpRequest) -> HttpResponseBase | None:
        """The response, or None to send the request the long way. On a request thread;
        gives the thread's database connection back after."""
        try:
            return self._answer(route, request)
        finally:
            close_old_connections()

    def _answer(self, route: tuple[Route, str], request: HttpRequest) -> HttpResponseBase | None:
        try:
            request.get_host()
            if any(check.process_request(request) is not None for check in self.checks):
                return None
        except (DisallowedHost, PermissionDenied):
            return None
        function, allow = route
        credential = None
        try:
            authenticated = self.authenticator.authenticate_cached(request)
            if authenticated is None:
                return None
            request.user, token, credential = authenticated
            answer = function(request, request.user, credential)
        except exceptions.AuthenticationFailed:
            return None  # the long way answers 401, with its header
        except CredentialRefused:
            self.authenticator.forget(token.key)
            return None  # the long way looks the token up again
        except Exception as exc:  # a database outage, say: the envelope, as DRF gives it
            if credential is not None and not self._holds(credential, token.key):
                return None  # the long way looks the token up again
            from sageproject.api import exception_handler

            answer = exception_handler(exc, {"request": request, "view": None})
        response = HttpResponse(
            self.renderer.render(answer.data),
            status=answer.status_code,
            content_type="application/json",
        )
        for name, value in answer.items():  # Retry-After, say; the content type is set above
            if name.lower() != "content-type":
                response[name] = value
        response["Allow"] = allow
        response["Content-Length"] = str(len(response.content))  # as CommonMiddleware does
        for middleware in self.headers:
            response = middleware.process_response(request, response)
        if response.status_code >= 400:
            log_response(
                "%s: %s", response.reason_phrase, request.path, response=response, request=request
            )
        return response
