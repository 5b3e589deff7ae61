"""A caller's authentication, asked again inside the transaction that acts on it.

The express lane authenticates an API token from a per-process cache
(`sageproject.authentication`); what it grants must still hold in the database when a run
is admitted. The admission (`scheduling.runs.admit`) checks the `Credential` in its own
transaction, so a cache never grants what the database no longer does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections


@dataclass(slots=True)
class Credential:
    """What the caller authenticated the owner with, checked again inside the admission's
    transaction. ``sql`` is a boolean SQL expression (``%s`` placeholders for ``params``)
    that holds while the credential still names the owner with the rights the caller went
    by. A caller that authenticated from a cache of its own passes one, so that its cache
    grants nothing the database no longer does: an admission whose credential no longer
    holds admits nothing and raises `CredentialRefused`. ``checked`` is set once the
    admission has found it holding (what the admission answers after that — its run, or a
    refusal such as a full queue — is the owner's)."""

    sql: str
    params: tuple[Any, ...]
    checked: bool = False


class CredentialRefused(Exception):
    """The admission's `Credential` no longer holds: nothing was admitted."""


def check_credential(credential: Credential, using: str = DEFAULT_DB_ALIAS) -> None:
    """Raise `CredentialRefused` unless ``credential`` holds now (in the caller's
    transaction, when one is open); marks it checked."""
    with connections[using].cursor() as cursor:
        cursor.execute(f"SELECT CASE WHEN {credential.sql} THEN 1 ELSE 0 END", credential.params)
        (holds,) = cursor.fetchone()
    if not holds:
        raise CredentialRefused
    credential.checked = True
