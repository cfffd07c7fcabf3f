"""A voice released by the multi-process worker engine leaves its worker processes too: two
workers running the test fake (an engine that clones) on the CPU."""

from __future__ import annotations

import numpy as np
import pytest

from engine.api import SynthesisRequest, TextSegment, UnknownVoice
from engine.workers import WorkerPoolEngine, WorkerSpec, WorkerStream
from tests.engine.workers.test_worker_pool import collect, wait_for
from tests.fakes import FakeEngine

pytestmark = pytest.mark.timeout(60)

CLIP = (0.3 * np.sin(np.arange(32_000) / 16_000 * 2 * np.pi * 180)).astype(np.float32)


def opened_on_each_worker(pool: WorkerPoolEngine, voice: str, tag: str) -> list[WorkerStream]:
    """One stream per worker: opened together, least-loaded routing spreads them."""
    streams = [pool.open(SynthesisRequest(request_id=f"s/{tag}{i}", voice=voice)) for i in range(2)]
    assert {s.worker.index for s in streams if s.worker is not None} == {0, 1}
    for stream in streams:
        stream.push(TextSegment("Hello there.", char_start=0))
        stream.close_text()
    return streams


async def test_a_released_voice_leaves_every_worker() -> None:
    pool = WorkerPoolEngine([WorkerSpec(FakeEngine, {}, f"w{i}") for i in range(2)])
    await pool.start()
    try:
        await wait_for(lambda: all(w is not None and w.alive for w in pool.workers))
        await pool.register_voice("grace", CLIP, 16_000, "hello")
        for stream in opened_on_each_worker(pool, "grace", "before"):
            assert (await collect(aiter(stream)))[-1].final
        await pool.unregister_voice("grace")
        with pytest.raises(UnknownVoice):
            pool.open(SynthesisRequest(request_id="s/after", voice="grace"))
        # past the pool's own check, every worker refuses it: none of them keeps it
        pool._voices["grace"] = (CLIP, 16_000, "hello")
        for stream in opened_on_each_worker(pool, "grace", "worker"):
            with pytest.raises(UnknownVoice):
                await collect(aiter(stream))
    finally:
        await pool.stop()
