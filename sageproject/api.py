"""Shared API plumbing: the one exception handler, pagination and plain JSON error pages."""

from __future__ import annotations

import copy
import logging
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured, PermissionDenied, RequestDataTooBig
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema_field
from rest_framework import exceptions as drf_exceptions
from rest_framework import serializers
from rest_framework import status as http
from rest_framework.pagination import PageNumberPagination
from rest_framework.response import Response

from sageproject import counters
from sageproject.errors import ErrorCategory, SageError, envelope
from sageproject.parsers import int_schema, query_int

logger = logging.getLogger("sage.api")


class Pagination(PageNumberPagination):
    """Every list's pages, one rule for all: ``page`` an integer ≥ 1 (a page past the last
    answers 404) and ``page_size`` an integer 1..100 (default 50); any other value, ``null``
    and negatives included, is 400 ``request.invalid`` naming the parameter."""

    page_size = 50
    page_size_query_param = "page_size"
    max_page_size = 100
    last_page_strings = ()

    def get_page_size(self, request: Any) -> int:
        return query_int(
            request, "page_size", self.page_size, minimum=1, maximum=self.max_page_size
        )

    def get_page_number(self, request: Any, paginator: Any) -> int:
        return query_int(request, "page", 1, minimum=1)

    def get_schema_operation_parameters(self, view: Any) -> list[dict[str, Any]]:
        parameters = super().get_schema_operation_parameters(view)
        for parameter in parameters:
            if parameter["name"] == "page":
                parameter["schema"] = int_schema(1)
                parameter["description"] = "A page number, 1 or more (default 1)."
            elif parameter["name"] == "page_size":
                parameter["schema"] = int_schema(1, self.max_page_size)
                parameter["description"] = (
                    f"Results per page, 1..{self.max_page_size} (default {self.page_size})."
                )
        return parameters


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
        counters.rate_limited(error.code)
        retry_after = error.details.get("retry_after") or 1
        response["Retry-After"] = str(max(1, int(float(retry_after) + 0.999)))
    return response


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """Render every error as the DESIGN §6 envelope."""
    if isinstance(exc, SageError):
        return sage_error_response(exc)
    if isinstance(exc, RequestDataTooBig):
        return Response(too_large_body(), status=http.HTTP_413_REQUEST_ENTITY_TOO_LARGE)
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
    view, request = context.get("view"), context.get("request")
    where = type(view).__name__ if view is not None else getattr(request, "path", "a request")
    logger.exception("unhandled error in %s", where)
    body = envelope("server.internal", "internal server error", category=ErrorCategory.INTERNAL)
    return Response(body, status=http.HTTP_500_INTERNAL_SERVER_ERROR)


def too_large_body() -> dict[str, Any]:
    """The 413 envelope: the API's exception handler and the ASGI handler (which refuses an
    oversized body before reading it) answer the same."""
    return envelope(
        "request.too_large",
        "request body is larger than this host accepts",
        category=ErrorCategory.VALIDATION,
        details={"max_bytes": settings.DATA_UPLOAD_MAX_MEMORY_SIZE},
    )


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


class FieldsOnceMixin:
    """A serializer whose fields are built once per class; each instance binds shallow
    copies of them.

    DRF builds every instance's fields anew: the declared ones deep-copied (each field's
    ``__init__`` run again, its validators built again) and, for a ``ModelSerializer``, the
    model's fields read and turned into serializer fields. That is half the cost of
    validating a run submission's body, for fields that never change (docs/PERFORMANCE.md).
    Here the first instance builds them as DRF does (``get_fields``) and keeps them; every
    instance gets shallow copies, which binding (name, parent, source) changes on their
    own, while what they share (validators, choices, messages) nobody changes after
    construction. Only for serializers whose fields do not depend on the instance (its
    context or arguments) and hold no nested serializer (refused: a nested serializer's
    own fields would be shared)."""

    def get_fields(self) -> dict[str, Any]:
        cls = type(self)
        fields = cls.__dict__.get("_built_fields")
        if fields is None:
            fields = super().get_fields()  # type: ignore[misc]
            nested = [n for n, f in fields.items() if isinstance(f, serializers.BaseSerializer)]
            if nested:
                raise ImproperlyConfigured(
                    f"{cls.__name__}: FieldsOnceMixin cannot share nested serializers ({nested})"
                )
            cls._built_fields = fields  # type: ignore[attr-defined]
        return {name: copy.copy(field) for name, field in fields.items()}


class StrictFieldsMixin:
    """Reject unknown fields instead of silently dropping them (a typo must not pass), and
    values of the wrong JSON type instead of coercing them (DRF would store ``5`` as
    ``"5"`` and take ``"yes"`` for true). The schema says both (``additionalProperties:
    false``, the fields' types: `sageproject.schema.AutoSchema`)."""

    def to_internal_value(self, data: Any) -> Any:
        if isinstance(data, dict):
            problems: dict[str, list[str]] = {}
            writable = {name: f for name, f in self.fields.items() if not f.read_only}
            for name in sorted(set(data) - set(writable)):
                problems[name] = ["unknown field"]
            for name, field in writable.items():
                if name in data and (problem := _json_problem(field, data[name])):
                    problems[name] = [problem]
            if problems:
                raise serializers.ValidationError(problems)
        return super().to_internal_value(data)


def _json_problem(field: serializers.Field, value: Any) -> str | None:
    """Why ``value`` is not of the JSON type ``field`` takes, or a string longer than its
    ``max_length`` as sent (the schema's ``maxLength``; DRF would measure it trimmed); None
    when neither (null is the field's own business: ``allow_null``)."""
    if value is None or isinstance(field, serializers.JSONField):
        return None
    if isinstance(field, serializers.BooleanField):
        return None if isinstance(value, bool) else "must be true or false"
    if isinstance(field, serializers.IntegerField):
        number = isinstance(value, int | float) and not isinstance(value, bool)
        return None if number else "must be an integer"
    if isinstance(field, serializers.ListField):
        if not isinstance(value, list):
            return "must be a list"
        for item in value:
            if problem := _json_problem(field.child, item):
                return f"every item {problem}"
        return None
    if isinstance(field, serializers.DictField | serializers.Serializer):
        return None if isinstance(value, dict) else "must be an object"
    if isinstance(field, serializers.CharField | serializers.ChoiceField | serializers.UUIDField):
        if not isinstance(value, str):
            return "must be a string"
        longest = getattr(field, "max_length", None)
        if longest is not None and len(value) > longest:
            return f"Ensure this field has no more than {longest} characters."
    return None


@extend_schema_field(OpenApiTypes.OBJECT)
class JSONObjectField(serializers.JSONField):
    """A JSON object (options, a manifest); any other JSON value is refused."""

    default_error_messages = {"not_an_object": "must be a JSON object"}

    def to_internal_value(self, data: Any) -> Any:
        if not isinstance(data, dict):
            self.fail("not_an_object")
        return super().to_internal_value(data)


# --- the error envelope, as the schema shows it (sageproject.schema) ----------------------


class ErrorDetailSerializer(serializers.Serializer):
    code = serializers.CharField(help_text="Stable code, e.g. request.invalid, model.queue_full.")
    category = serializers.ChoiceField(choices=[c.value for c in ErrorCategory])
    message = serializers.CharField()
    retryable = serializers.BooleanField(help_text="The same request may succeed later.")
    resumable = serializers.BooleanField(help_text="Durable state was kept; it can continue.")
    details = serializers.DictField(
        help_text="request.invalid: {fields: {name: [problem, ...]}}; "
        "request.too_large: {max_bytes}; rate limits: {retry_after}."
    )


class ErrorEnvelopeSerializer(serializers.Serializer):
    """Every error the API answers (DESIGN §6)."""

    error = ErrorDetailSerializer()
