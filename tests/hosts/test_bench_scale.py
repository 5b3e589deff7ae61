"""``manage.py bench_scale`` in a tiny configuration on the test database: real ``runworker``
subprocesses, one and then two. Checks the lines' exact keys, that every measured run is
counted once among the workers, and that nothing is left behind. No timing is asserted."""

from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from pooling.models import ModelRecord
from scheduling.models import WorkerSnapshot
from tests.benchmarks.test_benchmarks import assert_nothing_left, run_command

pytestmark = [pytest.mark.storage, pytest.mark.django_db(transaction=True)]


def test_it_prints_a_line_per_worker_count_and_a_summary():
    lines = run_command(
        "bench_scale", "--workers", "2,1", "--concurrency", "2", "--model-ms", "50",
        "--seconds", "0.5", "--users", "2", "--timeout", "120",
    )  # fmt: skip
    assert [line["path"] for line in lines] == ["scale", "scale", "scale_summary"]
    one, two, summary = lines
    assert set(one) == set(two) == {"path", "workers", "runs_per_s", "per_worker_runs"}
    # 2 slots x (1000 / 50 ms) runs/s x 0.5 s per worker, each counted by the worker that
    # completed it.
    assert (one["workers"], sum(one["per_worker_runs"]), len(one["per_worker_runs"])) == (1, 20, 1)
    assert (two["workers"], sum(two["per_worker_runs"]), len(two["per_worker_runs"])) == (2, 40, 2)
    assert one["runs_per_s"] > 0 and two["runs_per_s"] > 0
    assert set(summary) == {"path", "ratio_2_over_1", "max_share_spread"}
    assert summary["ratio_2_over_1"] == round(two["runs_per_s"] / one["runs_per_s"], 3)
    counts = two["per_worker_runs"]
    assert summary["max_share_spread"] == round((max(counts) - min(counts)) / 20, 3)
    assert_nothing_left()
    assert WorkerSnapshot.objects.count() == 0
    assert not ModelRecord.objects.filter(name__startswith="bench-scale-").exists()


def test_bad_options_are_refused():
    with pytest.raises(CommandError, match="--workers"):
        call_command("bench_scale", "--workers", "0,2", stdout=StringIO())
    with pytest.raises(CommandError, match="--concurrency must be positive"):
        call_command("bench_scale", "--concurrency", "0", stdout=StringIO())
