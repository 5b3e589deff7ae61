"""A run renders exactly as its serializer's declared fields would render it (the
representation is built directly, the fields stay the schema)."""

from __future__ import annotations

import json

import pytest
from django.utils import timezone
from rest_framework import serializers
from rest_framework.renderers import JSONRenderer

from agents.api.runs import RunSerializer
from scheduling import runs
from scheduling.models import Run, RunStatus

pytestmark = pytest.mark.django_db


def _rendered(data) -> dict:
    return json.loads(JSONRenderer().render(data))


def test_every_kind_of_run_renders_as_its_declared_fields_would(alice, make_session, settings):
    settings.SAGE = {**settings.SAGE, "SAGE_SERVER_MAX_PENDING_RUNS": 100}
    session = make_session(alice)
    queued, _ = runs.admit(owner=alice, session_id=session.pk, input="hi")
    done, _ = runs.admit(owner=alice, session_id=session.pk, input={"text": "structured"})
    failed, _ = runs.admit(owner=alice, session_id=session.pk, input="x", priority=-7)
    parked, _ = runs.admit(owner=alice, session_id=session.pk, input="y")
    now = timezone.now()
    Run.objects.filter(pk=done.pk).update(
        status=RunStatus.COMPLETED,
        result={"text": "ok", "steps": 1},
        started_at=now,
        finished_at=now,
        attempts=1,
    )
    Run.objects.filter(pk=failed.pk).update(
        status=RunStatus.FAILED,
        finished_at=now,
        crashes=3,
        cancel_requested=True,
        error={"code": "execution.worker_restarted", "category": "INTERNAL", "message": "m"},
    )
    Run.objects.filter(pk=parked.pk).update(
        status=RunStatus.SUSPENDED,
        interaction={"id": "i1", "allowed_decisions": ["retry"]},
    )
    child = Run.objects.create(
        session=session, owner=alice, parent_id=done.pk, input="step", queue="managed"
    )
    for run in Run.objects.filter(pk__in=[queued.pk, done.pk, failed.pk, parked.pk, child.pk]):
        serializer = RunSerializer(run)
        generic = serializers.ModelSerializer.to_representation(serializer, run)
        assert _rendered(serializer.data) == _rendered(generic)
        assert list(serializer.data) == list(serializer.fields)  # the schema's fields, in order
