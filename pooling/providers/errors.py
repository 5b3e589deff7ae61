"""Upstream error handling shared by every provider adapter.

Each vendor formats errors differently, so each adapter's ``transform_error`` turns a
status and a raw body into a short human reason; the parsing of the envelopes we know
(OpenAI-compatible servers, Anthropic, Gemini, Ollama, Mistral, HTML error pages) lives here
once and adapters call it. ``upstream_error`` then builds the one ``UpstreamError`` the rest
of the system sees. The raw body is written to the ``sage.upstream`` log at WARNING and
nowhere else: never into an error's message or details, an API response or an event.
"""

from __future__ import annotations

import email.utils
import html
import json
import logging
import re
import time
from typing import Any

from sageproject.errors import ErrorCategory, UpstreamError

logger = logging.getLogger("sage.upstream")

MAX_REASON_CHARS = 200
# Enough of a body to diagnose it from the log without letting one huge page flood it.
MAX_LOGGED_BODY_CHARS = 8192

# Anthropic reports errors inside a 200 stream as ``event: error``; these are the statuses
# the same error type carries as an HTTP response, so mid-stream errors map like any other.
ANTHROPIC_ERROR_STATUS: dict[str, int] = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "billing_error": 402,
    "permission_error": 403,
    "not_found_error": 404,
    "request_too_large": 413,
    "rate_limit_error": 429,
    "api_error": 500,
    "timeout_error": 504,
    "overloaded_error": 529,
}

# Key-shaped strings some upstreams echo back ("Incorrect API key provided: sk-...").
_SECRET_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"\bsk-[A-Za-z0-9_\-*.]{6,}"), "***"),
    (re.compile(r"\bAIza[0-9A-Za-z_\-]{8,}"), "***"),
    (re.compile(r"(?i)\b(bearer\s+)[^\s\"',;]+"), r"\1***"),
    (re.compile(r"(?i)\b((?:api[_-]?key|key|token|access_token)=)[^\s&\"',;]+"), r"\1***"),
)
_TAG = re.compile(r"<[^>]+>")
_TITLE = re.compile(r"<title[^>]*>(.*?)</title\s*>", re.IGNORECASE | re.DOTALL)
_HEADING = re.compile(r"<h([1-3])[^>]*>(.*?)</h\1\s*>", re.IGNORECASE | re.DOTALL)
_HTML_START = re.compile(r"^\s*(?:<!doctype\s+html|<html|<head|<body|<title|<h1)", re.IGNORECASE)


def decode_body(body: bytes | str | None) -> str:
    """The body as text (undecodable bytes replaced); ``None`` gives ``""``."""
    if body is None:
        return ""
    if isinstance(body, bytes | bytearray | memoryview):
        return bytes(body).decode("utf-8", errors="replace")
    return str(body)


def redact(text: str, secrets: tuple[str, ...] | list[str] = ()) -> str:
    """``text`` with the given secrets and anything key-shaped replaced by ``***``."""
    for secret in secrets:
        # Very short "secrets" (placeholder keys) would mangle ordinary words.
        if secret and len(secret) >= 6:
            text = text.replace(secret, "***")
    for pattern, replacement in _SECRET_PATTERNS:
        text = pattern.sub(replacement, text)
    return text


def shorten(text: str, limit: int = MAX_REASON_CHARS) -> str:
    """``text`` on one line, secrets redacted, cut to ``limit`` characters with an ellipsis."""
    text = redact(" ".join(text.split()))
    if len(text) > limit:
        text = text[: limit - 1].rstrip() + "…"
    return text


def _strip_tags(fragment: str) -> str:
    return " ".join(html.unescape(_TAG.sub(" ", fragment)).split())


def html_reason(text: str) -> str | None:
    """A reason for an HTML error page (a proxy's 502, a firewall page), else ``None``.

    Uses the page's ``<title>``, or its first ``<h1>`` to ``<h3>`` when the title is missing.
    """
    if not _HTML_START.search(text) and "<html" not in text[:2048].lower():
        return None
    label = ""
    match = _TITLE.search(text)
    if match:
        label = _strip_tags(match.group(1))
    if not label:
        match = _HEADING.search(text)
        if match:
            label = _strip_tags(match.group(2))
    prefix = "upstream returned an HTML error page"
    if not label:
        return prefix
    return shorten(f"{prefix}: {shorten(label, 120)}")


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": "))


def _with_label(message: str, label: Any) -> str:
    message = _as_text(message).strip()
    label = label.strip() if isinstance(label, str) else ""
    if message and label and label.lower() not in message.lower():
        return f"{message} ({label})"
    return message or label


def _detail_reason(detail: Any) -> str:
    # FastAPI-style validation errors (Mistral, vLLM): [{"loc": [...], "msg": "...", ...}].
    if isinstance(detail, list):
        parts = []
        for item in detail[:3]:
            if isinstance(item, dict) and "msg" in item:
                loc = ".".join(str(p) for p in item.get("loc", ()) if p != "body")
                parts.append(f"{item['msg']} ({loc})" if loc else str(item["msg"]))
            else:
                parts.append(_as_text(item))
        return "; ".join(p for p in parts if p)
    if isinstance(detail, dict):
        return _as_text(detail.get("message") or detail.get("msg") or detail)
    return _as_text(detail)


def _envelope_reason(data: Any) -> str:
    if isinstance(data, str):
        return data
    if isinstance(data, list):
        # Gemini and some gateways wrap the envelope in a one-element list.
        return _envelope_reason(data[0]) if data else ""
    if not isinstance(data, dict):
        return ""
    error = data.get("error")
    if isinstance(error, dict):
        # Anthropic: {"type": "error", "error": {"type", "message"}}
        # OpenAI-compatible: {"error": {"message", "type", "code"}}
        # Gemini: {"error": {"code": 429, "message", "status": "RESOURCE_EXHAUSTED"}}
        label = error.get("status") if isinstance(error.get("status"), str) else None
        if label is None:
            code = error.get("code")
            label = code if isinstance(code, str) else error.get("type")
        message = error.get("message")
        if message is None and "metadata" in error:
            message = error["metadata"]
        return _with_label(_as_text(message), label)
    if isinstance(error, str):
        # Ollama (and many small servers): {"error": "model 'x' not found"}.
        return error
    if isinstance(error, list):
        return _envelope_reason(error)
    if "message" in data:
        # Mistral: {"object": "error", "message": ..., "type": ..., "code": ...}; the message
        # is sometimes itself a structure (validation details).
        message = data["message"]
        if isinstance(message, dict):
            message = _detail_reason(message.get("detail", message))
        elif isinstance(message, list):
            message = _detail_reason(message)
        return _with_label(_as_text(message), data.get("type"))
    if "detail" in data:
        # Mistral and FastAPI-based servers: {"detail": "..."} or {"detail": [...]}.
        return _detail_reason(data["detail"])
    return ""


def parse_error_body(body: bytes | str | None) -> str | None:
    """A short human reason from an upstream error body, or ``None`` when unrecognised.

    Recognises JSON envelopes of OpenAI-compatible servers, Anthropic, Gemini, Ollama and
    Mistral, and HTML error pages. Plain text is not a recognised envelope and gives
    ``None``: passing it through would leak the raw body. Never raises.
    """
    text = decode_body(body).strip()
    if not text:
        return None
    if text[0] in "{[":
        try:
            data = json.loads(text)
        except ValueError:
            data = None
        if data is not None:
            try:
                reason = _envelope_reason(data)
            except (TypeError, ValueError, AttributeError, IndexError, KeyError):
                logger.warning("could not interpret an upstream error envelope", exc_info=True)
                reason = ""
            reason = shorten(reason) if reason else ""
            return reason or None
    return html_reason(text)


def retry_after_seconds(value: str | None, *, now: float | None = None) -> float | None:
    """Seconds from a ``Retry-After`` value (delta-seconds or an HTTP date), else ``None``."""
    if value is None:
        return None
    value = value.strip()
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            moment = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if moment is None:
            return None
        seconds = moment.timestamp() - (time.time() if now is None else now)
    if seconds != seconds or seconds in (float("inf"), float("-inf")):
        return None
    return max(0.0, seconds)


def retry_after_from_headers(headers: Any) -> float | None:
    """``Retry-After`` (or the millisecond ``retry-after-ms``) from response headers."""
    if headers is None:
        return None
    try:
        ms = headers.get("retry-after-ms")
        if ms is not None:
            return max(0.0, float(ms) / 1000.0)
    except (TypeError, ValueError):
        pass
    return retry_after_seconds(headers.get("retry-after"))


def unknown_reason(status: int | None) -> str:
    """The uniform fallback message when no adapter yields a reason."""
    return f"api error {status}: unknown error"


def upstream_error(
    status: int | None,
    body: bytes | str,
    *,
    adapter: Any = None,
    retry_after: float | None = None,
    secrets: tuple[str, ...] = (),
) -> UpstreamError:
    """Build (not raise) the ``UpstreamError`` for an upstream failure and log the raw body.

    ``status`` is the upstream HTTP status, or ``None`` when the failure carried no status
    (an error event inside a stream). The message is ``adapter.transform_error(status,
    body)`` (secrets redacted, at most 200 characters) or exactly ``api error <status>:
    unknown error``. Codes: 429 → ``upstream.rate_limited`` (RATE_LIMITED, retryable,
    ``details["retry_after"]``); 401/403 → ``upstream.auth`` (not retryable); 5xx or no
    status → ``upstream.error`` (retryable); any other status → ``upstream.error`` (not
    retryable). ``details`` holds only the status (and retry_after), never the body.
    """
    raw = decode_body(body)
    protocol = getattr(adapter, "protocol", None)
    logger.warning(
        "upstream error: protocol=%s status=%s retry_after=%s body=%s",
        protocol,
        status,
        retry_after,
        raw[:MAX_LOGGED_BODY_CHARS],
    )
    reason: str | None = None
    if adapter is not None and raw.strip():
        try:
            reason = adapter.transform_error(status if status is not None else 0, body)
        except Exception:
            # A buggy hook must not hide the upstream failure; the uniform fallback applies.
            logger.exception("transform_error of %s failed", protocol)
            reason = None
    if reason and reason.strip():
        message = shorten(redact(reason, secrets))
    else:
        message = unknown_reason(status)

    details: dict[str, Any] = {"status": status}
    if status == 429:
        details["retry_after"] = retry_after
        return UpstreamError(
            "upstream.rate_limited",
            message,
            category=ErrorCategory.RATE_LIMITED,
            retryable=True,
            details=details,
        )
    if status in (401, 403):
        return UpstreamError("upstream.auth", message, retryable=False, details=details)
    retryable = status is None or status >= 500
    return UpstreamError("upstream.error", message, retryable=retryable, details=details)


def connection_error(description: str, *, cause: BaseException | None = None) -> UpstreamError:
    """Build the retryable ``upstream.error`` for a transport failure (connect, timeout, drop).

    ``description`` is our own short wording ("connection failed", "timed out"), never text
    from the upstream; the message is ``upstream <description>`` and the underlying
    exception goes to the log only.
    """
    logger.warning("upstream %s: %r", description, cause)
    return UpstreamError(
        "upstream.error",
        f"upstream {description}",
        retryable=True,
        details={"status": None},
    )
