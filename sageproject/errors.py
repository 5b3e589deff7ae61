"""Domain errors shared by every app, and the one envelope they render to.

This module is deliberately free of Django imports so that the Django-free core of
``pooling`` (and any other library code) can raise ``SageError`` without pulling in the
framework.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any


class ErrorCategory(StrEnum):
    # The request itself is wrong; repeating it unchanged will fail again.
    VALIDATION = "VALIDATION"
    # The request clashes with current state (a version exists, a stale ref).
    CONFLICT = "CONFLICT"
    # The object does not exist, or belongs to someone else.
    NOT_FOUND = "NOT_FOUND"
    # No valid credentials were presented.
    AUTHENTICATION = "AUTHENTICATION"
    # Valid credentials, but not allowed to do this.
    AUTHORIZATION = "AUTHORIZATION"
    # A bounded queue or pool is full; try again later.
    RATE_LIMITED = "RATE_LIMITED"
    # An upstream model provider failed.
    UPSTREAM = "UPSTREAM"
    # This host cannot serve the request right now (closed, shutting down).
    UNAVAILABLE = "UNAVAILABLE"
    # A resource the operation relied on was lost (a lease, a kernel).
    RESOURCE_LOST = "RESOURCE_LOST"
    # The operation was cancelled.
    CANCELLED = "CANCELLED"
    # A bug: something that should not happen.
    INTERNAL = "INTERNAL"


HTTP_STATUS: dict[ErrorCategory, int] = {
    ErrorCategory.VALIDATION: 400,
    ErrorCategory.CONFLICT: 409,
    ErrorCategory.NOT_FOUND: 404,
    ErrorCategory.AUTHENTICATION: 401,
    ErrorCategory.AUTHORIZATION: 403,
    ErrorCategory.RATE_LIMITED: 429,
    ErrorCategory.UPSTREAM: 502,
    ErrorCategory.UNAVAILABLE: 503,
    ErrorCategory.RESOURCE_LOST: 409,
    ErrorCategory.CANCELLED: 409,
    ErrorCategory.INTERNAL: 500,
}


class SageError(Exception):
    """An error with a stable ``code`` that clients and tests can rely on.

    ``retryable`` means the same request may succeed later unchanged (a full queue);
    ``resumable`` means durable state was preserved and the operation can be continued.
    ``details`` must never hold a secret or a raw upstream body.
    """

    default_category: ErrorCategory = ErrorCategory.INTERNAL

    def __init__(
        self,
        code: str,
        message: str,
        *,
        category: ErrorCategory | None = None,
        retryable: bool = False,
        resumable: bool = False,
        details: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.category = category or self.default_category
        self.message = message
        self.retryable = retryable
        self.resumable = resumable
        self.details = dict(details or {})

    @property
    def http_status(self) -> int:
        return HTTP_STATUS[self.category]

    def record(self) -> dict[str, Any]:
        """The shape stored on a run, job or archive: the envelope's fields without
        ``details`` (which may carry figures meant for the caller only)."""
        return {
            "code": self.code,
            "category": str(self.category),
            "message": self.message,
            "retryable": self.retryable,
            "resumable": self.resumable,
        }

    def to_dict(self) -> dict[str, Any]:
        """The envelope of DESIGN §6: ``{"error": {...}}``."""
        return {"error": {**self.record(), "details": self.details}}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.code!r}, {self.message!r})"


class ValidationError(SageError):
    default_category = ErrorCategory.VALIDATION


class ConflictError(SageError):
    default_category = ErrorCategory.CONFLICT


class NotFoundError(SageError):
    default_category = ErrorCategory.NOT_FOUND


class RateLimitedError(SageError):
    default_category = ErrorCategory.RATE_LIMITED

    def __init__(self, code: str, message: str, **kwargs: Any) -> None:
        kwargs.setdefault("retryable", True)
        super().__init__(code, message, **kwargs)


class UpstreamError(SageError):
    default_category = ErrorCategory.UPSTREAM


class UnavailableError(SageError):
    default_category = ErrorCategory.UNAVAILABLE


def envelope(
    code: str,
    message: str,
    *,
    category: ErrorCategory,
    retryable: bool = False,
    resumable: bool = False,
    details: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Build the envelope for an error that is not (yet) a ``SageError``."""
    return SageError(
        code, message, category=category, retryable=retryable, resumable=resumable, details=details
    ).to_dict()
