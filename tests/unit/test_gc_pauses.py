"""The garbage collector's pauses, timed by a gc.callbacks hook (gateway/gc_pauses.py)."""

from __future__ import annotations

import gc

from gateway.gc_pauses import GcPauses


def test_a_full_collection_is_timed_observed_and_kept_for_the_window() -> None:
    seen: list[tuple[int, float]] = []
    pauses = GcPauses(lambda generation, seconds: seen.append((generation, seconds))).install()
    try:
        garbage = [[i] for i in range(200_000)]  # something for the collection to walk
        gc.collect(2)
        del garbage
    finally:
        pauses.uninstall()
    full = [s for g, s in seen if g == 2]
    assert full and all(s > 0 for s in full)
    assert pauses.longest_s() == max(s for _, s in seen)
    assert pauses._callback not in gc.callbacks
    seen.clear()
    gc.collect(2)  # uninstalled: no longer timed
    assert seen == []


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
