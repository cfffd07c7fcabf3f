"""The multi-process worker engine on the CPU: two worker processes (null or eSpeak engine),
least-loaded routing, cancellation across the process boundary, and a dying worker that fails
only its own requests."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import time
from collections.abc import AsyncIterator

import numpy as np
import pytest

from cadence.engines import EngineOptions, build_engine
from engine.api import AudioChunk, EngineError, SynthesisRequest, TextSegment, UnknownVoice
from engine.workers import WorkerPoolEngine, WorkerSpec

pytestmark = pytest.mark.timeout(60)

LONG_TEXT = "This sentence is long enough to keep a null engine busy for several seconds of audio. " * 3


def pool_of(engine_name: str, workers: int = 2) -> WorkerPoolEngine:
    factory = functools.partial(build_engine, EngineOptions(name=engine_name))
    return WorkerPoolEngine([WorkerSpec(factory, {"CADENCE_WORKER": str(i)}, f"w{i}") for i in range(workers)])


async def started(engine_name: str) -> WorkerPoolEngine:
    pool = pool_of(engine_name)
    await pool.start()
    return pool


def speak(pool: WorkerPoolEngine, rid: str, text: str):  # type: ignore[no-untyped-def]
    stream = pool.open(SynthesisRequest(request_id=rid))
    stream.push(TextSegment(text, char_start=0))
    stream.close_text()
    return stream


async def collect(stream: AsyncIterator[AudioChunk]) -> list[AudioChunk]:
    return [chunk async for chunk in stream]


async def wait_for(predicate, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


async def test_espeak_speaks_through_a_worker_process() -> None:
    pool = await started("espeak")
    try:
        assert pool.info.name == "espeak" and pool.info.sample_rate > 0
        chunks = await collect(speak(pool, "s/u1", "Hello from a worker process."))
        assert chunks[-1].final
        audio = np.concatenate([c.samples for c in chunks])
        assert len(audio) > pool.info.sample_rate // 2 and float(np.abs(audio).max()) > 0.01
        words = [w.text for c in chunks for w in c.words]
        assert words[0] == "Hello" and words[-1].startswith("process")
        with pytest.raises(UnknownVoice):
            pool.open(SynthesisRequest(request_id="s/u2", voice="nobody"))
    finally:
        await pool.stop()


async def test_new_requests_go_to_the_least_loaded_worker() -> None:
    pool = await started("null")
    try:
        await wait_for(lambda: all(w is not None and w.load is not None for w in pool.workers))
        streams = [speak(pool, f"s/u{i}", LONG_TEXT) for i in range(4)]
        per_worker = [len(w.in_flight) for w in pool.workers if w is not None]
        assert per_worker == [2, 2]
        assert [s.worker.index for s in streams] == [0, 1, 0, 1]
        # the worker with fewer requests gets the next one
        streams[0].cancel()
        streams[2].cancel()
        nxt = speak(pool, "s/u9", LONG_TEXT)
        assert nxt.worker.index == 0
        await wait_for(lambda: pool.load().active == 3)
        assert pool.load().extra["workers_alive"] == 2
        # each worker reports its process's CPU time; the pool sums them (the load test's CPU share)
        assert 0 < pool.load().extra["worker_cpu_seconds"] < 600
        for s in (streams[1], streams[3], nxt):
            s.cancel()
    finally:
        await pool.stop()


async def test_cancel_crosses_the_process_boundary() -> None:
    pool = await started("null")
    try:
        stream = speak(pool, "s/u1", LONG_TEXT)
        got: list[AudioChunk] = []
        async for chunk in stream:
            got.append(chunk)
            if len(got) == 3:
                stream.cancel()
        assert len(got) == 3 and not got[-1].final  # iteration ended at the cancel
        # the worker's engine dropped the stream: its reported load goes back to zero
        await wait_for(lambda: pool.load().active == 0, 3.0)
        assert not any(w.in_flight for w in pool.workers if w is not None)
    finally:
        await pool.stop()


async def test_a_dying_worker_fails_only_its_own_requests() -> None:
    pool = await started("null")
    try:
        victim_stream = speak(pool, "s/victim", LONG_TEXT)
        other_stream = speak(pool, "s/other", "Short and sweet.")
        assert victim_stream.worker.index != other_stream.worker.index
        victim = victim_stream.worker

        async def run_victim() -> str:
            try:
                async for _ in victim_stream:
                    pass
            except EngineError as exc:
                return str(exc)
            return "ended without error"

        victim_task = asyncio.create_task(run_victim())
        other_task = asyncio.create_task(collect(other_stream))
        await asyncio.sleep(0.2)
        os.kill(victim.process.pid, signal.SIGKILL)
        assert "died" in await asyncio.wait_for(victim_task, 10)
        other_chunks = await asyncio.wait_for(other_task, 10)
        assert other_chunks[-1].final  # the other worker's request finished normally
        # the pool stays ready on the survivor, and starts a replacement
        assert pool.load().ready
        await wait_for(lambda: pool.restarts == 1 and len(pool.live_workers()) == 2, 30.0)
        chunks = await collect(speak(pool, "s/after", "Back again."))
        assert chunks[-1].final
    finally:
        await pool.stop()


async def test_a_loop_pass_of_worker_messages_crosses_the_pipe_as_one_batch_in_order() -> None:
    from engine.workers import WorkerPoolEngine, _Worker, _WorkerLoop

    class Pipe:
        def __init__(self) -> None:
            self.sent: list[tuple[object, ...]] = []

        def send(self, message: tuple[object, ...]) -> None:
            self.sent.append(message)

    pipe = Pipe()
    loop = _WorkerLoop(pipe, WorkerSpec(lambda: None))  # type: ignore[arg-type]
    chunks = [AudioChunk(f"u{i % 3}", np.zeros(8, np.float32), 8 * i) for i in range(9)]
    for i, c in enumerate(chunks):
        loop.post("chunk", i % 3, c)
    loop.post("end", 0)
    assert pipe.sent == []  # nothing leaves before the loop pass ends
    await asyncio.sleep(0)
    assert len(pipe.sent) == 1 and pipe.sent[0][0] == "batch"
    batch = pipe.sent[0][1]
    assert [m[0] for m in batch] == ["chunk"] * 9 + ["end"]
    assert [m[2].sample_offset for m in batch[:9]] == [c.sample_offset for c in chunks]

    # the gateway side takes a batch apart in order
    pool = WorkerPoolEngine([WorkerSpec(lambda: None)])  # type: ignore[arg-type]
    from engine.bridge import LoopChunkChannel

    channel = LoopChunkChannel()
    pool._channels[0] = channel
    pool._on_message(_Worker(0, None, None, 1), pipe.sent[0])  # type: ignore[arg-type]
    assert [c.sample_offset async for c in channel] == [0, 24, 48]
