"""The web processes' own counters: 429 answers of the API, by error code.

The API's exception handler counts each 429 it answers (`rate_limited`); ``GET /metrics``
(`sagehost.metrics`) reads the totals of every web process (`families`). They are kept in
prometheus_client's multiprocess file format: each process adds to its own file in
``SAGE_METRICS_DIR`` (default ``.local/metrics``) and a scrape sums them all. Counters of
processes that have exited are folded into one file (``counter_archive.db``) under a lock
when a process starts counting and at every scrape, so the directory stays small and
totals survive web-process restarts. One directory per host: process ids identify files.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path

from django.conf import settings
from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.mmap_dict import MmapedDict, mmap_key
from prometheus_client.multiprocess import MultiProcessCollector

logger = logging.getLogger("sage.metrics")

API_RATE_LIMITED = "sage_api_rate_limited"
API_RATE_LIMITED_HELP = "Answers 429 of the API (all web processes), by error code."
ARCHIVE_FILE = "counter_archive.db"


def metrics_dir() -> Path:
    """``SAGE_METRICS_DIR``, or ``metrics`` in the project's local directory."""
    configured = settings.SAGE.get("SAGE_METRICS_DIR")
    return Path(configured) if configured else Path(settings.LOCAL_DIR) / "metrics"


@contextlib.contextmanager
def _dir_lock(path: Path) -> Iterator[None]:
    """The directory's lock: held while dead processes' files are folded and while a scrape
    reads, so a scrape never sees a count twice or not at all."""
    with open(path / ".lock", "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _fold_dead(path: Path) -> None:
    """Add the counters of exited processes into the archive file and remove their files
    (the caller holds the directory's lock)."""
    dead = []
    for name in glob.glob(str(path / "counter_*.db")):
        pid = Path(name).stem.removeprefix("counter_")
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            dead.append(name)
    if not dead:
        return
    archive = MmapedDict(str(path / ARCHIVE_FILE))
    try:
        for name in dead:
            for key, value, _timestamp, _pos in MmapedDict.read_all_values_from_file(name):
                total, _ = archive.read_value(key)
                archive.write_value(key, total + value, 0.0)
    finally:
        archive.close()
    for name in dead:
        os.remove(name)


class _ProcessCounters:
    """This process's counters in ``counter_<pid>.db`` of the metrics directory."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._opened: tuple[Path, int] | None = None
        self._file: MmapedDict | None = None
        self._values: dict[str, float] = {}

    def _open(self) -> MmapedDict:
        place = (metrics_dir(), os.getpid())
        if self._file is not None and self._opened == place:
            return self._file
        if self._file is not None:
            self._file.close()
        path = place[0]
        path.mkdir(parents=True, exist_ok=True)
        with _dir_lock(path):
            _fold_dead(path)
        self._file = MmapedDict(str(path / f"counter_{place[1]}.db"))
        self._opened, self._values = place, {}
        return self._file

    def add(self, metric: str, labels: dict[str, str], help_text: str, amount: float) -> None:
        key = mmap_key(metric, f"{metric}_total", list(labels), list(labels.values()), help_text)
        with self._lock:
            file = self._open()
            if key not in self._values:
                self._values[key] = file.read_value(key)[0]
            self._values[key] += amount
            file.write_value(key, self._values[key], 0.0)


_process_counters = _ProcessCounters()


def rate_limited(code: str) -> None:
    """Count one 429 answer of the API (``code``: the error's). Never raises: a metrics
    problem must not turn an answer into a 500."""
    try:
        _process_counters.add(API_RATE_LIMITED, {"code": code}, API_RATE_LIMITED_HELP, 1)
    except Exception as exc:
        logger.warning("could not count a 429 answer: %s", exc)


def families() -> list[Metric]:
    """The counters of every web process of this host, summed, as Prometheus families
    (a scrape's share: `sagehost.metrics`)."""
    family = CounterMetricFamily(API_RATE_LIMITED, API_RATE_LIMITED_HELP, labels=["code"])
    path = metrics_dir()
    if path.is_dir():
        with _dir_lock(path):
            _fold_dead(path)
            files = glob.glob(str(path / "counter_*.db"))
            merged = MultiProcessCollector.merge(files, accumulate=True)
        totals: dict[str, float] = {}
        for metric in merged:
            if metric.name != API_RATE_LIMITED:
                continue
            for sample in metric.samples:
                code = sample.labels.get("code", "")
                totals[code] = totals.get(code, 0) + sample.value
        for code, value in sorted(totals.items()):
            family.add_metric([code], value)
    return [family]
