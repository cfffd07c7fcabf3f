"""The real eSpeak engine on this machine, offered twice the capacity it measures (closed loop, a
few seconds): the excess is queued or refused at once, the queue stays within its limit, admitted
streams keep ahead of their listeners, and the engine's figures count what happened."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import pytest

from clients.client import PlaybackClock
from engine.api import Overloaded, SynthesisRequest, TextSegment
from engine.espeak.engine import SAMPLE_RATE, EspeakEngine

pytestmark = pytest.mark.timeout(120)

TEXT = "The quick brown fox jumps over the lazy dog. It runs all the way back home again."
QUEUE_LIMIT = 16
# the player's buffer: admission keeps the worker within its headroom of real time, and a shared
# two-core machine may still pause the process now and then; a whole second of margin
BUFFER_MS = 1000.0


@dataclass
class Tally:
    admitted_at_once: int = 0
    queued: int = 0
    refused: int = 0
    finished: int = 0
    underrun_streams: int = 0
    most_queued: int = 0
    positions: list[int] = field(default_factory=list)


async def one(engine: EspeakEngine, rid: str, tally: Tally) -> float:
    """One request: its Retry-After when refused, 0 when served."""
    try:
        stream = engine.open(SynthesisRequest(rid, language="English"))
    except Overloaded as refusal:
        tally.refused += 1
        return refusal.retry_after_s
    position = stream.queue_position()
    if position is None:
        tally.admitted_at_once += 1
    else:
        tally.queued += 1
        tally.positions.append(position.position)
    tally.most_queued = max(tally.most_queued, engine.load().queued)
    stream.push(TextSegment(TEXT, 0))
    stream.close_text()
    player = PlaybackClock(SAMPLE_RATE, BUFFER_MS)
    async for chunk in stream:
        if len(chunk.samples):
            player.on_packet(len(chunk.samples), time.perf_counter())
    tally.finished += 1
    tally.underrun_streams += player.underruns > 0
    return 0.0


async def closed_loop(engine: EspeakEngine, streams: int, seconds: float, tally: Tally) -> None:
    stop = time.perf_counter() + seconds
    ids = iter(range(10**9))

    async def client(k: int) -> None:
        while time.perf_counter() < stop:
            retry = await one(engine, f"c{k}-{next(ids)}", tally)
            if retry:
                await asyncio.sleep(min(retry, 0.5))  # a client honouring Retry-After, kept short here

    await asyncio.gather(*(client(k) for k in range(streams)))


async def test_twice_the_measured_capacity() -> None:
    engine = EspeakEngine(queue_limit=QUEUE_LIMIT)
    await engine.start()
    try:
        warm = Tally()
        await closed_loop(engine, 96, 1.5, warm)  # the load that shows what the worker keeps
        capacity = engine.load().capacity
        before = engine.load().admission
        assert before is not None and 1 <= capacity <= before.max_streams
        tally = Tally()
        await closed_loop(engine, 2 * capacity, 3.0, tally)
        after = engine.load().admission
        assert after is not None
    finally:
        await engine.stop()
    offered = tally.admitted_at_once + tally.queued + tally.refused
    assert offered > 2 * capacity  # every client asked at least once
    assert tally.queued + tally.refused > 0  # the excess waited or was refused, at once (open returned)
    assert tally.most_queued <= QUEUE_LIMIT and all(1 <= p <= QUEUE_LIMIT for p in tally.positions)
    assert tally.finished == tally.admitted_at_once + tally.queued  # nothing admitted was lost
    assert tally.underrun_streams == 0
    # the engine's counts are what the clients saw
    assert after.admitted_total - before.admitted_total == tally.admitted_at_once + tally.queued
    assert after.queued_total - before.queued_total == tally.queued
    assert after.refused["queue_full"] - before.refused["queue_full"] == tally.refused
    assert after.wait_counts[-1] - before.wait_counts[-1] == tally.queued
    assert after.admitted == 0 and after.queued == 0
