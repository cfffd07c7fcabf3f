"""While a sync stream holds or awaits a place, aligned streams are held to what the wrapped engine
says its step keeps at the sync streams' pace (engine.qwen3.capacity `sync_capacity`, reported as
the `admission_sync_streams` load figure): sync audio goes out word by word, so a listener runs dry
between releases when the engine makes audio only a little faster than real time."""

from __future__ import annotations

import dataclasses

import pytest

from engine.alignment.engine import PACE_REFRESH_S, AlignedEngine
from engine.api import EngineLoad, SynthesisRequest, TextSegment
from engine.qwen3.capacity import SYNC_HEADROOM, StepCapacity
from tests.engine.alignment.fakes import SpreadAligner
from tests.fakes import FakeEngine

FRAME_S = 0.08


class PacedEngine(FakeEngine):
    """FakeEngine whose load says how many streams its step keeps at the sync pace."""

    sync_streams: float | None = 2.0

    def load(self) -> EngineLoad:
        load = super().load()
        if self.sync_streams is None:
            return load
        return dataclasses.replace(load, extra={**load.extra, "admission_sync_streams": self.sync_streams})


def request(rid: str, mode: str) -> SynthesisRequest:
    return SynthesisRequest(request_id=rid, language="English", word_alignment=mode)


def open_held(engine: AlignedEngine, rid: str, mode: str):
    """A stream that holds its place: its text stays open."""
    stream = engine.open(request(rid, mode))
    stream.push(TextSegment("Hello there.", 0))
    return stream


def waiting(streams) -> list[bool]:
    return [s.queue_position() is not None for s in streams]


def test_the_step_curve_keeps_fewer_streams_at_the_sync_pace_than_in_real_time():
    capacity = StepCapacity(frame_s=FRAME_S, initial_streams=4)
    for rows in (50, 100, 200, 400, 600):
        capacity.step(rows, 0.01 + rows * 0.00012)  # 10 ms a step plus 0.12 ms a row
    real_time = capacity.capacity(1000)  # within 0.7 of a frame: 56 ms -> 383 rows
    paced = capacity.sync_capacity(1000)  # within a third of a frame: 26.7 ms -> 138 rows
    assert real_time == 383
    assert paced == int((SYNC_HEADROOM * FRAME_S - 0.01) / 0.00012) == 138
    assert capacity.figures(100, 1000)["admission_sync_streams"] == paced


def test_before_any_step_costs_more_than_the_pace_the_initial_streams_are_kept():
    capacity = StepCapacity(frame_s=FRAME_S, initial_streams=8)
    assert capacity.sync_capacity(1000) == 8
    capacity.step(4, 0.005)
    assert capacity.sync_capacity(1000) >= 8
    capacity.step(6, 0.2)  # one step far past the pace: the curve, not the initial count, decides
    assert capacity.sync_capacity(1000) < 6


async def test_sync_streams_past_the_engines_pace_wait_and_start_as_places_free(engines):
    inner = PacedEngine()
    engine = await engines(inner, SpreadAligner())
    streams = [open_held(engine, f"s{i}", "sync") for i in range(4)]
    assert waiting(streams) == [False, False, True, True]
    streams[0].close_text()
    streams[0].cancel()
    assert waiting(streams[1:]) == [False, False, True]
    for stream in streams[1:]:
        stream.cancel()


async def test_async_streams_are_not_held_to_the_sync_pace_until_a_sync_stream_comes(engines):
    inner = PacedEngine()
    engine = await engines(inner, SpreadAligner())
    quick = [open_held(engine, f"a{i}", "async") for i in range(3)]
    assert waiting(quick) == [False, False, False]
    late = open_held(engine, "s", "sync")  # three aligned streams already: past the pace's two
    assert late.queue_position() is not None
    for stream in [*quick, late]:
        stream.cancel()


async def test_streams_the_engine_serves_without_the_aligner_count_against_the_pace(engines):
    inner = PacedEngine()
    inner.sync_streams = 3.0
    engine = await engines(inner, SpreadAligner())
    plain = open_held(engine, "off", "off")
    streams = [open_held(engine, f"s{i}", "sync") for i in range(3)]
    assert waiting(streams) == [False, False, True]
    for stream in [plain, *streams]:
        stream.cancel()


async def test_a_sync_stream_is_admitted_even_when_the_engine_keeps_none_at_the_pace(engines):
    inner = PacedEngine()
    inner.sync_streams = 0.0
    engine = await engines(inner, SpreadAligner())
    streams = [open_held(engine, f"s{i}", "sync") for i in range(2)]
    assert waiting(streams) == [False, True]
    for stream in streams:
        stream.cancel()


async def test_an_engine_that_reports_no_pace_leaves_sync_streams_to_the_aligners_capacity(engines):
    inner = PacedEngine()
    inner.sync_streams = None
    engine = await engines(inner, SpreadAligner())
    streams = [open_held(engine, f"s{i}", "sync") for i in range(5)]
    assert waiting(streams) == [False] * 5
    for stream in streams:
        stream.cancel()


@pytest.mark.parametrize("switch_to", ["sync", "async"])
async def test_a_mode_set_before_the_first_chunk_decides_whether_the_pace_holds(engines, switch_to):
    inner = PacedEngine()
    inner.sync_streams = 1.0
    engine = await engines(inner, SpreadAligner())
    first = open_held(engine, "first", "async")
    first.set_word_alignment(switch_to)
    engine._pace = (float("-inf"), None)  # read the figure again, as PACE_REFRESH_S on would
    second = open_held(engine, "second", "async")
    assert second.queue_position() is None if switch_to == "async" else second.queue_position() is not None
    assert PACE_REFRESH_S > 0
    for stream in (first, second):
        stream.cancel()
