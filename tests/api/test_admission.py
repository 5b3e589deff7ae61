"""Concurrent admission on real databases: never over the limit, never lost, never doubled."""

from __future__ import annotations

import threading

import pytest
from django.db import connections

from agents import services
from sageproject.errors import SageError
from scheduling.models import Run

pytestmark = [pytest.mark.storage, pytest.mark.django_db(transaction=True)]


def _in_threads(count: int, target) -> list:
    results: list = [None] * count
    barrier = threading.Barrier(count)

    def run(index: int) -> None:
        barrier.wait()
        try:
            results[index] = target(index)
        except SageError as exc:
            results[index] = exc
        finally:
            connections.close_all()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return results


def test_it_never_admits_more_than_the_pending_limit(alice, make_session, settings):
    settings.SAGE = {**settings.SAGE, "SAGE_SERVER_MAX_PENDING_RUNS": 7}
    session = make_session(alice)
    results = _in_threads(16, lambda i: services.run_submit(owner=alice, session_id=session.pk,
                                                             input=f"r{i}"))
    admitted = [r for r in results if isinstance(r, tuple)]
    refused = [r for r in results if isinstance(r, SageError)]
    assert len(admitted) == 7
    assert len(refused) == 9
    assert {e.code for e in refused} == {"scheduler.queue_full"}
    assert Run.objects.count() == 7


def test_it_creates_one_run_for_one_idempotency_key(alice, make_session):
    session = make_session(alice)
    results = _in_threads(12, lambda i: services.run_submit(
        owner=alice, session_id=session.pk, input="same", idempotency_key="k"))
    ids = {run.pk for run, _created in results}
    assert len(ids) == 1
    assert sum(1 for _run, created in results if created) == 1
    assert Run.objects.count() == 1
