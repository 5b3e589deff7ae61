"""Writes of model records: the one door for the API (the admin validates the same
constraint through its form)."""

from __future__ import annotations

from django.db import IntegrityError, transaction

from pooling.models import ModelRecord
from sageproject.errors import ConflictError


def _name_taken(record: ModelRecord) -> bool:
    # owner_key is the owner's id, 0 for a shared record: the constraint's own index.
    others = ModelRecord.objects.filter(owner_key=record.owner_id or 0, name=record.name)
    if record.pk is not None:
        others = others.exclude(pk=record.pk)
    return others.exists()


def model_record_save(*, record: ModelRecord) -> ModelRecord:
    """Save ``record`` (new or changed) and return it.

    Names are unique per owner, and among shared records (owner null), on every database
    (the ``model_record_owner_key_name`` constraint). Raises ``model_record.name_conflict``
    (409) when the name is taken, whether found before the write or by the constraint when
    a concurrent write took it first.
    """
    if _name_taken(record):
        raise _conflict(record)
    try:
        with transaction.atomic():
            record.save()
    except IntegrityError:
        if _name_taken(record):
            raise _conflict(record) from None
        raise
    return record


def _conflict(record: ModelRecord) -> ConflictError:
    scope = "shared model records" if record.owner_id is None else "your model records"
    return ConflictError(
        "model_record.name_conflict",
        f"{scope} already include one named {record.name!r}",
        details={"fields": {"name": ["a model record with this name already exists"]}},
    )
