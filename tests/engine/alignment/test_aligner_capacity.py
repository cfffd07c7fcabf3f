"""engine.alignment.capacity: the aligned streams the aligner keeps up with, from what its calls cost
by batch and how fast the streams make their audio, and the backlog that holds new streams back."""

from __future__ import annotations

import pytest

from engine.alignment.capacity import AlignerCapacity


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def window(clock: Clock, cost: AlignerCapacity, streams: int, calls: list[tuple[float, float, int]]) -> None:
    """`streams` aligned streams for one window, in which the aligner made `calls` (busy s, audio s,
    jobs)."""
    cost.streams(streams)
    clock.now += cost.window_s
    for busy_s, audio_s, jobs in calls:
        cost.batch(busy_s, audio_s, jobs)


def test_before_any_call_the_initial_streams_are_admitted() -> None:
    cost = AlignerCapacity(initial_streams=8, clock=Clock())
    assert cost.capacity(100) == 8 and cost.capacity(5) == 5
    assert cost.share(3) == 0.0 and cost.starts(100.0) > 0  # no price yet for a backlog


def test_the_throughput_at_the_largest_batch_measured_sets_the_capacity() -> None:
    clock = Clock()
    cost = AlignerCapacity(headroom=0.5, window_s=1.0, initial_streams=4, max_batch=32, clock=clock)
    window(clock, cost, 4, [(0.04, 4.0, 4)])  # four streams in real time: one call of four 1 s jobs
    assert cost.rate == pytest.approx(1.0) and cost.job_audio_s == pytest.approx(1.0)
    # one call measured: predicted in proportion out to its reach (8 more jobs), 12 jobs in 0.12 s
    assert cost.throughput() == pytest.approx(100.0)
    assert cost.capacity(1000) == 8  # 50 streams' worth, but no more than twice the four measured
    window(clock, cost, 8, [(0.05, 8.0, 8)] * 2)  # 8 jobs cost little more than 4: a fixed cost
    assert cost.calls.reach() == 16
    # 16 jobs along the last segment: 0.04 + 12 x 0.0025 s
    assert cost.throughput() == pytest.approx(16 / 0.07)
    assert cost.capacity(1000) == 16  # twice the 8 measured
    assert cost.capacity(10) == 10


def test_audio_made_faster_than_real_time_takes_more_of_the_aligner() -> None:
    clock = Clock()
    cost = AlignerCapacity(headroom=0.7, window_s=1.0, initial_streams=64, max_batch=32, clock=clock)
    for _ in range(30):  # ten streams made at four times real time, in calls of 20 one-second jobs
        window(clock, cost, 10, [(0.1, 20.0, 20), (0.1, 20.0, 20)])
    assert cost.rate == pytest.approx(4.0, rel=1e-2)
    assert cost.throughput() == pytest.approx(200.0)  # 32 jobs predicted past the 20 measured
    assert cost.capacity(1000) == 35  # 0.7 x 200 audio-s/s over 4 audio-s/s a stream
    assert cost.share(35) == pytest.approx(0.7, rel=1e-2)


def test_a_stream_counts_as_real_time_at_least() -> None:
    clock = Clock()
    cost = AlignerCapacity(window_s=1.0, clock=clock)
    window(clock, cost, 10, [(0.05, 2.0, 2)])  # ten streams, most still waiting for first audio
    assert cost.rate == 1.0


def test_the_backlog_is_priced_at_the_throughput_and_holds_new_streams_back() -> None:
    clock = Clock()
    cost = AlignerCapacity(backlog_limit_s=1.0, window_s=1.0, max_batch=8, clock=clock)
    assert cost.backlog_s(10.0) == 0.0
    window(clock, cost, 4, [(0.1, 8.0, 8)])  # 80 audio-s/s at 8 jobs
    assert cost.throughput() == pytest.approx(80.0)
    assert cost.backlog_s(40.0) == pytest.approx(0.5) and cost.starts(40.0) > 0
    assert cost.backlog_s(120.0) == pytest.approx(1.5) and cost.starts(120.0) == 0


def test_nonsense_calls_are_ignored() -> None:
    cost = AlignerCapacity(clock=Clock())
    cost.batch(0.1, 0.0, 1)
    cost.batch(0.1, 1.0, 0)
    cost.batch(-1.0, 1.0, 1)
    assert cost.throughput() is None and cost.calls.samples == 0


def test_a_rate_measured_while_load_drains_does_not_lower_the_capacity() -> None:
    clock = Clock()
    cost = AlignerCapacity(headroom=0.7, window_s=1.0, initial_streams=64, max_batch=32, clock=clock)
    for _ in range(30):  # 100 streams at twice real time
        window(clock, cost, 100, [(0.1, 100.0, 20), (0.1, 100.0, 20)])
    loaded = cost.capacity(1000)
    assert cost.rate == pytest.approx(2.0, rel=1e-2)
    for _ in range(10):  # 20 streams left, made at ten times real time by an engine now idle
        window(clock, cost, 20, [(0.1, 100.0, 20), (0.1, 100.0, 20)])
    assert cost.rate == pytest.approx(2.0, rel=1e-2) and cost.capacity(1000) == loaded
    for _ in range(30):  # 60 streams: half the most or more, so their rate counts again
        window(clock, cost, 60, [(0.1, 150.0, 20), (0.1, 150.0, 20)])
    assert cost.rate == pytest.approx(5.0, rel=2e-2)
