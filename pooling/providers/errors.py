"""The one place where upstream (model provider) responses become errors.

Every adapter hands its failures here: an HTTP error status with its body
(``upstream_error``), a 200 that is not a usable event stream (``require_event_stream``,
``invalid_response``, ``broken_stream``) and a transport failure (``connection_error``).
Each builds the one ``UpstreamError`` the rest of the system sees.

What a client sees is our own message for the kind of failure, followed by at most a
vetted short reason: the HTTP status and the provider's error type or code when that is a
short identifier (``invalid_api_key``, ``overloaded_error``), or a label of our own (``HTML
error page``, ``not an event stream``). Free text from the body (a JSON ``message``, an HTML
``<title>``) never reaches an error's message or details, so never an API response, an
event, the admin or the database. The raw body goes to the ``sage.upstream`` log at
WARNING and nowhere else, after ``redact`` removed the record's credentials and anything
shaped like a key.
"""

from __future__ import annotations

import email.utils
import json
import logging
import re
import time
import urllib.parse
from typing import Any

from sageproject.errors import ErrorCategory, UpstreamError

logger = logging.getLogger("sage.upstream")

# Enough of a body to diagnose it from the log without letting one huge page flood it.
MAX_LOGGED_BODY_CHARS = 8192
# The delay a rate-limited run is told to wait when the provider's 429 named none.
DEFAULT_RETRY_AFTER_SECONDS = 30.0

# Our own message for each kind of upstream failure.
AUTH_MESSAGE = "the provider rejected the credentials"
RATE_LIMITED_MESSAGE = "the provider's rate limit was reached; retry later"
REJECTED_MESSAGE = "the provider rejected the request"
FAILED_MESSAGE = "the provider failed"
INVALID_RESPONSE_MESSAGE = "invalid response from the provider"

# Labels of our own for what was wrong with a body; they may follow any message.
HTML_PAGE = "HTML error page"
NOT_AN_EVENT_STREAM = "not an event stream"
NO_EVENTS = "no events"
ENDED_EARLY = "stream ended early"
BROKEN_EVENT_STREAM = "broken event stream"
NOT_UTF8 = "not UTF-8"
MALFORMED_EVENT = "malformed event"
UNDECODABLE_BODY = "undecodable body"
OWN_LABELS = frozenset(
    {
        HTML_PAGE,
        NOT_AN_EVENT_STREAM,
        NO_EVENTS,
        ENDED_EARLY,
        BROKEN_EVENT_STREAM,
        NOT_UTF8,
        MALFORMED_EVENT,
        UNDECODABLE_BODY,
    }
)
# A provider's error type or code is passed on only when it looks like an identifier:
# ``rate_limit_exceeded``, ``RESOURCE_EXHAUSTED``; a sentence (or a host name) is free text
# and is dropped.
_IDENTIFIER = re.compile(r"[A-Za-z][A-Za-z0-9_\-]{0,47}")

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
    (re.compile(r"\b(?:sk|xai|pk)-[A-Za-z0-9_\-*.]{6,}"), "***"),
    (re.compile(r"\b(?:gsk|hf|r8|ghp|github_pat)_[A-Za-z0-9_]{8,}"), "***"),
    (re.compile(r"\bAIza[0-9A-Za-z_\-]{8,}"), "***"),
    (re.compile(r"\bAKIA[0-9A-Z]{12,}"), "***"),
    (re.compile(r"(?i)\b(bearer\s+)[^\s\"',;]+"), r"\1***"),
    (re.compile(r"(?i)\b((?:api[_-]?key|key|token|access_token)=)[^\s&\"',;]+"), r"\1***"),
    (
        re.compile(
            r"(?i)(\"(?:api[_-]?key|x-api-key|authorization|access[_-]?token|secret|password)\""
            r"\s*:\s*\")(?:[^\"\\]|\\.)*\""
        ),
        r'\1***"',
    ),
)
_HTML_START = re.compile(r"^\s*(?:<!doctype\s+html|<html|<head|<body|<title|<h1)", re.IGNORECASE)


def decode_body(body: bytes | str | None) -> str:
    """The body as text (undecodable bytes replaced); ``None`` gives ``""``."""
    if body is None:
        return ""
    if isinstance(body, bytes | bytearray | memoryview):
        return bytes(body).decode("utf-8", errors="replace")
    return str(body)


def redact(text: str, secrets: tuple[str, ...] | list[str] = ()) -> str:
    """``text`` with the given secrets (also as JSON- or URL-escaped) and anything
    key-shaped replaced by ``***``."""
    for secret in secrets:
        # Very short "secrets" (placeholder keys) would mangle ordinary words.
        if not secret or len(secret) < 6:
            continue
        escaped = json.dumps(secret)[1:-1]
        # JSON as Python writes it, as some servers write it ("\/"), and URL-encoded.
        forms = {secret, escaped, escaped.replace("/", "\\/"), urllib.parse.quote(secret, safe="")}
        for form in sorted(forms, key=len, reverse=True):
            text = text.replace(form, "***")
    for pattern, replacement in _SECRET_PATTERNS:
        text = pattern.sub(replacement, text)
    return text


def client_secrets(client: Any) -> tuple[str, ...]:
    """The credentials an SDK client holds (its API key, a bearer token), for ``redact``."""
    values = (getattr(client, "api_key", None), getattr(client, "auth_token", None))
    return tuple(str(value) for value in values if value)


def vetted_reason(reason: Any, secrets: tuple[str, ...] = ()) -> str | None:
    """``reason`` if a client may see it, else ``None``: one of our own labels, or a short
    identifier (a provider's error type or code) that holds nothing secret."""
    if not isinstance(reason, str):
        return None
    if reason in OWN_LABELS:
        return reason
    if _IDENTIFIER.fullmatch(reason) and redact(reason, secrets) == reason:
        return reason
    return None


def _envelope_reason(data: Any) -> str | None:
    """The provider's error type or code from a JSON error envelope, vetted."""
    if isinstance(data, list):
        # Gemini and some gateways wrap the envelope in a one-element list.
        return _envelope_reason(data[0]) if data else None
    if not isinstance(data, dict):
        return None
    error = data.get("error")
    if isinstance(error, list):
        return _envelope_reason(error)
    # OpenAI-compatible {"error": {"message", "type", "code"}}, Anthropic {"type": "error",
    # "error": {"type", "message"}}, Gemini {"error": {"code": 429, "status": ...}};
    # Mistral {"object": "error", "message", "type", "code"}. Ollama's {"error": "..."} and
    # FastAPI's {"detail": ...} carry free text only.
    source = error if isinstance(error, dict) else data if data.get("object") == "error" else {}
    for key in ("status", "code", "type"):
        reason = vetted_reason(source.get(key))
        if reason is not None:
            return reason
    return None


def parse_error_body(body: bytes | str | None) -> str | None:
    """The vetted short reason of an upstream error body, or ``None``.

    For a JSON error envelope (OpenAI-compatible servers, Anthropic, Gemini, Mistral) the
    provider's error status, code or type when it is a short identifier; for an HTML page
    ``"HTML error page"``. Never text chosen by the upstream (a message, a page's title),
    which stays in the log. Never raises.
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
            return _envelope_reason(data)
    if _HTML_START.search(text) or "<html" in text[:2048].lower():
        return HTML_PAGE
    return None


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


def error_message(message: str, status: int | None, reason: str | None) -> str:
    """``message`` followed by ``(status N, reason)`` as far as they are known."""
    parts = [f"status {status}"] if status is not None else []
    if reason:
        parts.append(reason)
    return f"{message} ({', '.join(parts)})" if parts else message


def log_body(
    what: str,
    body: bytes | str | None,
    *,
    protocol: str | None,
    status: int | None,
    secrets: tuple[str, ...] = (),
    exc_info: BaseException | None = None,
    **fields: Any,
) -> None:
    """Write an upstream body to the ``sage.upstream`` log at WARNING, redacted and cut to
    ``MAX_LOGGED_BODY_CHARS``: the only place an upstream body goes."""
    # Cut before redacting (a huge page), but well past the final cut so that a secret
    # astride the first one is beyond the logged part anyway.
    raw = redact(decode_body(body)[: 4 * MAX_LOGGED_BODY_CHARS], secrets)
    extra = "".join(f" {name}={value}" for name, value in fields.items())
    logger.warning(
        "upstream %s: protocol=%s status=%s%s body=%s",
        what,
        protocol,
        status,
        redact(extra, secrets),
        raw[:MAX_LOGGED_BODY_CHARS],
        exc_info=exc_info,
    )


def upstream_error(
    status: int | None,
    body: bytes | str,
    *,
    adapter: Any = None,
    retry_after: float | None = None,
    secrets: tuple[str, ...] = (),
) -> UpstreamError:
    """Build (not raise) the ``UpstreamError`` for an upstream error status and log the body.

    ``status`` is the upstream HTTP status, or ``None`` when the failure carried no status
    (an error event inside a stream). The message is ours for the kind of failure, with the
    status and ``adapter.transform_error(status, body)`` when that is a vetted reason
    (``vetted_reason``). Codes: 429 → ``upstream.rate_limited`` (RATE_LIMITED, retryable,
    resumable, ``details["retry_after"]``: the provider's delay or
    ``DEFAULT_RETRY_AFTER_SECONDS``); 401/403 → ``upstream.auth`` (not retryable); 5xx or no
    status → ``upstream.error`` (retryable); any other status → ``upstream.error`` (not
    retryable). ``details`` holds only the status (and retry_after), never the body.
    """
    protocol = getattr(adapter, "protocol", None)
    log_body(
        "error", body, protocol=protocol, status=status, secrets=secrets, retry_after=retry_after
    )
    reason: str | None = None
    if adapter is not None and decode_body(body).strip():
        try:
            reason = adapter.transform_error(status if status is not None else 0, body)
        except Exception:
            # A buggy hook must not hide the upstream failure; the message goes without it.
            logger.exception("transform_error of %s failed", protocol)
            reason = None
    reason = vetted_reason(reason, secrets)

    details: dict[str, Any] = {"status": status}
    if status == 429:
        details["retry_after"] = (
            retry_after if retry_after is not None else DEFAULT_RETRY_AFTER_SECONDS
        )
        return UpstreamError(
            "upstream.rate_limited",
            error_message(RATE_LIMITED_MESSAGE, status, reason),
            category=ErrorCategory.RATE_LIMITED,
            retryable=True,
            # Nothing was produced: the run can wait (suspended) and go on where it was.
            resumable=True,
            details=details,
        )
    if status in (401, 403):
        return UpstreamError(
            "upstream.auth",
            error_message(AUTH_MESSAGE, status, reason),
            retryable=False,
            details=details,
        )
    retryable = status is None or status >= 500
    message = FAILED_MESSAGE if retryable else REJECTED_MESSAGE
    return UpstreamError(
        "upstream.error",
        error_message(message, status, reason),
        retryable=retryable,
        details=details,
    )


def invalid_response(
    label: str,
    *,
    status: int | None = 200,
    body: bytes | str | None = None,
    adapter: Any = None,
    secrets: tuple[str, ...] = (),
    exc_info: BaseException | None = None,
    **fields: Any,
) -> UpstreamError:
    """Build the retryable ``upstream.error`` "invalid response from the provider" for a
    response that is not a usable event stream (``label`` says how, one of ours), and log
    the body it had."""
    log_body(
        f"invalid response ({label})",
        body,
        protocol=getattr(adapter, "protocol", None),
        status=status,
        secrets=secrets,
        exc_info=exc_info,
        **fields,
    )
    return UpstreamError(
        "upstream.error",
        error_message(INVALID_RESPONSE_MESSAGE, status, vetted_reason(label)),
        retryable=True,
        details={"status": status},
    )


def broken_stream(
    exc: Exception,
    *,
    status: int | None = 200,
    event: Any = None,
    adapter: Any = None,
    secrets: tuple[str, ...] = (),
) -> UpstreamError:
    """The ``invalid_response`` for an exception raised while an event stream was decoded:
    bytes that are not UTF-8, an event whose JSON is broken, or an event of the wrong
    shape (``event``, the last one decoded). The offending text is logged."""
    if isinstance(exc, UnicodeDecodeError):
        return invalid_response(
            NOT_UTF8, status=status, body=exc.object, adapter=adapter, secrets=secrets
        )
    if isinstance(exc, json.JSONDecodeError):
        return invalid_response(
            BROKEN_EVENT_STREAM, status=status, body=exc.doc, adapter=adapter, secrets=secrets
        )
    # An event of the wrong shape (a list, a number where text belongs): the traceback says
    # where, and tells a bug of ours apart from the provider's.
    return invalid_response(
        MALFORMED_EVENT,
        status=status,
        body=None if event is None else repr(event),
        adapter=adapter,
        secrets=secrets,
        exc_info=exc,
        error=type(exc).__name__,
    )


async def require_event_stream(
    response: Any, *, adapter: Any = None, secrets: tuple[str, ...] = ()
) -> None:
    """Raise ``invalid_response`` ("not an event stream") when a streaming call's successful
    response declares a content type other than ``text/event-stream``: a JSON body, an HTML
    captive portal. Its first ``MAX_LOGGED_BODY_CHARS`` bytes are read for the log. A
    response without a content type is left to the stream's own checks."""
    content_type = str(response.headers.get("content-type") or "")
    media_type = content_type.split(";", 1)[0].strip().lower()
    if not media_type or media_type == "text/event-stream":
        return
    head = bytearray()
    async for piece in response.aiter_bytes():
        head += piece
        if len(head) >= MAX_LOGGED_BODY_CHARS:
            break
    raise invalid_response(
        NOT_AN_EVENT_STREAM,
        status=response.status_code,
        body=bytes(head),
        adapter=adapter,
        secrets=secrets,
        content_type=media_type,
    )


def connection_error(
    description: str, *, cause: BaseException | None = None, secrets: tuple[str, ...] = ()
) -> UpstreamError:
    """Build the retryable ``upstream.error`` for a transport failure (connect, timeout, drop).

    ``description`` is our own short wording ("connection failed", "timed out"), never text
    from the upstream; the message is ``upstream <description>`` and the underlying
    exception goes to the log only (redacted).
    """
    logger.warning("upstream %s: %s", description, redact(repr(cause), secrets))
    return UpstreamError(
        "upstream.error",
        f"upstream {description}",
        retryable=True,
        details={"status": None},
    )
