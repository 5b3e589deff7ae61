"""Under ASGI the REST API's views run on the event loop's thread pool (several requests of
one web process at once); elsewhere they are left as Django runs them."""

from __future__ import annotations

import inspect

import pytest
from django.test import AsyncRequestFactory
from drf_spectacular.generators import SchemaGenerator
from rest_framework.authtoken.models import Token

from sageproject import api_urls
from sageproject.api import concurrent_patterns
from scheduling.models import Run


def _api_patterns():
    return [p for p in api_urls.router.urls if hasattr(p.callback, "cls")]


def test_outside_asgi_the_views_are_left_as_they_are(monkeypatch):
    monkeypatch.delenv("SAGE_ASGI", raising=False)
    patterns = _api_patterns()
    assert concurrent_patterns(patterns) is patterns


def test_under_asgi_every_view_becomes_async_and_keeps_what_drf_and_the_schema_read(
    monkeypatch,
):
    monkeypatch.setenv("SAGE_ASGI", "1")
    wrapped = concurrent_patterns(_api_patterns())
    assert wrapped
    for pattern, original in zip(wrapped, _api_patterns(), strict=True):
        assert inspect.iscoroutinefunction(pattern.callback)
        assert pattern.callback.cls is original.callback.cls
        assert pattern.callback.csrf_exempt
        assert pattern.name == original.name
    schema = SchemaGenerator(patterns=wrapped).get_schema(request=None, public=True)
    assert "/runs/" in schema["paths"]


@pytest.mark.django_db(transaction=True)
async def test_a_wrapped_view_admits_a_run_from_a_pool_thread(monkeypatch, alice, make_session):
    from asgiref.sync import sync_to_async

    monkeypatch.setenv("SAGE_ASGI", "1")
    session = await sync_to_async(make_session)(alice)
    token = (await sync_to_async(Token.objects.get_or_create)(user=alice))[0].key
    runs_list = next(p for p in concurrent_patterns(_api_patterns()) if p.name == "run-list")
    request = AsyncRequestFactory().post(
        "/api/v1/runs/",
        {"session": str(session.pk), "input": "hi"},
        content_type="application/json",
        headers={"Authorization": f"Token {token}"},
    )

    response = await runs_list.callback(request)

    assert response.status_code == 202
    response.render()
    assert b'"status":"queued"' in response.content.replace(b" ", b"")
    assert await Run.objects.filter(session_id=session.pk).acount() == 1
