"""Pure unit tests for upstream error parsing and mapping (no network)."""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import pytest

from pooling.providers import PROTOCOLS, ProviderAdapter, get_adapter, upstream_error
from pooling.providers.errors import (
    parse_error_body,
    retry_after_from_headers,
    retry_after_seconds,
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


@pytest.mark.parametrize("protocol", ADAPTERS)
def test_it_reads_the_openai_envelope(protocol):
    body = openai_error("The model `gpt-9` does not exist", type="invalid_request_error",
                        code="model_not_found")
    reason = get_adapter(protocol).transform_error(404, body)
    assert reason == "The model `gpt-9` does not exist (model_not_found)"


@pytest.mark.parametrize("protocol", ADAPTERS)
def test_it_reads_the_anthropic_envelope(protocol):
    body = anthropic_error("Overloaded", type="overloaded_error")
    assert get_adapter(protocol).transform_error(529, body) == "Overloaded (overloaded_error)"


@pytest.mark.parametrize("protocol", ADAPTERS)
def test_it_reads_the_gemini_envelope(protocol):
    body = gemini_error("Quota exceeded for metric generate_content", code=429,
                        status="RESOURCE_EXHAUSTED")
    reason = get_adapter(protocol).transform_error(429, body)
    assert reason == "Quota exceeded for metric generate_content (RESOURCE_EXHAUSTED)"


def test_it_reads_a_gemini_envelope_wrapped_in_a_list():
    body = "[" + gemini_error("API key not valid", code=400, status="INVALID_ARGUMENT") + "]"
    assert parse_error_body(body) == "API key not valid (INVALID_ARGUMENT)"


@pytest.mark.parametrize("protocol", ADAPTERS)
def test_it_reads_the_ollama_envelope(protocol):
    body = ollama_error("model 'llama9' not found, try pulling it first")
    reason = get_adapter(protocol).transform_error(404, body)
    assert reason == "model 'llama9' not found, try pulling it first"


@pytest.mark.parametrize("protocol", ADAPTERS)
def test_it_reads_the_mistral_object_envelope(protocol):
    body = mistral_error("Invalid model: mistral-huge", type="invalid_model")
    assert get_adapter(protocol).transform_error(400, body) == (
        "Invalid model: mistral-huge (invalid_model)"
    )


def test_it_reads_a_mistral_envelope_whose_message_is_structured():
    body = mistral_error({"detail": [{"loc": ["body", "messages"], "msg": "Field required",
                                      "type": "missing"}]})
    assert parse_error_body(body) == "Field required (messages) (invalid_request_error)"


def test_it_reads_the_mistral_detail_string():
    assert parse_error_body(json.dumps({"detail": "Unauthorized"})) == "Unauthorized"


def test_it_reads_a_fastapi_validation_detail_list():
    body = json.dumps({"detail": [{"loc": ["body", "max_tokens"], "msg": "must be positive",
                                   "type": "value_error"}]})
    assert parse_error_body(body) == "must be positive (max_tokens)"


@pytest.mark.parametrize("protocol", ADAPTERS)
def test_it_recognises_a_proxy_502_page(protocol):
    reason = get_adapter(protocol).transform_error(502, HTML_502.encode())
    assert reason == "upstream returned an HTML error page: 502 Bad Gateway"


def test_it_uses_the_first_heading_of_an_html_page_without_a_title():
    assert parse_error_body(HTML_FIREWALL) == "upstream returned an HTML error page: Access denied"


def test_it_recognises_an_html_page_with_neither_title_nor_heading():
    assert parse_error_body("<html><body>nope</body></html>") == (
        "upstream returned an HTML error page"
    )


def test_it_shortens_a_long_html_title():
    page = f"<html><head><title>{'Very long title ' * 40}</title></head></html>"
    reason = parse_error_body(page)
    assert reason.startswith("upstream returned an HTML error page: Very long title")
    assert len(reason) <= 200


def test_it_shortens_a_long_message_to_200_characters():
    reason = parse_error_body(openai_error("x" * 5000))
    assert len(reason) <= 200
    assert reason.endswith("…")


def test_it_redacts_a_key_echoed_by_the_upstream():
    body = openai_error("Incorrect API key provided: sk-proj-abcdef123456. Find your key.",
                        code="invalid_api_key")
    reason = parse_error_body(body)
    assert "sk-proj" not in reason
    assert reason.startswith("Incorrect API key provided: ***")


@pytest.mark.parametrize("body", ["", "   ", "Bad Gateway", b"\xff\xfe", "{not json", "[]", "{}",
                                  "42", "null"])
def test_it_yields_no_reason_for_unrecognised_bodies(body):
    assert parse_error_body(body) is None


def test_it_maps_429_to_rate_limited_with_retry_after():
    error = upstream_error(429, openai_error("slow down"), adapter=get_adapter("openai"),
                           retry_after=7.0)
    assert isinstance(error, UpstreamError)
    assert (error.code, error.category, error.retryable) == (
        "upstream.rate_limited", ErrorCategory.RATE_LIMITED, True)
    assert error.details == {"status": 429, "retry_after": 7.0}


def test_it_maps_429_without_retry_after_to_none():
    error = upstream_error(429, "", adapter=get_adapter("openai"))
    assert error.details == {"status": 429, "retry_after": None}


@pytest.mark.parametrize("status", [401, 403])
def test_it_maps_auth_failures_to_a_final_upstream_auth_error(status):
    body = anthropic_error("invalid x-api-key", type="authentication_error")
    error = upstream_error(status, body, adapter=get_adapter("anthropic"))
    assert (error.code, error.category, error.retryable) == (
        "upstream.auth", ErrorCategory.UPSTREAM, False)
    assert error.message == "invalid x-api-key (authentication_error)"


@pytest.mark.parametrize("status", [500, 502, 503, 529])
def test_it_maps_server_errors_to_a_retryable_upstream_error(status):
    error = upstream_error(status, HTML_502, adapter=get_adapter("openai"))
    assert (error.code, error.category, error.retryable) == (
        "upstream.error", ErrorCategory.UPSTREAM, True)
    assert error.details == {"status": status}


@pytest.mark.parametrize("status", [400, 404, 413, 422])
def test_it_maps_other_client_errors_to_a_final_upstream_error(status):
    error = upstream_error(status, openai_error("bad"), adapter=get_adapter("openai"))
    assert (error.code, error.retryable) == ("upstream.error", False)


def test_it_falls_back_to_the_uniform_message_when_no_adapter_yields_a_reason():
    error = upstream_error(418, "I am a teapot", adapter=get_adapter("openai"))
    assert error.message == "api error 418: unknown error"


def test_it_falls_back_to_the_uniform_message_without_an_adapter():
    error = upstream_error(502, HTML_502)
    assert error.message == "api error 502: unknown error"


def test_it_falls_back_when_transform_error_raises(caplog):
    class Broken:
        protocol = "broken"

        def transform_error(self, status, body):
            raise RuntimeError("hook bug")

    with caplog.at_level(logging.WARNING, logger="sage.upstream"):
        error = upstream_error(500, openai_error("boom"), adapter=Broken())
    assert error.message == "api error 500: unknown error"
    assert "transform_error of broken failed" in caplog.text


def test_it_keeps_the_raw_body_out_of_the_error_and_in_the_log(caplog):
    body = openai_error("quota exhausted", code="insufficient_quota") + " TRACE-7f3a"
    with caplog.at_level(logging.WARNING, logger="sage.upstream"):
        error = upstream_error(500, body, adapter=get_adapter("openai"))
    assert "TRACE-7f3a" not in json.dumps(error.to_dict())
    assert "TRACE-7f3a" in caplog.text
    assert any(r.name == "sage.upstream" and r.levelno == logging.WARNING for r in caplog.records)


def test_it_redacts_the_clients_own_key_from_the_message():
    error = upstream_error(401, ollama_error("key abc-secret-999 rejected"),
                           adapter=get_adapter("openai"), secrets=("abc-secret-999",))
    assert error.message == "key *** rejected"


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
