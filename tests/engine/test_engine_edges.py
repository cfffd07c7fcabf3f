"""Edges of the engine contract for the engines outside Qwen3: a stream cancelled before its engine
has begun to serve it still gives its place back."""

from __future__ import annotations

import asyncio

import pytest

from engine.api import AudioChunk, SynthesisRequest, SynthesisStream, TextSegment
from tests.engine.vllm_omni.conftest import engine_for, sim  # noqa: F401 (a fixture)
from tests.engine.vllm_omni.simulator import RunningSimulator

pytestmark = pytest.mark.timeout(30)


async def test_a_vllm_omni_stream_cancelled_as_it_opens_frees_its_place(sim: RunningSimulator) -> None:  # noqa: F811
    """open() starts the stream's task; a cancel in the same turn of the loop (the agent hung up
    at once) cancels that task before its first step, so none of its own cleanup runs: the engine
    must still take the place back, or one slot is lost for good per such cancel."""
    engine = engine_for(sim, max_streams=1, queue_limit=0)
    await engine.start()
    try:
        stream = engine.open(SynthesisRequest("first"))
        stream.cancel()
        await asyncio.sleep(0.05)  # the cancelled task has ended
        assert engine.load().active == 0 and engine.admission.figures().admitted == 0
        assert engine.load().extra["open_streams"] == 0
        second = engine.open(SynthesisRequest("second"))  # Overloaded while the place is held
        second.push(TextSegment("The place is free again.", 0))
        second.close_text()
        chunks = await asyncio.wait_for(_collect(second), 10)
        assert chunks[-1].final and sum(len(c.samples) for c in chunks) > 0
    finally:
        await engine.stop()


async def _collect(stream: SynthesisStream) -> list[AudioChunk]:
    return [chunk async for chunk in stream]
