"""The multi-process worker engine on the CPU: two worker processes (null or eSpeak engine),
least-loaded routing, cancellation across the process boundary, and a dying worker that fails
only its own requests."""

from __future__ import annotations

import asyncio
import functools
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import AsyncIterator
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import pytest

from cadence.engines import EngineOptions, build_engine
from engine.api import (
    AudioChunk,
    EngineError,
    Overloaded,
    SynthesisRequest,
    SynthesisStream,
    TextSegment,
    UnknownVoice,
    pcm16,
)
from engine.workers import (
    WorkerPoolEngine,
    WorkerSpec,
    WorkerStream,
    _StreamOut,
    _Worker,
    _WorkerLoop,
    receive,
)

pytestmark = pytest.mark.timeout(60)

LONG_TEXT = "This sentence is long enough to keep a null engine busy for several seconds of audio. " * 3


def pool_of(engine_name: str, workers: int = 2) -> WorkerPoolEngine:
    factory = functools.partial(build_engine, EngineOptions(name=engine_name))
    return WorkerPoolEngine(
        [WorkerSpec(factory, {"CADENCE_WORKER": str(i)}, f"w{i}") for i in range(workers)]
    )


async def started(engine_name: str) -> WorkerPoolEngine:
    """A started pool whose workers are all alive and have reported their measured capacity (until
    then each counts as one stream, and the pool's queue as the workers' queues, empty)."""
    pool = pool_of(engine_name)
    await pool.start()
    await wait_for(lambda: all(w is not None and w.alive and w.load is not None for w in pool.workers))
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
        # what each worker's start-up made is frozen out of the cyclic collector's reach
        assert pool.load().extra["worker_gc_frozen_objects"] > 2 * 10_000
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


def received(conn: Connection) -> list[tuple[Any, ...]]:
    """The batches waiting on the gateway's end of the pipe."""
    batches = []
    while conn.poll(0.5):
        message = receive(conn)
        assert message[0] == "batch"
        batches.append(message)
    return batches


async def test_a_loop_pass_of_worker_messages_crosses_the_pipe_in_order_first_chunks_ahead() -> None:
    gateway_end, worker_end = mp.Pipe()
    loop = _WorkerLoop(worker_end, WorkerSpec(lambda: None))  # type: ignore[arg-type]
    outs = [_StreamOut(loop, rid) for rid in range(3)]
    outs[0].first = outs[1].first = False  # streams 0 and 1 are under way; 2 starts in this pass
    chunks = [AudioChunk(f"u{i % 3}", (np.arange(8, dtype=np.float32) + i) / 20, 8 * i) for i in range(9)]
    for i, c in enumerate(chunks):
        outs[i % 3].chunk(c)
    outs[0].end()
    outs[1].fail(EngineError("gone"))
    assert not gateway_end.poll()  # nothing leaves before the loop pass ends
    await asyncio.sleep(0)
    batches = received(gateway_end)
    assert len(batches) == 2  # stream 2's first chunk alone, then the rest in the order posted
    assert [(m[1], m[2].sample_offset) for m in batches[0][1]] == [(2, 16)]
    rest = batches[1][1]
    assert [m[0] for m in rest] == ["chunk"] * 8 + ["end", "fail"]
    assert [m[2].sample_offset for m in rest[:8]] == [c.sample_offset for i, c in enumerate(chunks) if i != 2]
    for m in batches[0][1] + rest[:8]:  # each chunk's own samples as int16 PCM, in an array of its own
        np.testing.assert_array_equal(m[2].samples, pcm16(chunks[m[2].sample_offset // 8].samples))
        assert m[2].samples.flags.writeable and m[2].samples.base is None

    # the gateway side takes a batch apart in order
    pool = WorkerPoolEngine([WorkerSpec(lambda: None)])  # type: ignore[arg-type]
    stream = WorkerStream(pool, 0, SynthesisRequest("u"))
    pool._streams[0] = stream
    channel = stream.channel
    pool._on_message(_Worker(0, None, None, 1), batches[1])  # type: ignore[arg-type]
    assert [c.sample_offset async for c in channel] == [0, 24, 48]


async def test_a_batch_larger_than_the_pipe_and_one_without_audio_arrive_whole() -> None:
    gateway_end, worker_end = mp.Pipe()
    loop = _WorkerLoop(worker_end, WorkerSpec(lambda: None))  # type: ignore[arg-type]
    sizes = [0 if i % 7 == 3 else 48_000 + 17 * i for i in range(40)]  # some words-only chunks among them
    big = [AudioChunk("u", np.random.default_rng(i).random(n, np.float32), i) for i, n in enumerate(sizes)]
    got: list[tuple[Any, ...]] = []
    thread = threading.Thread(target=lambda: got.extend(received(gateway_end)))
    thread.start()  # 7.7 MB: the worker's write waits for the reader
    for c in big:
        loop.post("chunk", 0, c)
    loop.post("chunk", 0, AudioChunk("u", np.zeros(0, np.float32), 40, final=True))
    await asyncio.sleep(0)
    loop.post("chunk", 1, AudioChunk("v", np.zeros(0, np.float32), 0, final=True))
    await asyncio.sleep(0)
    thread.join()
    assert len(got) == 2
    assert [m[2].sample_offset for m in got[0][1][:40]] == list(range(40))
    assert all(np.array_equal(m[2].samples, pcm16(c.samples)) for m, c in zip(got[0][1], big, strict=False))
    assert got[0][1][-1][2].final and got[0][1][-1][2].samples.size == 0
    assert got[1][1][0][2].request_id == "v" and got[1][1][0][2].final


async def test_a_stream_that_is_not_a_bridge_channel_is_forwarded_by_a_task_in_order() -> None:
    class Stream(SynthesisStream):  # listen() declines, as SynthesisStream's does
        async def __aiter__(self) -> AsyncIterator[AudioChunk]:
            for offset in (0, 8):
                yield AudioChunk("g", np.full(8, offset / 16, np.float32), offset)
                await asyncio.sleep(0)
            raise EngineError("ran dry")

    class Engine:
        def open(self, request: SynthesisRequest) -> Stream:
            return Stream()

    gateway_end, worker_end = mp.Pipe()
    loop = _WorkerLoop(worker_end, WorkerSpec(lambda: None))  # type: ignore[arg-type]
    loop.engine = Engine()
    loop._handle(("open", 5, SynthesisRequest(request_id="g")))
    await asyncio.wait_for(asyncio.gather(*loop.tasks), 5)
    await asyncio.sleep(0)
    messages = [m for batch in received(gateway_end) for m in batch[1]]
    assert [(m[0], m[1]) for m in messages] == [("chunk", 5), ("chunk", 5), ("fail", 5)]
    assert [int(m[2].samples[0]) for m in messages[:2]] == [0, 16384] and messages[2][3] == "ran dry"
    assert 5 not in loop.streams


async def test_a_listener_gets_a_worker_streams_chunks_and_the_request_is_forgotten_at_its_end() -> None:
    class Listener:
        def __init__(self) -> None:
            self.items: list[Any] = []

        def chunk(self, chunk: AudioChunk) -> None:
            self.items.append(chunk)

        def end(self) -> None:
            self.items.append("end")

        def fail(self, error: BaseException) -> None:
            self.items.append(error)

    pool = await started("espeak")
    try:
        listener = Listener()
        stream = speak(pool, "s/l1", "Heard without a task.")
        assert stream.listen(listener)
        await wait_for(lambda: bool(listener.items) and listener.items[-1] == "end")
        chunks = [c for c in listener.items[:-1] if isinstance(c, AudioChunk)]
        assert len(chunks) == len(listener.items) - 1 and chunks[-1].final
        assert sum(c.samples.size for c in chunks) > pool.info.sample_rate // 2
        assert not any(worker.in_flight for worker in pool.live_workers())  # forgotten at the end
    finally:
        await pool.stop()


async def test_a_streams_word_alignment_reaches_the_workers_stream_before_its_text() -> None:
    class Stream(SynthesisStream):
        def __init__(self) -> None:
            self.request_id = "w"
            self.calls: list[tuple[str, object]] = []

        def push(self, segment: TextSegment) -> None:
            self.calls.append(("push", segment.text))

        def set_word_alignment(self, mode: str) -> None:
            self.calls.append(("word_alignment", mode))

        async def __aiter__(self) -> AsyncIterator[AudioChunk]:
            yield AudioChunk("w", np.zeros(0, np.float32), 0, final=True)

    opened: list[Stream] = []

    class Engine:
        def open(self, request: SynthesisRequest) -> Stream:
            opened.append(Stream())
            return opened[-1]

    gateway_end, worker_end = mp.Pipe()
    loop = _WorkerLoop(worker_end, WorkerSpec(lambda: None))  # type: ignore[arg-type]
    loop.engine = Engine()
    for message in gateway_side_messages(gateway_end, worker_end):
        loop._handle(message)
    assert opened[0].calls == [("word_alignment", "sync"), ("push", "Hello.")]
    await asyncio.wait_for(asyncio.gather(*loop.tasks), 5)


def gateway_side_messages(gateway_end: Any, worker_end: Any) -> list[tuple[Any, ...]]:
    """What a WorkerStream sends its worker for open, set_word_alignment and push, as the worker reads it."""

    class Worker:
        alive = True

        def send(self, *message: object) -> None:
            gateway_end.send(message)

    gateway_end.send(("open", 9, SynthesisRequest(request_id="w")))
    stream = WorkerStream(None, 9, SynthesisRequest(request_id="w"))  # type: ignore[arg-type]
    stream.worker = Worker()  # type: ignore[assignment]
    stream.set_word_alignment("sync")
    stream.push(TextSegment("Hello.", 0))
    return [worker_end.recv() for _ in range(3)]


async def test_admission_holds_per_worker_and_the_excess_waits_in_the_pool() -> None:
    """Each worker admits one stream (its engine's bound): the pool sends each worker one, holds
    the next (its text too) in its queue until a worker has room, and refuses past its queue."""
    factory = functools.partial(build_engine, EngineOptions(name="null", max_streams=1))
    pool = WorkerPoolEngine([WorkerSpec(factory, {}, f"w{i}") for i in range(2)], queue_limit=1)
    await pool.start()
    try:
        await wait_for(lambda: all(w is not None and w.load is not None for w in pool.workers))
        assert pool.load().capacity == 2
        first, second = speak(pool, "s/a", LONG_TEXT), speak(pool, "s/b", "Short and sweet.")
        assert {first.worker.index, second.worker.index} == {0, 1}
        queued = speak(pool, "s/c", "Held in the pool.")
        position = queued.queue_position()
        assert queued.worker is None and position is not None and position.position == 1
        with pytest.raises(Overloaded):
            pool.open(SynthesisRequest(request_id="s/d"))
        figures = pool.load().admission
        assert figures is not None and (figures.admitted, figures.queued) == (2, 1)
        assert figures.refused["queue_full"] == 1
        assert (await collect(second))[-1].final
        # the worker that finished takes the queued stream, with the text it held
        chunks = await asyncio.wait_for(collect(queued), 10)
        assert chunks[-1].final and queued.worker is not None
        assert queued.worker.index == second.worker.index and queued.queue_wait_s() > 0
        first.cancel()
        await wait_for(lambda: pool.load().admission.admitted == 0)  # type: ignore[union-attr]
        assert pool.load().admission.queued_total == 1  # type: ignore[union-attr]
    finally:
        await pool.stop()
