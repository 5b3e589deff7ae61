"""Shared API plumbing: the one exception handler, pagination and plain JSON error pages."""

from __future__ import annotations

import logging
from typing import Any

from django.conf import settings
from django.core.exceptions import PermissionDenied, RequestDataTooBig
from django.db import connection
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import redirect
from rest_framework import exceptions as drf_exceptions
from rest_framework import status as http
from rest_framework.pagination import PageNumberPagination
from rest_framework.response import Response

from sageproject.errors import ErrorCategory, SageError, envelope

logger = logging.getLogger("sage.api")


class Pagination(PageNumberPagination):
    page_size = 50
    page_size_query_param = "page_size"
    max_page_size = 100


def _flatten(detail: Any) -> Any:
    """DRF's ErrorDetail tree → plain lists and dicts of strings."""
    if isinstance(detail, dict):
        return {str(k): _flatten(v) for k, v in detail.items()}
    if isinstance(detail, list):
        return [_flatten(v) for v in detail]
    return str(detail)


def _summary(fields: Any) -> str:
    if isinstance(fields, dict) and fields:
        name, problems = next(iter(fields.items()))
        first = problems[0] if isinstance(problems, list) and problems else problems
        if isinstance(first, dict):
            return f"{name}: {_summary(first)}"
        return f"{name}: {first}" if name != "non_field_errors" else str(first)
    if isinstance(fields, list) and fields:
        return str(fields[0])
    return "invalid request"


def sage_error_response(error: SageError) -> Response:
    response = Response(error.to_dict(), status=error.http_status)
    if error.category == ErrorCategory.RATE_LIMITED:
        retry_after = error.details.get("retry_after") or 1
        response["Retry-After"] = str(max(1, int(float(retry_after) + 0.999)))
    return response


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """Render every error as the DESIGN §5 envelope."""
    if isinstance(exc, SageError):
        return sage_error_response(exc)
    if isinstance(exc, RequestDataTooBig):
        body = envelope(
            "request.too_large",
            "request body is larger than this host accepts",
            category=ErrorCategory.VALIDATION,
            details={"max_bytes": settings.DATA_UPLOAD_MAX_MEMORY_SIZE},
        )
        return Response(body, status=http.HTTP_413_REQUEST_ENTITY_TOO_LARGE)
    if isinstance(exc, Http404):
        exc = drf_exceptions.NotFound()
    elif isinstance(exc, PermissionDenied):
        exc = drf_exceptions.PermissionDenied()
    if isinstance(exc, drf_exceptions.ParseError):
        body = envelope(
            "request.malformed",
            f"malformed request body: {exc.detail}",
            category=ErrorCategory.VALIDATION,
        )
        return Response(body, status=http.HTTP_400_BAD_REQUEST)
    if isinstance(exc, drf_exceptions.ValidationError):
        fields = _flatten(exc.detail)
        body = envelope(
            "request.invalid",
            _summary(fields),
            category=ErrorCategory.VALIDATION,
            details={"fields": fields},
        )
        return Response(body, status=http.HTTP_400_BAD_REQUEST)
    if isinstance(exc, drf_exceptions.NotAuthenticated | drf_exceptions.AuthenticationFailed):
        body = envelope("auth.required", str(exc.detail), category=ErrorCategory.AUTHENTICATION)
        response = Response(body, status=http.HTTP_401_UNAUTHORIZED)
        response["WWW-Authenticate"] = 'Token realm="api"'
        return response
    if isinstance(exc, drf_exceptions.PermissionDenied):
        body = envelope("auth.forbidden", str(exc.detail), category=ErrorCategory.AUTHORIZATION)
        return Response(body, status=http.HTTP_403_FORBIDDEN)
    if isinstance(exc, drf_exceptions.NotFound):
        body = envelope("not_found", "not found", category=ErrorCategory.NOT_FOUND)
        return Response(body, status=http.HTTP_404_NOT_FOUND)
    if isinstance(exc, drf_exceptions.MethodNotAllowed):
        body = envelope(
            "request.method_not_allowed", str(exc.detail), category=ErrorCategory.VALIDATION
        )
        return Response(body, status=http.HTTP_405_METHOD_NOT_ALLOWED)
    if isinstance(exc, drf_exceptions.UnsupportedMediaType):
        body = envelope(
            "request.unsupported_media_type", str(exc.detail), category=ErrorCategory.VALIDATION
        )
        return Response(body, status=http.HTTP_415_UNSUPPORTED_MEDIA_TYPE)
    if isinstance(exc, drf_exceptions.Throttled):
        body = envelope(
            "request.throttled",
            str(exc.detail),
            category=ErrorCategory.RATE_LIMITED,
            retryable=True,
        )
        response = Response(body, status=http.HTTP_429_TOO_MANY_REQUESTS)
        response["Retry-After"] = str(int(exc.wait or 1))
        return response
    if isinstance(exc, drf_exceptions.APIException):
        body = envelope("request.error", str(exc.detail), category=ErrorCategory.VALIDATION)
        return Response(body, status=exc.status_code)
    logger.exception("unhandled error in %s", context.get("view").__class__.__name__)
    body = envelope("server.internal", "internal server error", category=ErrorCategory.INTERNAL)
    return Response(body, status=http.HTTP_500_INTERNAL_SERVER_ERROR)


def _json_error(code: str, message: str, category: ErrorCategory, status: int) -> JsonResponse:
    return JsonResponse(envelope(code, message, category=category), status=status)


def bad_request(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    return _json_error("request.invalid", "bad request", ErrorCategory.VALIDATION, 400)


def permission_denied(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    return _json_error("auth.forbidden", "permission denied", ErrorCategory.AUTHORIZATION, 403)


def not_found(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    return _json_error("not_found", "not found", ErrorCategory.NOT_FOUND, 404)


def server_error(request: HttpRequest) -> HttpResponse:
    return _json_error("server.internal", "internal server error", ErrorCategory.INTERNAL, 500)


def home(request: HttpRequest) -> HttpResponse:
    return redirect("/admin/")


def healthz(request: HttpRequest) -> HttpResponse:
    """Liveness plus a database round trip; no authentication, no details."""
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
    except Exception as exc:  # the point is to report it, not to crash
        logger.warning("health check failed: %s", exc)
        return JsonResponse({"status": "unavailable"}, status=503)
    return JsonResponse({"status": "ok"})


class StrictFieldsMixin:
    """Reject unknown fields instead of silently dropping them (a typo must not pass)."""

    def to_internal_value(self, data: Any) -> Any:
        from rest_framework import serializers

        if isinstance(data, dict):
            known = {name for name, f in self.fields.items() if not f.read_only}
            unknown = sorted(set(data) - known)
            if unknown:
                raise serializers.ValidationError({name: ["unknown field"] for name in unknown})
        return super().to_internal_value(data)
