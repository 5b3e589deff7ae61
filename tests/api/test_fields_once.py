"""`sageproject.api.FieldsOnceMixin`: a serializer's fields built once per class, each
instance binding copies of its own — and the answers DRF's own copies give."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from rest_framework import serializers

from agents.api.runs import RunSubmitSerializer
from sageproject.api import FieldsOnceMixin


class DrfCopies(RunSubmitSerializer):
    """The submission's serializer with DRF's own per-instance deep copies."""

    def get_fields(self) -> dict[str, Any]:
        return serializers.Serializer.get_fields(self)


SESSION = str(uuid.uuid4())
BODIES = [
    {"session": SESSION, "input": "hi"},
    {"session": SESSION, "input": "hi", "priority": -5, "multitask": "reject"},
    {"session": "not a uuid", "input": ""},
    {"session": SESSION, "input": "x" * 100_001},
    {"session": SESSION, "input": "hi", "priority": 101, "multitask": "sideways"},
    {"session": SESSION, "input": "hi", "priority": "high"},
    {"session": SESSION, "input": "hi", "unknown": 1},
    {},
    [],
]


@pytest.mark.parametrize("body", BODIES)
def test_it_answers_as_drfs_own_copies_do(body):
    ours, drfs = RunSubmitSerializer(data=body), DrfCopies(data=body)
    assert ours.is_valid() == drfs.is_valid()
    assert ours.errors == drfs.errors
    if not ours.errors:
        assert ours.validated_data == drfs.validated_data


def test_each_instance_binds_copies_of_its_own():
    first, second = RunSubmitSerializer(data={}), RunSubmitSerializer(data={})
    for name, field in first.fields.items():
        other = second.fields[name]
        assert field is not other
        assert (field.parent, other.parent) == (first, second)
        assert field.field_name == other.field_name == name
    built = RunSubmitSerializer.__dict__["_built_fields"]
    assert all(field.parent is None for field in built.values())  # never bound


def test_a_nested_serializer_is_refused():
    class Inner(serializers.Serializer):
        name = serializers.CharField()

    class Outer(FieldsOnceMixin, serializers.Serializer):
        inner = Inner()

    with pytest.raises(ImproperlyConfigured, match="nested"):
        Outer(data={}).fields  # noqa: B018 - building the fields is the test
