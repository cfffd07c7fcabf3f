"""engine.alignment.capacity: the aligner's share of real time by aligned streams, from what a second
of their audio costs it, and the backlog that holds new streams back."""

from __future__ import annotations

import pytest

from engine.alignment.capacity import AlignerCapacity


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def measured(clock: Clock, cost: AlignerCapacity, streams: int, busy_s: float, audio_s: float) -> None:
    """`streams` aligned streams for one window, in which the aligner spent `busy_s` on `audio_s`
    of their audio (no probes)."""
    cost.streams(streams)
    clock.now += cost.window_s
    cost.batch(busy_s, audio_s, audio_s)


def test_before_any_measurement_the_initial_streams_are_admitted() -> None:
    cost = AlignerCapacity(initial_streams=8, clock=Clock())
    assert cost.capacity(100) == 8 and cost.capacity(5) == 5
    assert cost.share(3) == 0.0 and cost.starts(100.0) > 0  # no price yet for a backlog


def test_a_window_prices_a_second_of_audio_and_the_capacity_follows() -> None:
    clock = Clock()
    cost = AlignerCapacity(headroom=0.7, window_s=1.0, clock=clock)
    cost.streams(1)
    clock.now = 0.5
    cost.batch(0.1, 0.5, 0.5)
    assert not cost.curve.curve()  # half a window: nothing observed yet
    clock.now = 1.0
    cost.batch(0.1, 0.5, 0.5)
    assert cost.cost_per_audio_s == pytest.approx(0.2)  # 0.2 s of aligner per second of audio
    assert cost.share(1) == pytest.approx(0.2) and cost.share(3) == pytest.approx(0.6)
    assert cost.capacity(100) == 3  # four would take 0.8 of real time
    assert cost.capacity(2) == 2


def test_a_second_costing_less_in_larger_batches_admits_more_than_in_proportion() -> None:
    clock = Clock()
    cost = AlignerCapacity(headroom=0.7, window_s=1.0, clock=clock)
    measured(clock, cost, 4, busy_s=0.12, audio_s=4.0)  # 4 streams: 0.12 of real time
    assert cost.capacity(1000) == 23  # in proportion from one point
    measured(clock, cost, 8, busy_s=0.18, audio_s=8.0)  # 8 streams: 0.18, not 0.24
    assert cost.share(8) == pytest.approx(0.18)
    assert cost.capacity(1000) == 42  # along the measured slope (in proportion to 8: 31)


def test_the_streams_are_counted_over_the_window_and_idle_time_is_no_window() -> None:
    clock = Clock()
    cost = AlignerCapacity(window_s=1.0, clock=clock)
    clock.now = 100.0  # idle since the start
    cost.streams(2)
    clock.now = 100.5
    cost.streams(4)
    clock.now = 101.0
    cost.batch(0.3, 3.0, 3.0)  # 3 streams on average over the window, 0.1 s per audio second
    (point,) = cost.curve.curve()
    assert point == pytest.approx((3.0, 0.3))


def test_probes_are_part_of_the_price_of_a_second_and_the_backlog_is_priced_per_second_aligned() -> None:
    clock = Clock()
    cost = AlignerCapacity(headroom=0.7, backlog_limit_s=1.0, window_s=1.0, clock=clock)
    cost.streams(1)
    clock.now = 1.0
    cost.batch(0.3, 1.5, 1.0)  # 1.5 s aligned, of which 1 s the stream's own: probes overlap
    assert cost.share(1) == pytest.approx(0.3)
    assert cost.cost_per_aligned_s == pytest.approx(0.2)
    assert cost.backlog_s(4.0) == pytest.approx(0.8) and cost.starts(4.0) > 0
    assert cost.backlog_s(6.0) == pytest.approx(1.2) and cost.starts(6.0) == 0


def test_audio_made_faster_than_real_time_takes_the_share_it_costs() -> None:
    clock = Clock()
    cost = AlignerCapacity(headroom=0.7, window_s=1.0, clock=clock)
    measured(clock, cost, 10, busy_s=0.4, audio_s=40.0)  # ten streams made at four times real time
    assert cost.cost_per_audio_s == pytest.approx(0.01)
    assert cost.share(10) == pytest.approx(0.4)  # not 10 x 0.01: what they made, as fast as it came
    assert cost.capacity(1000) == 17


def test_a_costly_first_window_above_the_load_since_is_forgotten() -> None:
    clock = Clock()
    cost = AlignerCapacity(headroom=0.7, window_s=0.5, initial_streams=64, clock=clock)
    measured(clock, cost, 64, busy_s=0.5, audio_s=4.0)  # a cold start: every second costly
    assert cost.capacity(1000) == 0
    held = []
    for _ in range(60):  # then fewer streams, each second cheap
        measured(clock, cost, 40, busy_s=0.05, audio_s=20.0)
        held.append(cost.capacity(1000) < 64)
    assert held[0] and not held[-1]
    assert cost.capacity(1000) >= 64  # the costly 64 forgotten: the curve reaches past 40 again
