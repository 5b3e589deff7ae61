"""Which model record a run uses: the owner's own before the shared one of that name."""

from __future__ import annotations

import pytest

from agents.applications import find_model_record
from pooling.models import ModelRecord, Protocol
from sageproject.errors import SageError

pytestmark = [pytest.mark.storage, pytest.mark.django_db]


def record(name: str, owner=None) -> ModelRecord:
    return ModelRecord.objects.create(
        owner=owner, name=name, protocol=Protocol.SCRIPTED, model=f"{name}-{owner}", options={}
    )


def test_it_uses_the_owners_own_record_before_the_shared_one(alice, bob):
    shared = record("m")
    own = record("m", owner=alice)
    assert find_model_record(alice.pk, "m").pk == own.pk
    assert find_model_record(bob.pk, "m").pk == shared.pk


def test_it_never_uses_another_users_record(alice, bob):
    record("private", owner=bob)
    with pytest.raises(SageError) as missing:
        find_model_record(alice.pk, "private")
    assert missing.value.code == "server.model_not_configured"
