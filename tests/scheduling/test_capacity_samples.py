"""The capacity history behind the capacity page's charts (``scheduling.samples``): at most
one sample per period however many workers offer one, pruned to the last day, and written
by a real worker with its snapshot."""

from __future__ import annotations

from datetime import timedelta

import pytest

from scheduling import samples
from scheduling.models import CapacitySample
from scheduling.runs import db_now
from tests.e2e.conftest import start_worker, wait_for  # noqa: F401  (the worker fixture)

pytestmark = [pytest.mark.storage, pytest.mark.django_db(transaction=True)]

FIGURES = {
    "per_user": {"7": {"active": 1, "pending": 2}},
    "per_queue": {"chat": {"active": 2, "pending": 5}, "managed": {"active": 1, "pending": 0}},
}


def _period_start():
    """The database's now, moved to the start of its sampling period."""
    now = db_now()
    return now - timedelta(seconds=now.timestamp() % samples.SAMPLE_SECONDS)


def test_workers_write_one_sample_per_period_between_them():
    start = _period_start()
    assert samples.record(FIGURES, now=start) is True
    # A second worker, later in the same period: nothing more is written.
    assert samples.record({"per_queue": {}}, now=start + timedelta(seconds=10)) is False
    assert samples.record(FIGURES, now=start + timedelta(seconds=samples.SAMPLE_SECONDS)) is True
    rows = list(
        CapacitySample.objects.order_by("slot").values_list("queued", "active", "per_queue")
    )
    assert rows == [(5, 3, FIGURES["per_queue"])] * 2


def test_the_history_is_pruned_to_the_last_day():
    start = _period_start()
    day = timedelta(seconds=samples.KEEP_SECONDS)
    for moment in (
        start - day - timedelta(minutes=5),
        start - day + timedelta(minutes=5),
        start + timedelta(hours=2),
    ):  # the last one is ahead of the clock
        CapacitySample.objects.create(slot=samples.slot_of(moment), time=moment)
    assert samples.record(FIGURES, now=start)
    kept = sorted(CapacitySample.objects.values_list("slot", flat=True))
    assert kept == [samples.slot_of(start - day + timedelta(minutes=5)), samples.slot_of(start)]
    assert CapacitySample.objects.count() <= samples.KEEP_SLOTS + 1


def test_the_charts_read_the_last_hour_oldest_first():
    start = _period_start()
    for minutes in (70, 45, 5, 30):
        moment = start - timedelta(minutes=minutes)
        CapacitySample.objects.create(slot=samples.slot_of(moment), time=moment, queued=minutes)
    assert [s.queued for s in samples.history(3600, now=start)] == [45, 30, 5]


def test_a_running_worker_records_samples(start_worker):  # noqa: F811
    start_worker()
    wait_for(lambda: CapacitySample.objects.exists(), message="the worker's first sample")
    sample = CapacitySample.objects.get()
    assert (sample.queued, sample.active, sample.per_queue) == (0, 0, {})
    assert abs((sample.time - db_now()).total_seconds()) < 60
