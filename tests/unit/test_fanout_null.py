"""The null engine's ticker keeps its phase through a stall: every stream's chunks stay on the grid
they started on (a shifted phase would move every stream's packets by up to a tick, which the
fan-out bench would count as gateway lag), and the stall's chunks come all at once at the next tick."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from engine.api import SynthesisRequest, TextSegment
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
    phase = np.array([((t - t0) / TICK_S + 0.5) % 1.0 - 0.5 for t, _ in arrivals[12:]])  # in ticks
    assert abs(float(np.median(phase))) < 0.15  # the old grid (the stall alone would shift it by 0.5)
    offsets = [o for _, o in arrivals]
    assert offsets == sorted(offsets) and len(set(offsets)) == len(offsets)  # nothing lost or repeated
    caught_up = [t for t, _ in arrivals[10:12]]
    assert max(caught_up) - min(caught_up) < 0.5 * TICK_S  # what the stall owed came at one tick


async def test_every_tick_serves_the_streams_in_the_order_they_opened() -> None:
    engine = NullEngine()
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
