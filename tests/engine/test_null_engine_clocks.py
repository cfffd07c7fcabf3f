"""The null engine's clocks keep their phase through a stall: every stream's chunks stay on the grid
they started on (a shifted phase would move every stream's packets by up to a tick, which the
fan-out bench would count as gateway lag), and the stall's chunks come all at once at the next tick.
Each stream's clock starts when its text comes (phase "stream"), or on one grid for all ("shared")."""

from __future__ import annotations

import asyncio
import time
from typing import Literal

import numpy as np
import pytest

from engine.api import EngineError, SynthesisRequest, TextSegment
from engine.null import TICK_S, NullEngine

pytestmark = pytest.mark.timeout(30)


async def test_the_ticker_keeps_its_phase_through_a_stall() -> None:
    engine = NullEngine()
    await engine.start()
    loop = asyncio.get_running_loop()
    try:
        stream = engine.open(SynthesisRequest("r"))
        stream.push(TextSegment("word " * 40, 0))  # ~14 s of audio
        stream.close_text()
        arrivals: list[tuple[float, int]] = []
        async for chunk in stream:
            arrivals.append((loop.time(), chunk.sample_offset))
            if len(arrivals) == 10:
                time.sleep(2.5 * TICK_S)  # noqa: ASYNC251 (the point: the event loop stalls 2.5 ticks)
            if len(arrivals) == 40:
                stream.cancel()
    finally:
        await engine.stop()
    t0 = arrivals[0][0]

    def phase(times: list[float]) -> float:  # the median position on the tick grid from t0, in ticks
        return float(np.median([((t - t0) / TICK_S + 0.5) % 1.0 - 0.5 for t in times]))

    # after the stall, the grid of the chunks before it (a lone late first chunk does not set it;
    # the stall alone would shift the phase by 0.5)
    before, after = phase([t for t, _ in arrivals[:10]]), phase([t for t, _ in arrivals[12:]])
    assert abs((after - before + 0.5) % 1.0 - 0.5) < 0.15  # on the circle of one tick
    offsets = [o for _, o in arrivals]
    assert offsets == sorted(offsets) and len(set(offsets)) == len(offsets)  # nothing lost or repeated
    caught_up = [t for t, _ in arrivals[10:12]]
    assert max(caught_up) - min(caught_up) < 0.5 * TICK_S  # what the stall owed came at one tick


async def test_every_tick_serves_the_streams_in_the_order_they_opened() -> None:
    engine = NullEngine(phase="shared")
    await engine.start()
    order: list[str] = []
    try:
        streams = [engine.open(SynthesisRequest(f"r{i}")) for i in range(60)]
        for stream in streams[::7]:  # some end early: the rest keep their order
            stream.cancel()
        live = [s for s in streams if not s.done]
        for stream in live:
            stream.push(TextSegment("word word", 0))
        ticks_before = 3
        for stream in live:  # record the order of the ticker's calls through each stream's channel
            put = stream._channel.put

            def recording(chunk: object, put: object = put, rid: str = stream.request_id) -> None:
                order.append(rid)
                put(chunk)  # type: ignore[operator]

            stream._channel.put = recording  # type: ignore[method-assign]
        await asyncio.sleep(ticks_before * TICK_S)
    finally:
        await engine.stop()
    expected = [s.request_id for s in live]
    rounds = [order[i : i + len(expected)] for i in range(0, len(order) - len(expected) + 1, len(expected))]
    assert rounds and all(r == expected for r in rounds)


async def _phase_gap_ms(engine: NullEngine, gap_s: float) -> tuple[float, float]:
    """Two streams whose text comes about `gap_s` apart: (how far apart their chunks fall within a
    tick, how far apart their texts came within a tick), in ms."""
    loop = asyncio.get_running_loop()
    pushed = [0.0, 0.0]
    times: list[list[float]] = [[], []]

    async def consume(index: int) -> None:
        stream = engine.open(SynthesisRequest(f"r{index}", forced_frames=5))  # 400 ms: 20 chunks
        pushed[index] = loop.time()
        stream.push(TextSegment("word " * 10, 0))
        stream.close_text()
        times[index] = [loop.time() async for _ in stream][:-1]  # the final (empty) chunk aside

    first = asyncio.create_task(consume(0))
    await asyncio.sleep(gap_s)
    await asyncio.gather(first, consume(1))
    phases = [float(np.median([(t - pushed[0]) % TICK_S for t in ts])) for ts in times]
    return _ms_apart(phases[1] - phases[0]), _ms_apart(pushed[1] - pushed[0])


def _ms_apart(delta: float) -> float:
    gap = delta % TICK_S
    return 1000.0 * min(gap, TICK_S - gap)


@pytest.mark.parametrize("phase", ["stream", "shared"])
async def test_a_streams_clock_starts_when_its_text_comes_unless_the_phase_is_shared(
    phase: Literal["stream", "shared"],
) -> None:
    engine = NullEngine(phase=phase)
    await engine.start()
    try:
        chunks_apart, texts_apart = await _phase_gap_ms(engine, 0.047)  # about 2 ticks and 7 ms
    finally:
        await engine.stop()
    assert texts_apart > 4.0
    expected = texts_apart if phase == "stream" else 0.0
    assert abs(chunks_apart - expected) < 2.0


async def test_stopping_the_engine_ends_a_waiting_consumer_with_an_engine_error() -> None:
    engine = NullEngine()
    await engine.start()
    stream = engine.open(SynthesisRequest("r"))  # no text: nothing comes

    async def first_chunk() -> object:
        return await anext(aiter(stream))

    consumer = asyncio.create_task(first_chunk())
    await asyncio.sleep(0.01)
    await engine.stop()
    with pytest.raises(EngineError, match="engine stopped"):
        await consumer
