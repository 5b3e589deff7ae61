"""API token authentication: DRF's ``Authorization: Token <key>`` scheme, looked up lean.

Every API request authenticates, so the lookup is on the path of every submit. DRF's own
class builds an ORM query (``select_related("user").get(key=…)``) per request, which costs
more CPU in the web process than the database spends answering it. This class answers the
same thing — the token's user, refused when the key is unknown or the user inactive, with
DRF's messages — from one SQL statement written once per process (on PostgreSQL a
prepared statement: planning its join cost the server twice what running it does).
"""

from __future__ import annotations

from functools import cache
from typing import Any

from django.contrib.auth import get_user_model
from django.db import connection
from django.db.models.expressions import Col
from rest_framework import authentication, exceptions
from rest_framework.authtoken.models import Token

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


class TokenAuthentication(authentication.TokenAuthentication):
    """``Authorization: Token <key>``: the same answers as DRF's class, one raw statement."""

    def authenticate_credentials(self, key: str) -> tuple[Any, Token]:
        sql, user_names, token_names, converters = _lookup()
        if connection.vendor == "postgresql":  # planning the join costs more than running it
            connection.ensure_connection()
            with connection.wrap_database_errors:
                row = prepared(connection.connection, sql, [key]).fetchone()
        else:
            with connection.cursor() as cursor:
                cursor.execute(sql, [key])
                row = cursor.fetchone()
        if row is None:
            raise exceptions.AuthenticationFailed("Invalid token.")
        values = list(row)
        for index, functions, column in converters:
            for convert in functions:
                values[index] = convert(values[index], column, connection)
        split = len(user_names)
        user = get_user_model().from_db(connection.alias, user_names, values[:split])
        if not user.is_active:
            raise exceptions.AuthenticationFailed("User inactive or deleted.")
        token = Token.from_db(connection.alias, token_names, values[split:])
        token.user = user
        return user, token
