"""API tokens (``Authorization: Token <key>``): the lean lookup answers as DRF's class does,
on every database."""

from __future__ import annotations

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
