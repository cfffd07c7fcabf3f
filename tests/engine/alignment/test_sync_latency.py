"""Sync mode's added delay after a segment is complete: one aligner call, plus at most the call in
progress when the segment's job arrived. A fake aligner of known cost stands in for the model."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence

import numpy as np
import pytest

from engine.alignment.api import AlignedWord, AlignInput
from engine.alignment.engine import AlignedEngine
from engine.api import (
    AudioChunk,
    EngineInfo,
    EngineLoad,
    SynthesisRequest,
    SynthesisStream,
    TextSegment,
    WordTiming,
)
from tests.engine.alignment.fakes import SpreadAligner

RATE = 24_000
FRAME = 960  # 40 ms
CALL_S = 0.06


class CostlyAligner(SpreadAligner):
    """Every call takes CALL_S without holding the GIL, as a call waiting on a GPU does."""

    def __init__(self) -> None:
        super().__init__()
        self.warmed = 0

    def warm_up(self, max_batch: int) -> None:
        self.warmed += 1

    def align(self, batch: Sequence[AlignInput]) -> list[list[AlignedWord]]:
        time.sleep(CALL_S)
        return super().align(batch)


class PacedStream(SynthesisStream):
    """One segment of `frames` 40 ms frames made 10x faster than real time, its words on the last."""

    def __init__(self, request: SynthesisRequest, frames: int) -> None:
        self.request_id = request.request_id
        self.frames = frames
        self.segment: TextSegment | None = None
        self.completed_at: float | None = None

    def push(self, segment: TextSegment) -> None:
        self.segment = self.segment or segment

    def close_text(self) -> None: ...

    def cancel(self) -> None: ...

    def __aiter__(self) -> AsyncIterator[AudioChunk]:
        return self._run()

    async def _run(self) -> AsyncIterator[AudioChunk]:
        assert self.segment is not None
        text = self.segment.text
        for i in range(self.frames):
            await asyncio.sleep(FRAME / RATE / 10)
            words: tuple[WordTiming, ...] = ()
            if i == self.frames - 1:
                words = (WordTiming(text.strip(), 0, (i + 1) * FRAME, 0, len(text.strip()), "estimate"),)
                self.completed_at = time.perf_counter()
            yield AudioChunk(self.request_id, np.zeros(FRAME, np.float32), i * FRAME, words)
        yield AudioChunk(self.request_id, np.zeros(0, np.float32), self.frames * FRAME, final=True)


class PacedEngine:
    def __init__(self) -> None:
        self.info = EngineInfo(name="paced", model="silence", sample_rate=RATE)
        self.streams: list[PacedStream] = []

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def load(self) -> EngineLoad:
        return EngineLoad(active=len(self.streams), queued=0, capacity=64, queue_limit=0)

    def open(self, request: SynthesisRequest) -> PacedStream:
        self.streams.append(PacedStream(request, frames=10 + len(self.streams) % 3))
        return self.streams[-1]

    async def register_voice(self, *args: object) -> None: ...


async def added_after_segment(concurrency: int) -> tuple[list[float], CostlyAligner]:
    aligner = CostlyAligner()
    inner = PacedEngine()
    engine = AlignedEngine(inner, aligner, default_mode="sync")
    await engine.start()

    async def utterance(i: int) -> float:
        stream = engine.open(SynthesisRequest(request_id=f"u{i}", language="English"))
        stream.push(TextSegment("Hello there.", 0))
        stream.close_text()
        first_out = None
        async for chunk in stream:
            if first_out is None and len(chunk.samples):
                first_out = time.perf_counter()
        completed = inner.streams[i].completed_at
        assert first_out is not None and completed is not None
        return first_out - completed

    try:
        return list(await asyncio.gather(*(utterance(i) for i in range(concurrency)))), aligner
    finally:
        await engine.stop()


async def test_an_idle_aligner_starts_at_once():
    added, aligner = await added_after_segment(1)
    assert aligner.warmed == 1
    assert CALL_S <= added[0] < CALL_S + 0.04


@pytest.mark.parametrize("concurrency", [8, 24])
async def test_jobs_that_arrive_during_a_call_share_the_next_one(concurrency):
    added, aligner = await added_after_segment(concurrency)
    assert sum(len(batch) for batch in aligner.batches) == concurrency
    assert len(aligner.batches) <= 3  # segments end within ~8 ms of one another: no call per job
    assert max(added) < 2 * CALL_S + 0.04  # at worst the call in progress, then its own
