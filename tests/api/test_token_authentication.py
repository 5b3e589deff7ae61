"""API tokens (``Authorization: Token <key>``): the lean lookup answers as DRF's class does,
on every database."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from sageproject.authentication import TokenAuthentication

pytestmark = [pytest.mark.storage, pytest.mark.django_db]


def client_with(key: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {key}")
    return client


def test_a_token_authenticates_its_user_with_one_query(alice, bob):
    token = Token.objects.create(user=alice)
    Token.objects.create(user=bob)
    with CaptureQueriesContext(connection) as queries:
        user, found = TokenAuthentication().authenticate_credentials(token.key)
    # PostgreSQL's is a prepared statement, outside Django's query log (tested below).
    assert len(queries) == (0 if connection.vendor == "postgresql" else 1)
    assert (user.pk, user.username, user.is_active) == (alice.pk, "alice", True)
    assert user.check_password("alice-password")  # every field came back, the hash too
    assert (found.key, found.user_id, found.created) == (token.key, alice.pk, token.created)
    assert found.user is user


def test_the_api_answers_the_tokens_user(alice, bob):
    Token.objects.create(user=bob)
    key = Token.objects.create(user=alice).key
    response = client_with(key).get("/api/v1/sessions/")
    assert response.status_code == 200


@pytest.mark.parametrize("key", ["0" * 40, "nope", "x' OR '1'='1"])
def test_an_unknown_key_is_refused_in_the_envelope(alice, key):
    Token.objects.create(user=alice)
    response = client_with(key).get("/api/v1/runs/")
    assert response.status_code == 401
    error = response.json()["error"]
    assert error["category"] == "AUTHENTICATION"
    assert "Invalid token" in error["message"]


def test_an_inactive_users_token_is_refused(alice):
    key = Token.objects.create(user=alice).key
    alice.is_active = False
    alice.save(update_fields=["is_active"])
    response = client_with(key).get("/api/v1/runs/")
    assert response.status_code == 401
    assert "inactive" in response.json()["error"]["message"]


def test_a_deleted_token_stops_working_at_once(alice):
    token = Token.objects.create(user=alice)
    client = client_with(token.key)
    assert client.get("/api/v1/runs/").status_code == 200
    token.delete()
    assert client.get("/api/v1/runs/").status_code == 401


def test_the_users_datetimes_come_back_as_the_orm_gives_them(alice):
    from django.utils import timezone

    alice.last_login = timezone.now()
    alice.save(update_fields=["last_login"])
    key = Token.objects.create(user=alice).key
    user, _ = TokenAuthentication().authenticate_credentials(key)
    expected = type(alice).objects.get(pk=alice.pk)
    assert (user.last_login, user.date_joined) == (expected.last_login, expected.date_joined)
    assert timezone.is_aware(user.last_login)


def test_the_lookup_is_a_prepared_statement_on_postgresql(alice):
    """Planned once per connection: planning the token-user join cost the server about
    twice what running it does, on every API request."""
    if connection.vendor != "postgresql":
        pytest.skip("prepared statements are PostgreSQL's")
    key = Token.objects.create(user=alice).key
    for _ in range(3):
        user, _token = TokenAuthentication().authenticate_credentials(key)
        assert user.pk == alice.pk
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement, generic_plans + custom_plans FROM pg_prepared_statements")
        prepared = cursor.fetchall()
    lookups = [n for text, n in prepared if "authtoken_token" in text]
    assert lookups == [3], prepared


def _reading(monkeypatch) -> list[str]:
    """The keys `TokenAuthentication` reads from the database, as it reads them."""
    reads: list[str] = []
    row = TokenAuthentication._row

    def counting(self, key):
        reads.append(key)
        return row(self, key)

    monkeypatch.setattr(TokenAuthentication, "_row", counting)
    return reads


def _cached(authenticator: TokenAuthentication, key: str) -> Any:
    from django.test import RequestFactory

    request = RequestFactory().post("/api/v1/runs/", HTTP_AUTHORIZATION=f"Token {key}")
    user, token, credential = authenticator.authenticate_cached(request)
    assert (token.key, credential.params[:2]) == (key, (key, user.pk))
    return user


def test_the_lanes_cache_reads_a_row_again_once_it_is_old(alice, monkeypatch):
    from sageproject import authentication

    reads = _reading(monkeypatch)
    key = Token.objects.create(user=alice).key
    authenticator = TokenAuthentication()
    _cached(authenticator, key)
    _cached(authenticator, key)
    assert reads == [key]
    monkeypatch.setattr(authentication, "CACHE_SECONDS", 0.0)
    assert _cached(authenticator, key).pk == alice.pk
    assert reads == [key, key]


def test_the_lanes_cache_keeps_at_most_its_size_the_oldest_read_going_first(
    alice, bob, monkeypatch
):
    from sageproject import authentication

    reads = _reading(monkeypatch)
    monkeypatch.setattr(authentication, "CACHE_SIZE", 1)
    first, second = Token.objects.create(user=alice).key, Token.objects.create(user=bob).key
    authenticator = TokenAuthentication()
    for key in (first, first, second, second, first):
        _cached(authenticator, key)
    assert reads == [first, second, first]
