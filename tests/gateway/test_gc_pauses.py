"""The garbage collector's pauses, timed by a gc.callbacks hook (gateway/gc_pauses.py) and read by
/metrics at scrape time."""

from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path

from prometheus_client import generate_latest

from gateway.gc_pauses import BUCKETS_S, GcPauses
from gateway.metrics import GatewayMetrics

ROOT = Path(__file__).resolve().parents[2]


def test_a_full_collection_is_timed_counted_and_kept_for_the_window() -> None:
    pauses = GcPauses().install()
    try:
        garbage = [[i] for i in range(200_000)]  # something for the collection to walk
        gc.collect(2)
        del garbage
    finally:
        pauses.uninstall()
    full = {g: (counts, total) for g, counts, total in pauses.histograms()}[2]
    assert full[0][-1] >= 1 and full[1] > 0  # counted (the +Inf bucket holds all) and timed
    assert 0 < pauses.longest_s() <= sum(total for _, _, total in pauses.histograms())
    assert pauses._callback not in gc.callbacks
    before = [(g, list(c)) for g, c, _ in pauses.histograms()]
    gc.collect(2)  # uninstalled: no longer timed
    assert [(g, list(c)) for g, c, _ in pauses.histograms()] == before


def test_pauses_fill_cumulative_buckets_per_generation() -> None:
    now = [0.0]
    pauses = GcPauses(clock=lambda: now[0])
    for generation, seconds in ((0, 0.0015), (0, 0.03), (2, 0.25), (2, 3.0)):
        pauses._callback("start", {"generation": generation})
        now[0] += seconds
        pauses._callback("stop", {"generation": generation})
    got = {g: (counts, round(total, 6)) for g, counts, total in pauses.histograms()}
    assert set(got) == {0, 2}  # generation 1 never paused: no series
    upper = list(BUCKETS_S)
    assert got[0][0] == [sum(s <= b for s in (0.0015, 0.03)) for b in upper] + [2]
    assert got[2][0] == [sum(s <= b for s in (0.25, 3.0)) for b in upper] + [2]
    assert got[0][1] == 0.0315 and got[2][1] == 3.25


def test_pauses_older_than_the_window_are_forgotten() -> None:
    now = [100.0]
    pauses = GcPauses(window_s=60.0, clock=lambda: now[0])
    pauses._callback("start", {"generation": 2})
    now[0] += 0.3
    pauses._callback("stop", {"generation": 2})
    now[0] += 1.0
    pauses._callback("start", {"generation": 0})
    now[0] += 0.01
    pauses._callback("stop", {"generation": 0})
    assert abs(pauses.longest_s() - 0.3) < 1e-9
    now[0] += 59.5  # the 0.3 s pause ended 60.51 s ago: out of the window
    assert abs(pauses.longest_s() - 0.01) < 1e-9
    now[0] += 1.0
    assert pauses.longest_s() == 0.0
    pauses._callback("stop", {"generation": 1})  # a stop without its start is ignored
    assert pauses.longest_s() == 0.0


def test_metrics_expose_the_pauses_at_scrape_time() -> None:
    now = [0.0]
    pauses = GcPauses(clock=lambda: now[0])
    metrics = GatewayMetrics()
    metrics.watch_gc(pauses)
    pauses._callback("start", {"generation": 1})
    now[0] += 0.004
    pauses._callback("stop", {"generation": 1})
    lines = dict(
        line.rsplit(" ", 1)
        for line in generate_latest(metrics.registry).decode().splitlines()
        if line and not line.startswith("#")
    )
    assert float(lines['cadence_gc_pause_seconds_count{generation="1"}']) == 1.0
    assert abs(float(lines['cadence_gc_pause_seconds_sum{generation="1"}']) - 0.004) < 1e-9
    assert float(lines['cadence_gc_pause_seconds_bucket{generation="1",le="0.002"}']) == 0.0
    assert float(lines['cadence_gc_pause_seconds_bucket{generation="1",le="0.005"}']) == 1.0
    assert abs(float(lines["cadence_gc_pause_longest_seconds"]) - 0.004) < 1e-9


COLLECTION_UNDER_METRIC_LOCKS = """
import gc
from gateway.gc_pauses import GcPauses
from gateway.metrics import GatewayMetrics
metrics = GatewayMetrics()
pauses = GcPauses().install()
metrics.watch_gc(pauses)
locks = [c._lock for c in list(metrics.registry._collector_to_names) if hasattr(c, "_lock")]
for lock in locks:
    lock.acquire()
gc.collect()  # as a collection started inside a scrape would, with a metric's lock held
for lock in locks:
    lock.release()
print(len(locks) >= 3, sum(counts[-1] for _, counts, _ in pauses.histograms()))
"""


def test_a_collection_while_a_metric_lock_is_held_completes() -> None:
    """A collection can start inside any allocation, a scrape's too, while prometheus_client holds a
    metric's lock (a scrape copies a metric's children under it). A hook observing a
    prometheus_client metric would then wait for that lock forever; this one takes no lock."""
    out = subprocess.run(
        [sys.executable, "-c", COLLECTION_UNDER_METRIC_LOCKS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.split() == ["True", "1"]
