"""Model-record names are unique per owner and among shared records, on every database.

A unique constraint with a condition (``owner IS NULL``) is never created on MySQL/MariaDB;
the stored ``owner_key`` column (owner id, 0 when shared) makes one plain constraint work
everywhere, and the API answers a taken name with 409 ``model_record.name_conflict``.
"""

from __future__ import annotations

import pytest
from django.core.exceptions import ValidationError as ModelValidationError
from django.db import IntegrityError, transaction

from pooling import services
from pooling.models import ModelRecord, Protocol
from sageproject.errors import SageError

pytestmark = [pytest.mark.storage, pytest.mark.django_db]


def _record(name: str, owner=None, **fields) -> ModelRecord:
    return ModelRecord(owner=owner, name=name, protocol=Protocol.SCRIPTED, model=name, **fields)


def test_it_refuses_two_shared_records_with_one_name_in_the_database():
    _record("gpt").save()
    with pytest.raises(IntegrityError), transaction.atomic():
        _record("gpt").save()
    assert ModelRecord.objects.filter(owner__isnull=True, name="gpt").count() == 1


def test_it_refuses_two_records_of_one_owner_with_one_name_in_the_database(alice):
    _record("gpt", alice).save()
    with pytest.raises(IntegrityError), transaction.atomic():
        _record("gpt", alice).save()


def test_it_lets_each_owner_and_the_shared_records_use_the_same_name(alice, bob):
    for owner in (None, alice, bob):
        _record("gpt", owner).save()
    keys = set(ModelRecord.objects.filter(name="gpt").values_list("owner_key", flat=True))
    assert keys == {0, alice.pk, bob.pk}


def test_it_refuses_a_taken_shared_name_in_the_service_with_a_conflict():
    services.model_record_save(record=_record("gpt"))
    with pytest.raises(SageError) as conflict:
        services.model_record_save(record=_record("gpt"))
    assert conflict.value.code == "model_record.name_conflict"
    assert conflict.value.http_status == 409


def test_it_lets_a_record_be_saved_again_under_its_own_name():
    record = services.model_record_save(record=_record("gpt"))
    record.model = "gpt-2"
    assert services.model_record_save(record=record).model == "gpt-2"


def test_it_reports_a_taken_shared_name_in_model_validation():
    # What the admin's form shows instead of an IntegrityError.
    _record("gpt").save()
    with pytest.raises(ModelValidationError) as invalid:
        _record("gpt").full_clean()
    assert "already exists" in str(invalid.value)


def test_it_answers_409_when_a_user_reuses_one_of_their_names(alice_api):
    body = {"name": "gpt", "protocol": "scripted", "model": "gpt"}
    assert alice_api.post("/api/v1/model-records/", body, format="json").status_code == 201
    response = alice_api.post("/api/v1/model-records/", body, format="json")
    assert response.status_code == 409
    assert response.json()["error"]["code"] == "model_record.name_conflict"


def test_it_answers_409_when_staff_rename_a_shared_record_to_a_taken_name(staff_api):
    _record("gpt").save()
    other = _record("claude")
    other.save()
    response = staff_api.patch(f"/api/v1/model-records/{other.pk}/", {"name": "gpt"}, format="json")
    assert response.status_code == 409
    assert response.json()["error"]["code"] == "model_record.name_conflict"
    other.refresh_from_db()
    assert other.name == "claude"
