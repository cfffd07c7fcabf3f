"""Chunks from an engine thread to the event loop: in order per channel, errors and ends kept, and
one wake-up of the loop for a burst of chunks over many channels."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from engine.api import AudioChunk, EngineError
from engine.bridge import ChunkBatch, ChunkChannel, LoopChunkChannel, deliver_on_producer_thread


def chunk(rid: str, offset: int) -> AudioChunk:
    return AudioChunk(rid, np.zeros(4, np.float32), offset)


async def test_a_burst_over_many_channels_wakes_the_loop_once_and_keeps_each_channels_order() -> None:
    loop = asyncio.get_running_loop()
    channels = [ChunkChannel() for _ in range(10)]
    wakes = 0
    real = loop.call_soon_threadsafe

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal wakes
        wakes += 1
        return real(*args, **kwargs)

    loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
    try:

        def engine_step() -> None:  # a step handing out ten chunks per channel, then the ends
            for offset in range(10):
                for i, ch in enumerate(channels):
                    ch.put(chunk(f"r{i}", offset))
            for ch in channels:
                ch.finish()

        thread = threading.Thread(target=engine_step)
        thread.start()
        thread.join()  # the loop did not run meanwhile: everything waits in the mailbox
        got = [[c.sample_offset async for c in ch] for ch in channels]
    finally:
        loop.call_soon_threadsafe = real  # type: ignore[method-assign]
    assert got == [list(range(10))] * 10
    assert wakes == 1


async def test_a_batch_reaches_its_channels_only_when_posted_in_order_with_its_ends_and_errors() -> None:
    done, failed, cut = ChunkChannel(), ChunkChannel(), ChunkChannel()

    def engine_step() -> None:
        batch = ChunkBatch()
        for offset in range(3):
            batch.put(done, chunk("a", offset))
        batch.finish(done)
        batch.put(failed, chunk("b", 0))
        batch.fail(failed, EngineError("gpu fell over"))
        batch.finish(cut)
        assert done.pending() == 0  # nothing is handed out before post()
        batch.post()

    thread = threading.Thread(target=engine_step)
    thread.start()
    thread.join()
    assert [c.sample_offset async for c in done] == [0, 1, 2]
    assert [c async for c in cut] == []
    seen = []
    with pytest.raises(EngineError, match="gpu fell over"):
        async for c in failed:
            seen.append(c.sample_offset)
    assert seen == [0]


async def test_a_failure_reaches_the_consumer_after_the_chunks_before_it() -> None:
    ch = ChunkChannel()
    thread = threading.Thread(target=lambda: (ch.put(chunk("a", 0)), ch.fail(EngineError("gpu fell over"))))
    thread.start()
    thread.join()
    seen = []
    with pytest.raises(EngineError, match="gpu fell over"):
        async for c in ch:
            seen.append(c.sample_offset)
    assert seen == [0]


async def test_items_posted_while_the_loop_delivers_come_in_a_later_batch() -> None:
    ch = ChunkChannel()
    first_batch = threading.Event()
    received = []

    def engine() -> None:
        ch.put(chunk("a", 0))
        first_batch.wait(5)
        ch.put(chunk("a", 1))
        ch.finish()

    thread = threading.Thread(target=engine)
    thread.start()
    async for c in ch:
        received.append(c.sample_offset)
        first_batch.set()
    thread.join()
    assert received == [0, 1]


def test_a_put_after_the_loop_closed_is_dropped_without_raising() -> None:
    loop = asyncio.new_event_loop()
    ch = ChunkChannel(loop)
    loop.close()
    ch.put(chunk("a", 0))  # the engine thread must not die because its consumer's loop is gone
    ch.finish()


class Recorder:
    """A ChunkListener that logs every item of every channel it listens to, in one order."""

    def __init__(self, log: list[tuple[str, object]], name: str) -> None:
        self.log, self.name = log, name

    def chunk(self, chunk: AudioChunk) -> None:
        self.log.append((self.name, chunk.sample_offset))

    def end(self) -> None:
        self.log.append((self.name, "end"))

    def fail(self, error: BaseException) -> None:
        self.log.append((self.name, f"fail: {error}"))


def on_thread(fn) -> None:  # type: ignore[no-untyped-def]
    thread = threading.Thread(target=fn)
    thread.start()
    thread.join()  # the loop did not run meanwhile: everything waits in the mailbox


async def test_a_first_chunk_posted_after_later_chunks_of_other_streams_is_delivered_first() -> None:
    log: list[tuple[str, object]] = []
    a, b, c = ChunkChannel(), ChunkChannel(), ChunkChannel()
    for name, ch in zip("abc", (a, b, c), strict=True):
        ch.listen(Recorder(log, name))
    on_thread(lambda: (a.put(chunk("a", 0)), b.put(chunk("b", 0))))
    await asyncio.sleep(0)
    log.clear()  # a and b are under way; c's first chunks come last in the next step
    on_thread(
        lambda: (
            a.put(chunk("a", 4)),
            b.put(chunk("b", 4)),
            c.put(chunk("c", 0)),
            a.put(chunk("a", 8)),
            c.put(chunk("c", 4)),
            b.finish(),
        )
    )
    await asyncio.sleep(0)
    assert log == [("c", 0), ("c", 4), ("a", 4), ("b", 4), ("a", 8), ("b", "end")]


async def test_first_chunks_also_wake_iterating_consumers_first() -> None:
    order: list[str] = []
    old, new = ChunkChannel(), ChunkChannel()
    on_thread(lambda: old.put(chunk("old", 0)))
    old_items = old.__aiter__()
    await old_items.__anext__()

    async def consume(name: str, items) -> None:  # type: ignore[no-untyped-def]
        async for _ in items:
            order.append(name)

    tasks = [asyncio.create_task(consume("old", old_items)), asyncio.create_task(consume("new", new))]
    await asyncio.sleep(0)  # both wait
    on_thread(lambda: (old.put(chunk("old", 4)), new.put(chunk("new", 0)), old.finish(), new.finish()))
    await asyncio.gather(*tasks)
    assert order == ["new", "old"]


async def test_a_listener_gets_what_was_queued_then_the_rest_and_one_end_after_a_final_chunk() -> None:
    log: list[tuple[str, object]] = []
    ch = ChunkChannel()
    on_thread(lambda: ch.put(chunk("a", 0)))
    await asyncio.sleep(0)  # queued: nobody iterates yet
    ch.listen(Recorder(log, "a"))
    on_thread(
        lambda: (
            ch.put(chunk("a", 4)),
            ch.put(AudioChunk("a", np.zeros(0, np.float32), 8, final=True)),
            ch.put(chunk("a", 12)),
            ch.finish(),
        )
    )
    await asyncio.sleep(0)
    assert log == [("a", 0), ("a", 4), ("a", 8), ("a", "end")]
    ch.close()  # a cancel after the end hands out nothing more
    assert log[-1] == ("a", "end") and len(log) == 4


async def test_a_listener_gets_a_failure_after_the_chunks_before_it_and_an_end_on_close() -> None:
    log: list[tuple[str, object]] = []
    failing, closed = ChunkChannel(), LoopChunkChannel()
    failing.listen(Recorder(log, "f"))
    closed.listen(Recorder(log, "c"))
    on_thread(
        lambda: (
            failing.put(chunk("f", 0)),
            failing.fail(EngineError("gpu fell over")),
            failing.put(chunk("f", 4)),
        )
    )
    closed.put(chunk("c", 0))
    await asyncio.sleep(0)
    closed.close()
    closed.put(chunk("c", 4))
    assert log == [("c", 0), ("f", 0), ("f", "fail: gpu fell over"), ("c", "end")]


async def test_listeners_can_take_items_on_the_posting_thread_after_what_waited_in_the_mailbox() -> None:
    log: list[tuple[str, object]] = []
    batches: list[int] = []
    deliver_on_producer_thread(asyncio.get_running_loop(), lambda: batches.append(threading.get_ident()))
    early, late, iterated = ChunkChannel(), ChunkChannel(), ChunkChannel()
    on_thread(lambda: early.put(chunk("e", 0)))  # no listener yet: it waits for the loop
    early.listen(Recorder(log, "e"))
    late.listen(Recorder(log, "l"))
    assert log == [("e", 0)]
    seen: list[list[tuple[str, object]]] = []

    def engine_step() -> None:
        batch = ChunkBatch()
        batch.put(early, chunk("e", 4))
        batch.put(late, chunk("l", 0))
        batch.finish(early)
        batch.put(iterated, chunk("i", 0))
        batch.finish(iterated)
        batch.post()
        seen.append(list(log))  # handed out before the loop ran again

    on_thread(engine_step)
    assert seen == [[("e", 0), ("l", 0), ("e", 4), ("e", "end")]]  # a stream's first chunk first
    assert len(batches) == 2 and threading.get_ident() not in batches
    assert [c.sample_offset async for c in iterated] == [0]  # an iterated channel: through the loop
