"""API token authentication: DRF's ``Authorization: Token <key>`` scheme, looked up lean.

Every API request authenticates, so the lookup is on the path of every submit. DRF's own
class builds an ORM query (``select_related("user").get(key=…)``) per request, which costs
more CPU in the web process than the database spends answering it. This class answers the
same thing — the token's user, refused when the key is unknown or the user inactive, with
DRF's messages — from one SQL statement written once per process (on PostgreSQL a
prepared statement: planning its join cost the server twice what running it does).

The express lane's submissions (`sagehost.express`) go further: `authenticate_cached`
answers from a per-process cache of token rows (``CACHE_SECONDS``, at most ``CACHE_SIZE``
keys) and gives the request a `Credential` (`sageproject.credentials`) — the same question
in SQL — that the admission asks again inside its own transaction (on PostgreSQL inside its
one statement, so the cache saves a round trip and grants nothing: a token deleted, a user
deactivated or whose staff or superuser flag changed, admits nothing; the lane then sends
the request the long way, which looks the token up afresh).
"""

from __future__ import annotations

import threading
import time
from functools import cache
from typing import Any

from django.contrib.auth import get_user_model
from django.db import connection
from django.db.models.expressions import Col
from rest_framework import authentication, exceptions
from rest_framework.authtoken.models import Token

from sageproject.credentials import Credential
from sageproject.db import prepared


@cache
def _lookup() -> tuple[str, list[str], list[str], list[tuple[int, list[Any], Col]]]:
    """The statement (for the default database), the user's and the token's field names,
    and the database's value converters per column (as the ORM applies them: datetimes
    made aware on SQLite and MySQL, for example)."""
    user_model = get_user_model()
    quote = connection.ops.quote_name
    user_fields = list(user_model._meta.concrete_fields)
    token_fields = list(Token._meta.concrete_fields)
    columns = [f"u.{quote(f.column)}" for f in user_fields] + [
        f"t.{quote(f.column)}" for f in token_fields
    ]
    user_column = quote(Token._meta.get_field("user").column)
    sql = (
        f"SELECT {', '.join(columns)} FROM {quote(Token._meta.db_table)} t "
        f"JOIN {quote(user_model._meta.db_table)} u "
        f"ON u.{quote(user_model._meta.pk.column)} = t.{user_column} "
        f"WHERE t.{quote(Token._meta.get_field('key').column)} = %s"
    )
    converters = []
    for index, (alias, field) in enumerate(
        [("u", f) for f in user_fields] + [("t", f) for f in token_fields]
    ):
        column = Col(alias, field)
        functions = connection.ops.get_db_converters(column) + column.get_db_converters(connection)
        if functions:
            converters.append((index, functions, column))
    return sql, [f.attname for f in user_fields], [f.attname for f in token_fields], converters


@cache
def credential_sql() -> str:
    """The `Credential` question for the default database: the token (first parameter)
    still names the user (second), who is active and whose staff and superuser flags are
    still the given ones (third and fourth)."""
    user = get_user_model()._meta
    quote = connection.ops.quote_name
    return (
        f"EXISTS (SELECT 1 FROM {quote(Token._meta.db_table)} t"
        f" JOIN {quote(user.db_table)} u"
        f" ON u.{quote(user.pk.column)} = t.{quote(Token._meta.get_field('user').column)}"
        f" WHERE t.{quote(Token._meta.get_field('key').column)} = %s"
        f" AND u.{quote(user.pk.column)} = %s"
        f" AND u.{quote(user.get_field('is_active').column)}"
        f" AND u.{quote(user.get_field('is_staff').column)} = %s"
        f" AND u.{quote(user.get_field('is_superuser').column)} = %s)"
    )


# The express lane's cache of token rows: how long a row is used before it is read again,
# and how many keys are kept (the one read longest ago goes first).
CACHE_SECONDS = 60.0
CACHE_SIZE = 4096


class TokenAuthentication(authentication.TokenAuthentication):
    """``Authorization: Token <key>``: the same answers as DRF's class, one raw statement."""

    def __init__(self) -> None:
        super().__init__()
        self._rows: dict[str, tuple[float, list[Any]]] = {}
        self._rows_lock = threading.Lock()

    def authenticate_credentials(self, key: str) -> tuple[Any, Token]:
        return self._authenticated(self._row(key))

    def _authenticated(self, values: list[Any] | None) -> tuple[Any, Token]:
        """The user and token of a row of `_row`; DRF's refusals for none, or an inactive
        user."""
        if values is None:
            raise exceptions.AuthenticationFailed("Invalid token.")
        user, token = self._objects(values)
        if not user.is_active:
            raise exceptions.AuthenticationFailed("User inactive or deleted.")
        return user, token

    def authenticate_cached(self, request: Any) -> tuple[Any, Token, Any] | None:
        """(user, token, `Credential`) for the request's ``Authorization: Token <key>``,
        from the cache when it holds the key (see the module text); None for a header
        DRF's scheme would refuse or explain (the caller goes the long way, which answers
        it). Raises ``AuthenticationFailed`` as `authenticate_credentials` does."""
        parts = authentication.get_authorization_header(request).split()
        if len(parts) != 2 or parts[0].lower() != self.keyword.lower().encode():
            return None
        try:
            key = parts[1].decode()
        except UnicodeError:
            return None
        now = time.monotonic()
        entry = self._rows.get(key)
        if entry is not None and now - entry[0] < CACHE_SECONDS:
            user, token = self._objects(entry[1])
        else:
            self.forget(key)
            values = self._row(key)
            user, token = self._authenticated(values)  # unknown, inactive: not kept
            with self._rows_lock:
                self._rows[key] = (now, values)
                while len(self._rows) > CACHE_SIZE:
                    del self._rows[next(iter(self._rows))]
        credential = Credential(credential_sql(), (key, user.pk, user.is_staff, user.is_superuser))
        return user, token, credential

    def forget(self, key: str) -> None:
        """Drop ``key``'s cached row (its credential was refused): the next request reads it."""
        with self._rows_lock:
            self._rows.pop(key, None)

    def _row(self, key: str) -> list[Any] | None:
        """The token's and its user's columns, converted as the ORM converts them."""
        sql, _, _, converters = _lookup()
        if connection.vendor == "postgresql":  # planning the join costs more than running it
            connection.ensure_connection()
            with connection.wrap_database_errors:
                row = prepared(connection.connection, sql, [key]).fetchone()
        else:
            with connection.cursor() as cursor:
                cursor.execute(sql, [key])
                row = cursor.fetchone()
        if row is None:
            return None
        values = list(row)
        for index, functions, column in converters:
            for convert in functions:
                values[index] = convert(values[index], column, connection)
        return values

    def _objects(self, values: list[Any]) -> tuple[Any, Token]:
        """A fresh user and token from a row of `_row` (each request its own objects)."""
        _, user_names, token_names, _ = _lookup()
        split = len(user_names)
        user = get_user_model().from_db(connection.alias, user_names, values[:split])
        token = Token.from_db(connection.alias, token_names, values[split:])
        token.user = user
        return user, token
