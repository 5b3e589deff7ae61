"""Reading a ``GET /metrics`` answer in tests: the Prometheus text parsed into samples."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from rest_framework.test import APIClient

Labels = tuple[tuple[str, str], ...]


class Scrape:
    """The samples of one exposition by name and labels, and each family's type and help."""

    def __init__(self, text: str) -> None:
        self.samples: dict[str, dict[Labels, float]] = {}
        self.types: dict[str, str] = {}
        self.helps: dict[str, str] = {}
        for family in text_string_to_metric_families(text):
            self.types[family.name] = family.type
            self.helps[family.name] = family.documentation
            for sample in family.samples:
                labels = tuple(sorted(sample.labels.items()))
                self.samples.setdefault(sample.name, {})[labels] = sample.value

    def value(self, name: str, **labels: str) -> float | None:
        """The sample ``name`` with exactly ``labels``; None when there is none."""
        return self.samples.get(name, {}).get(tuple(sorted(labels.items())))

    def series(self, name: str, **labels: str) -> dict[Labels, float]:
        """Every sample ``name`` whose labels include ``labels``."""
        wanted = set(labels.items())
        return {k: v for k, v in self.samples.get(name, {}).items() if wanted <= set(k)}

    def total(self, name: str, **labels: str) -> float:
        """The sum of `series` (0 when there is none)."""
        return sum(self.series(name, **labels).values())


# The bearer token the `metrics_dir` fixture sets.
TOKEN = "metrics-token-0123456789abcdef"


@pytest.fixture(name="metrics_dir")
def metrics_dir_fixture(tmp_path, settings) -> Path:
    """A metrics directory of the test's own (the web counters' files), and `TOKEN` set as
    ``SAGE_METRICS_TOKEN``. Register it with ``from tests.scrape import metrics_dir_fixture``
    and ``metrics_dir = metrics_dir_fixture``."""
    path = tmp_path / "metrics"
    settings.SAGE = {**settings.SAGE, "SAGE_METRICS_DIR": str(path), "SAGE_METRICS_TOKEN": TOKEN}
    return path


def scrape(client: APIClient | None = None) -> Scrape:
    """``GET /metrics`` in process with the bearer token; 200 or the test fails."""
    client = client or APIClient()
    response = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert response.status_code == 200, response.content[:500]
    return Scrape(response.content.decode())


def assert_run_families_match(got: Scrape) -> None:
    """Every run and queue family of ``got`` equals the database's own count, per queue."""
    from scheduling.models import TERMINAL_STATUSES, Run, RunQueue, RunStatus

    for queue in RunQueue.values:
        rows = Run.objects.filter(queue=queue)
        for status in RunStatus.values:
            count = rows.filter(status=status).count()
            assert got.value("sage_runs", status=status, queue=queue) == count, (status, queue)
            if status in TERMINAL_STATUSES:
                finished = got.value("sage_runs_finished_total", queue=queue, outcome=status)
                assert finished == count, (status, queue)
        assert got.value("sage_runs_submitted_total", queue=queue) == rows.count()
        started = rows.filter(started_at__isnull=False).count()
        assert got.value("sage_runs_started_total", queue=queue) == started
        queued = rows.filter(status=RunStatus.QUEUED).count()
        assert got.value("sage_queue_depth", queue=queue) == queued
