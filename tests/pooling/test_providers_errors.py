"""Pure unit tests for upstream error parsing and mapping (no network)."""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import pytest

from pooling.providers import PROTOCOLS, ProviderAdapter, get_adapter, upstream_error
from pooling.providers.errors import (
    DEFAULT_RETRY_AFTER_SECONDS,
    parse_error_body,
    redact,
    retry_after_from_headers,
    retry_after_seconds,
    vetted_reason,
)
from sageproject.errors import ErrorCategory, UpstreamError, ValidationError
from tests.pooling.upstream import (
    HTML_502,
    HTML_FIREWALL,
    anthropic_error,
    gemini_error,
    mistral_error,
    ollama_error,
    openai_error,
)

ADAPTERS = ["openai", "anthropic", "scripted"]


# -- reasons: the provider's error type or code, never its text ---------------------------


@pytest.mark.parametrize("protocol", ADAPTERS)
def test_it_reads_the_code_of_the_openai_envelope(protocol):
    body = openai_error("The model `gpt-9` does not exist", type="invalid_request_error",
                        code="model_not_found")
    assert get_adapter(protocol).transform_error(404, body) == "model_not_found"


def test_it_reads_the_type_of_an_openai_envelope_without_a_code():
    assert parse_error_body(openai_error("bad", type="invalid_request_error")) == (
        "invalid_request_error"
    )


@pytest.mark.parametrize("protocol", ADAPTERS)
def test_it_reads_the_type_of_the_anthropic_envelope(protocol):
    body = anthropic_error("Overloaded", type="overloaded_error")
    assert get_adapter(protocol).transform_error(529, body) == "overloaded_error"


@pytest.mark.parametrize("protocol", ADAPTERS)
def test_it_reads_the_status_of_the_gemini_envelope(protocol):
    body = gemini_error("Quota exceeded for metric generate_content", code=429,
                        status="RESOURCE_EXHAUSTED")
    assert get_adapter(protocol).transform_error(429, body) == "RESOURCE_EXHAUSTED"


def test_it_reads_a_gemini_envelope_wrapped_in_a_list():
    body = "[" + gemini_error("API key not valid", code=400, status="INVALID_ARGUMENT") + "]"
    assert parse_error_body(body) == "INVALID_ARGUMENT"


@pytest.mark.parametrize("protocol", ADAPTERS)
def test_it_gives_no_reason_for_the_free_text_ollama_envelope(protocol):
    body = ollama_error("model 'llama9' not found, try pulling it first")
    assert get_adapter(protocol).transform_error(404, body) is None


@pytest.mark.parametrize("protocol", ADAPTERS)
def test_it_reads_the_type_of_the_mistral_object_envelope(protocol):
    body = mistral_error("Invalid model: mistral-huge", type="invalid_model")
    assert get_adapter(protocol).transform_error(400, body) == "invalid_model"


def test_it_reads_the_type_of_a_mistral_envelope_whose_message_is_structured():
    body = mistral_error({"detail": [{"loc": ["body", "messages"], "msg": "Field required",
                                      "type": "missing"}]})
    assert parse_error_body(body) == "invalid_request_error"


@pytest.mark.parametrize("body", [json.dumps({"detail": "Unauthorized"}),
                                  json.dumps({"detail": [{"loc": ["body", "max_tokens"],
                                                          "msg": "must be positive",
                                                          "type": "value_error"}]})])
def test_it_gives_no_reason_for_a_fastapi_detail(body):
    assert parse_error_body(body) is None


@pytest.mark.parametrize("protocol", ADAPTERS)
def test_it_labels_a_proxy_502_page_without_its_title(protocol):
    assert get_adapter(protocol).transform_error(502, HTML_502.encode()) == "HTML error page"


@pytest.mark.parametrize("page", [HTML_FIREWALL, "<html><body>nope</body></html>",
                                  "<html><head><title>Hotel Wi-Fi: sign in</title></head></html>"])
def test_it_labels_every_html_page_alike(page):
    assert parse_error_body(page) == "HTML error page"


@pytest.mark.parametrize("label", [
    "The model does not exist",  # a sentence
    "x" * 49,  # too long for an identifier
    "sk-proj-abcdef123456",  # shaped like a key
    "<b>bold</b>",
    "gw-7.internal.example",  # a host name
    42,
])
def test_it_drops_a_type_or_code_that_is_not_a_short_identifier(label):
    body = json.dumps({"error": {"message": "m", "type": label, "code": label}})
    assert parse_error_body(body) is None


def test_it_drops_a_code_that_is_the_records_own_key():
    assert vetted_reason("alice-key-7Qm2vX9pL4", ("alice-key-7Qm2vX9pL4",)) is None
    assert vetted_reason("invalid_api_key", ("alice-key-7Qm2vX9pL4",)) == "invalid_api_key"


@pytest.mark.parametrize("body", ["", "   ", "Bad Gateway", b"\xff\xfe", "{not json", "[]", "{}",
                                  "42", "null"])
def test_it_yields_no_reason_for_unrecognised_bodies(body):
    assert parse_error_body(body) is None


# -- redaction -------------------------------------------------------------------------


@pytest.mark.parametrize("text", [
    "Incorrect API key provided: sk-proj-abcdef123456.",
    "key AIzaSyA1234567890abcdef was rejected",
    "Authorization: Bearer eyJhbGciOi.payload.sig",
    "GET /v1/models?api_key=abc123secret&x=1",
    '{"x-api-key": "any-value-at-all", "model": "m"}',
    "groq gsk_0123456789abcdefABCDEF",
])
def test_it_redacts_anything_shaped_like_a_key(text):
    redacted = redact(text)
    assert "***" in redacted
    for secret in ("sk-proj-abcdef123456", "AIzaSyA1234567890abcdef", "eyJhbGciOi",
                   "abc123secret", "any-value-at-all", "gsk_0123456789"):
        assert secret not in redacted


def test_it_redacts_the_records_own_key_also_when_escaped():
    key = "alice/key+7Qm2vX9pL4"
    text = f'raw {key} json "alice\\/key+7Qm2vX9pL4" url alice%2Fkey%2B7Qm2vX9pL4'
    assert "7Qm2vX9pL4" not in redact(text, (key,))


# -- mapping to errors -----------------------------------------------------------------


def test_it_maps_429_to_a_resumable_rate_limit_with_retry_after():
    error = upstream_error(429, openai_error("slow down", code="rate_limit_exceeded"),
                           adapter=get_adapter("openai"), retry_after=7.0)
    assert isinstance(error, UpstreamError)
    assert (error.code, error.category, error.retryable, error.resumable) == (
        "upstream.rate_limited", ErrorCategory.RATE_LIMITED, True, True)
    assert error.details == {"status": 429, "retry_after": 7.0}
    assert error.message == (
        "the provider's rate limit was reached; retry later (status 429, rate_limit_exceeded)"
    )


def test_it_gives_a_429_without_retry_after_the_default_delay():
    error = upstream_error(429, "", adapter=get_adapter("openai"))
    assert error.details == {"status": 429, "retry_after": DEFAULT_RETRY_AFTER_SECONDS}
    assert (error.retryable, error.resumable) == (True, True)


@pytest.mark.parametrize("status", [401, 403])
def test_it_maps_auth_failures_to_a_final_upstream_auth_error(status):
    body = anthropic_error("invalid x-api-key", type="authentication_error")
    error = upstream_error(status, body, adapter=get_adapter("anthropic"))
    assert (error.code, error.category, error.retryable) == (
        "upstream.auth", ErrorCategory.UPSTREAM, False)
    assert error.message == (
        f"the provider rejected the credentials (status {status}, authentication_error)"
    )


@pytest.mark.parametrize("status", [500, 502, 503, 529])
def test_it_maps_server_errors_to_a_retryable_upstream_error(status):
    error = upstream_error(status, HTML_502, adapter=get_adapter("openai"))
    assert (error.code, error.category, error.retryable) == (
        "upstream.error", ErrorCategory.UPSTREAM, True)
    assert error.details == {"status": status}
    assert error.message == f"the provider failed (status {status}, HTML error page)"


@pytest.mark.parametrize("status", [400, 404, 413, 422])
def test_it_maps_other_client_errors_to_a_final_upstream_error(status):
    error = upstream_error(status, openai_error("bad"), adapter=get_adapter("openai"))
    assert (error.code, error.retryable) == ("upstream.error", False)
    assert error.message == (
        f"the provider rejected the request (status {status}, invalid_request_error)"
    )


def test_it_gives_our_message_alone_when_no_adapter_yields_a_reason():
    error = upstream_error(418, "I am a teapot", adapter=get_adapter("openai"))
    assert error.message == "the provider rejected the request (status 418)"


def test_it_gives_our_message_alone_without_an_adapter():
    error = upstream_error(502, HTML_502)
    assert error.message == "the provider failed (status 502)"


def test_it_gives_our_message_alone_for_an_error_event_without_a_reason():
    error = upstream_error(None, json.dumps({"error": "boom"}), adapter=get_adapter("openai"))
    assert (error.message, error.retryable) == ("the provider failed", True)


def test_it_drops_free_text_that_an_adapter_hook_returns():
    class Chatty:
        protocol = "chatty"

        def transform_error(self, status, body):
            return "Your organisation acme-corp exceeded its budget"

    error = upstream_error(400, openai_error("x"), adapter=Chatty())
    assert error.message == "the provider rejected the request (status 400)"


def test_it_falls_back_when_transform_error_raises(caplog):
    class Broken:
        protocol = "broken"

        def transform_error(self, status, body):
            raise RuntimeError("hook bug")

    with caplog.at_level(logging.WARNING, logger="sage.upstream"):
        error = upstream_error(500, openai_error("boom"), adapter=Broken())
    assert error.message == "the provider failed (status 500)"
    assert "transform_error of broken failed" in caplog.text


def test_it_keeps_the_raw_body_out_of_the_error_and_in_the_log(caplog):
    body = openai_error("quota exhausted TRACE-7f3a", code="insufficient_quota")
    with caplog.at_level(logging.WARNING, logger="sage.upstream"):
        error = upstream_error(500, body, adapter=get_adapter("openai"))
    assert "TRACE-7f3a" not in json.dumps(error.to_dict())
    assert "quota exhausted" not in json.dumps(error.to_dict())
    assert error.message == "the provider failed (status 500, insufficient_quota)"
    assert "TRACE-7f3a" in caplog.text
    assert any(r.name == "sage.upstream" and r.levelno == logging.WARNING for r in caplog.records)


def test_it_logs_the_body_without_the_records_key(caplog):
    body = ollama_error("key abc-secret-999 rejected; also sk-live-0123456789 TRACE-99")
    with caplog.at_level(logging.WARNING, logger="sage.upstream"):
        error = upstream_error(401, body, adapter=get_adapter("openai"),
                               secrets=("abc-secret-999",))
    assert error.message == "the provider rejected the credentials (status 401)"
    logged = "\n".join(r.getMessage() for r in caplog.records if r.name == "sage.upstream")
    assert "TRACE-99" in logged
    assert "abc-secret-999" not in logged
    assert "sk-live-0123456789" not in logged


@pytest.mark.parametrize(("value", "expected"), [("7", 7.0), ("1.5", 1.5), ("-3", 0.0),
                                                 ("", None), (None, None), ("soon", None)])
def test_it_parses_retry_after_seconds(value, expected):
    assert retry_after_seconds(value) == expected


def test_it_parses_retry_after_as_an_http_date():
    now = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
    value = format_datetime(now + timedelta(seconds=30), usegmt=True)
    assert retry_after_seconds(value, now=now.timestamp()) == 30.0


def test_it_prefers_retry_after_ms():
    assert retry_after_from_headers({"retry-after-ms": "1500", "retry-after": "9"}) == 1.5


def test_it_lists_the_built_in_protocols():
    assert set(PROTOCOLS) == {"openai", "anthropic", "scripted"}
    assert all(get_adapter(p).protocol == p for p in PROTOCOLS)


def test_it_returns_one_shared_adapter_per_protocol():
    assert get_adapter("scripted") is get_adapter("scripted")


def test_it_rejects_an_unknown_protocol():
    with pytest.raises(ValidationError) as caught:
        get_adapter("gopher")
    assert caught.value.code == "model.protocol_unsupported"
    assert caught.value.category == ErrorCategory.VALIDATION


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_it_builds_adapters_that_satisfy_the_protocol(protocol):
    assert isinstance(get_adapter(protocol), ProviderAdapter)
