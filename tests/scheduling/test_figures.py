"""A worker's counters and histograms for /metrics (`scheduling.figures`, Django-free)."""

from __future__ import annotations

import json

from scheduling import figures
from scheduling.figures import Figures


def test_counters_add_up_by_labels():
    counted = Figures()
    counted.count(figures.SUSPENSIONS, code="model.queue_full")
    counted.count(figures.SUSPENSIONS, code="model.queue_full")
    counted.count(figures.SUSPENSIONS, code="upstream.rate_limited")
    counted.count(figures.LEASE_RECLAIMS, 3)
    counted.count(figures.LEASE_RECLAIMS, 0)  # nothing: no empty series either
    counted.count(figures.FENCE_REJECTIONS, 0, write="renew")
    snapshot = counted.snapshot()
    assert snapshot["counters"] == {
        figures.SUSPENSIONS: [
            [{"code": "model.queue_full"}, 2],
            [{"code": "upstream.rate_limited"}, 1],
        ],
        figures.LEASE_RECLAIMS: [[{}, 3]],
    }
    assert json.loads(json.dumps(snapshot)) == snapshot


def test_a_histogram_counts_each_value_in_the_first_bucket_that_holds_it():
    counted = Figures()
    bounds = figures.BUCKETS[figures.START_WAIT]
    for value in (0.005, 0.0051, 0.7, 10_000, -1):
        counted.observe(figures.START_WAIT, value, queue="chat")
    entry = counted.snapshot()["histograms"][figures.START_WAIT]
    assert entry["bounds"] == list(bounds)
    [[labels, data]] = entry["series"]
    assert labels == {"queue": "chat"}
    cumulative = dict(zip(bounds, data["buckets"], strict=True))
    assert cumulative[0.005] == 2  # -1 counts as 0; a value on a bound is in that bucket
    assert cumulative[0.01] == 3
    assert cumulative[0.5] == 3
    assert cumulative[1] == 4
    assert cumulative[bounds[-1]] == 4  # 10,000 s is past every bound: only in +Inf
    assert data["count"] == 5
    assert data["sum"] == round(0.005 + 0.0051 + 0.7 + 10_000, 6)


def test_label_sets_are_bounded():
    counted = Figures()
    for i in range(figures.MAX_SERIES + 10):
        counted.count(figures.MODEL_TOKENS, 1, model=f"m{i}", type="input")
        counted.observe(figures.FIRST_TOKEN, 0.1, model=f"m{i}")
    counted.count(figures.MODEL_TOKENS, 1, model="m0", type="input")  # a known one still counts
    series = dict(
        (json.dumps(labels, sort_keys=True), value)
        for labels, value in counted.snapshot()["counters"][figures.MODEL_TOKENS]
    )
    assert len(series) == figures.MAX_SERIES + 1
    assert series[json.dumps({"model": "other", "type": "input"}, sort_keys=True)] == 10
    assert series[json.dumps({"model": "m0", "type": "input"}, sort_keys=True)] == 2
    histograms = counted.snapshot()["histograms"][figures.FIRST_TOKEN]["series"]
    assert len(histograms) == figures.MAX_SERIES + 1
